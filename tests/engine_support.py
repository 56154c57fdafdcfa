"""The real model, converted once and reused by every engine and server test; a live
server on a free port in a thread."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.engine import Engine, LoadedModel, load_model
from prefixcache.engine.model import DEFAULT_MODEL, resolve_model

MODELS_DIR = Path(__file__).resolve().parent.parent / ".prefixcache" / "models"  # git-ignored, kept across runs
MODEL_ID = "smollm2-135m-instruct"


@contextlib.contextmanager
def models_lock() -> Iterator[None]:
    """The models folder to this process alone while it converts or builds a model there:
    test workers (``pytest -n``) and runs side by side would otherwise write one folder
    at once on a fresh clone."""
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    with (MODELS_DIR / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@functools.cache
def model() -> LoadedModel:
    """SmolLM2-135M-Instruct on CPU (converted from the GGUF on the first run only)."""
    with models_lock():
        resolve_model(DEFAULT_MODEL, MODELS_DIR)
    return load_model(models_dir=MODELS_DIR, device="cpu")


def encode(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    """``text``'s token ids, without the tokenizer's special tokens."""
    return tuple(loaded.tokenizer.encode(text, add_special_tokens=False))


def layout(loaded: LoadedModel) -> KVLayout:
    return loaded.kv


def tiered_cache(loaded: LoadedModel, tmp: Path, memory_bytes: int = 256 << 20, **extra: Any) -> PrefixCache:
    """A memory + disk cache for ``loaded``'s KV; ``extra`` goes to CacheConfig."""
    tiers = extra.pop("tiers", None) or (
        TierConfig(kind="memory", capacity_bytes=memory_bytes),
        TierConfig(kind="disk", capacity_bytes=1 << 30, path=str(tmp / "disk")),
    )
    return PrefixCache(CacheConfig(block_size=16, kv_layout=layout(loaded), tiers=tiers, **extra))


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 at a free port, in a thread."""

    def __init__(self, app: Any, engine: Engine | None = None, config: uvicorn.Config | None = None) -> None:
        self.engine = engine  # the engine behind ``app``, for tests that look at its stats
        self.config = config or uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        sockets = self.server.servers[0].sockets
        port = sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# NOTE: far beyond any request's run on a loaded 2-core machine: a test that is about a
# deadline gives its request one (and the engine an injected clock), no other test meets one
TEST_TIMEOUT_S = 3600.0


def engine(loaded: LoadedModel, cache: PrefixCache | None = None, **kwargs: Any) -> Engine:
    kwargs.setdefault("timeout_s", TEST_TIMEOUT_S)
    return Engine(loaded, MODEL_ID, cache=cache, **kwargs)


class WorkClock:
    """Virtual time for timing audits: a unit (1/1024 s, exact in binary) per token the
    model is given, counted by a forward pre-hook. A request's time to first token is
    then the prefill it cost, and a cached prefix time saved exactly, whatever else the
    machine runs; ``close`` removes the hook."""

    def __init__(self, model: Any) -> None:
        self.tokens = 0
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.tokens += int(ids.shape[-1])

    def __call__(self) -> float:
        return self.tokens / 1024

    def close(self) -> None:
        self._hook.remove()


class Settled(httpx.BaseTransport):
    """An audit's transport to a live server in this process: each answer is read whole,
    then the engine settles (every store done) before the audit goes on. A tenant's next
    request is then never a race with the store of the request before it, which the
    engine orders only within a conversation."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        try:
            body = response.read()
        finally:
            response.close()
        assert self.engine.wait_idle(600), "the engine never settled"
        headers = [(k, v) for k, v in response.headers.items() if k not in ("content-length", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=body, request=request)

    def close(self) -> None:
        self.inner.close()
