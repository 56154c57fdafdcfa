"""``prefixcache serve``: settings -> model -> cache -> engine -> app -> uvicorn.

The app (``app.py``) reaches the fleet's KV-event publisher through an interface
(``app.EventPublisher``); ``create_app`` here builds the one ``[fleet]`` asks for, so this
wiring is where the server meets ``fleet/``.

On SIGTERM or SIGINT uvicorn stops taking requests and lets the running ones finish;
then the engine stops and the cache flushes its queued writes (at most
``server.flush_timeout_s`` seconds), so a restarted server hits on what this one
computed; then the fleet publisher (``[fleet]``) sends the last KV events and stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from prefixcache.api.transport import Server, uvicorn_config
from prefixcache.blend.serve_engine import BlendEngine
from prefixcache.blend.serve_gate import open_blender
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig
from prefixcache.engine import Engine, LoadedModel, load_model
from prefixcache.engine.model import ModelError
from prefixcache.engine.threads import serial_torch
from prefixcache.fleet.journal import beside
from prefixcache.fleet.publisher import FleetPublisher, PublisherConfig
from prefixcache.quality.codec_gate import CodecGateRefused, CodecStart, check_codecs
from prefixcache.quality.reference import model_fingerprint
from prefixcache.server import app as server_app
from prefixcache.server import startlog
from prefixcache.server.app import PublisherFactory
from prefixcache.settings import LOCAL_TENANT, Settings, describe, load_settings

log = logging.getLogger("prefixcache.serve")


def fleet_publisher(settings: Settings, model_id: str) -> PublisherFactory | None:
    """What builds the publisher of the cache's KV events ``[fleet]`` asks for; None when off."""
    fleet = settings.fleet
    if not fleet.publish:
        return None
    config = PublisherConfig(fleet.redis_url, settings.fleet_name, fleet.stream_prefix, fleet.maxlen)
    return lambda cache, registry: FleetPublisher(
        cache, config, model_id, registry=registry, journal=beside(cache.config.tiers, config.name)
    )


def create_app(
    engine: Engine,
    settings: Settings,
    cache: PrefixCache | None = None,
    registry: CollectorRegistry | None = None,
    shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The app as ``serve`` runs it: ``app.create_app`` with the KV-event publisher of
    ``[fleet]`` (``fleet_publisher``). NOTE: the events and ``/fleet/info`` name the model
    as the cache keys it (``engine.cache_model``: the weights by content), so a router
    credits a backend only with blocks of the weights it serves."""
    publisher = fleet_publisher(settings, engine.cache_model)
    return server_app.create_app(engine, settings, cache, registry, shutdown, publisher=publisher)


@dataclass
class Service:
    """Everything a running server holds; ``close()`` releases it in order."""

    engine: Engine
    cache: PrefixCache | None
    settings: Settings
    app: FastAPI = field(init=False)
    closed: bool = False

    def __post_init__(self) -> None:
        self.app = create_app(self.engine, self.settings, self.cache, shutdown=self.close)

    def close(self) -> None:
        """Stop the engine, then flush and close the cache, then publish its last KV events
        and stop the fleet publisher. Idempotent."""
        self.engine.close()
        try:
            self._close_cache()
        finally:
            self.app.state.server.stop_fleet()

    def _close_cache(self) -> None:
        if self.cache is not None and not self.closed:
            self.closed = True
            started = time.monotonic()
            flushed = self.cache.close(self.settings.server.flush_timeout_s)
            writer = self.cache.stats().writer
            took = time.monotonic() - started
            if flushed:
                log.info("event=cache_flushed seconds=%.1f (queued writes landed: a restart hits on them)", took)
            else:
                abandoned = writer.abandoned if writer is not None else 0
                log.warning("event=cache_flush_incomplete seconds=%.1f abandoned_writes=%d", took, abandoned)


def check_tier_codecs(settings: Settings, loaded: LoadedModel, config: CacheConfig) -> CodecStart:
    """The codec gate's start check on the tiers of ``config`` (``quality/codec_gate.py``):
    raises ``CodecGateRefused`` when a lossy codec has not passed for this model."""
    tiers = [(tier.label, tier.codec) for tier in config.tiers]  # raw ones need no gate (LOSSLESS)
    return check_codecs(
        model_fingerprint(loaded),
        tiers,
        settings.server.codec_gate_file,
        allow_ungated=settings.server.allow_ungated_codecs,
        name=settings.model.name,
    )


def build_service(settings: Settings) -> Service:
    """Load the model, open the cache and wire the app (what ``serve`` and the tests run)."""
    engine, cache = open_engine(settings)
    return Service(engine, cache, settings)


def open_engine(settings: Settings) -> tuple[Engine, PrefixCache | None]:
    """The model, its cache (behind the codec gate's start check) and the engine over them,
    as ``serve`` runs them; ``prefixcache warm`` opens the same, so what it stores is what
    a server started on these settings looks up. Clients name the model by
    ``served_id``; the engine keys the cache on ``served_id@fingerprint`` (``LoadedModel.key``)."""
    loaded = load_model(settings.model.name, settings.model.models_dir, settings.model.device, settings.model.dtype)
    cache = None
    if settings.server.cache:
        cache_config = settings.cache_config(loaded.kv)
        check_tier_codecs(settings, loaded, cache_config)  # before a tier opens: a refusal leaves nothing behind
        cache = PrefixCache(cache_config)
    model_id = settings.model.served_id
    # the queue, the deadline, each tenant's share and the slicing of the worker's time
    args: dict[str, Any] = {"max_queue": settings.server.max_queue, "timeout_s": settings.server.request_timeout_s}
    args |= settings.admission.engine_args()
    if not settings.blend.enabled:
        return Engine(loaded, model_id, cache=cache, **args), cache
    config = settings.blend.config()
    blender, gate = open_blender(config, loaded, model_id, cache)
    return BlendEngine(loaded, model_id, config, blender, gate, cache=cache, **args), cache


def _settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Settings:
    """The settings the flags, the environment and the file make (a bad one exits 2)."""
    flags: dict[str, dict[str, Any]] = {"server": {}, "model": {}}
    if args.host is not None:
        flags["server"]["host"] = args.host
    if args.port is not None:
        flags["server"]["port"] = args.port
    if args.allow_open_access:
        flags["server"]["allow_open_access"] = True
    if args.model is not None:
        flags["model"]["name"] = args.model
    try:
        settings = load_settings(args.config, overrides={k: v for k, v in flags.items() if v})
        if not settings.auth.tenant_header:  # a gateway's header may name any tenant
            settings.admission.check_tenants(set(settings.auth.api_keys.values()) or {LOCAL_TENANT})
    except ValueError as exc:
        parser.error(str(exc))
    return settings


def _warn(settings: Settings) -> None:
    if settings.auth.local_mode:
        log.warning("no [auth] api_keys configured: single-tenant local mode, no authentication (tenant 'local')")
    if settings.cross_tenant_reuse:
        log.warning(
            "isolation = 'shared' with several tenants (auth.allow_cross_tenant_reuse): every tenant reuses, "
            "and so can detect, the prefixes any other tenant sent"
        )
    if settings.auth.tenant_header and not settings.auth.tenant_secret:
        log.warning(
            "auth.tenant_header with no auth.tenant_secret: any client that reaches this port directly names its "
            "tenant; set tenant_secret (the gateway's proof), or listen where only the gateway reaches"
        )


def _interrupted(sig: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM while the model loads: stop as on Ctrl-C


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Serve until SIGINT or SIGTERM, then flush the cache and exit 0 (a stop asked for is
    a success, also when it comes while the model loads)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = _settings(args, parser)
    if args.print_settings:
        print(json.dumps(describe(settings), indent=2, default=str))
        return 0
    serial_torch()  # NOTE: this thread loads the model; the engine's worker alone runs torch in parallel
    log.debug("settings (defaults < file < PREFIXCACHE_* env < flags): %s", describe(settings))
    for line in startlog.settings_lines(settings):
        log.info("%s", line)
    _warn(settings)
    previous = signal.signal(signal.SIGTERM, _interrupted)
    service: Service | None = None
    try:
        try:
            service = build_service(settings)
        except (ModelError, FileNotFoundError, CodecGateRefused) as exc:  # the model, a tier's folder or codec
            parser.error(str(exc))
        for line in startlog.opened_lines(settings, service.engine.loaded, service.cache):
            log.info("%s", line)
        _banner(settings)
        Server(uvicorn_config(service.app, settings)).run()
    except KeyboardInterrupt:  # before uvicorn took the signals over
        log.info("event=serve_stopped while starting")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if service is not None:
            service.close()  # NOTE: the lifespan's shutdown did it on SIGTERM and SIGINT; this is for the rest
    return 0


def _banner(settings: Settings) -> None:
    """What a newcomer reads on stdout: where to send a first request."""
    url = startlog.url(settings)
    model = settings.model.served_id
    disk = [t.path for t in settings.cache.tiers if t.path is not None]
    where = f"  (cache dir {Path(disk[0]).resolve()})" if disk and settings.server.cache else ""
    print(f"\nprefixcache is serving {model} at {url}/v1{where}")
    print("try:")
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\")
    auth = "" if settings.auth.local_mode else "  -H 'Authorization: Bearer YOUR_KEY' \\\n"
    print(f'{auth}  -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\'\n', flush=True)
