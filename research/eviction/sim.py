"""Tree-mode replay for eviction research, step for step the replay's tree mode.

Per request (``prefixcache replay``'s tree mode on a pre-hashed trace, shared
isolation, no TTL, no publication, no partial blocks):

1. walk the request's block ids from its context root: the hit is the longest cached
   prefix, ``min(h * block_size, input_length)`` tokens;
2. tell the policy about the hit (the library calls ``access_many`` deepest first);
3. the deepest matched block (or the root) is pinned; make room for the blocks the
   request lacks (``need = min(missing, capacity)``): ask the policy for victims
   until they fit or nothing is evictable. Only unpinned leaves may leave
   (prefix-closed tree, invariant 4 of design.md);
4. store as many of the missing blocks as fit, as one chain under the deepest
   matched block (the library inserts them into its policy deepest first).

Capacity is in native blocks (``capacity_tokens // block_size``). Requests before
``warmup * n`` only warm the cache. The cost-weighted hit rate is the replay's cost
model (``costmodel.CostModel``, llama-3-8b): prefill FLOPs saved over FLOPs of all
counted prompts.

A policy sees more than the library's interface: the tree (parent, depth, children),
the request (time, index, length, how much of it hit), and a ``leaf`` call when a
block becomes an evictable leaf because its last child left.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

from research.eviction.traces import Trace

# llama-3-8b, the replay's default cost profile
PARAMS, LAYERS, HIDDEN = 8.03e9, 32, 4096


def prefill_flops(tokens: int) -> float:
    """FLOPs of prefilling the first ``tokens`` positions (dense + attention)."""
    return 2.0 * PARAMS * tokens + float(4 * LAYERS * HIDDEN * (tokens * (tokens - 1) // 2))


class Policy:
    """A research policy. ``sim`` is the running ``Sim`` (tree arrays, request state)."""

    name = "policy"

    def attach(self, sim: Sim) -> None:
        self.sim = sim

    def hit(self, path: list[int]) -> None:
        """The request matched ``path`` (root-most first); called only when non-empty."""

    def insert(self, new: list[int]) -> None:
        """``new`` (root-most first) were stored under the deepest matched block."""

    def victim(self, pinned: int) -> int | None:
        """An unpinned leaf to evict (``sim.nkids[n] == 0 and n != pinned``), forgotten
        by the policy; None when there is none."""
        raise NotImplementedError

    def leaf(self, node: int) -> None:
        """``node`` just lost its last child: it is now a leaf (and evictable)."""

    def end(self) -> None:
        """The request is done (after its insert)."""


@dataclass
class Result:
    trace: str
    policy: str
    capacity_tokens: float
    requests: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    flops_total: float = 0.0
    flops_saved: float = 0.0
    evictions: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def cost_rate(self) -> float:
        return self.flops_saved / self.flops_total if self.flops_total else 0.0


class Sim:
    """The block tree of one replay. Node ids are never reused; roots are nodes too
    (depth 0, never in a policy)."""

    def __init__(self, trace: Trace, capacity_tokens: float) -> None:
        self.trace = trace
        self.bs = trace.block_size
        self.capacity = math.inf if math.isinf(capacity_tokens) else int(capacity_tokens) // self.bs
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.nkids: list[int] = []
        self.born: list[int] = []  # request index that stored it
        self.kids: dict[tuple[int, int], int] = {}
        self.bid: list[int] = []
        # a stable key per block: the same block stored again (after an eviction) has
        # the same key, as the cache's chained hash does (ghosts need it)
        self.key: list[int] = []
        self.roots: dict[str, int] = {}
        self.used = 0
        self.evictions = 0
        # the current request
        self.r = 0
        self.now = 0.0
        self.req_blocks = 0
        self.req_len = 0
        self.hit_blocks = 0

    def _node(self, parent: int, bid: int, depth: int) -> int:
        n = len(self.parent)
        self.parent.append(parent)
        self.depth.append(depth)
        self.nkids.append(0)
        self.bid.append(bid)
        self.key.append(bid * 1024 + len(self.roots) if parent < 0 else bid * 1024 + self.key[parent] % 1024)
        self.born.append(self.r)
        return n

    def root(self, name: str) -> int:
        n = self.roots.get(name)
        if n is None:
            n = self.roots[name] = self._node(-1, -1, 0)
        return n

    def is_root(self, n: int) -> bool:
        return self.parent[n] < 0

    def evict(self, n: int) -> None:
        p = self.parent[n]
        del self.kids[(p, self.bid[n])]
        self.nkids[p] -= 1
        self.used -= 1
        self.evictions += 1
        self.bid[n] = -2  # gone
        if self.nkids[p] == 0 and self.parent[p] >= 0:
            self.policy.leaf(p)

    def alive(self, n: int) -> bool:
        return self.bid[n] != -2

    def run(self, policy: Policy, warmup: float = 0.5, label: str | None = None) -> Result:
        self.policy = policy
        policy.attach(self)
        res = Result(self.trace.name, label or policy.name, self.capacity * self.bs)
        skip = int(len(self.trace.reqs) * warmup)
        kids, cap, bs = self.kids, self.capacity, self.bs
        start = time.perf_counter()
        for r, req in enumerate(self.trace.reqs):
            self.r, self.now, self.req_len = r, req.t, req.input_length
            ids = req.ids
            self.req_blocks = len(ids)
            node = self.root(req.root)
            path: list[int] = []
            for b in ids:
                c = kids.get((node, b))
                if c is None:
                    break
                path.append(c)
                node = c
            h = len(path)
            self.hit_blocks = h
            if r >= skip:
                hit = min(h * bs, req.input_length)
                res.requests += 1
                res.lookup_tokens += req.input_length
                res.hit_tokens += hit
                res.flops_total += prefill_flops(req.input_length)
                res.flops_saved += prefill_flops(hit)
            if h:
                policy.hit(path)
            missing = len(ids) - h
            if missing and cap > 0:
                need = min(missing, cap)
                while cap - self.used < need:
                    v = policy.victim(node)
                    if v is None:
                        break
                    assert self.nkids[v] == 0 and v != node and self.alive(v), v
                    self.evict(v)
                room = min(need, cap - self.used)
                if room > 0:
                    new = []
                    d = h
                    for b in ids[h : h + room]:
                        d += 1
                        c = self._node(node, b, d)
                        kids[(node, b)] = c
                        self.nkids[node] += 1
                        new.append(c)
                        node = c
                    self.used += room
                    policy.insert(new)
            policy.end()
        res.seconds = time.perf_counter() - start
        res.evictions = self.evictions
        return res


def replay(trace: Trace, policy: Policy, capacity_tokens: float, warmup: float = 0.5) -> Result:
    return Sim(trace, capacity_tokens).run(policy, warmup)


# ---------------------------------------------------------------------------- the optimum


def belady(trace: Trace, capacity_tokens: float, warmup: float = 0.5) -> Result:
    """The replay's optimum (``sim/optimum.py``), re-implemented on this trace form:
    Belady with bypass on the flat block sequence, the hit a request's contiguous prefix
    of resident blocks. Also returns its cost-weighted hit rate (the same decisions,
    which maximise block hits, not FLOPs: an upper reference, not the cost optimum)."""
    ids: dict[tuple[str, int], int] = {}
    seq: list[int] = []
    bounds = [0]
    for req in trace.reqs:
        for b in req.ids:
            seq.append(ids.setdefault((req.root, b), len(ids)))
        bounds.append(len(seq))
    never = len(seq) + 1
    next_use = [never] * len(seq)
    last: dict[int, int] = {}
    for pos in range(len(seq) - 1, -1, -1):
        next_use[pos] = last.get(seq[pos], never)
        last[seq[pos]] = pos
    capacity_blocks = capacity_tokens / trace.block_size
    cap = math.inf if math.isinf(capacity_blocks) else int(capacity_blocks)
    resident: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    res = Result(trace.name, "optimum", capacity_tokens)
    skip = int(len(trace.reqs) * warmup)
    start = time.perf_counter()
    for r, req in enumerate(trace.reqs):
        prefix_hits, prefix = 0, True
        for pos in range(bounds[r], bounds[r + 1]):
            block, nxt = seq[pos], next_use[pos]
            if block in resident:
                prefix_hits += prefix
            else:
                prefix = False
                if nxt == never or cap == 0:
                    continue
                if len(resident) >= cap:
                    while -heap[0][0] != resident.get(heap[0][1]):
                        heapq.heappop(heap)
                    if -heap[0][0] <= nxt:
                        continue
                    _, victim = heapq.heappop(heap)
                    del resident[victim]
            resident[block] = nxt
            heapq.heappush(heap, (-nxt, block))
            if nxt == never:
                del resident[block]
        if r >= skip:
            hit = min(prefix_hits * trace.block_size, req.input_length)
            res.requests += 1
            res.lookup_tokens += req.input_length
            res.hit_tokens += hit
            res.flops_total += prefill_flops(req.input_length)
            res.flops_saved += prefill_flops(hit)
    res.seconds = time.perf_counter() - start
    return res
