"""Replay traces x policies x capacities in the research harness; print a table.

    .venv/bin/python -m research.eviction.run conversation --policy lib:lru,lib:s3fifo \
        --capacity-tokens 1e6,3e6,1e7 [--optimum] [--json out.json]

Traces: ``conversation`` / ``synthetic`` (the Mooncake traces), a generated workload
name from ``traces.WORKLOADS``, or a path.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from research.eviction import candidates  # noqa: F401  (registers the candidates)
from research.eviction.policies import make
from research.eviction.sim import Result, belady, replay
from research.eviction.traces import by_name, load


def row(r: Result, opt: Result | None, lru: Result | None) -> str:
    s = f"{r.trace:18s} {r.capacity_tokens:10.3g} {r.policy:34s} hit {r.hit_rate:.4f} cost {r.cost_rate:.4f}"
    if opt is not None and lru is not None and opt.hit_rate > lru.hit_rate:
        closed = (r.hit_rate - lru.hit_rate) / (opt.hit_rate - lru.hit_rate)
        s += f"  gap closed {closed:+.0%}"
    return s + f"  ev {r.evictions:7d}  {r.seconds:5.1f}s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", help="comma-separated trace names or paths")
    ap.add_argument("--policy", default="lib:lru")
    ap.add_argument("--capacity-tokens", default="1e6,3e6,1e7")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--optimum", action="store_true", help="also the flat Belady optimum")
    ap.add_argument("--json", help="append results (JSON lines) to this file")
    a = ap.parse_args(argv)
    out = []
    for tname in a.traces.split(","):
        trace = load(by_name(tname), tname)
        for cap in (float(c) for c in a.capacity_tokens.split(",")):
            opt = belady(trace, cap, a.warmup) if a.optimum else None
            results = []
            if opt is not None:
                print(row(opt, None, None), flush=True)
                results.append(opt)
            lru = None
            for pname in re.split(r",(?![^()]*\))", a.policy):
                res = replay(trace, make(pname), cap, a.warmup)
                if pname == "lib:lru":
                    lru = res
                print(row(res, opt, lru), flush=True)
                results.append(res)
            out.extend(results)
    if a.json:
        with open(a.json, "a") as f:
            for r in out:
                f.write(json.dumps({**r.__dict__, "hit_rate": r.hit_rate, "cost_rate": r.cost_rate}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
