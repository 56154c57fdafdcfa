"""``prefixcache serve``: settings -> model -> cache -> engine -> app -> uvicorn."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.engine import Engine, KVShape, load_model
from prefixcache.server.app import create_app
from prefixcache.server.settings import CacheSettings, Settings, describe, load_settings

log = logging.getLogger("prefixcache.serve")


def cache_config(settings: CacheSettings, kv: KVShape) -> CacheConfig:
    """The tiered cache the settings describe, for a model whose KV looks like ``kv``."""
    tiers = [TierConfig(kind="memory", capacity_bytes=settings.memory_bytes)]
    if settings.disk_bytes > 0:
        tiers.append(TierConfig(kind="disk", capacity_bytes=settings.disk_bytes, path=settings.disk_path))
    if settings.redis_url:
        tiers.append(
            TierConfig(
                kind="redis",
                capacity_bytes=settings.redis_bytes,
                url=settings.redis_url,
                namespace=settings.redis_namespace or None,
            )
        )
    return CacheConfig(
        block_size=settings.block_size,
        policy=settings.policy,
        isolation=settings.isolation,
        partial_blocks=settings.partial_blocks,
        seed=settings.seed,
        kv_layout=KVLayout(layers=kv.layers, kv_heads=kv.kv_heads, head_dim=kv.head_dim, dtype=kv.dtype),
        tiers=tuple(tiers),
    )


@dataclass
class Service:
    """Everything a running server holds; ``close()`` releases it in order."""

    app: FastAPI
    engine: Engine
    cache: PrefixCache | None
    settings: Settings

    def close(self) -> None:
        self.engine.close()
        if self.cache is not None:
            self.cache.close()


def build_service(settings: Settings) -> Service:
    """Load the model, open the cache and wire the app (what ``serve`` and the tests run)."""
    loaded = load_model(settings.model.name, settings.model.models_dir, settings.model.device, settings.model.dtype)
    cache = PrefixCache(cache_config(settings.cache, loaded.kv)) if settings.cache.enabled else None
    engine = Engine(
        loaded,
        settings.model.served_id,
        cache=cache,
        max_queue=settings.server.max_queue,
        timeout_s=settings.server.request_timeout_s,
    )
    return Service(create_app(engine, settings, cache), engine, cache, settings)


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    flags: dict[str, dict[str, Any]] = {"server": {}, "model": {}}
    if args.host is not None:
        flags["server"]["host"] = args.host
    if args.port is not None:
        flags["server"]["port"] = args.port
    if args.model is not None:
        flags["model"]["name"] = args.model
    try:
        settings = load_settings(args.config, overrides=flags)
    except ValueError as exc:
        parser.error(str(exc))
    log.info("settings (defaults < file < PREFIXCACHE_* env < flags): %s", describe(settings))
    if settings.auth.local_mode:
        log.warning("no [auth] api_keys configured: single-tenant local mode, no authentication (tenant 'local')")
    service = build_service(settings)
    host, port = settings.server.host, settings.server.port
    url = f"http://{host}:{port}"
    model = settings.model.served_id
    print(f"\nprefixcache is serving {model} at {url}/v1  (cache dir {Path(settings.cache.disk_path).resolve()})")
    print("try:")
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\")
    auth = "" if settings.auth.local_mode else "  -H 'Authorization: Bearer YOUR_KEY' \\\n"
    print(f'{auth}  -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\'\n')
    try:
        uvicorn.run(service.app, host=host, port=port, log_level="info")
    finally:
        service.close()
    return 0
