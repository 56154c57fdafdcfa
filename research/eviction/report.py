"""Markdown tables from the suite's JSON lines (results/*.jsonl).

    .venv/bin/python -m research.eviction.report research/eviction/results/tuning.jsonl \
        [--policies "lib:gittins,gkm"] [--cost]

One row per (trace, capacity): LRU, the optimum, the target (LRU + half the gap where
the gap is at least 5 points), then each policy's token hit rate with the share of the
LRU-to-optimum gap it closes; ``--cost`` gives the cost-weighted hit rate instead
(prefill FLOPs saved / FLOPs of all counted prompts, llama-3-8b), the gap measured the
same way on the cost figures.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--policies", help="comma-separated, in column order (default: all)")
    ap.add_argument("--cost", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    for name in a.files:
        with open(name) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    latest: dict[tuple[str, float, str], dict[str, float]] = {}
    for r in rows:  # a policy run twice: the last run counts
        latest[(r["trace"], r["capacity_tokens"], r["policy"])] = r
    configs = list(dict.fromkeys((t, c) for t, c, _ in latest))
    names = re.split(r",(?![^()]*\))", a.policies) if a.policies else list(dict.fromkeys(p for _, _, p in latest))
    m = "cost" if a.cost else "hit"
    head = ["trace", "capacity", "LRU", "optimum", "target", *names]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for t, c in configs:
        base = next(r for (tt, cc, _), r in latest.items() if (tt, cc) == (t, c))
        lru, opt = base[f"lru_{m}"], base[f"opt_{m}"]
        gap = opt - lru
        target = f"{lru + gap / 2:.3f}" if base["opt_hit"] - base["lru_hit"] >= 0.05 else "-"
        cells = [t, f"{c:.0e}".replace("e+0", "e"), f"{lru:.3f}", f"{opt:.3f}", target]
        for n in names:
            r = latest.get((t, c, n))
            if r is None:
                cells.append("")
                continue
            v = r[m]
            closed = f" ({(v - lru) / gap:+.0%})" if gap > 1e-9 else ""
            cells.append(f"{v:.3f}{closed}")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
