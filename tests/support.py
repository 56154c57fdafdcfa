"""Small helpers shared by the tests."""

from __future__ import annotations

import io
import math
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixcache.cache.stats import CacheStats, Histogram, TierStats, WriterStats
from prefixcache.sim.summary import TraceSource
from prefixcache.sim.traces import Request, read_trace
from prefixcache.storage import codec

TRACES = Path(__file__).parent / "data" / "traces"  # the Mooncake traces, with their README
SYNTHETIC = TRACES / "mooncake_synthetic_trace.jsonl"
CONVERSATION = TRACES / "mooncake_conversation_trace.jsonl"


def source_of(path: Path) -> TraceSource:
    """A trace source that reads ``path`` again on every pass."""

    def source() -> Iterable[Request]:
        return read_trace(path)

    return source


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (the reference for the
    cache's own matching)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Clock:
    """An injected clock the test moves by hand.

    NOTE: an engine's clock starts past 0 (``Clock(1000.0)``): the engine takes a 0.0
    timestamp for one not taken yet (``started or clock()``)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------- KV frames

SHAPE = (2, 2, 1, 4, 8)  # a small [layers, 2, kv_heads, block_tokens, head_dim]
TOKENS = struct.pack("<4I", 1, 2, 3, 4)
WIRE: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


def random_kv(dtype: str, seed: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Random bytes as a tensor: NaN payloads and -0.0 included, so equality is bitwise."""
    raw = np.random.default_rng(seed).bytes(math.prod(shape) * WIRE[dtype].itemsize)
    out: np.ndarray = np.frombuffer(raw, dtype=WIRE[dtype]).reshape(shape)
    return out


def frame_of(i: int, dtype: str = "float16", shape: tuple[int, ...] = SHAPE) -> bytes:
    """The codec frame of block ``i``: its key and KV both derived from ``i``."""
    return codec.encode(key_of(i), TOKENS, random_kv(dtype, i, shape), dtype=dtype)


def tok(ts: float, tokens: Sequence[int], tenant: str = "t", model: str = "m", output: Sequence[int] = ()) -> Request:
    """A trace record with a token prompt (and, optionally, the output it got)."""
    return Request(
        timestamp=ts,
        tenant=tenant,
        model=model,
        endpoint="",
        input_length=len(tokens),
        output_length=len(output),
        tokens=tuple(tokens),
        output_tokens=tuple(output) if output else None,
    )


# ---------------------------------------------------------------------------- stats snapshots


def tier_stats(name: str, kind: str, **over: Any) -> TierStats:
    """One tier's entry of ``stats().tiers``, with round figures (``over`` replaces any)."""
    levels = {"device": "L0", "memory": "L1"}
    base = TierStats(
        name=name,
        kind=kind,
        level=levels.get(kind, "L2"),
        write="back",
        capacity_bytes=1 << 30,
        used_bytes=1 << 29,
        frame_bytes=1 << 20,
        blocks=100,
        hits=10,
        misses=2,
        bytes_read=4096,
        bytes_written=8192,
        promotions=1,
        demotions=3,
        evictions=5,
        removals={},
        errors={},
        load_seconds=Histogram(((0.001, 4), (0.01, 9), (float("inf"), 10)), 0.05, 10),
        writes_pending=0,
        writes_dropped=0,
        writes_failed=0,
    )
    return replace(base, **over)


WRITER = WriterStats("background", 0, 0, 1 << 28, 0, 0, 0, 0)


class StatsSource:
    """A stats source with fixed figures: an empty cache's, with ``over`` replacing fields
    (``tiers``, ``writer``, ...). The collector reads nothing else."""

    def __init__(self, **over: Any) -> None:
        from prefixcache import CacheConfig, PrefixCache

        self._stats = replace(PrefixCache(CacheConfig()).stats(), **over)

    def stats(self) -> CacheStats:
        return self._stats


def wait_for(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``cond`` until it holds; fail the test after ``timeout`` seconds (a guard
    against a hang, never waited out by a passing test: generous, for loaded machines)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``prefixcache ARGS`` run in this process; an
    argparse error's SystemExit becomes its code."""
    from prefixcache.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def raises_with(exc: type[codec.FrameError], fn: Callable[..., object], *args: Any, **kwargs: Any) -> codec.FrameError:
    """Assert ``fn`` raises exactly ``exc`` with a message naming what was expected and found."""
    with pytest.raises(codec.FrameError) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc, f"expected {exc.__name__}, got {type(info.value).__name__}: {info.value}"
    assert "expected" in str(info.value) and "found" in str(info.value), str(info.value)
    return info.value
