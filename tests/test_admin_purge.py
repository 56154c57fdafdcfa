"""``/admin/purge`` is final beyond the server that answers it: the tenant's generation is
kept in the shared tier, so another server on it misses the tenant's blocks once it
syncs; and when the tier does not keep it, a 503 says so (the purge holds on this
server), never a silent success that a restart or a neighbour would undo."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from engine_support import LiveServer
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.engine import Engine
from prefixcache.hashing import CacheContext
from prefixcache.server.app import create_app
from prefixcache.settings import AuthSettings, ServerSettings, Settings
from redis_server import RedisServer
from standin import STANDIN_ID, standin

pytestmark = pytest.mark.model  # the stand-in takes SmolLM2's converted tokenizer

ADMIN = "adm-0123456789"
TOKENS = list(range(100, 148))  # three blocks of 16


def config(redis_url: str) -> CacheConfig:
    tiers = (
        TierConfig(kind="memory", capacity_bytes=16 << 20, write="through"),
        TierConfig(kind="redis", capacity_bytes=16 << 20, url=redis_url),
    )
    return CacheConfig(block_size=16, kv_layout=standin().kv, tiers=tiers)


@pytest.fixture
def live(redis_server: RedisServer) -> Iterator[LiveServer]:
    loaded = dataclasses.replace(standin(), context_length=64)
    cache = PrefixCache(config(redis_server.url), epoch_sync_s=None)
    settings = Settings(server=ServerSettings(max_queue=8), auth=AuthSettings(admin_key=ADMIN))
    engine = Engine(loaded, STANDIN_ID, cache=cache, max_queue=8, timeout_s=60.0)
    server = LiveServer(create_app(engine, settings, cache), engine).start()
    yield server
    server.stop()
    engine.close()
    cache.close()


def purge(live: LiveServer, tenant: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    return httpx.post(live.url + "/admin/purge", json={"tenant": tenant}, headers=headers, timeout=30)


def matched(cache: PrefixCache, ctx: CacheContext) -> int:
    with cache.match(TOKENS, ctx) as m:
        return m.cached_tokens


def test_a_purge_through_the_server_reaches_another_server_on_its_redis(
    live: LiveServer, redis_server: RedisServer
) -> None:
    assert live.engine is not None
    acme, globex = live.engine.context("acme"), live.engine.context("globex")
    with PrefixCache(config(redis_server.url), epoch_sync_s=None) as other:
        layout = other.config.kv_layout
        assert layout is not None
        kv = np.zeros(layout.shape(len(TOKENS)), dtype=layout.dtype)
        other.insert(TOKENS, acme, kv=kv)
        other.insert(TOKENS, globex, kv=kv)
        answer = purge(live, "acme")
        assert answer.status_code == 200 and answer.json() == {"tenant": "acme", "removed_blocks": 0}
        assert matched(other, acme) == 48  # until it syncs
        other.sync_epochs()
        assert matched(other, acme) == 0 and matched(other, globex) == 48


def test_a_purge_redis_does_not_keep_is_a_503_and_a_later_one_succeeds(
    live: LiveServer, redis_server: RedisServer
) -> None:
    assert purge(live, "acme").status_code == 200
    redis_server.kill()
    refused = purge(live, "acme")
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "purge_not_kept" and "generation 2" in error["message"] and "redis" in error["message"]
    redis_server.start()
    assert purge(live, "acme").status_code == 200  # generation 3: the second purge held here all along
