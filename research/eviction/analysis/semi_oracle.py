"""Semi-oracle: knows WHETHER each block is requested again within WINDOW requests,
not when; evicts blocks without such a reuse first, LRU among equals.

    .venv/bin/python research/eviction/analysis/semi_oracle.py conversation 1e6,3e6 300,1000
"""

import heapq
import sys
from bisect import bisect_right
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from research.eviction.candidates import TreeOracle
from research.eviction.sim import Sim
from research.eviction.traces import by_name, load


class Semi(TreeOracle):
    def __init__(self, window: int) -> None:
        self.window = window
        self.name = f"semi{window}"

    def _touch(self, nodes: list[int]) -> None:
        r, key, nu, heap, occ = self.sim.r, self.sim.key, self.nu, self.heap, self.occ
        for n in nodes:
            o = occ[key[n]]
            i = bisect_right(o, r)
            nxt = o[i] if i < len(o) else self.never
            pri = (10**9 if nxt - r <= self.window else 0) + r  # evict the smallest
            nu[n] = -pri
            heapq.heappush(heap, (pri, n))


if __name__ == "__main__":
    tname = sys.argv[1]
    t = load(by_name(tname), tname)
    for cap in map(float, sys.argv[2].split(",")):
        for w in map(int, sys.argv[3].split(",")):
            res = Sim(t, cap).run(Semi(w))
            print(tname, cap, "semi-oracle window", w, "requests: hit %.4f" % res.hit_rate)
