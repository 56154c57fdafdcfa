"""Replay throughput, in block lookups per second, on the Mooncake conversation trace.

Ours: ``prefixcache.sim.replay`` in tree mode (match, insert, release per request, verified
against the stored block ids) with LRU and S3-FIFO, at 10,000,000 tokens of capacity, on
both engines: ``native`` (the compiled kernel, what ``prefixcache replay`` runs by default)
and ``python`` (the real ``PrefixCache``), which must agree on every figure. Beside them,
in the same run, libCacheSim on the same flat block sequence at the same capacity: its
``process_trace`` loop runs in C on a binary oracleGeneral file, and its ``get()`` called
per block from Python.

Run:  .venv/bin/python benchmarks/bench_replay.py [TRACE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from prefixcache.config import CacheConfig
from prefixcache.sim.peers import libcachesim_run
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.summary import summarize
from prefixcache.sim.traces import read_trace

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE.parent / "tests" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
CAPACITY_TOKENS = 10_000_000
TARGET = 1_000_000


def block_sequence(path: Path) -> list[int]:
    return [block for req in read_trace(path, "mooncake") for block in (req.hash_ids or ())]


def ours(path: Path, policy: str, engine: str, repeats: int) -> tuple[float, int, int]:
    """Best of ``repeats``: lookups/s, hit tokens, evictions."""
    source = lambda: read_trace(path, "mooncake")  # noqa: E731
    summary = summarize(source)
    requests = list(source())  # parse once, outside the timing: we measure the cache, not json
    cfg = ReplayConfig(CacheConfig(policy=policy, capacity_tokens=CAPACITY_TOKENS, block_size=512, isolation="shared"))
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        (result,) = replay(lambda: requests, [cfg], optimal=False, summary=summary, engine=engine)
        best = max(best, result.blocks_looked_up / (time.perf_counter() - start))
        assert result.engine == engine, result.engine
    return best, result.hit_tokens, result.evictions


def libcachesim(blocks: list[int], policy: str) -> tuple[float, float, float]:
    """libCacheSim on the flat block sequence: its C loop, then its get() from Python."""
    import libcachesim as lcs

    capacity = CAPACITY_TOKENS // 512
    miss_ratio, seconds = libcachesim_run(blocks, policy, capacity)
    cache = {"lru": lcs.LRU, "s3fifo": lcs.S3FIFO, "fifo": lcs.FIFO}[policy](capacity)
    start = time.perf_counter()
    for block in blocks:
        cache.get(lcs.Request(obj_id=block, obj_size=1))
    py_rate = len(blocks) / (time.perf_counter() - start)
    return len(blocks) / seconds, py_rate, miss_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the native engine (best counts)")
    args = parser.parse_args()
    blocks = block_sequence(args.trace)
    print(f"{args.trace.name}: {len(blocks):,} block lookups, capacity {CAPACITY_TOKENS:,} tokens")
    for policy in ("lru", "s3fifo"):
        rate, hits, evictions = ours(args.trace, policy, "native", args.repeats)
        py_rate, py_hits, py_evictions = ours(args.trace, policy, "python", 1)
        same = "same" if (hits, evictions) == (py_hits, py_evictions) else "DIFFERENT"
        c_rate, get_rate, miss = libcachesim(blocks, policy)
        print(
            f"{policy:>6}: tree replay, native {rate / 1e6:5.2f} M lookups/s, python (PrefixCache)"
            f" {py_rate / 1e6:5.2f} M/s: {rate / py_rate:4.1f}x; {same} hits ({hits:,} tokens) and evictions"
            f" ({evictions:,})\n"
            f"        libcachesim flat (miss ratio {miss:.3f}): process_trace (C) {c_rate / 1e6:5.2f} M/s,"
            f" get() from Python {get_rate / 1e6:5.2f} M/s | native / libcachesim C loop: {rate / c_rate:4.2f}x"
        )
        if policy == "lru":
            verdict = "met" if rate >= TARGET else "NOT met"
            print(f"        target >= {TARGET / 1e6:.0f} M lookups/s for tree-mode LRU: {verdict}")


if __name__ == "__main__":
    main()
