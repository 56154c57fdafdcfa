"""The sampled method's miniature caches (curves.py): kernel trees at scaled
capacities, fed the kept requests whole and every request's shared head.

A miniature of capacity C at rate R holds C x R, where a sampled block costs its size
and a block of a shared head (touched by every request, kept or not) R times its size
(the kernel's ``head_unit``), so the head is weighed at full scale whatever the policy
keeps of it. The cache has no such cost: minitree.py is its Python reference, held to
the kernel by tests/sim/test_minitree.py. A dropped request also touches its sampling unit, the first block below
its head: in the cache the dropped chain hangs there and keeps the head interior
(a leaf-only policy cannot evict it); without it the head became a leaf far more often
in a miniature than in the cache, and the miniatures missed (docs/simulator.md).
A miniature that would hold fewer than ``MIN_INSERTS`` requests' new blocks is
replayed whole (below).

The estimate is split at the head (``Tally``). Every request's head is looked up in
every miniature, so its hits are counted over all requests, not sampled. Below the
head, only the kept requests' hits are known; they are scaled by what all requests
could hit there at all: the blocks an unlimited cache (one more tree, fed every
request) would hit. A request that continues a conversation and one that starts a
new document then weigh as often as they occur in the trace, whichever units the
hash kept, which leaves the miniatures' own error and less of the draw's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from prefixcache.sim.blocks import block_digests, root_key
from prefixcache.sim.engines import engine_config, kernel_ttl
from prefixcache.sim.forks import fork_map
from prefixcache.sim.results import UNLIMITED, ReplayConfig
from prefixcache.sim.summary import TraceSource, TraceSummary
from prefixcache.sim.traces import Request

RESOLUTION = 1024
"""At a rate below 1, the least cost of a miniature's block, in integer units."""
MIN_INSERTS = 80
"""A miniature must hold this many requests' new blocks (on average): a kept request's
new blocks come whole, not sampled, so in a smaller one each flushes a large share of
it (of S3-FIFO's small queue, a tenth of the capacity, all of it), and the miniature
misses more than the cache. Such a capacity is replayed at rate 1. NOTE: the smallest
miniatures still erred by twice the bound at 30 (SIEVE) and by more than it at 60
(LFUDA), on 20 M lookups (docs/simulator.md)."""

Out = tuple[int, int, list[float], list[float]]
"""Counted requests, their lookup tokens, the capacities, the hit rate at each."""


class Chains:
    """A request as the kernel sees it: its context root's key and its block ids."""

    def __init__(self, cfg: ReplayConfig, hashed: bool) -> None:
        self.shared = cfg.isolation == "shared"
        self.unit = cfg.block_size
        self.hashed = hashed
        self._roots: dict[tuple[str, str], int] = {}

    def root(self, req: Request) -> int:
        name = (req.model, "" if self.shared else req.tenant)
        key = self._roots.get(name)
        if key is None:
            key = self._roots[name] = root_key(*name)
        return key

    def ids(self, req: Request) -> Sequence[int]:
        if req.hash_ids is not None:
            return req.hash_ids
        assert req.tokens is not None
        return block_digests(req.tokens, self.unit)


def tokens(capacity: float) -> int:
    return UNLIMITED if math.isinf(capacity) else int(capacity)


class Minis:
    """One kernel tree per capacity (``engines.KernelStepper``'s, without its per-call
    work), each request's ids computed once for all. At a rate R below 1, a miniature
    of capacity C holds C x R, a sampled block costs its size, and a block of a shared
    head (unsampled: every request touches it) costs R times its size."""

    def __init__(
        self, cfg: ReplayConfig, summary: TraceSummary, capacities: list[int], rate: float = 1.0, seen: bool = False
    ) -> None:
        from prefixcache.sim.native import _kernel

        self.trees: list[Any] = []
        self.roots: dict[int, list[int]] = {}
        self._access_all = _kernel.access_all
        for capacity in capacities:
            config = engine_config(replace(cfg, cache=replace(cfg.cache, capacity_tokens=capacity)), summary)
            unit, size, head_unit = config.block_size, config.capacity, 0
            if rate < 1.0:  # NOTE: integer costs: scale all by k so that a head block's is exact enough
                k = math.ceil(RESOLUTION / (unit * rate))
                head_unit = max(1, round(unit * k * rate))
                size = size if capacity == UNLIMITED else round(size * k * rate)
                unit *= k
            self.trees.append(_kernel.Tree(config.policy, size, unit, False, kernel_ttl(config), head_unit))
        if seen:  # NOTE: last, unlimited, FIFO (whose touch is free): what any capacity could hit
            self.trees.append(_kernel.Tree("fifo", UNLIMITED, 1, False, kernel_ttl(engine_config(cfg, summary))))

    def access(self, root_key: int, ids: Sequence[int], now: float, head: int = 0, limit: int = -1) -> list[int]:
        """Each tree's cached prefix of ``ids[:limit]`` (the first ``head`` of them a
        shared head), in blocks; with ``seen``, last, the unlimited tree's."""
        roots = self.roots.get(root_key)
        if roots is None:
            roots = self.roots[root_key] = [tree.root(root_key) for tree in self.trees]
        return self._access_all(self.trees, roots, ids, now, head, limit)


@dataclass(frozen=True, slots=True)
class Sample:
    """How the sampled method draws: the rate, its hash's salt, the most requests a
    sampling unit may pass, and the new blocks a request brings on average."""

    rate: float
    seed: int
    most: int
    inserts: float

    def exact(self, capacity: float, block_size: int) -> bool:
        """Whether a miniature at ``capacity`` tokens is too small (``MIN_INSERTS``):
        it is replayed at rate 1 instead."""
        if self.rate >= 1.0 or math.isinf(capacity):
            return False
        return self.rate * capacity / block_size < MIN_INSERTS * self.inserts


class Tally:
    """Hit tokens of the miniatures, split at each request's head: its hits in the head
    over all requests, below it over the kept ones, and what an unlimited cache would
    hit below it, over all and over the kept."""

    def __init__(self, n: int, block_size: int, hashed: bool) -> None:
        self.bs, self.hashed = block_size, hashed
        self.head, self.below = [0] * n, [0] * n
        self.seen_all = self.seen_kept = 0

    def tokens(self, blocks: int, length: int) -> int:
        return min(blocks * self.bs, length) if self.hashed else blocks * self.bs

    def dropped(self, cached: list[int], depth: int, length: int) -> None:
        head = self.head
        for j, blocks in enumerate(cached):
            head[j] += self.tokens(min(blocks, depth), length)

    def kept(self, cached: list[int], depth: int, length: int) -> None:
        head, below = self.head, self.below
        for j, blocks in enumerate(cached):
            top = self.tokens(min(blocks, depth), length)
            head[j] += top
            below[j] += self.tokens(blocks, length) - top

    def seen(self, blocks: int, depth: int, length: int, kept: bool) -> None:
        more = self.tokens(blocks, length) - self.tokens(min(blocks, depth), length)
        self.seen_all += more
        self.seen_kept += more if kept else 0

    def rates(self, lookup: int) -> list[float]:
        scale = self.seen_all / self.seen_kept if self.seen_kept else 0.0
        return [(h + b * scale) / lookup if lookup else 0.0 for h, b in zip(self.head, self.below, strict=True)]


@dataclass(frozen=True, slots=True)
class Part:
    """The trees one process replays: the indices of its capacities replayed whole
    (``small``) and of its miniatures (``large``), and whether it feeds the unlimited
    tree that ``Tally`` scales by."""

    small: tuple[int, ...]
    large: tuple[int, ...]
    seen: bool


@dataclass(frozen=True, slots=True)
class PartHits:
    """What one part counted: the counted requests and their lookup tokens, hit tokens
    per capacity of ``small``, its miniatures' ``Tally`` halves, and the unlimited
    tree's (0 without it)."""

    requests: int
    lookup: int
    exact: tuple[int, ...]
    head: tuple[int, ...]
    below: tuple[int, ...]
    seen_all: int
    seen_kept: int


def split(small: int, large: int, seen: bool, rate: float, jobs: int) -> list[Part]:
    """At most ``jobs`` parts of even work: a tree replayed whole is fed every request,
    a miniature about ``rate`` of the lookups (its heads besides); each tree goes to the
    part with the least work so far, the heaviest first."""
    trees = [(1.0, "small", i) for i in range(small)] + [(rate, "large", i) for i in range(large)]
    if seen:
        trees.append((1.0, "seen", 0))
    count = max(1, min(jobs, len(trees)))
    work, members = [0.0] * count, [list[tuple[str, int]]() for _ in range(count)]
    for weight, kind, i in sorted(trees, key=lambda t: -t[0]):
        least = work.index(min(work))
        work[least] += weight
        members[least].append((kind, i))
    return [
        Part(
            tuple(sorted(i for kind, i in part if kind == "small")),
            tuple(sorted(i for kind, i in part if kind == "large")),
            ("seen", 0) in part,
        )
        for part in members
    ]


def sampled(
    source: TraceSource,
    cfg: ReplayConfig,
    summary: TraceSummary,
    skip: int,
    caps: list[float],
    prefixes: Any,
    sample: Sample,
    jobs: int = 1,
) -> Out:
    """Miniature caches: the kept requests on the kernel, the dropped ones' shared heads
    and units touched; the capacities too small for a miniature replayed whole (with,
    below rate 1, the unlimited tree that ``Tally`` scales by). The trees are split into
    up to ``jobs`` parts, each replayed in its own process over the whole trace
    (forks.py); the answer does not depend on how."""
    small = [c for c in caps if sample.exact(c, cfg.block_size)]
    large = caps[len(small) :]
    parts = split(len(small), len(large), sample.rate < 1.0, sample.rate, jobs)

    trace = Trace(source, cfg, summary, skip, prefixes, sample)

    def run(part: Part) -> PartHits:
        return _replay_part(trace, [small[i] for i in part.small], [large[i] for i in part.large], part.seen)

    got = fork_map(run, parts)
    exact_hits, tally = [0] * len(small), Tally(len(large), cfg.block_size, summary.native_block_size is not None)
    for part, hits in zip(parts, got, strict=True):
        for i, h in zip(part.small, hits.exact, strict=True):
            exact_hits[i] = h
        for i, h, b in zip(part.large, hits.head, hits.below, strict=True):
            tally.head[i], tally.below[i] = h, b
        tally.seen_all += hits.seen_all
        tally.seen_kept += hits.seen_kept
    requests, lookup = got[0].requests, got[0].lookup
    rates = [h / lookup if lookup else 0.0 for h in exact_hits]
    rates += tally.rates(lookup)
    return requests, lookup, caps, rates


@dataclass(frozen=True, slots=True)
class Trace:
    """What every part replays: the trace, its configuration and summary, the requests
    of the warm-up (``skip``), the sketch of sampling units and the draw."""

    source: TraceSource
    cfg: ReplayConfig
    summary: TraceSummary
    skip: int
    prefixes: Any
    sample: Sample


def _replay_part(trace: Trace, small: list[float], large: list[float], seen: bool) -> PartHits:
    """One part's trees over the whole trace: ``small`` capacities replayed whole,
    ``large`` ones by miniatures, and with ``seen`` the unlimited tree."""
    cfg, summary, sample = trace.cfg, trace.summary, trace.sample
    bs, rate = cfg.block_size, sample.rate
    exact = Minis(cfg, summary, [tokens(c) for c in small], seen=seen)
    minis = Minis(cfg, summary, [tokens(c) for c in large], rate)
    chains = Chains(cfg, summary.native_block_size is not None)
    threshold = int(rate * 2**64)
    tally, exact_hits = Tally(len(large), bs, chains.hashed), [0] * len(small)
    requests, lookup = 0, 0
    for i, req in enumerate(trace.source()):
        counted, length = i >= trace.skip, req.input_length
        if counted:
            requests += 1
            lookup += length
        root, ids = chains.root(req), chains.ids(req)
        cached = exact.access(root, ids, req.timestamp) if exact.trees else []
        if counted:
            for j in range(len(small)):
                exact_hits[j] += tally.tokens(cached[j], length)
        depth = len(ids)
        kept = True
        if rate < 1.0 and (seen or minis.trees):  # NOTE: a part of whole trees only needs no draw
            unit, depth = trace.prefixes.unit(root, ids, sample.most)
            kept = xxhash.xxh3_64_intdigest(unit.to_bytes(8, "little"), seed=sample.seed) < threshold
            if counted and seen:
                tally.seen(cached[-1], depth, length, kept)
        if not minis.trees:
            continue
        if not kept:
            # NOTE: the unit too, as a child that keeps the head interior, as the
            # dropped chain below it keeps it in the cache
            cached = minis.access(root, ids, req.timestamp, depth + 1, depth + 1)
            if counted:
                tally.dropped(cached, depth, length)
            continue
        cached = minis.access(root, ids, req.timestamp, depth if rate < 1.0 else 0)
        if counted:
            tally.kept(cached, depth, length)
    return PartHits(
        requests, lookup, tuple(exact_hits), tuple(tally.head), tuple(tally.below), tally.seen_all, tally.seen_kept
    )
