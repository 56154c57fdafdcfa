"""What ``PrefixCache.stats()`` returns: frozen snapshots, read by the metrics exporter,
the dashboard, the admin route and the tests; and the running counters behind them.

Every counter of the cache (``Counters``, a tier's ``TierCounters``, a pool's
evictions) changes here and nowhere else, by the methods below, each called under the
cache's lock by the step that commits what it counts: an outcome a byte mover reports
is counted when the lock's owner commits it, never by the thread that moved the bytes.

Removals are keyed by ``RemovalReason`` (one table, whose ``label`` is what metrics
call each reason); ``to_json`` gives the admin route its plain-JSON view.
"""

from __future__ import annotations

import enum
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from prefixcache.cache.retention import Level, TenantRetention
from prefixcache.events import RemovalReason
from prefixcache.tenancy import PUBLIC, Pool

if TYPE_CHECKING:
    from prefixcache.cache.ledger import Ledger

__all__ = [
    "LATENCY_BUCKETS",
    "CacheStats",
    "Counters",
    "Histogram",
    "LatencyHistogram",
    "PoolStats",
    "TenantCounters",
    "TenantStats",
    "TierCounters",
    "TierStats",
    "WriterStats",
    "snapshot",
    "to_json",
    "top_tenants",
]

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative counts per upper bound (Prometheus ``le``; the last bound is +inf)."""

    buckets: tuple[tuple[float, int], ...]
    sum: float
    count: int


class LatencyHistogram:
    """Fixed buckets (seconds), so that the exporter reads counts instead of keeping a
    second copy of every observation."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def snapshot(self) -> Histogram:
        cumulative, total = [], 0
        for le, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            cumulative.append((le, total))
        return Histogram(tuple(cumulative), self.sum, self.count)


# ---------------------------------------------------------------------------- counters (mutable)


@dataclass(slots=True)
class TenantCounters:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    inserted_tokens: int = 0


@dataclass(slots=True)
class Counters:
    """The ledger's running counters (only ever read through ``CacheStats``)."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    partial_hit_tokens: int = 0
    inserted_tokens: int = 0
    inserted_blocks: int = 0
    declined_tokens: int = 0
    evicted_tokens: int = 0
    collisions: int = 0
    published_blocks: int = 0
    epoch_bumps: int = 0
    purges: int = 0  # operator calls of purge and purge_prefix (the removals count their blocks)
    voided_tokens: int = 0  # tokens of stores a purge or an epoch bump made after their decision dropped
    kv_bytes_in: int = 0  # KV bytes taken from callers' sources by inserts: the new ranges only
    removals: Counter[RemovalReason] = field(default_factory=Counter)
    tenants: dict[str, TenantCounters] = field(default_factory=dict)

    def tenant(self, name: str) -> TenantCounters:
        counters = self.tenants.get(name)
        if counters is None:
            counters = self.tenants[name] = TenantCounters()
        return counters

    def count_lookup(self, tenant: str, n_tokens: int, hit: int, partial: int) -> None:
        for c in (self, self.tenant(tenant)):
            c.lookups += 1
            c.lookup_tokens += n_tokens
            c.hit_tokens += hit
            c.hit_requests += hit > 0
        self.partial_hit_tokens += partial

    def count_collision(self) -> None:
        """A hash collision caught (a key whose tokens differ from the request's)."""
        self.collisions += 1

    def count_declined(self, tokens: int) -> None:
        self.declined_tokens += tokens

    def count_inserted(self, tenant: str, tokens: int, blocks: int) -> None:
        self.inserted_tokens += tokens
        self.inserted_blocks += blocks
        self.tenant(tenant).inserted_tokens += tokens

    def count_published(self, blocks: int) -> None:
        self.published_blocks += blocks

    def count_removal(self, reason: RemovalReason, tokens: int, pool: Pool) -> None:
        """A block of ``tokens`` left ``pool`` (and the cache) for ``reason``."""
        self.removals[reason] += 1
        if reason is RemovalReason.EVICTED:
            pool.evictions += 1
            self.evicted_tokens += tokens

    def count_purge(self) -> None:
        self.purges += 1

    def count_epoch_bump(self) -> None:
        self.epoch_bumps += 1

    def count_voided(self, tokens: int) -> None:
        """A store decided before a purge or bump that covers it: dropped (``invalidations.py``)."""
        self.voided_tokens += tokens

    def count_kv_in(self, nbytes: int) -> None:
        self.kv_bytes_in += nbytes


class TierCounters:
    """One tier's running counters (read through ``TierStats``)."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.promotions = 0
        self.demotions = 0
        self.evictions = 0
        self.removals: Counter[RemovalReason] = Counter()
        self.errors: Counter[str] = Counter()
        self.writes_dropped = 0
        self.writes_failed = 0
        self.latency = LatencyHistogram()

    def hit(self) -> None:
        self.hits += 1

    def miss(self, failure: str | None) -> None:
        """A block this tier should have given back and did not (absent, or bad bytes)."""
        self.misses += 1
        self.errors[failure or "missing"] += 1

    def seconds(self, seconds: float) -> None:
        self.latency.observe(seconds)

    def promotion(self) -> None:
        self.promotions += 1

    def demotion(self) -> None:
        self.demotions += 1

    def eviction(self) -> None:
        self.evictions += 1

    def removal(self, reason: RemovalReason) -> None:
        """A block held here left the cache for ``reason``."""
        self.removals[reason] += 1

    def dropped(self) -> None:
        """A write into this tier was decided but not queued (no room in the queue)."""
        self.writes_dropped += 1

    def failed_write(self, kind: str | None) -> None:
        """One failed write into this tier: one more in ``writes_failed``, and one more
        error of ``kind`` when the cache, not the store, knows its cause. NOTE: counting
        ``"write"`` on top of the store's own kind made one failed disk write two errors
        (``io`` and ``write``)."""
        self.writes_failed += 1
        if kind is not None:
            self.errors[kind] += 1


# ---------------------------------------------------------------------------- snapshots (frozen)


@dataclass(frozen=True, slots=True)
class TenantStats:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    inserted_tokens: int = 0
    used_tokens: int | None = None  # partitioned isolation: what its pool holds now


@dataclass(frozen=True, slots=True)
class PoolStats:
    quota_tokens: int
    used_tokens: int
    blocks: int
    evictions: int


@dataclass(frozen=True, slots=True)
class TierStats:
    """One storage tier: what it holds, what it served, what moved, what failed."""

    name: str
    kind: str
    level: str  # L0 device, L1 host RAM, L2 disk and Redis (what the alerts and runbook say)
    write: str  # its write policy: when its blocks are copied to the next slower tier
    capacity_bytes: int
    used_bytes: int
    frame_bytes: int  # what one full block's frame takes here, as ``used_bytes`` counts it (a slot, or its length)
    blocks: int
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    promotions: int  # blocks copied up into it from a slower tier on a hit
    demotions: int  # blocks moved down into it when a faster tier evicted them
    evictions: int  # blocks its own policy sent away to make room
    removals: Mapping[RemovalReason, int]  # blocks that left the cache while here, by reason
    errors: Mapping[str, int]  # failed operations by kind (io, checksum, timeout, missing, full, ...)
    load_seconds: Histogram
    writes_pending: int  # writes into it queued and not yet done
    writes_dropped: int  # writes into it refused by the full write queue
    writes_failed: int  # writes into it the store failed


@dataclass(frozen=True, slots=True)
class WriterStats:
    """The background writer's queue (puts and deletes for the tiers it serves)."""

    mode: str
    queued_jobs: int
    queued_bytes: int
    limit_bytes: int
    done: int
    dropped: int  # writes refused because the queue held ``limit_bytes`` already
    failed: int
    abandoned: int  # writes still queued when ``close`` gave up waiting for them


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since start, and occupancy now, overall, per tenant, pool and tier."""

    lookups: int
    lookup_tokens: int
    hit_tokens: int
    hit_requests: int
    partial_hit_tokens: int
    inserted_tokens: int
    inserted_blocks: int
    declined_tokens: int
    evicted_tokens: int
    collisions: int
    published_blocks: int
    epoch_bumps: int
    purges: int
    kv_bytes_in: int
    removals: Mapping[RemovalReason, int]
    capacity_tokens: int
    used_tokens: int
    blocks: int
    stale_roots_pending: int
    events_dropped: int
    tenants: Mapping[str, TenantStats]
    pools: Mapping[str, PoolStats]
    tiers: tuple[TierStats, ...] = ()
    writer: WriterStats | None = None
    voided_tokens: int = 0  # stores dropped because a purge or epoch bump came after their decision
    retention: tuple[TenantRetention, ...] = ()  # each tenant's retention (``retention.py``)
    retention_levels: tuple[Level, ...] = ()  # the levels its figures are per: the cache, then each tier

    @property
    def evictions(self) -> int:
        """Blocks removed under capacity pressure."""
        return self.removals.get(RemovalReason.EVICTED, 0)

    def removed(self, reason: RemovalReason) -> int:
        return self.removals.get(reason, 0)


def top_tenants(tenants: Mapping[str, TenantStats], n: int, other: str = "other") -> dict[str, TenantStats]:
    """The ``n`` tenants with the most prompt tokens looked up, and the rest summed under
    ``other`` (so that a report's size is bounded, as /metrics' labels are)."""
    ranked = sorted(tenants.items(), key=lambda item: (-item[1].lookup_tokens, item[0]))
    kept = dict(ranked[:n])
    rest = [t for _, t in ranked[n:]]
    if rest:
        used = [t.used_tokens for t in rest if t.used_tokens is not None]
        kept[other] = TenantStats(
            sum(t.lookups for t in rest),
            sum(t.lookup_tokens for t in rest),
            sum(t.hit_tokens for t in rest),
            sum(t.hit_requests for t in rest),
            sum(t.inserted_tokens for t in rest),
            sum(used) if used else None,
        )
    return kept


def to_json(value: Any) -> Any:
    """A snapshot as plain JSON: dataclasses as objects, enum keys and values as their
    strings, tuples as lists, an infinite bound as the string "+Inf"."""
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {_key(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and math.isinf(value):
        return "+Inf"
    return value


def _key(key: object) -> str:
    return key.value if isinstance(key, enum.Enum) else str(key)


def snapshot(ledger: Ledger, tiers: tuple[TierStats, ...] = (), writer: WriterStats | None = None) -> CacheStats:
    """The ledger's counters and occupancy now, with the tiers' and the writer's."""
    c = ledger.counters
    tenants = {
        name: TenantStats(t.lookups, t.lookup_tokens, t.hit_tokens, t.hit_requests, t.inserted_tokens)
        for name, t in c.tenants.items()
    }
    if ledger.tenancy.partitioned:
        for name, pool in ledger.tenancy.pools.items():
            if name != PUBLIC:
                tenants[name] = replace(tenants.get(name, TenantStats()), used_tokens=pool.used)
    pools = {p.name: PoolStats(p.quota, p.used, p.blocks, p.evictions) for p in ledger.tenancy.pools.values()}
    return CacheStats(
        lookups=c.lookups,
        lookup_tokens=c.lookup_tokens,
        hit_tokens=c.hit_tokens,
        hit_requests=c.hit_requests,
        partial_hit_tokens=c.partial_hit_tokens,
        inserted_tokens=c.inserted_tokens,
        inserted_blocks=c.inserted_blocks,
        declined_tokens=c.declined_tokens,
        evicted_tokens=c.evicted_tokens,
        collisions=c.collisions,
        published_blocks=c.published_blocks,
        epoch_bumps=c.epoch_bumps,
        purges=c.purges,
        kv_bytes_in=c.kv_bytes_in,
        removals=dict(c.removals),
        capacity_tokens=ledger.config.capacity,
        used_tokens=ledger.life.used,
        blocks=len(ledger.tree),
        stale_roots_pending=len(ledger.life.stale),
        events_dropped=ledger.events.dropped,
        tenants=tenants,
        pools=pools,
        tiers=tiers,
        writer=writer,
        voided_tokens=c.voided_tokens,
        retention=tuple(ledger.keeper.snapshot()),
        retention_levels=ledger.keeper.levels,
    )
