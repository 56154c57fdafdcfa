"""``CacheCollector``: the cache's own figures on /metrics, read from ``PrefixCache.stats()``
at scrape time, so the cache keeps plain counters and never imports prometheus_client.

It exports occupancy, removals by reason (``RemovalReason.label``), epochs, collisions,
publications, and per tier: capacity and use, hits and misses, bytes moved, promotions,
demotions, evictions by reason, errors by kind, the load latency histogram, and the
writes queued, dropped and failed; and the write queue itself; and each tenant's
retention (``retention.py``). Names are in ``metrics.CACHE_METRICS`` and
``metrics.RETENTION_METRICS``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.cache.stats import CacheStats, TierStats, WriterStats
from prefixcache.events import RemovalReason
from prefixcache.ops.metrics import TIER_LABELS
from prefixcache.ops.retention import RetentionMetrics

__all__ = ["CacheCollector", "StatsSource"]


class StatsSource(Protocol):
    """What ``CacheCollector`` reads: a ``PrefixCache``, or anything with its ``stats()``."""

    def stats(self) -> CacheStats: ...


class CacheCollector(Collector):
    """Exports ``source.stats()`` at scrape time: ``registry.register(CacheCollector(cache))``.
    Retained frames become bytes by each tier's ``TierStats.frame_bytes``."""

    def __init__(self, source: StatsSource) -> None:
        self.source = source
        self.retention = RetentionMetrics()

    def describe(self) -> list[Metric]:
        return []  # do not call stats() at registration

    def collect(self) -> Iterable[Metric]:
        stats = self.source.stats()
        yield from _cache_families(stats)
        yield from _tier_families(stats.tiers)
        if stats.writer is not None:
            yield from _writer_families(stats.writer)
        yield from self.retention.families(stats)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)


def _cache_families(s: CacheStats) -> Iterable[Metric]:
    yield _counter("prefixcache_cache_lookups_total", "Lookups (match calls) since start.", s.lookups)
    yield _counter("prefixcache_cache_lookup_tokens_total", "Tokens looked up since start.", s.lookup_tokens)
    yield _counter("prefixcache_cache_hit_tokens_total", "Tokens matched since start.", s.hit_tokens)
    yield _counter("prefixcache_cache_inserted_tokens_total", "Tokens stored since start.", s.inserted_tokens)
    yield _counter("prefixcache_evicted_tokens_total", "Tokens evicted under capacity pressure.", s.evicted_tokens)
    yield _counter(
        "prefixcache_epoch_bumps_total", "Model or adapter epoch bumps (every old block stale).", s.epoch_bumps
    )
    yield _counter("prefixcache_purges_total", "Purge operations (tenant or prefix).", s.purges)
    yield _counter(
        "prefixcache_hash_collisions_total", "Hash matches whose stored tokens differed (misses).", s.collisions
    )
    yield _counter(
        "prefixcache_published_blocks_total", "Blocks published to the shared public pool.", s.published_blocks
    )
    yield _counter("prefixcache_events_dropped_total", "Cache events dropped by a full event buffer.", s.events_dropped)
    yield _counter(
        "prefixcache_kv_bytes_in_total", "KV bytes inserts took from the engine: the new ranges only.", s.kv_bytes_in
    )
    yield GaugeMetricFamily("prefixcache_used_tokens", "Tokens held in the cache.", value=s.used_tokens)
    yield GaugeMetricFamily("prefixcache_capacity_tokens", "Capacity of the cache in tokens.", value=s.capacity_tokens)
    yield GaugeMetricFamily("prefixcache_blocks", "Blocks held in the cache.", value=s.blocks)
    yield GaugeMetricFamily(
        "prefixcache_stale_roots_pending", "Stale contexts whose blocks await reclaim.", value=s.stale_roots_pending
    )
    removed = CounterMetricFamily(
        "prefixcache_evictions",
        "Blocks removed from the cache, by reason (capacity, stale, purge, ttl, replaced, lost).",
        labels=["reason"],
    )
    for reason in RemovalReason:
        removed.add_metric([reason.label], s.removed(reason))
    yield removed


def _tier_families(tiers: Iterable[TierStats]) -> Iterable[Metric]:
    labels = list(TIER_LABELS)

    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=labels)

    def counter(name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=labels)

    gauges = {
        "capacity_bytes": gauge("prefixcache_tier_capacity_bytes", "Capacity of the tier."),
        "used_bytes": gauge("prefixcache_tier_used_bytes", "Bytes held in the tier."),
        "blocks": gauge("prefixcache_tier_blocks", "Blocks held in the tier."),
        "writes_pending": gauge("prefixcache_tier_writes_pending", "Writes into the tier queued and not yet done."),
    }
    counters = {
        "hits": counter("prefixcache_tier_hits", "Blocks found in the tier when loading."),
        "misses": counter("prefixcache_tier_misses", "Blocks asked of the tier and not served (absent or bad)."),
        "bytes_read": counter("prefixcache_tier_read_bytes", "Bytes read from the tier."),
        "bytes_written": counter("prefixcache_tier_written_bytes", "Bytes written to the tier."),
        "promotions": counter("prefixcache_tier_promotions", "Blocks copied up into the tier from a slower one."),
        "demotions": counter("prefixcache_tier_demotions", "Blocks moved down into the tier from a faster one."),
        "writes_dropped": counter(
            "prefixcache_tier_writes_dropped", "Writes into the tier refused because the write queue was full."
        ),
        "writes_failed": counter("prefixcache_tier_writes_failed", "Writes into the tier that its store failed."),
    }
    evictions = CounterMetricFamily(
        "prefixcache_tier_evictions",
        "Blocks that left the tier, by reason: capacity (its own policy, or the cache's), stale, purge, ttl, ...",
        labels=[*labels, "reason"],
    )
    errors = CounterMetricFamily(
        "prefixcache_tier_errors", "Failed tier operations, by kind of error.", labels=[*labels, "error"]
    )
    latency = HistogramMetricFamily(
        "prefixcache_tier_load_seconds", "Time to load the matched blocks of a request from the tier.", labels=labels
    )
    for tier in tiers:
        values = [tier.name, tier.kind, tier.level]
        for key, family in gauges.items():
            family.add_metric(values, getattr(tier, key))
        for key, cfamily in counters.items():
            cfamily.add_metric(values, getattr(tier, key))
        by_reason = {reason.label: tier.removals.get(reason, 0) for reason in RemovalReason}
        by_reason[RemovalReason.EVICTED.label] += tier.evictions
        for label, count in by_reason.items():
            evictions.add_metric([*values, label], count)
        for kind, count in sorted(tier.errors.items()):
            errors.add_metric([*values, str(kind)], count)
        load = tier.load_seconds
        buckets = [(_le(le), count) for le, count in load.buckets]
        if not buckets or buckets[-1][0] != "+Inf":
            buckets.append(("+Inf", load.count))
        latency.add_metric(values, buckets, load.sum)
    yield from gauges.values()
    yield from counters.values()
    yield evictions
    yield errors
    yield latency


def _writer_families(w: WriterStats) -> Iterable[Metric]:
    yield GaugeMetricFamily("prefixcache_write_queue_bytes", "Frame bytes in the write queue.", value=w.queued_bytes)
    yield GaugeMetricFamily(
        "prefixcache_write_queue_limit_bytes",
        "The write queue's bound (a write beyond it is dropped).",
        value=w.limit_bytes,
    )
    yield _counter(
        "prefixcache_writes_abandoned_total",
        "Writes still queued when the cache closed (lost to a restart).",
        w.abandoned,
    )


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))
