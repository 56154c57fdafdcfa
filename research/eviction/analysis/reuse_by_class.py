import collections
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from research.eviction.traces import by_name, load

name = sys.argv[1]
t = load(by_name(name), name)
reqs = t.reqs
occ = collections.defaultdict(list)
for r, q in enumerate(reqs):
    for i, b in enumerate(q.ids):
        occ[(q.root, b)].append(r)
# at infinite capacity: per request hit h; new blocks reuse prob
seen = set()
stats = collections.Counter()
dist = collections.defaultdict(list)
for r, q in enumerate(reqs):
    h = 0
    for b in q.ids:
        if (q.root, b) in seen:
            h += 1
        else:
            break
    n = len(q.ids)
    for i, b in enumerate(q.ids):
        k = (q.root, b)
        o = occ[k]
        j = o.index(r)
        reused = j + 1 < len(o)
        isnew = k not in seen
        cls = (
            "hitreq" if h > 0 else "missreq",
            "new" if isnew else "old",
            "tail" if i == n - 1 else ("last4" if i >= n - 4 else "body"),
        )
        stats[cls + ("n",)] += 1
        stats[cls + ("reused",)] += reused
        if reused:
            dist[cls].append(o[j + 1] - r)
    for b in q.ids:
        seen.add((q.root, b))
for cls in sorted({k[:3] for k in stats}):
    n = stats[cls + ("n",)]
    u = stats[cls + ("reused",)]
    d = sorted(dist[cls])
    med = d[len(d) // 2] if d else -1
    print(
        cls, n, "P(reuse)=%.3f" % (u / n), "median next-use (requests)", med, "p90", d[int(len(d) * 0.9)] if d else -1
    )
# how many distinct reuse count per block
cnt = collections.Counter(len(o) for o in occ.values())
print("accesses per block:", sorted(cnt.items())[:12])
