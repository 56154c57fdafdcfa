"""Candidate eviction policies, registered in ``policies.REGISTRY``.

Every candidate works on the tree the harness keeps (``sim.Sim``): it may only evict
an unpinned leaf, and learns of new leaves through ``leaf``.
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_right
from collections import defaultdict

from research.eviction.policies import register
from research.eviction.sim import Policy, Sim


class Leaves:
    """The evictable-leaf set, indexable for uniform sampling (swap-remove)."""

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[int] = []
        self.pos: dict[int, int] = {}

    def add(self, n: int) -> None:
        if n not in self.pos:
            self.pos[n] = len(self.items)
            self.items.append(n)

    def discard(self, n: int) -> None:
        i = self.pos.pop(n, None)
        if i is None:
            return
        last = self.items.pop()
        if last != n:
            self.items[i] = last
            self.pos[last] = i

    def __len__(self) -> int:
        return len(self.items)


class LeafPolicy(Policy):
    """Keeps the leaf set up to date; subclasses rank leaves."""

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        self.leaves = Leaves()

    def insert(self, new: list[int]) -> None:
        self.leaves.discard(self.sim.parent[new[0]])
        self.leaves.add(new[-1])

    def leaf(self, node: int) -> None:
        self.leaves.add(node)


# ---------------------------------------------------------------------------- oracle


@register("oracle")
class TreeOracle(Policy):
    """Belady in the tree (a diagnostic, it reads the future): evict the evictable leaf
    whose next use is farthest. New blocks are ranked like the rest, so one whose next
    use is far goes at the next eviction: the tree's nearest thing to bypass."""

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        occ: dict[int, list[int]] = defaultdict(list)
        roots: dict[str, int] = {}
        for r, req in enumerate(sim.trace.reqs):
            ordinal = roots.setdefault(req.root, len(roots))
            for b in req.ids:
                occ[b * 1024 + ordinal].append(r)
        self.occ = occ
        self.never = len(sim.trace.reqs) + 1
        self.nu: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []

    def _touch(self, nodes: list[int]) -> None:
        r, key, nu, heap, occ = self.sim.r, self.sim.key, self.nu, self.heap, self.occ
        for n in nodes:
            o = occ[key[n]]
            i = bisect_right(o, r)
            v = o[i] if i < len(o) else self.never
            nu[n] = v
            heapq.heappush(heap, (-v, n))

    def hit(self, path: list[int]) -> None:
        self._touch(path)

    def insert(self, new: list[int]) -> None:
        self._touch(new)

    def leaf(self, node: int) -> None:
        heapq.heappush(self.heap, (-self.nu[node], node))

    def victim(self, pinned: int) -> int | None:
        heap, nu, nkids = self.heap, self.nu, self.sim.nkids
        held = []
        out = None
        while heap:
            v, n = heapq.heappop(heap)
            if nu.get(n) != -v or nkids[n]:
                continue  # stale, or not a leaf (re-pushed by ``leaf``)
            if n == pinned:
                held.append((v, n))
                continue
            del nu[n]
            out = n
            break
        for e in held:
            heapq.heappush(heap, e)
        return out


# ---------------------------------------------------------------------------- LHD


@register("lhd")
class LHD(LeafPolicy):
    """Least hit density (Beckmann et al., NSDI'18) over the tree's leaves.

    A block's value is its expected hits per unit of space-time it will still occupy,
    learned online per class from what happened to blocks of that class at each age:
    ``density(c, a) = sum_{x >= a} hits(c, x) / sum_{x >= a} sum_{y >= x} events(c, y)``.
    Age counts blocks stored since the block's last access (the cache's own clock), in
    ``capacity / 16`` quanta. Victim: the lowest density among ``k`` sampled leaves.

    Classes (flags, all principled, no trace constants):
    * ``hits``: hits so far, capped (the reference count LHD uses);
    * ``tail``: the block was its request's last one when stored or last hit (a prompt's
      partial last block is extended, not repeated, by the next turn);
    * ``cont``: the request that stored it hit more than ``cont`` of its blocks... bucketed
      log2 of the hit depth of the request that last touched it.
    """

    def __init__(
        self,
        k: float = 32,
        hits: float = 3,
        tail: float = 1,
        cont: float = 1,
        nb: float = 128,
        per: float = 16,
        decay: float = 0.9,
        cost: float = 0,
        seed: float = 1,
    ) -> None:
        self.k, self.maxhits, self.use_tail, self.use_cont = int(k), int(hits), bool(tail), bool(cont)
        self.nb, self.per, self.decay, self.use_cost = int(nb), per, decay, bool(cost)
        self.rng = random.Random(int(seed))

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        cap = sim.capacity if sim.capacity != float("inf") else 1 << 30
        self.quantum = max(1, int(cap // self.per))
        self.period = max(1, int(cap))  # reconfigure every ``capacity`` stored blocks
        self.clock = 0
        self.next_cfg = self.period
        self.ncls = (self.maxhits + 1) * 2 * 8
        self.H = [[0.0] * self.nb for _ in range(self.ncls)]
        self.E = [[0.0] * self.nb for _ in range(self.ncls)]
        self.D: list[list[float]] | None = None
        self.cls: dict[int, int] = {}
        self.nhits: dict[int, int] = {}
        self.ts: dict[int, int] = {}

    def _cls(self, n: int, is_tail: bool) -> int:
        c = min(self.nhits[n], self.maxhits)
        c = c * 2 + (is_tail and self.use_tail)
        return c * 8 + (min(self.sim.hit_blocks.bit_length(), 7) if self.use_cont else 0)

    def _age(self, n: int) -> int:
        a = (self.clock - self.ts[n]) // self.quantum
        return a if a < self.nb else self.nb - 1

    def hit(self, path: list[int]) -> None:
        H, nhits, cls, ts, clock = self.H, self.nhits, self.cls, self.ts, self.clock
        last = self.sim.req_blocks == len(path)
        for n in path:
            H[cls[n]][self._age(n)] += 1
            nhits[n] += 1
            ts[n] = clock
        for n in path:
            cls[n] = self._cls(n, last and n == path[-1])

    def insert(self, new: list[int]) -> None:
        super().insert(new)
        last = self.sim.req_blocks == self.sim.hit_blocks + len(new)
        for n in new:
            self.nhits[n] = 0
            self.ts[n] = self.clock
            self.cls[n] = self._cls(n, last and n == new[-1])
        self.clock += len(new)
        if self.clock >= self.next_cfg:
            self.next_cfg = self.clock + self.period
            self._reconfigure()

    def _reconfigure(self) -> None:
        D = []
        for c in range(self.ncls):
            h, e = self.H[c], self.E[c]
            d = [0.0] * self.nb
            hits_above = events_above = life = 0.0
            for a in range(self.nb - 1, -1, -1):
                hits_above += h[a]
                events_above += h[a] + e[a]
                life += events_above
                d[a] = hits_above / life if life > 0 else 0.0
            D.append(d)
            for a in range(self.nb):
                h[a] *= self.decay
                e[a] *= self.decay
        self.D = D

    def _rank(self, n: int) -> float:
        a = self._age(n)
        if self.D is None:
            return -a  # before the first reconfiguration: LRU-like
        v = self.D[self.cls[n]][a]
        if self.use_cost:
            v *= 1.0 + 0.0167 * self.sim.depth[n] * self.sim.bs / 512
        return v

    def victim(self, pinned: int) -> int | None:
        items = self.leaves.items
        if not items:
            return None
        best, best_v = -1, float("inf")
        if len(items) <= self.k:
            cands = items
        else:
            rnd = self.rng.randrange
            m = len(items)
            cands = [items[rnd(m)] for _ in range(self.k)]
        for n in cands:
            if n == pinned:
                continue
            v = self._rank(n)
            if v < best_v or (v == best_v and self.ts[n] < self.ts[best]):
                best, best_v = n, v
        if best < 0:
            if len(items) == 1:
                return None
            best = next(n for n in items if n != pinned)
        self.E[self.cls[best]][self._age(best)] += 1
        self.leaves.discard(best)
        del self.cls[best], self.nhits[best], self.ts[best]
        return best


# ---------------------------------------------------------------------------- reuse-time index


@register("gittins")
class GittinsReuse(LeafPolicy):
    """Evict the leaf with the lowest *reuse index*: the best hits per unit of
    space-time the cache can still expect from it, learned per class from uncensored
    reuse times.

    Every access (hit or store) of a block starts a *trial* that ends at its next
    access (a reuse at age ``x``) or at the horizon (``horizon`` x capacity blocks of
    traffic later, censored). Evicted blocks stay in a ghost (key, time, class) until
    their trial ends, so the reuse times observed do not depend on what the policy
    evicted: LHD's own statistics only see reuses of blocks it kept, and learn nothing
    about ages it never lets a block reach. With ``H(x)`` reuses at age ``x`` and
    ``S(x)`` trials still open at ``x``, a block of age ``a`` is worth

        index(a) = max over T > a of  sum_{a<=x<T} H(x) / sum_{a<=x<T} S(x)

    the Gittins index of its reuse: the best ratio of expected hits to expected
    occupancy over any holding time. When reuse comes after a "think time" (the next
    turn of a conversation), index rises with age, so a fresh block is worth less than
    one half-way to its expected reuse; a fresh block whose reuse is unlikely leaves
    first, the tree's nearest thing to bypass.

    Classes: hits so far (capped at ``hits``) x whether the block was its request's
    deepest (``tail``). Age is counted in blocks looked up (the traffic), in
    ``horizon * capacity / nb`` quanta.
    """

    def __init__(
        self,
        k: float = 32,
        hits: float = 3,
        tail: float = 1,
        nb: float = 256,
        horizon: float = 32,
        decay: float = 0,
        cost: float = 0,
        seed: float = 1,
        minn: float = 200,
        lru_ties: float = 1,
        depth: float = 0,
        memory: float = 2,
        irr: float = 0,
    ) -> None:
        self.k, self.maxhits, self.use_tail, self.nb = int(k), int(hits), bool(tail), int(nb)
        self.irr = int(irr)  # >0: class by the log2 bucket of the last reuse age (LIRS's IRR), not hits
        if self.irr:
            self.maxhits = self.irr
        self.depth_buckets, self.memory = int(depth), memory
        self.horizon, self.decay, self.use_cost, self.minn = horizon, decay, bool(cost), minn
        self.lru_ties = bool(lru_ties)
        self.rng = random.Random(int(seed))

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        from collections import deque

        import numpy as np

        self.np = np
        cap = sim.capacity if sim.capacity != float("inf") else 1 << 30
        self.amax = max(self.nb, int(self.horizon * cap))
        self.quantum = self.amax / self.nb
        self.period = max(1, int(cap // 2))
        if not self.decay:  # forget over ``memory`` horizons
            self.decay = max(0.5, 1.0 - self.period / (self.memory * self.amax))
        self.clock = 0
        self.next_cfg = self.period
        self.ncls = (self.maxhits + 1) * 2 * max(1, self.depth_buckets)
        self.H = np.zeros((self.ncls, self.nb))
        self.C = np.zeros(self.ncls)
        self.index: list[list[float]] | None = None
        self.st: dict[int, tuple[int, int, int]] = {}  # key -> (ts, class, hits), resident or ghost
        self.resident: dict[int, int] = {}  # key -> node
        self.queue: deque[tuple[int, int]] = deque()

    def _access(self, n: int, tail: bool) -> None:
        key = self.sim.key[n]
        clock = self.clock
        prev = self.st.get(key)
        hits = 0
        if prev is not None:
            ts, c, hits = prev
            age = clock - ts
            if age < self.amax:
                b = int(age / self.quantum)
                self.H[c, b] += 1
                hits = min(self.irr, (b + 1).bit_length()) if self.irr else hits + 1
        c = min(hits, self.maxhits) * 2 + (tail and self.use_tail)
        if self.depth_buckets:
            tokens = self.sim.depth[n] * self.sim.bs
            c = c * self.depth_buckets + min(max(tokens.bit_length() - 9, 0), self.depth_buckets - 1)
        self.st[key] = (clock, c, hits)
        self.queue.append((clock, key))

    def hit(self, path: list[int]) -> None:
        whole = self.sim.req_blocks == len(path)
        last = path[-1]
        for n in path:
            self._access(n, whole and n == last)

    def insert(self, new: list[int]) -> None:
        super().insert(new)
        whole = self.sim.req_blocks == self.sim.hit_blocks + len(new)
        last = new[-1]
        key = self.sim.key
        for n in new:
            self.resident[key[n]] = n
            self._access(n, whole and n == last)

    def end(self) -> None:
        self.clock += self.sim.req_blocks
        q, st, amax, clock = self.queue, self.st, self.amax, self.clock
        while q and clock - q[0][0] >= amax:
            ts, key = q.popleft()
            cur = st.get(key)
            if cur is not None and cur[0] == ts:
                self.C[cur[1]] += 1
                if key not in self.resident:
                    del st[key]
        if self.clock >= self.next_cfg:
            self.next_cfg = self.clock + self.period
            self._reconfigure()

    def _table(self, h: object, c: float) -> list[float]:
        np = self.np
        h = np.asarray(h)
        surv = np.cumsum(h[::-1])[::-1] + c  # S(x): trials open at age x
        ch = np.concatenate([[0.0], np.cumsum(h)])
        cs = np.concatenate([[0.0], np.cumsum(surv)])
        nb = self.nb
        # ratio[a, T] = (ch[T] - ch[a]) / (cs[T] - cs[a]) for T > a
        a = np.arange(nb)[:, None]
        t = np.arange(1, nb + 1)[None, :]
        num = ch[t] - ch[a]
        den = cs[t] - cs[a]
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where((t > a) & (den > 0), num / np.where(den > 0, den, 1), 0.0)
        return r.max(axis=1).tolist()  # type: ignore[no-any-return]

    def _reconfigure(self) -> None:
        pooled = self._table(self.H.sum(axis=0), float(self.C.sum()))
        idx = []
        for c in range(self.ncls):
            n = self.H[c].sum() + self.C[c]
            idx.append(self._table(self.H[c], float(self.C[c])) if n >= self.minn else pooled)
        self.index = idx
        self.H *= self.decay
        self.C *= self.decay

    def _rank(self, n: int) -> float:
        ts, c, _ = self.st[self.sim.key[n]]
        age = self.clock - ts
        if self.index is None:
            return -age
        if age >= self.amax:
            return 0.0
        v = self.index[c][int(age / self.quantum)]
        if self.use_cost:
            v *= 1.0 + 0.0167 * self.sim.depth[n] * self.sim.bs / 512
        return v

    def victim(self, pinned: int) -> int | None:
        items = self.leaves.items
        if not items:
            return None
        if len(items) <= self.k:
            cands = items
        else:
            rnd, m = self.rng.randrange, len(items)
            cands = [items[rnd(m)] for _ in range(self.k)]
        best, best_v, best_ts = -1, float("inf"), 0
        st, key = self.st, self.sim.key
        for n in cands:
            if n == pinned:
                continue
            v = self._rank(n)
            ts = st[key[n]][0]
            if v < best_v or (v == best_v and (ts < best_ts if self.lru_ties else ts > best_ts)):
                best, best_v, best_ts = n, v, ts
        if best < 0:
            if len(items) == 1:
                return None
            best = next(n for n in items if n != pinned)
        self.leaves.discard(best)
        del self.resident[key[best]]
        return best


@register("gittins-exact")
class GittinsExact(GittinsReuse):
    """``gittins`` with exact candidates instead of random samples: per class, the
    oldest and the youngest leaf. Within a class the index is a function of age alone;
    where it rises then falls with age (reuse after a think time), its minimum over a
    class's leaves is at one of the two ends, so these candidates contain the true
    victim. Random sampling misses it in a tree: after a leaf leaves, its parent is
    usually the right next victim, and a sample of k among hundreds of leaves rarely
    holds it."""

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        self.old: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.young: dict[int, list[tuple[int, int]]] = defaultdict(list)

    def _push(self, n: int) -> None:
        ts, c, _ = self.st[self.sim.key[n]]
        heapq.heappush(self.old[c], (ts, n))
        heapq.heappush(self.young[c], (-ts, n))

    def _access(self, n: int, tail: bool) -> None:
        super()._access(n, tail)
        if self.sim.nkids[n] == 0:
            self._push(n)

    def leaf(self, node: int) -> None:
        self._push(node)

    def _valid(self, n: int, ts: int, c: int) -> bool:
        if self.sim.nkids[n] or not self.sim.alive(n):
            return False
        cur = self.st.get(self.sim.key[n])
        return cur is not None and cur[0] == ts and cur[1] == c and self.resident.get(self.sim.key[n]) == n

    def _top(self, heap: list[tuple[int, int]], c: int, sign: int, pinned: int) -> int:
        held = []
        out = -1
        while heap:
            t, n = heap[0]
            if not self._valid(n, sign * t, c):
                heapq.heappop(heap)
                continue
            if n == pinned:
                held.append(heapq.heappop(heap))
                continue
            out = n
            break
        for e in held:
            heapq.heappush(heap, e)
        return out

    def victim(self, pinned: int) -> int | None:
        best, best_v, best_ts = -1, float("inf"), 0
        st, key = self.st, self.sim.key
        for c in list(self.old):
            for heap, sign in ((self.old[c], 1), (self.young[c], -1)):
                n = self._top(heap, c, sign, pinned)
                if n < 0:
                    continue
                v = self._rank(n)
                ts = st[key[n]][0]
                if v < best_v or (v == best_v and ts < best_ts):
                    best, best_v, best_ts = n, v, ts
        if best < 0:
            return None
        self.leaves.discard(best)
        del self.resident[key[best]]
        return best


# ---------------------------------------------------------------------------- reuse index, Kaplan-Meier


@register("gkm")
class GittinsKM(LeafPolicy):
    """The reuse index of ``gittins`` with a Kaplan-Meier estimate of the reuse-time
    distribution, so that trials still open (young ones, or any when the horizon is
    longer than the traffic seen so far) count as survivors, not as missing data.

    Per class ``c`` and age bin ``x``: ``R[c, x]`` trials reached bin ``x`` (at risk),
    ``H[c, x]`` ended there with a reuse; hazard ``h = H / R``, survival
    ``S(x) = prod_{y<x} (1 - h(y))``, and a block of age ``a`` is worth

        index(a) = max_{T > a} sum_{a<=x<T} S(x) h(x) / sum_{a<=x<T} S(x)

    (the Gittins index of its next reuse, hits per block per age bin). Ages are counted
    in ticks of ``horizon * capacity / nb`` blocks looked up. Victim: the lowest index
    among the oldest and youngest leaf of each class (exact when the index is unimodal
    in age), ties to the oldest.

    Classes: reuses so far (capped at ``hits``) x whether the block was its request's
    deepest (``tail``) [x log2 token depth (``depth`` buckets)] [x lineage: whether
    the request that touched it last extended a chain stored by a previous request].
    """

    def __init__(
        self,
        hits: float = 3,
        tail: float = 1,
        nb: float = 128,
        horizon: float = 16,
        memory: float = 4,
        depth: float = 0,
        cost: float = 0,
        prior: float = 50,
        gen: float = 0,
        irr: float = 0,
        parent: float = 0,
        clock: float = 0,
        young: float = 1,
        irrb: float = 0,
    ) -> None:
        self.irrb = int(irrb)  # >0: x bucket of the last reuse age (log4 ticks), for reused blocks
        self.use_young = bool(young)  # candidates from both ends of each class (else the oldest only)
        self.flat_clock = bool(clock)  # count blocks hit or stored (what a flat policy sees), not looked up
        self.parent_buckets = int(parent)  # >0: x bucket of the parent's reuses (root: 0)
        self.maxhits, self.use_tail, self.nb, self.horizon = int(hits), bool(tail), int(nb), horizon
        self.irr = int(irr)  # >0: "hits" is 1 + the log2 bucket of the last reuse age (LIRS's IRR), capped
        if self.irr:
            self.maxhits = self.irr
        self.memory, self.depth_buckets, self.use_cost, self.prior = memory, int(depth), bool(cost), prior
        self.gen = int(gen)

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        import numpy as np

        self.np = np
        cap = sim.capacity if sim.capacity != float("inf") else 1 << 30
        self.quantum = max(1, int(self.horizon * cap / self.nb))
        self.period = max(1, int(cap // 2))
        self.decay = max(0.5, 1.0 - self.period / (self.memory * self.horizon * cap))
        self.clock = 0
        self._stored = 0
        self.tick = 0
        self.next_cfg = self.period
        self.ncls = (self.maxhits + 1) * 2 * max(1, self.depth_buckets) * (2 if self.gen else 1)
        self.ncls *= max(1, self.parent_buckets) * max(1, self.irrb)
        self.last_irr: dict[int, int] = {}
        self.H = np.zeros((self.ncls, self.nb))
        self.R = np.zeros((self.ncls, self.nb))
        self.open = np.zeros((self.ncls, self.nb))
        self.index: list[list[float]] | None = None
        self.st: dict[int, tuple[int, int, int]] = {}  # key -> (tick of last access, class, hits)
        self.resident: dict[int, int] = {}  # key -> node
        self.origin: dict[int, int] = {}  # key -> bucket of the reuses of what it was stored under
        self.old: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.young: dict[int, list[tuple[int, int]]] = defaultdict(list)

    # -- statistics

    def _class(self, n: int, hits: int, tail: bool) -> int:
        c = min(hits, self.maxhits) * 2 + (tail and self.use_tail)
        if self.depth_buckets:
            tokens = self.sim.depth[n] * self.sim.bs
            c = c * self.depth_buckets + min(max(tokens.bit_length() - 9, 0), self.depth_buckets - 1)
        if self.gen:
            c = c * 2 + (self.sim.hit_blocks > 0 and self.lineage)
        if self.parent_buckets:
            c = c * self.parent_buckets + self.origin.get(self.sim.key[n], 0)
        if self.irrb:
            irr = self.last_irr.get(self.sim.key[n], -1)
            b = 0 if irr < 0 else min(self.irrb - 1, ((irr + 1).bit_length() + 1) // 2)
            c = c * self.irrb + b
        return c

    def _access(self, n: int, tail: bool) -> None:
        key = self.sim.key[n]
        prev = self.st.get(key)
        hits = 0
        if prev is not None:
            t0, c0, hits = prev
            age = self.tick - t0
            if age < self.nb:
                self.H[c0, age] += 1
                self.open[c0, age] -= 1
                if self.irrb:
                    self.last_irr[key] = age
                hits = min(self.irr, self.irr - (age + 1).bit_length() + 1) if self.irr else hits + 1
            elif self.irr:
                hits = 0
        c = self._class(n, max(hits, 0), tail)
        self.st[key] = (self.tick, c, hits)
        self.open[c, 0] += 1
        self.R[c, 0] += 1
        if self.sim.nkids[n] == 0:
            self._push(n)

    def _advance(self) -> None:
        np = self.np
        tick = self.clock // self.quantum
        while self.tick < tick:
            self.tick += 1
            self.open = np.roll(self.open, 1, axis=1)
            self.open[:, 0] = 0
            self.R += self.open
        if self.clock >= self.next_cfg:
            self.next_cfg = self.clock + self.period
            self._reconfigure()
            self._forget()

    def _forget(self) -> None:
        """Ghosts whose trial left the window."""
        tick, nb, resident = self.tick, self.nb, self.resident
        dead = [k for k, (t0, _, _) in self.st.items() if tick - t0 >= nb and k not in resident]
        for k in dead:
            del self.st[k]
            self.origin.pop(k, None)

    def _table(self, h: object, r: object) -> list[float]:
        np = self.np
        h, r = np.asarray(h), np.asarray(r)
        hz = np.where(r > 0, h / np.maximum(r, 1e-12), 0.0)
        hz = np.clip(hz, 0.0, 1.0)
        surv = np.concatenate([[1.0], np.cumprod(1.0 - hz)])[:-1]
        ch = np.concatenate([[0.0], np.cumsum(surv * hz)])
        cs = np.concatenate([[0.0], np.cumsum(surv)])
        a = np.arange(self.nb)[:, None]
        t = np.arange(1, self.nb + 1)[None, :]
        num, den = ch[t] - ch[a], cs[t] - cs[a]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where((t > a) & (den > 0), num / np.where(den > 0, den, 1.0), 0.0)
        return ratio.max(axis=1).tolist()  # type: ignore[no-any-return]

    def _reconfigure(self) -> None:
        # NOTE: a class with little data borrows the pooled hazard as a prior of
        # ``prior`` trials, so a rare class is neither ignored nor trusted blindly.
        Hs, Rs = self.H.sum(axis=0), self.R.sum(axis=0)
        pooled = self.np.where(Rs > 0, Hs / self.np.maximum(Rs, 1e-12), 0.0)
        idx = []
        for c in range(self.ncls):
            w = self.prior * self.np.minimum(1.0, Rs / max(Rs[0], 1e-12))
            idx.append(self._table(self.H[c] + w * pooled, self.R[c] + w))
        self.index = idx
        self.H *= self.decay
        self.R *= self.decay

    # -- hooks

    def hit(self, path: list[int]) -> None:
        self.lineage = True
        whole = self.sim.req_blocks == len(path)
        last = path[-1]
        for n in path:
            self._access(n, whole and n == last)

    def insert(self, new: list[int]) -> None:
        super().insert(new)
        self._stored = len(new)
        p = self.sim.parent[new[0]]
        self.lineage = not self.sim.is_root(p) and self.sim.born[p] != self.sim.r
        whole = self.sim.req_blocks == self.sim.hit_blocks + len(new)
        last = new[-1]
        key = self.sim.key
        # NOTE: a block's origin: the reuses of the deepest block of its request seen
        # before it (resident or ghost; root: 0), fixed when it is stored. A chat turn
        # whose previous turn was evicted still continues a lineage the ghost remembers.
        anchor = -1 if self.sim.is_root(p) else self.st[key[p]][2]
        for n in new:
            self.resident[key[n]] = n
            k = key[n]
            if self.parent_buckets:
                self.origin[k] = 0 if anchor < 0 else min(1 + anchor.bit_length(), self.parent_buckets - 1)
            seen = k in self.st
            self._access(n, whole and n == last)
            if seen:
                anchor = self.st[k][2]

    def end(self) -> None:
        if self.flat_clock:
            self.clock += self.sim.hit_blocks + min(self.sim.req_blocks - self.sim.hit_blocks, self._stored)
        else:
            self.clock += self.sim.req_blocks
        self._stored = 0
        self._advance()

    # -- ranking

    def _push(self, n: int) -> None:
        t0, c, _ = self.st[self.sim.key[n]]
        heapq.heappush(self.old[c], (t0, n))
        heapq.heappush(self.young[c], (-t0, n))

    def leaf(self, node: int) -> None:
        super().leaf(node)
        self._push(node)

    def _rank(self, n: int) -> float:
        t0, c, _ = self.st[self.sim.key[n]]
        age = self.tick - t0
        if self.index is None:
            return -age
        if age >= self.nb:
            return 0.0
        v = self.index[c][age]
        if self.use_cost:
            v *= 1.0 + 0.0167 * self.sim.depth[n] * self.sim.bs / 512
        return v

    def _valid(self, n: int, t0: int, c: int) -> bool:
        if self.sim.nkids[n] or not self.sim.alive(n):
            return False
        k = self.sim.key[n]
        cur = self.st.get(k)
        return cur is not None and cur[0] == t0 and cur[1] == c and self.resident.get(k) == n

    def _top(self, heap: list[tuple[int, int]], c: int, sign: int, pinned: int) -> int:
        held = []
        out = -1
        while heap:
            t, n = heap[0]
            if not self._valid(n, sign * t, c):
                heapq.heappop(heap)
                continue
            if n == pinned:
                held.append(heapq.heappop(heap))
                continue
            out = n
            break
        for e in held:
            heapq.heappush(heap, e)
        return out

    def victim(self, pinned: int) -> int | None:
        best, best_v, best_t = -1, float("inf"), 0
        st, key = self.st, self.sim.key
        for c in list(self.old):
            for heap, sign in ((self.old[c], 1), (self.young[c], -1)) if self.use_young else ((self.old[c], 1),):
                n = self._top(heap, c, sign, pinned)
                if n < 0:
                    continue
                v = self._rank(n)
                t0 = st[key[n]][0]
                if v < best_v or (v == best_v and t0 < best_t):
                    best, best_v, best_t = n, v, t0
        if best < 0:
            return None
        self.leaves.discard(best)
        del self.resident[key[best]]
        return best


@register("freq-oracle")
class FrequencyOracle(TreeOracle):
    """A diagnostic that reads the future, but only in aggregate: rank a leaf by how many
    times its block is requested over the whole trace ("perfect LFU"), ties to LRU.
    Under independent references (the generated workloads' chats, documents, tools)
    the best online policy keeps the blocks of highest rate, so this approximates the
    best any online policy could do there, well below Belady's optimum."""

    def __init__(self, span: float = 0, dead: float = 0) -> None:
        self.span = bool(span)  # rate over the block's active span instead of the trace
        self.dead = bool(dead)  # also knows when a block is never requested again

    def _touch(self, nodes: list[int]) -> None:
        key, nu, heap, occ, r = self.sim.key, self.nu, self.heap, self.occ, self.sim.r
        for n in nodes:
            o = occ[key[n]]
            f = len(o) if not self.span else len(o) / max(1, o[-1] - o[0] + 1) * 1e6
            if self.dead and o[-1] <= r:  # never requested again: nothing to keep it for
                f = 0
            v = int(f) * 10**7 + r  # higher keeps: frequency, then recency
            nu[n] = -v
            heapq.heappush(heap, (v, n))

    def leaf(self, node: int) -> None:
        heapq.heappush(self.heap, (-self.nu[node], node))

    def victim(self, pinned: int) -> int | None:
        heap, nu, nkids = self.heap, self.nu, self.sim.nkids
        held = []
        out = None
        while heap:
            v, n = heapq.heappop(heap)
            if nu.get(n) != -v or nkids[n]:
                continue
            if n == pinned:
                held.append((v, n))
                continue
            del nu[n]
            out = n
            break
        for e in held:
            heapq.heappush(heap, e)
        return out


# ---------------------------------------------------------------------------- simple baselines


class _HeapLeaves(LeafPolicy):
    """Leaves ranked by a priority fixed at their last access (lowest leaves first)."""

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        self.pri: dict[int, float] = {}
        self.heap: list[tuple[float, int]] = []

    def _set(self, n: int, v: float) -> None:
        self.pri[n] = v
        heapq.heappush(self.heap, (v, n))

    def leaf(self, node: int) -> None:
        super().leaf(node)
        heapq.heappush(self.heap, (self.pri[node], node))

    def victim(self, pinned: int) -> int | None:
        heap, pri, nkids = self.heap, self.pri, self.sim.nkids
        held = []
        out = None
        while heap:
            v, n = heapq.heappop(heap)
            if pri.get(n) != v or nkids[n]:
                continue
            if n == pinned:
                held.append((v, n))
                continue
            out = n
            break
        for e in held:
            heapq.heappush(heap, e)
        if out is not None:
            self._evicted(out)
            del pri[out]
            self.leaves.discard(out)
        return out

    def _evicted(self, n: int) -> None:
        pass


@register("lfuda")
class LFUDA(_HeapLeaves):
    """LFU with dynamic aging (Arlitt et al.): priority = L + hits, where L becomes the
    priority of each victim, so old frequencies fade as new blocks enter above them.
    With ``cost``: GDSF, priority = L + hits x prefill FLOPs the block saves (depth)."""

    def __init__(self, cost: float = 0) -> None:
        self.cost = bool(cost)

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        self.L = 0.0
        self.freq: dict[int, int] = {}

    def _w(self, n: int) -> float:
        return 1.0 + 0.0167 * self.sim.depth[n] * self.sim.bs / 512 if self.cost else 1.0

    def hit(self, path: list[int]) -> None:
        for n in path:
            self.freq[n] += 1
            self._set(n, self.L + self.freq[n] * self._w(n))

    def insert(self, new: list[int]) -> None:
        super().insert(new)
        for n in new:
            self.freq[n] = 1
            self._set(n, self.L + self._w(n))

    def _evicted(self, n: int) -> None:
        self.L = self.pri[n]
        del self.freq[n]


@register("lru-tail")
class LRUTail(_HeapLeaves):
    """LRU, except that a request's deepest block (a prompt's partial last block, which
    the next turn extends rather than repeats) leaves before anything else."""

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        self.t = 0

    def hit(self, path: list[int]) -> None:
        self.t += 1
        whole = self.sim.req_blocks == len(path)
        for n in path:
            self._set(n, self.t - (1e12 if whole and n == path[-1] else 0))

    def insert(self, new: list[int]) -> None:
        super().insert(new)
        self.t += 1
        whole = self.sim.req_blocks == self.sim.hit_blocks + len(new)
        for n in new:
            self._set(n, self.t - (1e12 if whole and n == new[-1] else 0))
