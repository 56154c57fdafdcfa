"""Tree mode's engines: what replays one configuration, one request at a time.

Two engines, one interface (``Stepper``: ``step`` one request, read the ledger's
``counters``): ``CacheStepper`` runs the real ``PrefixCache`` (the reference; its
ledger, metadata only), ``KernelStepper`` its compiled twin (``_kernel.c``) for the
configurations the twin models. tests/sim/test_kernel.py drives both at that interface
and compares every answer and every counter after every request. Both run the
configuration's own ``CacheConfig``, derived for the trace by ``engine_config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Protocol

from prometheus_client import CollectorRegistry

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig
from prefixcache.events import RemovalReason
from prefixcache.hashing import CacheContext
from prefixcache.ops.collector import CacheCollector
from prefixcache.sim.blocks import block_digests, root_key
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.retention import RetentionCounts
from prefixcache.sim.retention_steps import Retainer
from prefixcache.sim.summary import TraceSummary
from prefixcache.sim.traces import Request


def engine_config(cfg: ReplayConfig, summary: TraceSummary) -> CacheConfig:
    """The ``CacheConfig`` an engine runs: the configuration's own, without KV events
    (nothing reads them), and for a pre-hashed trace one pseudo-token per native block.

    NOTE: a pre-hashed trace's block ids become the cache's tokens, so its cache has a
    block size of 1 and counts capacity in native blocks (``capacity_bytes`` over
    ``bytes_per_token`` = the native block size), and publication's shortest prefix too,
    rounded up."""
    cache = replace(cfg.cache, events_capacity=0)
    native = summary.native_block_size
    if native is None:
        return cache
    publish = cache.publish
    if publish is not None:
        publish = replace(publish, min_tokens=max(1, -(-publish.min_tokens // native)))
    return replace(
        cache,
        block_size=1,
        capacity_tokens=None,
        capacity_bytes=cache.capacity,
        bytes_per_token=native,
        partial_blocks=False,
        publish=publish,
    )


@dataclass(frozen=True, slots=True)
class PoolCounters:
    quota: int
    used: int
    blocks: int
    evictions: int


@dataclass(frozen=True, slots=True)
class LedgerCounters:
    """What a ledger holds and has counted, in the cache's units (tokens, or native
    blocks for a pre-hashed trace); pools in the order they were made."""

    used: int
    blocks: int
    evictions: int
    expired: int
    collisions: int
    pools: tuple[PoolCounters, ...]


class Stepper(Protocol):
    """One tree-mode engine: replays one request at a time.

    ``step`` returns the request's cached prefix in the cache's units: tokens for a token
    trace, native blocks for a pre-hashed one. ``retention`` is what its retain calls got
    (``None``: retention off)."""

    engine: str

    @property
    def evictions(self) -> int: ...

    def step(self, req: Request) -> int: ...

    def counters(self) -> LedgerCounters: ...

    def retention(self) -> RetentionCounts | None: ...


class CacheStepper:
    """The reference engine: the real ``PrefixCache``, as it serves requests.

    ``registry``, when given, gets the cache's metrics (``CacheCollector``). With the
    configuration's retention on, each prompt is retained after its access, as a server
    retains it once the prompt is stored (``retention_steps``)."""

    engine = "python"

    def __init__(
        self, cfg: ReplayConfig, summary: TraceSummary, include_output: bool, registry: CollectorRegistry | None = None
    ) -> None:
        self._now = 0.0
        self.cache = PrefixCache(engine_config(cfg, summary), clock=lambda: self._now)
        if registry is not None:
            registry.register(CacheCollector(self.cache))
        self._dense: dict[int, int] = {}
        self._output = include_output and summary.native_block_size is None
        self._contexts: dict[tuple[str, str], CacheContext] = {}
        native = summary.native_block_size
        self._retainer = None
        if cfg.retention.on:
            self._retainer = Retainer(self.cache, cfg.retention, native or cfg.block_size, native or 1)

    @property
    def evictions(self) -> int:
        return self.cache.removed(RemovalReason.EVICTED)  # NOTE: one counter; stats() builds a snapshot

    def retention(self) -> RetentionCounts | None:
        return None if self._retainer is None else self._retainer.counts()

    def step(self, req: Request) -> int:
        self._now = req.timestamp
        ctx = self._contexts.get((req.tenant, req.model))
        if ctx is None:
            ctx = self._contexts[(req.tenant, req.model)] = CacheContext(tenant=req.tenant, model=req.model)
        cache, dense = self.cache, self._dense
        # NOTE: block ids become the cache's pseudo-tokens (uint32): map them to dense ints.
        prompt = [dense.setdefault(i, len(dense)) for i in req.hash_ids] if req.hash_ids is not None else req.tokens
        assert prompt is not None
        if self._output and req.output_tokens:
            with cache.match(prompt, ctx) as m:
                cache.insert([*prompt, *req.output_tokens], ctx)
                cached = m.cached_tokens
        else:
            cached = cache.access(prompt, ctx)[0]
        if self._retainer is not None:
            self._retainer.after(req, prompt, ctx)
        return cached

    def counters(self) -> LedgerCounters:
        s = self.cache.stats()
        pools = tuple(PoolCounters(p.quota_tokens, p.used_tokens, p.blocks, p.evictions) for p in s.pools.values())
        return LedgerCounters(
            s.used_tokens, s.blocks, s.evictions, s.removed(RemovalReason.EXPIRED), s.collisions, pools
        )


_kernel: ModuleType | None
try:
    from prefixcache.sim.native import _kernel
except ImportError as exc:  # NOTE: an optional extension; without a compiler the reference engine runs
    _kernel = None
    _KERNEL_MISSING = f"the compiled replay kernel is not built ({exc})"
else:
    _KERNEL_MISSING = ""

ENGINES = ("auto", "native", "python")


def kernel_ttl(config: CacheConfig) -> float | None:
    """The kernel tree's TTL: the cache's, with an infinite one (never) as None."""
    ttl = config.ttl_seconds
    return ttl if ttl is not None and math.isfinite(ttl) else None


def native_unsupported(cfg: ReplayConfig, metrics: bool = False) -> str:
    """Why the compiled kernel cannot replay ``cfg`` ("" when it can)."""
    if _KERNEL_MISSING:
        return _KERNEL_MISSING
    assert _kernel is not None
    reasons = []
    if cfg.policy not in _kernel.POLICIES:
        reasons.append(f"policy {cfg.policy!r} (it has {', '.join(_kernel.POLICIES)})")
    if cfg.cache.partial_blocks:
        reasons.append("partial blocks")
    if cfg.cache.publish is not None:
        reasons.append("hot-prefix publication")
    if cfg.cache.quotas or cfg.cache.shared_quota is not None:
        reasons.append("configured quotas")
    if metrics:
        reasons.append("server metrics (--metrics)")
    if cfg.retention.on:
        reasons.append("retention (--retention)")
    return "the compiled kernel does not model " + ", ".join(reasons) if reasons else ""


class KernelStepper:
    """The compiled engine (``_kernel.c``): the cache's metadata path -- block tree, pins,
    pools and quotas, policies, TTL -- for the configurations without publication or
    partial blocks, step for step the same as ``CacheStepper`` (tests/sim/test_kernel.py).

    NOTE: blocks are keyed by (parent, block id), so the tree needs per-block ids, not
    chained keys: a pre-hashed trace's ids (as they are below 2^64, else a 64-bit digest
    of them), or a 64-bit digest of each block's tokens. The kernel verifies parent and
    id on every hit, as the cache verifies tokens; two different blocks under one
    parent with one 64-bit id would alias (odds about n^2 / 2^65 over a replay's n
    sibling pairs). Likewise S3-FIFO's and Gittins' ghosts remember 64-bit path keys
    where the cache's are 128-bit."""

    engine = "native"

    def __init__(self, cfg: ReplayConfig, summary: TraceSummary, include_output: bool) -> None:
        why = native_unsupported(cfg)
        if why:
            raise ValueError(why)
        assert _kernel is not None
        config = engine_config(cfg, summary)  # the same validation and units as the cache
        partitioned = config.isolation == "partitioned"
        self._tree = _kernel.Tree(config.policy, config.capacity, config.block_size, partitioned, kernel_ttl(config))
        self._unit = config.block_size
        self._shared = config.isolation == "shared"
        self._output = include_output and summary.native_block_size is None
        self._roots: dict[tuple[str, str], int] = {}
        self._tenants: dict[str, int] = {}

    @property
    def evictions(self) -> int:
        return int(self._tree.evictions)

    def step(self, req: Request) -> int:
        tree = self._tree
        name = (req.model, "" if self._shared else req.tenant)
        root = self._roots.get(name)
        if root is None:
            root = self._roots[name] = tree.root(root_key(*name))
        tenant = self._tenants.setdefault(req.tenant, len(self._tenants))
        now = req.timestamp
        if req.hash_ids is not None:
            return int(tree.access(root, tenant, req.hash_ids, -1, now))
        assert req.tokens is not None
        unit = self._unit
        if self._output and req.output_tokens:
            ids = block_digests([*req.tokens, *req.output_tokens], unit)
            return int(tree.access(root, tenant, ids, len(req.tokens) // unit, now)) * unit
        return int(tree.access(root, tenant, block_digests(req.tokens, unit), -1, now)) * unit

    def retention(self) -> RetentionCounts | None:
        return None  # NOTE: never on: native_unsupported refuses a configuration with retention

    def counters(self) -> LedgerCounters:
        t = self._tree
        pools = tuple(PoolCounters(p["quota"], p["used"], p["blocks"], p["evictions"]) for p in t.pools())
        return LedgerCounters(t.used, len(t), t.evictions, t.expired, t.collisions, pools)


def make_stepper(
    cfg: ReplayConfig,
    summary: TraceSummary,
    include_output: bool,
    engine: str = "auto",
    registry: CollectorRegistry | None = None,
) -> Stepper:
    """The engine that replays ``cfg``: ``native`` (the compiled kernel; an error when it
    cannot model the configuration), ``python`` (the real ``PrefixCache``) or ``auto``
    (native where it can, else python)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown replay engine {engine!r}; valid: {', '.join(ENGINES)}")
    why = native_unsupported(cfg, registry is not None)
    if engine == "native" and why:
        raise ValueError(f"--engine native cannot replay {cfg.label}: {why}; use --engine python or auto")
    if engine == "python" or why:
        return CacheStepper(cfg, summary, include_output, registry)
    return KernelStepper(cfg, summary, include_output)
