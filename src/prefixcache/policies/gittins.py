"""Gittins: evict the block whose next reuse is worth least per unit of space-time.

A cached block is worth the hits it will still get divided by the room and time it
will still take. The policy learns, online and per class of block (how often and how
recently it was reused), the distribution of the time to a block's next reuse, and ranks
each block by the *Gittins index* of that distribution at the block's age:

    index(a) = max over T > a of  P(reuse in [a, T) | no reuse before a)
                                  / E[time held in [a, T) | no reuse before a]

the best ratio of expected hits to expected occupancy over any holding time. The block
with the lowest index leaves first. This is LHD's idea (Beckmann et al., "LHD:
Improving Cache Hit Rate by Maximizing Hit Density", NSDI'18) with two changes that
matter for a prefix cache:

* **Uncensored statistics.** LHD learns from what happens to the blocks it keeps, so
  it never sees a reuse at an age it does not let blocks reach. Here every access
  (hit or store) starts a *trial* that ends at the block's next access or at the
  horizon, and an evicted block stays in a ghost (key, time, class; no bytes) until
  its trial ends: a prompt that comes back after its blocks left still counts as a
  reuse. Trials still open are survivors (a Kaplan-Meier estimate), so the estimate
  is right from the start, not only after a horizon of traffic.
* **Index, not instantaneous density.** Where reuse follows a think time (the next
  turn of a conversation comes minutes later, an agent's next step seconds later),
  the chance of reuse *rises* with age; the index looks ahead to it, so a block half
  way to its likely reuse is kept over a fresh one. A fresh block whose class is
  rarely reused gets the lowest index and leaves at the next eviction: what bypass
  does, in a cache that must store a prompt before it can judge it.

A block stored again after its eviction (found in the ghost) keeps its reuse count,
so a conversation that came back once is ranked by what conversations that came back
do: admission on evidence, as TinyLFU's doorkeeper or S3-FIFO's ghost, but learned.

Classes: never reused; else reuses so far (capped) x how long the last reuse took
(LIRS's inter-reference recency, in log-4 buckets). Age is counted in traffic (entry
sizes inserted or hit), in ``bins`` steps up to a horizon of ``horizon`` x capacity.
Every half capacity of traffic the tables are recomputed and the counts decay (a
memory of ``memory`` horizons). Nothing is fitted to a trace: the constants are the
horizon (how far ahead a reuse is worth waiting for, relative to the cache's size),
the resolution and the class buckets, and results hardly move with any of them
(research/eviction/RESULTS.md).

::

    access / insert --> trial of class c starts at tick t     ghost (key -> t, c, hits)
            |                                                   ^ evicted keys, until
            v                                                   | their trial ends
    per class, groups by tick of last access  ------------------+
        [tick 3: k k k] [tick 5: k k] ... [tick 9: k k k k]
         ^ oldest end                          youngest end ^
    victim = the lowest index[c][age] among the first evictable entry of the oldest
             and of the youngest groups of each class (ties: the oldest)

NOTE: the prefix tree only lets leaves leave (``evictable``). The ledger says which
blocks are leaves (``set_leaf``): the others stay out of the groups, so a candidate is
found in one step unless it is pinned. Without that news (a tier's policy, a flat
cache) every entry is grouped: within a tick the cache names a chain deepest first,
so a group's first entry is the one that can leave; a blocked one moves to the back
of its own group, which keeps every age exact. Only ``probe`` groups at each end and
``probe`` entries in each are tried before a full scan. Both ends, because within a
class the index depends on age alone and where it rises then falls (reuse after a
wait) its minimum is at one of them. sim/native/_kernel.c mirrors all of it, order for
order (tests/sim/test_kernel.py replays both side by side).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import ClassVar

from prefixcache.policies.base import Evictable, EvictionPolicy, Key, always
from prefixcache.policies.gittins_index import gittins_index

__all__ = ["GittinsPolicy", "gittins_index"]


class GittinsPolicy(EvictionPolicy):
    """Evict the evictable entry with the lowest Gittins index of its next reuse.

    Classes: never reused; else reuses so far (1 .. ``max_hits``) x how long its last
    reuse took (``irr_buckets`` log-4 buckets of age: LIRS's inter-reference recency).
    The second splits what the first mixes: a prompt prefix shared by every request
    and an agent's context re-sent every few requests have both been reused many
    times, but only the second comes back after a wait, which makes it worth less
    just after its use than half way to its next one.
    """

    __slots__ = (
        "_bins",
        "_clock",
        "_decay",
        "_expired",
        "_ghost",
        "_ghost_cap",
        "_groups",
        "_hits",
        "_horizon",
        "_index",
        "_interior",
        "_irr_buckets",
        "_max_hits",
        "_memory",
        "_meta",
        "_next_table",
        "_open",
        "_prior",
        "_probe",
        "_quantum",
        "_tick",
    )
    name: ClassVar[str] = "gittins"
    tracks_leaves: ClassVar[bool] = True

    def __init__(
        self,
        capacity: int,
        horizon: float = 16.0,
        bins: int = 128,
        max_hits: int = 3,
        irr_buckets: int = 3,
        memory: float = 4.0,
        prior: float = 50.0,
        probe: int = 2,
    ) -> None:
        super().__init__(capacity)
        if not horizon > 0 or bins < 2 or max_hits < 1 or irr_buckets < 1 or not memory > 0 or prior < 0 or probe < 1:
            raise ValueError(
                f"bad Gittins parameters: horizon {horizon}, bins {bins}, max_hits {max_hits}, "
                f"irr_buckets {irr_buckets}, memory {memory}, prior {prior}, probe {probe}"
            )
        self._horizon, self._bins, self._max_hits, self._irr_buckets = horizon, bins, max_hits, irr_buckets
        self._memory, self._prior, self._probe = memory, prior, probe
        n = 1 + max_hits * irr_buckets
        # key -> [tick of last access, class, reuses so far, size]
        self._meta: dict[Key, list[int]] = {}
        # per class: tick of last access -> its entries, oldest tick first; within a
        # tick, in the order the cache named them (a chain deepest first)
        self._groups: list[OrderedDict[int, OrderedDict[Key, None]]] = [OrderedDict() for _ in range(n)]
        # evicted key -> (tick of last access, class, reuses), in eviction order
        self._ghost: OrderedDict[Key, tuple[int, int, int]] = OrderedDict()
        self._open = [[0] * bins for _ in range(n)]  # open trials by start tick % bins
        self._hits = [[0.0] * bins for _ in range(n)]  # reuses by age bin (decayed)
        self._expired = [0.0] * n  # trials that reached the horizon without a reuse (decayed)
        self._index: list[list[float]] | None = None
        # keys the cache said have children (``set_leaf``): out of the groups, never candidates
        self._interior: set[Key] = set()
        self._clock = 0
        self._tick = 0
        self.resize(capacity)
        self._next_table = self._table_every()

    def resize(self, capacity: int) -> None:
        # NOTE: the tables keep their bins; a rebalanced quota only rescales ages a little.
        super().resize(capacity)
        self._quantum = max(1, int(self._horizon * capacity / self._bins))
        self._ghost_cap = max(1, int(self._horizon * capacity))
        self._decay = max(0.5, 1.0 - 1.0 / (2.0 * self._memory * self._horizon))

    def _table_every(self) -> int:
        """Ticks between two recomputations of the index: half a capacity of traffic."""
        return max(1, int(self._bins / (2 * self._horizon)))

    def _class(self, reuses: int, last_age: int) -> int:
        if reuses == 0:
            return 0
        bucket = min(self._irr_buckets - 1, ((last_age + 1).bit_length() - 1) // 2)
        return 1 + (min(reuses, self._max_hits) - 1) * self._irr_buckets + bucket

    # ------------------------------------------------------------------ trials

    def _advance(self, size: int) -> None:
        self._clock += size
        tick = self._clock // self._quantum
        bins = self._bins
        while self._tick < tick:
            self._tick += 1
            slot = self._tick % bins  # trials started ``bins`` ticks ago reach the horizon
            for c, ring in enumerate(self._open):
                if ring[slot]:
                    self._expired[c] += ring[slot]
                    ring[slot] = 0
            if self._tick >= self._next_table:
                self._next_table = self._tick + self._table_every()
                self._recompute()

    def _reuse(self, start: int, c: int, reuses: int) -> tuple[int, int]:
        """A trial of class ``c`` started at tick ``start`` ends with a reuse now: the
        reuses and class of the next trial."""
        age = self._tick - start
        if age < self._bins:
            self._hits[c][age] += 1.0
            self._open[c][start % self._bins] -= 1
        return reuses + 1, self._class(reuses + 1, age)

    def _start(self, key: Key, reuses: int, c: int, size: int) -> None:
        tick = self._tick
        self._meta[key] = [tick, c, reuses, size]
        self._open[c][tick % self._bins] += 1
        if key not in self._interior:
            self._link(key, tick, c)

    def _link(self, key: Key, start: int, c: int) -> None:
        groups = self._groups[c]
        group = groups.get(start)
        if group is None:
            group = groups[start] = OrderedDict()
        group[key] = None

    def _unlink(self, key: Key, start: int, c: int) -> None:
        if key in self._interior:
            return
        groups = self._groups[c]
        group = groups[start]
        del group[key]
        if not group:
            del groups[start]

    def _recompute(self) -> None:
        bins, tick = self._bins, self._tick
        risks, total_hits, total_risk = [], [0.0] * bins, [0.0] * bins
        for c, ring in enumerate(self._open):
            # at risk at age x: trials that ended (reuse or horizon) at x or later, and
            # open trials already x old
            risk = [0.0] * bins
            above = self._expired[c]
            open_above = 0
            hits = self._hits[c]
            for x in range(bins - 1, -1, -1):
                open_above += ring[(tick - x) % bins]
                above += hits[x]
                risk[x] = above + open_above
                total_hits[x] += hits[x]
                total_risk[x] += risk[x]
            risks.append(risk)
        # NOTE: a class with little data borrows the pooled hazard, weighted as ``prior``
        # trials (fading with age like the data), so a rare class is neither ignored
        # nor trusted blindly.
        base = total_risk[0] or 1.0
        index = []
        for c in range(len(self._open)):
            hits, risk = self._hits[c], risks[c]
            h, r = [0.0] * bins, [0.0] * bins
            for x in range(bins):
                w = self._prior * total_risk[x] / base
                pooled = total_hits[x] / total_risk[x] if total_risk[x] > 0 else 0.0
                h[x] = hits[x] + w * pooled
                r[x] = risk[x] + w
            index.append(gittins_index(h, r))
        self._index = index
        decay = self._decay
        for c in range(len(self._open)):
            self._hits[c] = [v * decay for v in self._hits[c]]
            self._expired[c] *= decay

    # ------------------------------------------------------------------ interface

    def insert(self, key: Key, size: int = 1) -> None:
        if key in self._meta:
            raise KeyError(key)
        reuses, c = 0, 0
        ghost = self._ghost.pop(key, None)
        if ghost is not None and self._tick - ghost[0] < self._bins:
            reuses, c = self._reuse(*ghost)
        self._start(key, reuses, c, size)
        self._advance(size)

    def access(self, key: Key) -> None:
        start, c, reuses, size = self._meta[key]
        self._unlink(key, start, c)
        reuses, c = self._reuse(start, c, reuses)
        self._start(key, reuses, c, size)
        self._advance(size)

    def access_many(self, keys: Iterable[Key]) -> None:
        meta = self._meta
        for key in keys:
            if key not in meta:
                raise KeyError(key)
            self.access(key)

    def set_leaf(self, key: Key, leaf: bool) -> None:
        """``key`` lost its last child (``leaf``) or gained its first (the ledger says
        so). With it, only leaves are candidates and ``victim`` looks at one entry per
        class end; without it, blocked entries are found and passed over by
        ``evictable``, at some cost."""
        start, c = self._meta[key][:2]
        if leaf:
            if key in self._interior:
                self._interior.discard(key)
                self._link(key, start, c)
        elif key not in self._interior:
            self._unlink(key, start, c)
            self._interior.add(key)

    def remove(self, key: Key) -> None:
        start, c, _, _ = self._meta.pop(key)
        self._unlink(key, start, c)
        self._interior.discard(key)
        if self._tick - start < self._bins:
            self._open[c][start % self._bins] -= 1  # censored here: it never counts as a reuse

    def _rank(self, c: int, start: int) -> float:
        age = self._tick - start
        if self._index is None:
            return -float(age)  # until the first table: least recently used first
        return self._index[c][age] if age < self._bins else 0.0

    def victim(self, evictable: Evictable = always) -> Key | None:
        best: Key | None = None
        best_rank, best_start = 0.0, 0
        probe = self._probe
        for c, groups in enumerate(self._groups):
            if not groups:
                continue
            ends = (groups, reversed(groups)) if len(groups) > 1 else (groups,)
            for end in ends:
                for i, start in enumerate(end):
                    if i >= probe:
                        break
                    key = _first(groups[start], evictable, probe)
                    if key is not None:
                        rank = self._rank(c, start)
                        if best is None or rank < best_rank or (rank == best_rank and start < best_start):
                            best, best_rank, best_start = key, rank, start
                        break
        if best is None:
            best = self._scan(evictable)
            if best is None:
                return None
        self._evict(best)
        return best

    def _scan(self, evictable: Evictable) -> Key | None:
        """Every entry, when no end of any class had an evictable one."""
        best: Key | None = None
        best_rank, best_start = 0.0, 0
        for c, groups in enumerate(self._groups):
            for start, group in groups.items():
                rank = self._rank(c, start)
                if best is not None and (rank > best_rank or (rank == best_rank and start >= best_start)):
                    continue
                for key in group:
                    if evictable(key):
                        best, best_rank, best_start = key, rank, start
                        break
        return best

    def _evict(self, key: Key) -> None:
        start, c, reuses, _ = self._meta.pop(key)
        self._unlink(key, start, c)
        self._interior.discard(key)
        ghost = self._ghost
        if self._tick - start < self._bins:
            ghost[key] = (start, c, reuses)
        # NOTE: ghosts leave in eviction order, those whose trial ended first, and never
        # more than ``horizon`` x capacity of them (metadata only, no bytes).
        while ghost:
            old_key, (old_start, _, _) = next(iter(ghost.items()))
            if self._tick - old_start < self._bins and len(ghost) <= self._ghost_cap:
                break
            del ghost[old_key]

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta


def _first(group: OrderedDict[Key, None], evictable: Evictable, probe: int) -> Key | None:
    """The first evictable entry among ``probe`` of one (class, tick) group. Blocked
    ones move to the group's back: they keep their tick, so no order is lost."""
    for _ in range(min(len(group), probe)):
        key = next(iter(group))
        if evictable(key):
            return key
        group.move_to_end(key)
    return None
