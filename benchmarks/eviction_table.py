"""The README's eviction table: every registered policy x the Mooncake traces x three
capacities, beside the replay's optimum, and which policy the data supports as default.

    .venv/bin/python benchmarks/eviction_table.py [--capacity-tokens 1e6,3e6,1e7] [--policy a,b]

Tree mode, warm-up 0.5, the replay's cost model (llama-3-8b on H100). Two tables: the
token hit rate, and the prefill compute avoided (the cost-weighted hit rate). The
conversation trace is the tuning set of the eviction work, the synthetic trace the
held-out one (research/eviction/RESULTS.md). The default is chosen by *regret*: in
each row, how far a policy falls below the best policy of that row. Among the policies
that are nowhere more than ``SAFE_POINTS`` below LRU (the issue's safety bound; LRU
itself always qualifies), the one whose worst regret over all rows is smallest wins
(ties: the smaller mean regret).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from prefixcache.policies import POLICIES

SAFE_POINTS = 1.0  # a default may fall at most this far (points of token hit rate) below LRU anywhere
ROOT = Path(__file__).resolve().parent.parent
TRACES = {
    "conversation (tuning)": ROOT / "tests/data/traces/mooncake_conversation_trace.jsonl",
    "synthetic (held out)": ROOT / "tests/data/traces/mooncake_synthetic_trace.jsonl",
}


def _num(value: object) -> float:
    return float(str(value))


def run(trace: Path, policies: list[str], capacities: str) -> list[dict[str, object]]:
    cmd = [sys.executable, "-m", "prefixcache.cli", "replay", str(trace), "--policy", ",".join(policies)]
    cmd += ["--capacity-tokens", capacities, "--warmup", "0.5", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    results: list[dict[str, object]] = json.loads(out)["results"]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity-tokens", default="1e6,3e6,1e7")
    parser.add_argument("--policy", default=",".join(sorted(POLICIES)), help="policies (default: all registered)")
    args = parser.parse_args()
    policies = args.policy.split(",")
    if "lru" not in policies:
        parser.error("--policy must include lru, the baseline the default is held to")
    rows: list[tuple[str, float, dict[str, tuple[float, float]], float]] = []
    started = time.perf_counter()
    for name, path in TRACES.items():
        results = run(path, policies, args.capacity_tokens)
        for cap in sorted({float(str(r["capacity_tokens"])) for r in results}):
            at = [r for r in results if float(str(r["capacity_tokens"])) == cap]
            rates = {
                str(r["policy"]): (float(str(r["token_hit_rate"])), float(str(r["prefill_compute_avoided"])))
                for r in at
            }
            rows.append((name, cap, rates, float(str(at[0]["optimal_token_hit_rate"]))))
    for title, k in (("token hit rate", 0), ("prefill compute avoided (cost-weighted hit rate)", 1)):
        print(f"\n{title}\n")
        print("| trace | capacity | " + " | ".join(policies) + (" | optimum |" if k == 0 else " |"))
        print("|---|---|" + "---|" * (len(policies) + (1 if k == 0 else 0)))
        for name, cap, rates, opt in rows:
            best = max(rates[p][k] for p in policies)
            cells = [f"**{rates[p][k]:.3f}**" if rates[p][k] == best else f"{rates[p][k]:.3f}" for p in policies]
            print(f"| {name} | {cap:.0e} | " + " | ".join(cells) + (f" | {opt:.3f} |" if k == 0 else " |"))
    regret = {p: [max(rates[q][0] for q in policies) - rates[p][0] for _n, _c, rates, _o in rows] for p in policies}
    ranked = sorted(policies, key=lambda p: (max(regret[p]), sum(regret[p]) / len(regret[p])))
    below = {p: max(rates["lru"][0] - rates[p][0] for _n, _c, rates, _o in rows) for p in policies}
    print("\nregret (points of token hit rate below the best policy of each row): worst / mean;")
    print(f"worst shortfall below LRU (a default may fall at most {SAFE_POINTS:g} point below it)")
    for p in ranked:
        mean = 100 * sum(regret[p]) / len(regret[p])
        print(f"  {p:10s} {100 * max(regret[p]):5.1f} / {mean:4.1f}   below LRU {100 * max(below[p], 0.0):4.1f}")
    safe = [p for p in ranked if 100 * below[p] <= SAFE_POINTS]
    print(f"\nthe data's default: {safe[0]}   ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
