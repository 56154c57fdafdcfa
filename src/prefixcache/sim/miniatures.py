"""The sampled method's miniature caches (curves.py): kernel trees at scaled
capacities, fed the kept requests whole and every request's shared head.

A miniature of capacity C at rate R holds C x R, where a sampled block costs its size
and a block of a shared head (touched by every request, kept or not) R times its size
(the kernel's ``head_unit``), so the head is weighed at full scale whatever the policy
keeps of it. A dropped request also touches its sampling unit, the first block below
its head: in the cache the dropped chain hangs there and keeps the head interior
(a leaf-only policy cannot evict it); without it the head became a leaf far more often
in a miniature than in the cache, and the miniatures missed (docs/simulator.md).
A miniature that would hold fewer than ``MIN_INSERTS`` requests' new blocks is
replayed whole (below).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from prefixcache.sim.engines import _block_digests, engine_config
from prefixcache.sim.results import UNLIMITED, ReplayConfig
from prefixcache.sim.summary import TraceSource, TraceSummary
from prefixcache.sim.traces import Request

RESOLUTION = 1024
"""At a rate below 1, the least cost of a miniature's block, in integer units."""
MIN_INSERTS = 30
"""A miniature must hold this many requests' new blocks (on average): a kept request's
new blocks come whole, not sampled, so in a smaller one each flushes a large share of
it (of S3-FIFO's small queue, a tenth of the capacity, all of it), and the miniature
misses more than the cache. Such a capacity is replayed at rate 1."""

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
            key = self._roots[name] = xxhash.xxh3_64_intdigest(repr(name).encode())
        return key

    def ids(self, req: Request) -> Sequence[int]:
        if req.hash_ids is not None:
            return req.hash_ids
        assert req.tokens is not None
        return _block_digests(req.tokens, self.unit)


def tokens(capacity: float) -> int:
    return UNLIMITED if math.isinf(capacity) else int(capacity)


class Minis:
    """One kernel tree per capacity (``engines.KernelStepper``'s, without its per-call
    work), each request's ids computed once for all. At a rate R below 1, a miniature
    of capacity C holds C x R, a sampled block costs its size, and a block of a shared
    head (unsampled: every request touches it) costs R times its size."""

    def __init__(self, cfg: ReplayConfig, summary: TraceSummary, capacities: list[int], rate: float = 1.0) -> None:
        from prefixcache.sim import _kernel

        self.trees, self.roots = [], [dict[int, int]() for _ in capacities]
        for capacity in capacities:
            config = engine_config(replace(cfg, cache=replace(cfg.cache, capacity_tokens=capacity)), summary)
            ttl = config.ttl_seconds
            ttl = ttl if ttl is not None and math.isfinite(ttl) else None
            unit, size, head_unit = config.block_size, config.capacity, 0
            if rate < 1.0:  # NOTE: integer costs: scale all by k so that a head block's is exact enough
                k = math.ceil(RESOLUTION / (unit * rate))
                head_unit = max(1, round(unit * k * rate))
                size = size if capacity == UNLIMITED else round(size * k * rate)
                unit *= k
            self.trees.append(_kernel.Tree(config.policy, size, unit, False, ttl, head_unit))

    def access(self, root_key: int, ids: Sequence[int], now: float, head: int = 0) -> list[int]:
        """Each tree's cached prefix of ``ids`` (the first ``head`` of them a shared
        head), in blocks."""
        out = []
        for tree, roots in zip(self.trees, self.roots, strict=True):
            root = roots.get(root_key)
            if root is None:
                root = roots[root_key] = tree.root(root_key)
            out.append(tree.access(root, 0, ids, -1, now, head))
        return out


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


def sampled(
    source: TraceSource,
    cfg: ReplayConfig,
    summary: TraceSummary,
    skip: int,
    caps: list[float],
    prefixes: Any,
    sample: Sample,
) -> Out:
    """Miniature caches: the kept requests on the kernel, the dropped ones' shared heads
    and units touched; the capacities too small for a miniature replayed whole."""
    bs, rate = cfg.block_size, sample.rate
    small = [c for c in caps if sample.exact(c, bs)]
    large = caps[len(small) :]
    exact = Minis(cfg, summary, [tokens(c) for c in small])
    minis = Minis(cfg, summary, [tokens(c) for c in large], rate)
    chains = Chains(cfg, summary.native_block_size is not None)
    threshold = int(rate * 2**64)
    hits, exact_hits = [0] * len(large), [0] * len(small)
    requests, lookup, kept_lookup = 0, 0, 0

    def count(into: list[int], cached: list[int], length: int) -> None:
        for j, blocks in enumerate(cached):
            into[j] += min(blocks * bs, length) if chains.hashed else blocks * bs

    for i, req in enumerate(source()):
        counted = i >= skip
        if counted:
            requests += 1
            lookup += req.input_length
        root, ids = chains.root(req), chains.ids(req)
        if small:
            cached = exact.access(root, ids, req.timestamp)
            if counted:
                count(exact_hits, cached, req.input_length)
        depth = 0
        if rate < 1.0:
            unit, depth = prefixes.unit(root, ids, sample.most)
            if xxhash.xxh3_64_intdigest(unit.to_bytes(8, "little"), seed=sample.seed) >= threshold:
                # NOTE: the unit too, as a child that keeps the head interior, as the
                # dropped chain below it keeps it in the cache
                minis.access(root, ids[: depth + 1], req.timestamp, depth + 1)
                continue
        cached = minis.access(root, ids, req.timestamp, depth)
        if counted:
            kept_lookup += req.input_length
            count(hits, cached, req.input_length)
    rates = [h / lookup if lookup else 0.0 for h in exact_hits]
    rates += [h / kept_lookup if kept_lookup else 0.0 for h in hits]
    return requests, lookup, caps, rates
