"""Score policies on the tuning set (or, once, on the held-out set) against the goal.

    .venv/bin/python -m research.eviction.suite "lhd;lib:s3fifo" [--set tuning|heldout]

Goal (the issue): wherever LRU is at least 5 points below the optimum, reach
LRU + (optimum - LRU) / 2; nowhere fall more than 1 point below LRU.

TUNING: the Mooncake conversation trace (1e6, 3e6, 1e7 tokens), three workloads of
``prefixcache workload`` (1e5, 3e5, 1e6 tokens; their unique footprint is 8-10M
tokens) and one of agent loops from ``agentic.py`` (1e5, 3e5, 6e5 tokens).
HELD-OUT: the Mooncake synthetic trace (1e6, 3e6, 1e7 tokens).
LRU and the optimum are cached in /tmp (they do not change).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from research.eviction import candidates  # noqa: F401
from research.eviction.policies import make
from research.eviction.sim import Result, belady, replay
from research.eviction.traces import WORK, by_name, load

SETS: dict[str, list[tuple[str, list[float]]]] = {
    "tuning": [
        ("conversation", [1e6, 3e6, 1e7]),
        ("gen-default-b16", [1e5, 3e5, 1e6]),
        ("gen-turns4-b64", [1e5, 3e5, 1e6]),
        ("gen-turns12-b32", [1e5, 3e5, 1e6]),
        ("agentic-b64", [1e5, 3e5, 6e5]),
    ],
    "heldout": [("synthetic", [1e6, 3e6, 1e7])],
}


def baseline(trace_name: str, cap: float, which: str, trace: object) -> dict[str, float]:
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / "baselines.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    key = f"{trace_name}|{cap:g}|{which}"
    if key not in cache:
        res = belady(trace, cap) if which == "optimum" else replay(trace, make(which), cap)  # type: ignore[arg-type]
        cache[key] = {"hit": res.hit_rate, "cost": res.cost_rate}
        path.write_text(json.dumps(cache, indent=1))
    return cache[key]  # type: ignore[no-any-return]


def judge(res: Result, lru: dict[str, float], opt: dict[str, float]) -> str:
    gap = opt["hit"] - lru["hit"]
    target = lru["hit"] + gap / 2 if gap >= 0.05 else None
    closed = (res.hit_rate - lru["hit"]) / gap if gap > 1e-9 else 0.0
    ok = res.hit_rate >= lru["hit"] - 0.01 and (target is None or res.hit_rate >= target)
    return f"closed {closed:+5.0%} {'PASS' if ok else 'fail'}" + ("" if target is None else f" (target {target:.3f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("policies", help="policy names, separated by ',' (outside parentheses) or ';'")
    ap.add_argument("--set", default="tuning", choices=sorted(SETS))
    ap.add_argument("--only", help="comma-separated trace names to keep")
    ap.add_argument("--json", help="append results (JSON lines) to this file")
    a = ap.parse_args(argv)
    names = [p for p in re.split(r"[;]|,(?![^()]*\))", a.policies) if p]
    totals: dict[str, list[float]] = {n: [] for n in names}
    fails: dict[str, int] = {n: 0 for n in names}
    rows = []
    for tname, caps in SETS[a.set]:
        if a.only and tname not in a.only.split(","):
            continue
        trace = load(by_name(tname), tname)
        for cap in caps:
            lru = baseline(tname, cap, "lib:lru", trace)
            opt = baseline(tname, cap, "optimum", trace)
            head = f"[{a.set}] {tname} {cap:g}: LRU {lru['hit']:.4f} / {lru['cost']:.4f}"
            print(f"{head}  optimum {opt['hit']:.4f} / {opt['cost']:.4f}")
            for n in names:
                res = replay(trace, make(n), cap)
                verdict = judge(res, lru, opt)
                fails[n] += "fail" in verdict
                gap = opt["hit"] - lru["hit"]
                totals[n].append((res.hit_rate - lru["hit"]) / gap if gap > 1e-9 else 1.0)
                print(
                    f"    {n:40s} hit {res.hit_rate:.4f} cost {res.cost_rate:.4f}  {verdict}  {res.seconds:4.1f}s",
                    flush=True,
                )
                rows.append(
                    {
                        "set": a.set,
                        "trace": tname,
                        "capacity_tokens": cap,
                        "policy": n,
                        "hit": res.hit_rate,
                        "cost": res.cost_rate,
                        "lru_hit": lru["hit"],
                        "lru_cost": lru["cost"],
                        "opt_hit": opt["hit"],
                        "opt_cost": opt["cost"],
                    }
                )
    print()
    for n in names:
        t = totals[n]
        print(f"{n:40s} mean gap closed {sum(t) / len(t):+.1%}  min {min(t):+.1%}  fails {fails[n]}/{len(t)}")
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
