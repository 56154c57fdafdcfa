"""The planner and the sampled curve on a trace file, read on every pass against read
once and held in memory (sim/held.py), in one process.

A generated workload (about 20 M block lookups at the default size) is written to a
JSONL file (not timed). Then, for ``prefixcache plan``'s search and for a whole sampled
curve: the time with the trace parsed from the file on every pass (``hold_bytes=0``,
the baseline), the time held, their ratio, and a check that both give the same answer.

    .venv/bin/python benchmarks/bench_held.py [--requests N] [--target 0.5] [--jobs N] [--policy lru]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from prefixcache.config import CacheConfig
from prefixcache.sim.costmodel import CostModel, get_gpu, get_model
from prefixcache.sim.curves import curve
from prefixcache.sim.plan import PlanInputs, make_plan
from prefixcache.sim.plan_inputs import kv_layout
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.traces import Request, read_trace
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import write_jsonl

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def report(what: str, streamed: float, held: float, same: bool) -> None:
    print(f"{what:<16} streamed {streamed:7.1f} s   held {held:7.1f} s   {streamed / held:4.2f}x   same: {same}")
    if not same:
        raise SystemExit(f"{what}: the held trace gave another answer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=77_000)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--jobs", type=int, default=None, help="processes (default: one per CPU)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "workload.jsonl"
        spec = WorkloadSpec(requests=args.requests, tenants=16, seed=1, max_turns=12)
        write_jsonl(spec, path)
        print(f"workload: {args.requests:,} requests, {path.stat().st_size / 1e6:.0f} MB of JSONL")

        def source() -> Iterable[Request]:
            return read_trace(path)

        model = get_model("llama-3-8b")
        inputs = PlanInputs(
            target=args.target,
            cost=CostModel(model, get_gpu("h100")),
            kv=kv_layout(model),
            policy=args.policy,
        )
        (slow, t_slow) = timed(lambda: make_plan(source, inputs, jobs=args.jobs, hold_bytes=0))
        (fast, t_fast) = timed(lambda: make_plan(source, inputs, jobs=args.jobs))
        print(f"plan: {fast.capacity_tokens:,.0f} tokens at {fast.hit_rate:.4f}, {len(fast.curve)} points measured")
        report("plan", t_slow, t_fast, (slow.capacity_tokens, slow.curve) == (fast.capacity_tokens, fast.curve))

        config = ReplayConfig(CacheConfig(policy=args.policy, capacity_tokens=1 << 20))
        (slow_c, t_slow) = timed(lambda: curve(source, config, warmup=0.5, jobs=args.jobs, hold_bytes=0))
        (fast_c, t_fast) = timed(lambda: curve(source, config, warmup=0.5, jobs=args.jobs))
        report("sampled curve", t_slow, t_fast, slow_c.token_hit_rates == fast_c.token_hit_rates)


if __name__ == "__main__":
    main()
