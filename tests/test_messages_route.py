"""Anthropic's Messages API through ``prefixcache route`` to a server on the real model,
with the official ``anthropic`` client: the second turn reads the first turn's breakpoint,
the router predicts the server's prompt tokens, and answers its own errors in Anthropic's
shape."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from engine_support import MODEL_ID, MODELS_DIR, TEST_TIMEOUT_S, LiveServer, engine, model, tiered_cache
from prefixcache.api.prompts import Tokenizer
from prefixcache.fleet.router import RouteConfig, Router, create_router
from prefixcache.fleet.validate import MESSAGES
from prefixcache.server.main import create_app
from prefixcache.settings import AuthSettings, FleetSettings, ModelSettings, ServerSettings, Settings
from redis_server import RedisServer
from support import wait_for

pytestmark = [pytest.mark.model, pytest.mark.redis]

KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}
KEY = "sk-acme-0123456789"
CC: Any = {"type": "ephemeral"}
SYSTEM = "You are the help desk of Acme Anvils. Anvils ship in three sizes and never float. " * 4


@dataclasses.dataclass
class Pair:
    server: LiveServer
    router: LiveServer
    route: Router


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    lm = model()
    cache = tiered_cache(lm, tmp_path_factory.mktemp("cache"), partial_blocks=True)
    settings = Settings(  # the server's and the router's, as one settings file is
        server=ServerSettings(max_queue=32, request_timeout_s=TEST_TIMEOUT_S, max_body_bytes=1 << 20),
        auth=AuthSettings(
            api_keys=KEYS,
            admin_key="adm-0123456789",
            tenant_header="X-Org",
            tenant_secret="a-tenant-secret-of-32-characters",
        ),
        fleet=FleetSettings(publish=True, redis_url=redis.url, name="b1"),
        model=ModelSettings(models_dir=str(MODELS_DIR)),
    )
    eng = engine(lm, cache, max_queue=32)
    server = LiveServer(create_app(eng, settings, cache), eng)
    server.config.lifespan = "on"  # the fleet publisher starts with the app
    server.start()
    route = Router(RouteConfig((server.url,), redis.url), settings, Tokenizer(settings.model), CollectorRegistry())
    app = create_router(route)
    router = LiveServer(app, config=uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")).start()
    wait_for(lambda: all(b.up for b in route.backends), 30)
    yield Pair(server, router, route)
    router.stop()
    server.stop()
    eng.close()
    cache.close()
    redis.stop()


def client(pair: Pair, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=pair.router.url, api_key=key, max_retries=0, timeout=600)


def total(u: Any) -> int:
    return int(u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens)


def test_through_the_router_the_second_turn_reads_the_first_turns_breakpoint(pair: Pair) -> None:
    c = client(pair)
    system: Any = [{"type": "text", "text": SYSTEM, "cache_control": CC}]
    turns: Any = [{"role": "user", "content": [{"type": "text", "text": "Do anvils float?", "cache_control": CC}]}]
    raw = c.messages.with_raw_response.create(model=MODEL_ID, max_tokens=8, system=system, messages=turns)
    first = raw.parse()
    assert raw.headers["x-prefixcache-backend"] == "b1" and "x-prefixcache-retention" in raw.headers
    u1 = first.usage
    assert u1.cache_creation_input_tokens > 0
    assert total(u1) == c.messages.count_tokens(model=MODEL_ID, system=system, messages=turns).input_tokens
    # the router scores the prompt the server computes
    request = {"model": MODEL_ID, "max_tokens": 8, "system": system, "messages": turns}
    assert len(pair.route.tokens(MESSAGES, request)) == total(u1)
    assert pair.server.engine is not None and pair.server.engine.wait_idle(60)

    turns = [
        {"role": "user", "content": "Do anvils float?"},
        {"role": "assistant", "content": first.content[0].text or "No."},
        {"role": "user", "content": [{"type": "text", "text": "What sizes?", "cache_control": CC}]},
    ]
    with c.messages.stream(model=MODEL_ID, max_tokens=8, system=system, messages=turns) as stream:
        second = stream.get_final_message()
    u2 = second.usage
    assert u2.cache_read_input_tokens >= u1.cache_creation_input_tokens
    assert total(u2) == c.messages.count_tokens(model=MODEL_ID, system=system, messages=turns).input_tokens


def test_the_routers_own_errors_are_in_anthropics_shape(pair: Pair) -> None:
    body = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    url = pair.router.url + "/v1/messages"
    none = httpx.post(url, json=body, timeout=60)
    assert none.status_code == 401 and none.json()["error"]["type"] == "authentication_error"
    bad = httpx.post(url, json=body | {"max_tokens": 0}, headers={"x-api-key": KEY}, timeout=60)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error" and "x-prefixcache-backend" not in bad.headers
    with pytest.raises(anthropic.NotFoundError):
        client(pair).messages.create(model="claude-opus-4", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
