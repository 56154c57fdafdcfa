"""The fleet on loopback: three ``prefixcache serve`` processes on the real model, one
redis-server, the router; a multi-tenant, multi-turn workload through the official
``openai`` client.

* cost routing reaches at least 1.5x round robin's token hit rate, and its first tokens
  wait for less prefill (counted in tokens: what a TTFT is worth is the benchmarks' to say);
* events lost on purpose: the router's index recovers, from the stream and from a
  snapshot, and routing goes on hitting;
* a backend killed mid-run: no request fails that had not started streaming, and every
  answer equals the surviving backends' own answer to the same chat.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis
import uvicorn
from prometheus_client import CollectorRegistry

from engine_support import LiveServer
from prefixcache.api.prompts import Tokenizer
from prefixcache.fleet.router import RouteConfig, Router, create_router
from prefixcache.fleet.scoring import Routing
from prefixcache.settings import load_settings
from redis_server import RedisServer, free_port

pytestmark = [pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".prefixcache" / "models"
KEYS = {"sk-acme": "acme", "sk-globex": "globex", "sk-initech": "initech"}
ADMIN = "sk-admin"
BACKENDS = 3
START_TIMEOUT_S = 240.0

DOCS = {
    "acme": "You answer questions about Acme's rocket skates. Skates ship in three sizes and two colours.",
    "globex": "You are Globex's support bot. Globex sells hammocks, lamps and remote-control volcanoes.",
    "initech": "You help Initech staff with TPS reports. Every report needs a cover sheet and two signatures.",
}


def document(tenant: str) -> str:
    """A long system prompt (a tenant's catalogue: a few hundred tokens, many blocks), so
    that most of a turn's prompt is what a hit can save."""
    return (
        DOCS[tenant] + " " + " ".join(f"Item {i} of {tenant}'s catalogue costs {3 * i + 7} dollars." for i in range(24))
    )


QUESTIONS = ["What do you sell?", "Name one colour.", "How do I order?", "Say thanks.", "Any discount?"]


SHARED_TIER = """
[[cache.tiers]]
kind = "redis"
capacity_bytes = 1073741824
url = "{url}"
"""


def config_text(port: int, redis_url: str, name: str, shared: bool = False) -> str:
    keys = ", ".join(f'"{k}" = "{t}"' for k, t in KEYS.items())
    write = "through" if shared else "back"
    tier = SHARED_TIER.format(url=redis_url.removesuffix("/0") + "/1") if shared else ""
    return f"""
[server]
port = {port}
default_max_tokens = 8
[model]
models_dir = "{MODELS}"
[cache]
isolation = "namespace"
[[cache.tiers]]
kind = "memory"
capacity_bytes = 268435456
write = "{write}"
{tier}
[auth]
api_keys = {{ {keys} }}
admin_key = "{ADMIN}"
[fleet]
publish = true
redis_url = "{redis_url}"
name = "{name}"
"""


@dataclass
class Backend:
    name: str
    url: str
    proc: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Fleet:
    redis: RedisServer
    backends: list[Backend]
    config: Path  # the settings file the router reads


def start_backend(tmp: Path, redis_url: str, i: int, shared: bool = False) -> Backend:
    port = free_port()
    name = f"b{i}"
    cfg = tmp / f"{name}.toml"
    cfg.write_text(config_text(port, redis_url, name, shared))
    log = (tmp / f"{name}.log").open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # three servers on few cores
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.cli", "serve", "--config", str(cfg)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp,
        env=env,
    )
    return Backend(name, f"http://127.0.0.1:{port}", proc)


def wait_up(backend: Backend, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not backend.alive():
            raise RuntimeError(f"{backend.name} exited")
        try:
            if httpx.get(f"{backend.url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{backend.name} did not start")


@contextlib.contextmanager
def running_fleet(tmp: Path, n: int, shared: bool) -> Iterator[Fleet]:
    server = RedisServer(tmp).start()
    backends = [start_backend(tmp, server.url, i, shared) for i in range(n)]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for b in backends:
            wait_up(b, deadline)
        yield Fleet(server, backends, tmp / "b0.toml")
    finally:
        for b in backends:
            if b.alive():
                b.proc.send_signal(signal.SIGTERM)
        for b in backends:
            try:
                b.proc.wait(30)
            except subprocess.TimeoutExpired:
                b.proc.kill()
        server.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Three servers, each with its own memory tier: only routing makes them share."""
    with running_fleet(tmp_path_factory.mktemp("fleet"), BACKENDS, shared=False) as f:
        yield f


class RouterUnderTest:
    def __init__(self, fleet: Fleet, routing: Routing) -> None:
        settings = load_settings(str(fleet.config))
        config = RouteConfig(tuple(b.url for b in fleet.backends), fleet.redis.url, routing)
        self.router = Router(config, settings, Tokenizer(settings.model), CollectorRegistry())
        app = create_router(self.router)
        self.live = LiveServer(app, config=uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))

    def __enter__(self) -> RouterUnderTest:
        self.live.start()
        deadline = time.monotonic() + 30
        while sum(b.up for b in self.router.backends) < sum(1 for _ in self.router.backends):
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not see every backend up")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.live.url}/v1", api_key=key, max_retries=0, timeout=120)


@dataclass
class Turn:
    tenant: str
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    text: str
    backend: str
    messages: list[dict[str, str]]
    streamed: bool = True
    error: str = ""


def ask(client: openai.OpenAI, tenant: str, messages: list[dict[str, str]]) -> Turn:
    """One streamed chat turn, timed to its first chunk; an error after the first chunk
    is recorded (streamed), one before it raises."""
    start = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct",
        messages=messages,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        max_tokens=8,
    )
    backend = raw.headers.get("x-prefixcache-backend", "")
    stream = raw.parse()
    ttft, text, usage = 0.0, [], None
    try:
        for chunk in stream:
            if not ttft:
                ttft = time.monotonic() - start
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    except (openai.APIError, httpx.HTTPError) as exc:
        if not ttft:
            raise
        return Turn(tenant, 0, 0, ttft, "".join(text), backend, messages, True, type(exc).__name__)
    assert usage is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Turn(tenant, usage.prompt_tokens, cached or 0, ttft, "".join(text), backend, messages)


def conversation(client: openai.OpenAI, tenant: str, nonce: str, turns: int, out: list[Turn]) -> None:
    messages = [{"role": "system", "content": f"[{nonce}] {document(tenant)}"}]
    for q in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": q})
        turn = ask(client, tenant, list(messages))
        out.append(turn)
        messages.append({"role": "assistant", "content": turn.text})


CONVERSATIONS = (3, 2, 2)  # per tenant: 7 in all, prime to the 3 backends (see ``workload``)


def workload(rut: RouterUnderTest, nonce: str, turns: int = 4) -> list[Turn]:
    """Every tenant's conversations side by side (one thread each), turn after turn.

    NOTE: conversations that keep in step send one request each per round; with a number
    of them divisible by the backends', round robin would hand every conversation the
    same backend each round, and be a sticky router by accident."""
    out: list[Turn] = []
    jobs = [
        (key, tenant, f"{nonce}-{c}")
        for (key, tenant), n in zip(KEYS.items(), CONVERSATIONS, strict=True)
        for c in range(n)
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for f in [pool.submit(conversation, rut.client(k), t, n, turns, out) for k, t, n in jobs]:
            f.result()
    return out


def settled(size: Callable[[], int], minimum: int, timeout: float = 20.0) -> None:
    """Wait until ``size()`` is at least ``minimum`` and has not changed for half a second."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while True:
        now, value = time.monotonic(), size()
        if value != last:
            last, since = value, now
        elif value >= minimum and now - since >= 0.5:
            return
        assert now < deadline, f"still {value} (at least {minimum} wanted)"
        time.sleep(0.05)


def hit_rate(turns: list[Turn]) -> float:
    return sum(t.cached_tokens for t in turns) / sum(t.prompt_tokens for t in turns)


def mean_ttft(turns: list[Turn]) -> float:
    return sum(t.ttft for t in turns) / len(turns)


def prefilled(turns: list[Turn]) -> int:
    """The prompt tokens the backends computed: what the first tokens waited for."""
    return sum(t.prompt_tokens - t.cached_tokens for t in turns)


def test_cost_routing_hits_more_and_answers_sooner_than_round_robin(fleet: Fleet) -> None:
    with RouterUnderTest(fleet, Routing.ROUND_ROBIN) as rr:
        spread = workload(rr, uuid.uuid4().hex[:8])
    with RouterUnderTest(fleet, Routing.COST) as cost:
        routed = workload(cost, uuid.uuid4().hex[:8])
    print(
        f"\nround_robin hit {hit_rate(spread):.3f} ttft {mean_ttft(spread) * 1e3:.0f} ms | "
        f"cost hit {hit_rate(routed):.3f} ttft {mean_ttft(routed) * 1e3:.0f} ms"
    )
    assert {t.backend for t in spread} == {b.name for b in fleet.backends}
    assert hit_rate(routed) >= 1.5 * hit_rate(spread)
    assert prefilled(routed) < prefilled(spread)


def test_lost_events_are_recovered_by_replay_and_by_snapshot(fleet: Fleet) -> None:
    with RouterUnderTest(fleet, Routing.COST) as rut:
        nonce = uuid.uuid4().hex[:8]
        first: list[Turn] = []
        conversation(rut.client("sk-acme"), "acme", nonce, 1, first)
        home = next(b for b in rut.router.backends if b.name == first[0].backend)
        assert home.follower is not None and home.reader is not None
        replays, snapshots = home.follower.stats.replays, home.follower.stats.snapshots
        home.reader.lose_next(1)  # the next batch is read and lost on the way
        more: list[Turn] = []
        conversation(rut.client("sk-acme"), "acme", nonce, 2, more)
        deadline = time.monotonic() + 60  # NOTE: a guard against a hang, not a bound: a loaded machine is slow
        while home.follower.stats.replays == replays and time.monotonic() < deadline:
            time.sleep(0.05)
        assert home.follower.stats.replays > replays  # closed from the stream
        assert more[-1].backend == home.name and more[-1].cached_tokens > 0
        home.reader.pause()  # the router falls behind ...
        info = home.info
        assert info is not None
        stream = redis.Redis.from_url(fleet.redis.url)
        before = int(stream.xlen(info.stream))
        again: list[Turn] = []
        conversation(rut.client("sk-acme"), "acme", nonce, 3, again)
        settled(lambda: int(stream.xlen(info.stream)), before + 1)  # the server stores after it answers
        stream.xtrim(info.stream, maxlen=0)  # ... further than the stream holds
        after: list[Turn] = []
        conversation(rut.client("sk-acme"), "acme", nonce, 4, after)
        settled(lambda: int(stream.xlen(info.stream)), 1)
        home.reader.pause(False)
        deadline = time.monotonic() + 60
        while home.follower.stats.snapshots == snapshots and time.monotonic() < deadline:
            time.sleep(0.05)
        assert home.follower.stats.snapshots > snapshots  # closed by a snapshot
        final: list[Turn] = []
        conversation(rut.client("sk-acme"), "acme", nonce, 5, final)
        assert final[-1].backend == home.name and final[-1].cached_tokens >= again[-1].prompt_tokens // 2


def test_the_route_command_serves_the_openai_client(fleet: Fleet, tmp_path: Path) -> None:
    port = free_port()
    args = [sys.executable, "-m", "prefixcache.cli", "route", "--config", str(fleet.config), "--redis", fleet.redis.url]
    args += [arg for b in fleet.backends for arg in ("--backend", b.url)] + ["--port", str(port)]
    with (tmp_path / "route.log").open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if len(httpx.get(f"{url}/healthz", timeout=1.0).json().get("backends_up", [])) == BACKENDS:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "route.log").read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-globex", max_retries=0, timeout=120)
        turns: list[Turn] = []
        conversation(client, "globex", uuid.uuid4().hex[:8], 2, turns)
        assert turns[0].backend == turns[1].backend  # the second turn follows the first
        assert turns[1].cached_tokens >= turns[0].prompt_tokens // 2
        stranger = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-nobody", max_retries=0)
        with pytest.raises(openai.AuthenticationError):  # the servers' keys, checked by the router first
            stranger.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
        assert "prefixcache_route_requests_total" in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_backend_killed_mid_run_fails_no_request_that_had_not_streamed(fleet: Fleet) -> None:
    with RouterUnderTest(fleet, Routing.COST) as rut:
        out: list[Turn] = []
        failures: list[BaseException] = []
        victim = fleet.backends[1]

        def run(key: str, tenant: str, nonce: str) -> None:
            try:
                conversation(rut.client(key), tenant, nonce, 5, out)
            except BaseException as exc:  # a failure before streaming: the test fails
                failures.append(exc)

        threads = [
            threading.Thread(target=run, args=(k, t, f"{uuid.uuid4().hex[:8]}-{c}"))
            for k, t in KEYS.items()
            for c in range(2)
        ]
        for t in threads:
            t.start()
        while len(out) < 8 and not failures:
            time.sleep(0.05)
        victim.proc.kill()
        for t in threads:
            t.join(300)
        assert not failures, failures
        assert any(t.backend == victim.name for t in out)
        gone = next(b for b in rut.router.backends if b.name == victim.name)
        deadline = time.monotonic() + 10
        while (gone.up or rut.router.index.held(victim.name)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not gone.up and rut.router.index.held(victim.name) == 0  # it left, with its blocks
        served = [t for t in out if not t.error]
        assert len(served) >= len(out) - 2  # at most the ones streaming at the kill
        survivor = next(b for b in fleet.backends if b.alive())
        for turn in served:
            key = next(k for k, t in KEYS.items() if t == turn.tenant)
            direct = openai.OpenAI(base_url=f"{survivor.url}/v1", api_key=key, max_retries=0, timeout=120)
            again = direct.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=turn.messages,  # type: ignore[arg-type]
                temperature=0,
                max_tokens=8,
            )
            assert again.choices[0].message.content == turn.text


def test_a_shared_redis_tier_counts_for_every_backend_and_survives_its_writer(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two servers writing through to one Redis tier: the router credits the Redis copy
    to both, and when the server that computed a conversation dies, the other one
    continues it from Redis (it never saw it)."""
    with (
        running_fleet(tmp_path_factory.mktemp("shared"), 2, shared=True) as shared,
        RouterUnderTest(shared, Routing.COST) as rut,
    ):
        nonce = uuid.uuid4().hex[:8]
        first: list[Turn] = []
        conversation(rut.client("sk-acme"), "acme", nonce, 1, first)
        home = next(b for b in shared.backends if b.name == first[0].backend)
        other = next(b for b in shared.backends if b is not home)
        tokens = rut.router.tokenize("/v1/chat/completions", {"model": "m", "messages": first[0].messages})
        info = rut.router.backends[0].info
        assert info is not None
        chains = rut.router.chains("acme", tokens, info.model, info.block_size)
        deadline = time.monotonic() + 30
        whole = ("redis",) * len(chains[0])
        while rut.router.index.matched(chains[:1], [other.name])[other.name] != whole:
            assert time.monotonic() < deadline, "the Redis copy never reached the index"
            time.sleep(0.05)
        # NOTE: a tier's event comes when its write is queued; wait until the writer has
        # put every block in Redis (one key a block, in the tier's own database) and stopped.
        tier = redis.Redis.from_url(shared.redis.url.removesuffix("/0") + "/1")
        sizes = [-1]
        while not (sizes[-1] >= len(whole) and sizes[-1] == sizes[max(0, len(sizes) - 10)]):
            assert time.monotonic() < deadline, "the writer never finished"
            sizes.append(int(tier.dbsize()))  # type: ignore[arg-type]
            time.sleep(0.1)
        home.proc.kill()
        more: list[Turn] = []
        conversation(rut.client("sk-acme"), "acme", nonce, 2, more)
        assert {t.backend for t in more} == {other.name}
        assert more[0].cached_tokens >= first[0].prompt_tokens // 2  # from Redis: this server never saw it
