import collections
import statistics as st
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from research.eviction.traces import by_name, load

name = sys.argv[1]
t = load(by_name(name), name)
owner = {}  # block key -> request that first stored it
parent = []
hitlen = []
for r, q in enumerate(t.reqs):
    h = 0
    p = -1
    for b in q.ids:
        k = (q.root, b)
        if k in owner:
            h += 1
            p = owner[k]
        else:
            break
    parent.append(p)
    hitlen.append(h)
    for b in q.ids[h:]:
        owner[(q.root, b)] = r
# p is the request that stored the deepest hit block. classify: continuation if hit depth > shared-prefix...
children = collections.defaultdict(list)
for r, p in enumerate(parent):
    if p >= 0:
        children[p].append(r)
n = len(t.reqs)
# turn gaps
gaps = []
gaps_s = []
nchild = collections.Counter()
for r in range(n):
    ch = children.get(r, [])
    nchild[min(len(ch), 5)] += 1
    if ch:
        gaps.append(ch[0] - r)
        gaps_s.append(t.reqs[ch[0]].t - t.reqs[r].t)
print(
    "requests",
    n,
    "with a child (someone extends its stored blocks):",
    sum(1 for r in range(n) if children.get(r)),
    "nchild dist",
    sorted(nchild.items()),
)
gaps.sort()
gaps_s.sort()
q = lambda a, f: a[int(len(a) * f)]
print(
    "gap to first child (requests): p10 %d p25 %d p50 %d p75 %d p90 %d"
    % tuple(q(gaps, f) for f in (0.1, 0.25, 0.5, 0.75, 0.9))
)
print(
    "gap to first child (s): p10 %.1f p25 %.1f p50 %.1f p75 %.1f p90 %.1f"
    % tuple(q(gaps_s, f) for f in (0.1, 0.25, 0.5, 0.75, 0.9))
)
# chain depth (turn number) via parent chain
turn = [0] * n
for r in range(n):
    turn[r] = turn[parent[r]] + 1 if parent[r] >= 0 else 0
# P(has child | turn)
byturn = collections.defaultdict(lambda: [0, 0])
for r in range(n):
    k = min(turn[r], 8)
    byturn[k][0] += 1
    byturn[k][1] += bool(children.get(r))
print("turn: (n, P(continued))", {k: (v[0], round(v[1] / v[0], 3)) for k, v in sorted(byturn.items())})
# correlation of successive gaps: for r with parent p with grandparent: gap(p->r) vs gap(r->child)
pairs = []
for r in range(n):
    p = parent[r]
    ch = children.get(r)
    if p >= 0 and ch:
        pairs.append((r - p, ch[0] - r))
import math

xs = [math.log(a) for a, b in pairs]
ys = [math.log(b) for a, b in pairs]
print("successive gaps pairs", len(pairs), "corr(log)", round(st.correlation(xs, ys), 3))
# P(continued) vs previous gap bucket
b = collections.defaultdict(lambda: [0, 0])
for r in range(n):
    p = parent[r]
    if p < 0:
        continue
    g = r - p
    k = min(int(math.log2(g + 1)), 14)
    b[k][0] += 1
    b[k][1] += bool(children.get(r))
print("P(continued | log2 prev gap):", {k: (v[0], round(v[1] / v[0], 2)) for k, v in sorted(b.items())})
# hit depth distribution; is parent the 'shared prompt' ... how many distinct children per parent
multi = sum(1 for r in children if len(children[r]) > 1)
print("parents with >1 child", multi)
# size of new blocks per request
print("mean blocks", st.mean(len(q.ids) for q in t.reqs), "mean hit (inf)", st.mean(hitlen))
# P(continued) by first block id
g = collections.defaultdict(lambda: [0, 0])
for r, q in enumerate(t.reqs):
    k = q.ids[0] if q.ids else -1
    g[k][0] += 1
    g[k][1] += bool(children.get(r))
top = sorted(g.items(), key=lambda kv: -kv[1][0])[:25]
print("by first block: n, P(cont)", [(k, v[0], round(v[1] / v[0], 2)) for k, v in top])
print("distinct first blocks", len(g), "singletons", sum(1 for v in g.values() if v[0] == 1))
# by first 2 blocks
g2 = collections.defaultdict(lambda: [0, 0])
for r, q in enumerate(t.reqs):
    k = tuple(q.ids[:3])
    g2[k][0] += 1
    g2[k][1] += bool(children.get(r))
top = sorted(g2.items(), key=lambda kv: -kv[1][0])[:15]
print("by first 3 blocks:", [(v[0], round(v[1] / v[0], 2)) for k, v in top])
# by input length bucket
g3 = collections.defaultdict(lambda: [0, 0])
for r, q in enumerate(t.reqs):
    k = q.input_length.bit_length()
    g3[k][0] += 1
    g3[k][1] += bool(children.get(r))
print("by log2 input len", sorted((k, v[0], round(v[1] / v[0], 2)) for k, v in g3.items()))
import json

outl = [json.loads(l)["output_length"] for l in open(by_name(name))] if name in ("conversation", "synthetic") else None
if outl:
    g4 = collections.defaultdict(lambda: [0, 0])
    for r in range(n):
        k = outl[r].bit_length()
        g4[k][0] += 1
        g4[k][1] += bool(children.get(r))
    print("by log2 output len", sorted((k, v[0], round(v[1] / v[0], 2)) for k, v in g4.items()))
g5 = collections.defaultdict(lambda: [0, 0])
for r, q in enumerate(t.reqs):
    f = hitlen[r] / len(q.ids)
    k = round(f * 4)
    g5[k][0] += 1
    g5[k][1] += bool(children.get(r))
print("by hit fraction quartile", sorted((k, v[0], round(v[1] / v[0], 2)) for k, v in g5.items()))
g6 = collections.defaultdict(lambda: [0, 0])
for r, q in enumerate(t.reqs):
    k = hitlen[r].bit_length()
    g6[k][0] += 1
    g6[k][1] += bool(children.get(r))
print("by log2 hit blocks", sorted((k, v[0], round(v[1] / v[0], 2)) for k, v in g6.items()))
