"""Hit-rate curves (sim/curves.py) against full replays: time and largest error per
method, in one process.

1. On the Mooncake traces and a generated workload: the full replay of every capacity
   (the reference; the compiled kernel, one shared pass), then each fast method on the
   same capacities: its time, the ratio of times, and its largest absolute error in
   token hit rate over the capacities.
2. A generated workload of about 20 M block lookups, held in memory (generating it is
   not timed): a whole curve (20 capacities) for textbook LRU by stack distances and,
   for each policy of ``--policies``, by miniature caches at the default sample;
   ``--full`` also replays it in full for their errors (minutes a policy). The
   miniatures run in one process per CPU (``--jobs`` sets how many; the curve is the
   same for any number, only the time changes).

    .venv/bin/python benchmarks/bench_curves.py [--full] [--requests N] [--policies lru,s3fifo] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable
from pathlib import Path

from prefixcache.config import CacheConfig
from prefixcache.sim.curves import DEFAULT_SAMPLE, ERROR_BOUND, Curve, curve
from prefixcache.sim.forks import cpus, processes
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.traces import Request, read_trace
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import generate

TRACES = Path(__file__).resolve().parent.parent / "tests" / "data" / "traces"
IN_MEMORY = 0  # the traces here are lists already: curve() is not to copy them (sim/held.py)


def workload(requests: int, seed: int = 1) -> list[Request]:
    spec = WorkloadSpec(requests=requests, tenants=16, seed=seed, max_turns=12, sessions_per_tenant=50)
    return [
        Request(
            r["timestamp"],
            r["tenant"],
            r["model"],
            r.get("endpoint", ""),
            r["input_length"],
            r.get("output_length", 0),
            hash_ids=tuple(r["hash_ids"]),
            block_size=r["block_size"],
        )
        for r in generate(spec)
    ]


def _cfg(policy: str, isolation: str) -> ReplayConfig:
    return ReplayConfig(CacheConfig(policy=policy, isolation=isolation, capacity_tokens=1 << 20))


def _error(ref: Curve, got: Curve) -> float:
    return max(abs(a - b) for a, b in zip(ref.token_hit_rates, got.token_hit_rates, strict=True))


def compare(name: str, requests: list[Request], isolation: str, rates: Iterable[float | None]) -> None:
    lookups = sum(len(r.hash_ids or ()) for r in requests)
    print(f"{name}: {len(requests):,} requests, {lookups:,} block lookups, isolation {isolation}")
    for policy in ("lru", "s3fifo"):
        cfg = _cfg(policy, isolation)
        ref = curve(lambda: iter(requests), cfg, None, method="replay", hold_bytes=IN_MEMORY)
        print(f"  {policy:6}  full replay, {len(ref.capacities)} capacities: {ref.seconds:6.2f} s")
        methods: list[tuple[str, float | None]] = [("sampled", r) for r in rates]
        if policy == "lru":
            methods.insert(0, ("stack", None))
        for method, rate in methods:
            got = curve(lambda: iter(requests), cfg, ref.capacities, method=method, rate=rate, hold_bytes=IN_MEMORY)
            label = method if got.sampling_rate is None else f"{method} R={got.sampling_rate:.3g}"
            print(
                f"          {label:18} {got.seconds:6.2f} s ({ref.seconds / got.seconds:5.1f}x faster)"
                f"  max error {_error(ref, got):.4f}"
            )


def big(requests: int, full: bool, policies: list[str], jobs: int | None) -> None:
    start = time.perf_counter()
    trace = workload(requests)
    lookups = sum(len(r.hash_ids or ()) for r in trace)
    took = time.perf_counter() - start
    print(f"generated: {len(trace):,} requests, {lookups:,} block lookups ({took:.1f} s, untimed)")
    caps: tuple[float, ...] | None = None  # the stack's: the first curve's, for all
    for policy in policies:
        methods = ("stack", "sampled") if policy == "lru" else ("sampled",)
        cfg = _cfg(policy, "namespace")
        ref: Curve | None = None
        for method in methods:
            fork = jobs if method == "sampled" else None
            got = curve(lambda: iter(trace), cfg, caps, method=method, jobs=fork, hold_bytes=IN_MEMORY)
            caps = got.capacities
            rate = "" if got.sampling_rate is None else f" R={got.sampling_rate:.3g}"
            verdict = "met" if got.seconds < 60 else "MISSED"
            print(
                f"  {policy:6} {method}{rate}: {len(got.capacities)} capacities in {got.seconds:.1f} s"
                f" ({lookups / got.seconds / 1e6:.2f} M lookups/s); target < 60 s: {verdict}"
            )
            if full:
                ref = ref or curve(lambda: iter(trace), cfg, got.capacities, method="replay", hold_bytes=IN_MEMORY)
                ratio = ref.seconds / got.seconds
                error = _error(ref, got)
                verdict = "met" if error <= ERROR_BOUND else "MISSED"
                print(
                    f"         full replay {ref.seconds:.1f} s ({ratio:.1f}x); max error {error:.4f};"
                    f" target <= {ERROR_BOUND}: {verdict}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="also replay the 20 M lookups in full (minutes)")
    parser.add_argument("--requests", type=int, default=77_000, help="requests of the big workload (~20 M lookups)")
    parser.add_argument("--policies", default="lru,s3fifo", help="the big workload's policies (comma-separated)")
    parser.add_argument("--big-only", action="store_true", help="only the big workload")
    parser.add_argument("--jobs", type=int, help=f"processes for the big workload's miniatures (default {cpus()})")
    args = parser.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    jobs = processes(args.jobs)
    print(f"{os.cpu_count()} CPUs, load average {load}; default sample {DEFAULT_SAMPLE:,} lookups; {jobs} jobs")
    if not args.big_only:
        for name in ("conversation", "synthetic"):
            trace = list(read_trace(TRACES / f"mooncake_{name}_trace.jsonl"))
            compare(f"mooncake_{name}_trace.jsonl", trace, "shared", (None, 0.5, 0.25))
        compare("generated (20,000 requests)", workload(20_000), "namespace", (None, 0.25, 0.1))
    big(args.requests, args.full, args.policies.split(","), jobs)


if __name__ == "__main__":
    main()
