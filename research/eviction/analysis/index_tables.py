import collections
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np
from research.eviction.policies import make
from research.eviction.sim import Sim
from research.eviction.traces import by_name, load

tname, cap, pn = sys.argv[1], float(sys.argv[2]), sys.argv[3]
t = load(by_name(tname), tname)
p = make(pn)
sim = Sim(t, cap)
res = sim.run(p)
print(pn, res.hit_rate, "quantum", p.quantum)
occ = collections.Counter()
for k, node in p.resident.items():
    occ[p.st[k][1]] += 1
for c in range(p.ncls):
    h, r = p.H[c], p.R[c]
    if r[0] < 1:
        continue
    hz = np.where(r > 0, h / np.maximum(r, 1e-9), 0)
    surv = np.cumprod(1 - hz)
    idx = p.index[c]
    print(
        "cls %3d trials %8.0f P(reuse<H) %.2f  idx@0 %.2e @8 %.2e @32 %.2e @64 %.2e max %.2e occ %d"
        % (c, r[0], 1 - surv[-1], idx[0], idx[8], idx[32], idx[64], max(idx), occ[c])
    )
