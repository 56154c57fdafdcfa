"""Deadlines through the router: two ``prefixcache serve`` processes on the real model
behind the router, each serving one request at a time (``admission.max_active = 1``)
with a short deadline.

A prompt far longer than its deadline allows gets the backend's 504 from the router,
stopped part way through its prefill, and is never sent to the other backend; its
backend takes the next request then; and meanwhile another tenant's short requests are
served by the other backend. (That a deadline stops a prefill within a chunk is the
engine's test, on an injected clock: no verdict here reads a clock.)"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from engine_support import MODEL_ID, MODELS_DIR, LiveServer
from prefixcache.api.prompts import Tokenizer
from prefixcache.fleet.router import RouteConfig, Router, create_router
from prefixcache.settings import load_settings
from redis_server import RedisServer, free_port
from support import wait_for

pytestmark = [pytest.mark.model, pytest.mark.slow]

KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}
ADMIN = "sk-admin-0123456789"
DEADLINE_S = 10.0  # the backends' request_timeout_s: many times a short request's run, loaded or not
HEAVY_TOKENS = 8000  # prefilled alone, many times the deadline


def config_text(port: int, redis_url: str, name: str) -> str:
    keys = ", ".join(f'"{k}" = "{t}"' for k, t in KEYS.items())
    return f"""
[server]
port = {port}
request_timeout_s = {DEADLINE_S}
[model]
models_dir = "{MODELS_DIR}"
[[cache.tiers]]
kind = "memory"
capacity_bytes = 268435456
[auth]
api_keys = {{ {keys} }}
admin_key = "{ADMIN}"
[fleet]
publish = true
redis_url = "{redis_url}"
name = "{name}"
[admission]
max_active = 1
prefill_chunk_tokens = 64
"""


@dataclass
class Backend:
    name: str
    url: str
    proc: subprocess.Popen[bytes]

    def stats(self) -> dict[str, Any]:
        answer = httpx.get(self.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        engine: dict[str, Any] = answer.json()["engine"]
        return engine


def start_backend(tmp: Path, redis_url: str, name: str) -> Backend:
    port = free_port()
    config = tmp / f"{name}.toml"
    config.write_text(config_text(port, redis_url, name))
    log = (tmp / f"{name}.log").open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # two servers on few cores
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.cli", "serve", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp,
        env=env,
    )
    return Backend(name, f"http://127.0.0.1:{port}", proc)


def up(backend: Backend) -> bool:
    assert backend.proc.poll() is None, f"{backend.name} exited"
    try:
        return httpx.get(backend.url + "/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Fleet:
    backends: list[Backend]
    router: Router
    url: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("route-deadline")
    redis = RedisServer(tmp).start()
    backends = [start_backend(tmp, redis.url, name) for name in ("b0", "b1")]
    live: LiveServer | None = None
    try:
        for backend in backends:
            wait_for(lambda b=backend: up(b), 240)  # type: ignore[misc]
        settings = load_settings(str(tmp / "b0.toml"))
        config = RouteConfig(tuple(b.url for b in backends), redis.url)
        router = Router(config, settings, Tokenizer(settings.model), CollectorRegistry())
        app = create_router(router)
        live = LiveServer(app, config=uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")).start()
        wait_for(lambda: all(b.up for b in router.backends), 30)
        yield Fleet(backends, router, live.url)
    finally:
        if live is not None:
            live.stop()
        for backend in backends:
            backend.proc.send_signal(signal.SIGTERM)
        for backend in backends:
            try:
                backend.proc.wait(30)
            except subprocess.TimeoutExpired:
                backend.proc.kill()
        redis.stop()


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Answer:
    status: int
    backend: str
    body: bytes


def post(url: str, path: str, body: dict[str, Any], key: str) -> Answer:
    with httpx.Client(timeout=120) as http, http.stream("POST", url + path, json=body, headers=headers(key)) as r:
        body = b"".join(r.iter_bytes())
        return Answer(r.status_code, r.headers.get("x-prefixcache-backend", ""), body)


def chat(question: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": question}]
    return {"model": MODEL_ID, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}


def test_a_prompt_past_its_deadline_is_a_504_that_frees_its_backend(fleet: Fleet) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 40000) for _ in range(HEAVY_TOKENS)]
    heavy_body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    before = {b.name: b.stats() for b in fleet.backends}
    heavy: list[Answer] = []
    sent = time.monotonic()
    thread = threading.Thread(
        target=lambda: heavy.append(post(fleet.url, "/v1/completions", heavy_body, "sk-acme-0123456789"))
    )
    thread.start()
    wait_for(lambda: any(b.pending > 0 for b in fleet.router.backends), 30)  # the router sent it on
    busy = next(b for b in fleet.router.backends if b.pending > 0)
    own = next(b for b in fleet.backends if b.url == busy.url)
    other = next(b for b in fleet.backends if b is not own)

    # its backend's next request (sent to it directly, behind the heavy one in its one slot,
    # late enough that its own deadline is well after the heavy one's)
    following: list[Answer] = []
    after = threading.Thread(
        target=lambda: following.append(post(own.url, "/v1/chat/completions", chat("Hi"), "sk-acme-0123456789"))
    )
    # another tenant's short requests, through the router, while the heavy prompt runs
    lights = []
    for question in ("Hi", "Name a tool.", "Say yes."):
        running = busy.pending > 0  # the heavy one, on its backend
        lights.append((post(fleet.url, "/v1/chat/completions", chat(question), "sk-globex-0123456789"), running))
    time.sleep(max(0.0, sent + DEADLINE_S / 2 - time.monotonic()))
    after.start()
    thread.join(120)
    after.join(120)

    (answer,) = heavy
    assert answer.status == 504, answer.body
    assert b"timeout_error" in answer.body and b"while prefilling" in answer.body  # the backend's reason
    done, total = map(int, re.findall(rb"while prefilling its prompt \((\d+) of (\d+)\)", answer.body)[0])
    assert 0 < done < total  # stopped part way, not after its whole prefill
    assert answer.backend == own.name
    (next_one,) = following
    assert next_one.status == 200  # the slot went on to the request behind it
    assert lights[0][1]  # (at least) the first light request was sent while the heavy one ran
    for light, _ in lights:
        assert light.status == 200 and light.backend == other.name
    # the 504 was never sent to the other backend: it timed out once, on its own backend
    after_stats = {b.name: b.stats() for b in fleet.backends}
    assert after_stats[own.name]["timed_out"] - before[own.name]["timed_out"] == 1
    assert after_stats[other.name]["timed_out"] == before[other.name]["timed_out"]
    assert fleet.router.retries._value.get() == 0  # type: ignore[attr-defined]
