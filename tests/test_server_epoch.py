"""``/admin/epoch`` when a tier that keeps epochs does not take the bump: a 503 that says
so (the bump holds on this server), never a silent success that a restart would undo
(issue 39, finding 2)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest

from engine_support import LiveServer
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.engine import Engine
from prefixcache.server.app import create_app
from prefixcache.settings import AuthSettings, ServerSettings, Settings
from redis_server import RedisServer
from standin import STANDIN_ID, standin

pytestmark = pytest.mark.model  # the stand-in takes SmolLM2's converted tokenizer

ADMIN = "adm-0123456789"


@pytest.fixture
def live(redis_server: RedisServer) -> Iterator[LiveServer]:
    loaded = dataclasses.replace(standin(), context_length=64)
    tiers = (
        TierConfig(kind="memory", capacity_bytes=16 << 20, write="through"),
        TierConfig(kind="redis", capacity_bytes=16 << 20, url=redis_server.url),
    )
    cache = PrefixCache(CacheConfig(block_size=16, kv_layout=loaded.kv, tiers=tiers), epoch_sync_s=None)
    settings = Settings(server=ServerSettings(max_queue=8), auth=AuthSettings(admin_key=ADMIN))
    engine = Engine(loaded, STANDIN_ID, cache=cache, max_queue=8, timeout_s=60.0)
    server = LiveServer(create_app(engine, settings, cache), engine).start()
    yield server
    server.stop()
    engine.close()
    cache.close()


def test_a_bump_redis_does_not_keep_is_a_503_and_a_later_one_succeeds(
    live: LiveServer, redis_server: RedisServer
) -> None:
    def bump() -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        return httpx.post(live.url + "/admin/epoch", json={"model": STANDIN_ID}, headers=headers, timeout=30)

    assert bump().json()["epoch"] == 1
    redis_server.kill()
    refused = bump()
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "epoch_not_kept" and "epoch 2" in error["message"] and "redis" in error["message"]
    redis_server.start()
    assert bump().json()["epoch"] == 3  # the second bump held here all along
