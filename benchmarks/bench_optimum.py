"""The offline optimum (Belady with bypass): the compiled engine against the Python reference.

On the Mooncake conversation trace (parsed before the timing), both engines in this
process: block lookups per second at one capacity (10,000,000 tokens; best of 3 for the
compiled one) and over a sweep of capacities (lookups x capacities per second: the
compiled engine reads the trace once for all of them), peak memory by tracemalloc
(every allocation of both engines goes through Python's allocators; the compiled one
uses PyMem_Raw*), and whether they agree. Then the compiled engine alone on a generated
sequence of 20 M lookups streamed from a generator, as a trace file is (the reference
would hold it all in memory): its rate with the generator's own time subtracted, its
tracemalloc peak, and the growth of the process's peak RSS. Rates are per wall-clock
second and per CPU second of this process (the second is steadier on a busy machine).

Run:  .venv/bin/python benchmarks/bench_optimum.py [--lookups 20e6]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np

from prefixcache.sim.optimum import Optimum, native_available, optima
from prefixcache.sim.summary import TraceSource
from prefixcache.sim.traces import Request, read_trace

HERE = Path(__file__).resolve().parent
TRACE = HERE.parent / "tests" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
CAPACITY_TOKENS = 10_000_000
SWEEP_TOKENS = (1e6, 3e6, 1e7, 3e7, math.inf)
TARGET = 5_000_000  # lookups per second, compiled engine, one capacity
T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """(result, wall seconds, CPU seconds of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def traced_peak(fn: Callable[[], object]) -> int:
    """Peak bytes allocated through Python's allocators while ``fn`` runs."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB"


def generated(lookups: int, seed: int = 0) -> TraceSource:
    """A Mooncake-like sequence of about ``lookups`` block lookups: each request is the
    prefix (20-139 blocks) of one of 50,000 documents picked by Zipf(1.1) popularity,
    then 0-39 blocks of its own; blocks of 16 tokens. Made lazily, the same every time."""

    def source() -> Iterator[Request]:
        rng = np.random.default_rng(seed)
        done, fresh = 0, 10**12
        while done < lookups:
            docs = (rng.zipf(1.1, 4096) % 50_000).tolist()
            heads = rng.integers(20, 140, 4096).tolist()
            tails = rng.integers(0, 40, 4096).tolist()
            for doc, head, tail in zip(docs, heads, tails, strict=True):
                ids = (*range(doc * 1000, doc * 1000 + head), *range(fresh, fresh + tail))
                fresh += tail
                done += len(ids)
                yield Request(0.0, "t", "m", "", len(ids) * 16, 0, hash_ids=ids, block_size=16)
                if done >= lookups:
                    return

    return source


def run(source: TraceSource, tokens: list[float], block_size: int, engine: str) -> list[Optimum]:
    return optima(source, [t / block_size for t in tokens], block_size, "shared", 0, engine=engine)


def mooncake(repeats: int) -> None:
    requests = list(read_trace(TRACE, "mooncake"))
    source: TraceSource = lambda: requests  # noqa: E731
    n = sum(len(r.hash_ids or ()) for r in requests)
    print(f"{TRACE.name}: {n:,} block lookups, blocks of 512 tokens")
    one = [float(CAPACITY_TOKENS)]
    best = min((timed(lambda: run(source, one, 512, "native")) for _ in range(repeats)), key=lambda r: r[1])
    ref = timed(lambda: run(source, one, 512, "python"))
    same = "same" if best[0] == ref[0] else "DIFFERENT"
    print(
        f"  one capacity ({CAPACITY_TOKENS:,} tokens): compiled {n / best[1] / 1e6:6.2f} M lookups/s"
        f" ({n / best[2] / 1e6:.2f} M per CPU s), python {n / ref[1] / 1e6:5.2f} M/s:"
        f" {ref[1] / best[1]:5.1f}x; {same} answer ({best[0][0].hit_tokens:,} hit tokens)"
    )
    sweep = list(SWEEP_TOKENS)
    nat = timed(lambda: run(source, sweep, 512, "native"))
    py = timed(lambda: run(source, sweep, 512, "python"))
    same = "same" if nat[0] == py[0] else "DIFFERENT"
    print(
        f"  sweep of {len(sweep)} capacities: compiled {nat[1]:.3f} s ({n * len(sweep) / nat[1] / 1e6:.2f} M"
        f" lookups x capacities/s), python {py[1]:.2f} s: {py[1] / nat[1]:5.1f}x; {same} answers"
    )
    native_peak = traced_peak(lambda: run(source, one, 512, "native"))
    python_peak = traced_peak(lambda: run(source, one, 512, "python"))
    print(f"  peak memory (tracemalloc), one capacity: compiled {mb(native_peak)}, python {mb(python_peak)}")


def big(lookups: int) -> None:
    source = generated(lookups)
    n, gen_wall, gen_cpu = timed(lambda: sum(len(r.hash_ids or ()) for r in source()))
    print(f"generated: {n:,} block lookups, blocks of 16 tokens; generating them alone takes {gen_wall:.2f} s")
    rss0, max0 = rss_now(), max_rss()
    one = [1e7]
    found, wall, cpu = timed(lambda: run(source, one, 16, "native"))
    rss_growth = max_rss() - max(rss0, max0)
    rate, cpu_rate = n / (wall - gen_wall), n / max(cpu - gen_cpu, 1e-9)
    verdict = "met" if rate >= TARGET else "NOT met"
    print(
        f"  one capacity (1e7 tokens): compiled {rate / 1e6:5.2f} M lookups/s ({cpu_rate / 1e6:.2f} M per CPU s),"
        f" generator excluded ({wall:.2f} s with it); {found[0].hit_tokens:,} hit tokens"
    )
    print(f"  target >= {TARGET / 1e6:.0f} M lookups/s: {verdict}")
    sweep = [1e6, 1e7, 1e8, math.inf]
    _, swall, _ = timed(lambda: run(source, sweep, 16, "native"))
    print(
        f"  sweep of {len(sweep)} capacities: {swall:.2f} s ({n * len(sweep) / (swall - gen_wall) / 1e6:.2f} M"
        " lookups x capacities/s, generator excluded)"
    )
    peak = traced_peak(lambda: run(source, one, 16, "native"))
    print(
        f"  peak memory: tracemalloc {mb(peak)} (the generator's share included);"
        f" process peak RSS grew {mb(max(rss_growth, 0))} (from {mb(max(rss0, max0))})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lookups", type=float, default=20e6, help="lookups of the generated sequence")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the compiled engine (best counts)")
    args = parser.parse_args()
    if not native_available():
        raise SystemExit("the compiled optimum is not built: pip install -e . (see the Makefile's KERNEL target)")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load} (other processes share them: see the per-CPU-second rates)")
    big(int(args.lookups))  # NOTE: first, so that its growth of the peak RSS is its own
    mooncake(args.repeats)


if __name__ == "__main__":
    main()
