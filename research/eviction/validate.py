"""Check the harness against ``prefixcache replay``: every library policy, both
Mooncake traces, three capacities, warm-up 0.5 -- hit tokens, evictions, the optimum
and the cost-weighted rate must be the replay's exactly.

    .venv/bin/python -m research.eviction.validate

The reference (``ref/replay_reference.json``) was written from, at commit c9219c3:

    prefixcache replay tests/data/traces/mooncake_{conversation,synthetic}_trace.jsonl \
        --policy lru,s3fifo,fifo,sieve,lfu --capacity-tokens 1e6,3e6,1e7 --warmup 0.5 --json

``lfu`` has since been retired from the library (``prefixcache.policies.RETIRED``): its
references are skipped.
"""

from __future__ import annotations

import json
import sys

from prefixcache.policies import RETIRED
from research.eviction.policies import make
from research.eviction.sim import belady, replay
from research.eviction.traces import HERE, by_name, load


def main() -> int:
    ref = json.loads((HERE / "ref" / "replay_reference.json").read_text())
    traces = {name: load(by_name(name), name) for name in {r["trace"] for r in ref}}
    optimum: dict[tuple[str, float], float] = {}
    bad = 0
    for r in ref:
        if r["policy"] in RETIRED:
            print(f"skip {r['trace']:12s} {r['policy']:6s}: retired from the library")
            continue
        trace, cap = traces[r["trace"]], float(r["capacity_tokens"])
        res = replay(trace, make(f"lib:{r['policy']}"), cap)
        if (r["trace"], cap) not in optimum:
            optimum[(r["trace"], cap)] = belady(trace, cap).hit_rate
        got = (
            res.requests,
            res.hit_tokens,
            res.evictions,
            round(optimum[(r["trace"], cap)], 6),
            round(res.cost_rate, 6),
        )
        want = (
            r["requests"],
            r["hit_tokens"],
            r["evictions"],
            r["optimal_token_hit_rate"],
            r["prefill_compute_avoided"],
        )
        ok = got == want
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {r['trace']:12s} {r['policy']:6s} {cap:8.0e}  harness {got}  replay {want}")
    print("all equal" if not bad else f"{bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
