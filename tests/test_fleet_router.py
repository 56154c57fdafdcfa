"""The router without a model: fake backends that speak the fleet endpoints and stream
answers, a real redis-server for their event streams, the router in-process."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import redis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry

from engine_support import LiveServer
from prefixcache.fleet import router as router_module
from prefixcache.fleet.route_metrics import ROUTE_METRICS
from prefixcache.fleet.router import RouteConfig, Router, create_router
from prefixcache.fleet.scoring import Routing, affinity_of, rendezvous
from prefixcache.fleet.wire import BackendInfo, BlockStored, Entry, KVEventBatch, Snapshot, encode_entry, stream_key
from prefixcache.settings import AuthSettings, Settings
from redis_server import RedisServer, free_port
from support import wait_for

BS = 4
MODEL = "fake"
KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
ADMIN = "sk-admin"


def tokenize(path: str, body: dict[str, Any]) -> list[int]:
    """Each character of the last message's content is a token."""
    return [ord(c) for c in body["messages"][-1]["content"]]


class Fake:
    """A backend: fleet info and snapshot, health, and a chat route that streams its name."""

    def __init__(self, name: str, client: redis.Redis) -> None:
        self.name, self.client, self.seq, self.status = name, client, 0, 200
        self.headers: dict[str, str] = {}  # with a status other than 200
        self.delay_s = 0.0  # before answering
        self.stream = stream_key("prefixcache:fleet", name)
        self.blocks: list[BlockStored] = []
        self.served = 0
        self.asked = 0  # chat requests that reached it, answered or not
        app = FastAPI()

        @app.get("/fleet/info")
        def info() -> Response:
            body = BackendInfo(self.name, "inc", self.stream, BS, MODEL, 100)
            return Response(msgspec.json.encode(body), media_type="application/json")

        @app.get("/fleet/snapshot")
        def snapshot() -> Response:
            return Response(msgspec.msgpack.encode(Snapshot("inc", self.seq, self.blocks)))

        @app.get("/healthz")
        def healthz() -> dict[str, str]:
            return {"status": "ok"}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            self.asked += 1
            await asyncio.sleep(self.delay_s)
            if self.status != 200:
                error = {"message": f"{self.name} says {self.status}", "type": "t", "param": None, "code": "c"}
                return JSONResponse({"error": error}, self.status, headers=self.headers)
            self.served += 1

            async def chunks() -> Iterator[bytes]:  # type: ignore[misc]
                yield f'data: {{"backend": "{self.name}"}}\n\n'.encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

        self.live = LiveServer(app).start()

    @property
    def url(self) -> str:
        return self.live.url

    def store(self, tenant: str, text: str) -> None:
        """Announce a one-chain store of ``text``'s whole blocks (in ``tenant``'s namespace)."""
        tokens = [ord(c) for c in text][: len(text) // BS * BS]
        n = len(tokens) // BS
        event = BlockStored(
            [b"%s-%d" % (text.encode(), i) for i in range(n)],
            None,
            tokens,
            BS,
            None,
            "memory",
            None,
            [(tenant, MODEL)] * n,
        )
        self.blocks.append(event)
        self.seq += 1
        self.client.xadd(self.stream, encode_entry(Entry("inc", self.seq, KVEventBatch(0.0, [event]))))


@pytest.fixture
def redis_client(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture
def fakes(redis_client: redis.Redis) -> Iterator[list[Fake]]:
    made = [Fake(f"f{i}", redis_client) for i in range(3)]
    yield made
    for f in made:
        f.live.stop()


def start_router(urls: list[str], redis_url: str, routing: Routing = Routing.COST) -> tuple[Router, LiveServer]:
    settings = Settings(auth=AuthSettings(api_keys=KEYS, admin_key=ADMIN))
    router = Router(RouteConfig(tuple(urls), redis_url, routing), settings, tokenize, CollectorRegistry())
    app = create_router(router)
    live = LiveServer(app, config=uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")).start()
    return router, live


@pytest.fixture
def routed(
    fakes: list[Fake], redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Router, str]]:
    monkeypatch.setattr(router_module, "HEALTH_EVERY_S", 3600.0)  # only the start's check: no race with a test
    router, live = start_router([f.url for f in fakes], redis_server.url)
    wait_for(lambda: all(b.up for b in router.backends))
    yield router, live.url
    live.stop()


def chat(url: str, text: str, key: str = "sk-acme") -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)


ROUTE_METRICS_CREATED = {  # prometheus_client's creation timestamps of counters
    n.removesuffix("_total") + "_created" for n in ROUTE_METRICS if n.endswith("_total")
}
DOC = "the quick brown fox jumps over the lazy dog " * 4  # 44 blocks of 4


def test_a_request_goes_where_its_prefix_is_and_streams_back(routed: tuple[Router, str], fakes: list[Fake]) -> None:
    router, url = routed
    fakes[2].store("acme", DOC)
    wait_for(lambda: router.index.held("f2") > 0)
    for _ in range(3):
        reply = chat(url, DOC + "and then?")
        assert reply.status_code == 200 and reply.headers["x-prefixcache-backend"] == "f2"
        assert '"backend": "f2"' in reply.text and reply.text.endswith("data: [DONE]\n\n")


def test_another_tenants_blocks_never_attract_a_request(routed: tuple[Router, str], fakes: list[Fake]) -> None:
    router, url = routed
    fakes[2].store("acme", DOC)
    wait_for(lambda: router.index.held("f2") > 0)
    tokens = tokenize("", {"messages": [{"content": DOC + "and then?"}]})
    acme = {b.name: overlap for b, overlap, _left in router.rank("acme", tokens, set())}
    globex = {b.name: overlap for b, overlap, _left in router.rank("globex", tokens, set())}
    assert acme == {"f0": 0, "f1": 0, "f2": len(DOC) // BS} and globex == {"f0": 0, "f1": 0, "f2": 0}
    first = chat(url, DOC + "and then?", key="sk-globex").headers["x-prefixcache-backend"]
    second = chat(url, DOC + "and then?", key="sk-globex").headers["x-prefixcache-backend"]
    assert second == first  # globex follows its own request (expected blocks), never acme's


def test_a_backend_that_fails_before_streaming_is_skipped(routed: tuple[Router, str], fakes: list[Fake]) -> None:
    router, url = routed
    fakes[1].store("acme", DOC)
    fakes[1].store("acme", DOC.upper())
    wait_for(lambda: router.index.held("f1") >= 2 * (len(DOC) // BS))
    fakes[1].status = 503  # overloaded: the next best takes it
    reply = chat(url, DOC)
    assert reply.status_code == 200 and reply.headers["x-prefixcache-backend"] != "f1"
    fakes[1].live.stop()  # gone: the next request that prefers it is refused, and retried
    reply = chat(url, DOC.upper())
    assert reply.status_code == 200 and reply.headers["x-prefixcache-backend"] != "f1"
    wait_for(lambda: not router.backends[1].up and router.index.held("f1") == 0)  # it left, with its blocks
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert "prefixcache_route_retries_total 2.0" in metrics
    assert 'prefixcache_route_backend_up{backend="f1"} 0.0' in metrics
    assert 'prefixcache_route_backend_blocks{backend="f1"} 0.0' in metrics
    lines = [line for line in metrics.splitlines() if line.startswith("prefixcache_")]
    samples = {line.split("{")[0].split(" ")[0] for line in lines} - ROUTE_METRICS_CREATED
    assert samples == ROUTE_METRICS  # what the alert rules may use, exactly
    assert fakes[1].served == 0


def test_no_backend_bad_keys_and_large_bodies_get_clear_errors(redis_server: RedisServer) -> None:
    router, live = start_router([f"http://127.0.0.1:{free_port()}"], redis_server.url)
    try:
        reply = chat(live.url, "hello")
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_backend"
        assert chat(live.url, "hello", key="sk-nobody").status_code == 401
        big = httpx.post(
            f"{live.url}/v1/chat/completions",
            content=b"x" * (router.settings.server.max_body_bytes + 1),
            headers={"Authorization": "Bearer sk-acme", "Content-Type": "application/json"},
        )
        assert big.status_code == 413
        assert httpx.get(f"{live.url}/metrics").status_code == 401
    finally:
        live.stop()


# ---------------------------------------------------------------------- retries tell the truth


def retries(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    line = next(line for line in metrics.splitlines() if line.startswith("prefixcache_route_retries_total "))
    return float(line.split()[1])


def test_a_504_is_relayed_with_the_backends_reason_and_never_retried(
    routed: tuple[Router, str], fakes: list[Fake]
) -> None:
    _router, url = routed
    for f in fakes:
        f.status = 504  # each would time out: one try is the client's whole wait
    reply = chat(url, DOC)
    assert reply.status_code == 504
    backend = reply.headers["x-prefixcache-backend"]
    assert reply.json()["error"]["message"] == f"{backend} says 504"
    assert sum(f.asked for f in fakes) == 1 and retries(url) == 0


def test_a_429_is_relayed_with_its_retry_after(routed: tuple[Router, str], fakes: list[Fake]) -> None:
    _router, url = routed
    for f in fakes:
        f.status, f.headers = 429, {"Retry-After": "7"}
    reply = chat(url, DOC)
    assert reply.status_code == 429 and reply.headers["retry-after"] == "7"
    assert sum(f.asked for f in fakes) == 1


def test_503s_from_every_backend_up_are_relayed_not_called_no_backend(
    routed: tuple[Router, str], fakes: list[Fake]
) -> None:
    router, url = routed
    for f in fakes:
        f.status = 503  # shutting down, before any work: each is tried once
    reply = chat(url, DOC)
    assert reply.status_code == 503 and all(f.asked == 1 for f in fakes)
    last = reply.headers["x-prefixcache-backend"]
    assert reply.json()["error"] == {"message": f"{last} says 503", "type": "t", "param": None, "code": "c"}
    assert all(b.up for b in router.backends) and retries(url) == 2


def test_a_backend_that_answers_too_late_is_a_504_not_a_retry(routed: tuple[Router, str], fakes: list[Fake]) -> None:
    router, url = routed
    assert router.client is not None
    router.client.timeout = httpx.Timeout(connect=2.0, read=0.3, write=5, pool=5)
    for f in fakes:
        f.delay_s = 2.0  # the request was sent: the backend is working on it
    reply = chat(url, DOC)
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout"
    assert sum(f.asked for f in fakes) == 1 and retries(url) == 0
    assert all(b.up for b in router.backends)  # slow is not down


def test_only_refused_connections_are_retried_and_no_backend_means_none_up(
    routed: tuple[Router, str], fakes: list[Fake]
) -> None:
    router, url = routed
    fakes[0].live.stop()
    fakes[1].live.stop()
    for i in range(6):  # whichever it tries first, each request ends where a backend listens
        reply = chat(url, f"{i}: a question " * 4)  # no block in common: ties rotate
        assert reply.status_code == 200 and reply.headers["x-prefixcache-backend"] == "f2"
    assert [b.up for b in router.backends] == [False, False, True]  # each refused one request, once
    fakes[2].live.stop()
    reply = chat(url, DOC)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_backend"
    assert not any(b.up for b in router.backends)


# ---------------------------------------------------------------------- quiet logs


def test_health_checks_log_at_debug_and_transitions_above(
    fakes: list[Fake], redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(router_module, "HEALTH_EVERY_S", 0.02)  # fifty rounds a second
    # NOTE: a live fake's check never fails for want of time, however loaded the machine
    monkeypatch.setattr(router_module, "HEALTH_TIMEOUT", httpx.Timeout(60.0))
    caplog.set_level(logging.DEBUG)  # every logger, httpx's too

    def logged(event: str) -> int:
        return sum(r.getMessage().startswith(event) for r in caplog.records)

    router, live = start_router([f.url for f in fakes[:2]], redis_server.url)
    try:
        wait_for(lambda: all(b.up for b in router.backends))
        up = [r.getMessage().split()[0] for r in caplog.records if r.levelno == logging.INFO]
        assert up.count("event=route_backend_up") == 2  # once each (beside their first info and snapshot)
        wait_for(lambda: all(b.follower is not None and b.follower.stats.snapshots for b in router.backends))
        caplog.clear()
        wait_for(lambda: logged("event=route_health_ok") > 20, 60)  # ten rounds and more
        loud = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
        assert loud == []
        caplog.clear()
        fakes[0].live.stop()
        wait_for(lambda: not router.backends[0].up)
        wait_for(lambda: logged("event=route_health_failed") > 10, 60)  # failing while down: at DEBUG
        health = [r for r in caplog.records if r.getMessage().startswith(("event=route_health", "event=route_backend"))]
        loud = [r.getMessage().split()[0] for r in health if r.levelno >= logging.INFO]
        assert loud == ["event=route_health_failed", "event=route_health_failed", "event=route_backend_down"]
    finally:
        live.stop()


def test_a_prompt_cache_key_keeps_a_tenants_new_prompts_on_one_backend(
    routed: tuple[Router, str], fakes: list[Fake]
) -> None:
    """Issue 41: prompts that share nothing cached, each with the same ``prompt_cache_key``,
    go to the one backend that key ranks first (a hint: the tenant is the API key's);
    without the key the router's rotation spreads them."""
    _router, url = routed

    def send(text: str, **extra: str) -> str:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True, **extra}
        reply = httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-acme"}, timeout=10
        )
        assert reply.status_code == 200
        return reply.headers["x-prefixcache-backend"]

    affinity = affinity_of("acme", "agent-7")
    assert affinity is not None
    favourite = max((f.name for f in fakes), key=lambda name: rendezvous(affinity, name))
    # each prompt's first block is its own (a block is 4 characters here): no KV held or
    # expected draws it anywhere
    keyed = {send(f"{i:04d} task " + "word " * 3, prompt_cache_key="agent-7") for i in range(6)}
    assert keyed == {favourite}
    assert len({send(f"{i + 100:04d} task " + "word " * 3) for i in range(6)}) > 1
