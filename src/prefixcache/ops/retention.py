"""Retention as an operator reads it: each tenant's retained tokens (the cache) and bytes
(each tier), its caps, its expiries and cap hits, for ``/metrics``, the dashboard and
``diagnose``; read from ``PrefixCache.stats().retention`` (``cache/retention.py``).

The cache counts a tier's retention in frames. A frame of a full block takes what the
tier's byte gauge (``prefixcache_tier_used_bytes``) counts for it, and the cache says
how much in ``TierStats.frame_bytes`` (its store's answer, ``TierStore.footprint``: a
slot in memory and on a device, the encoded length elsewhere). Retained bytes are frames
times that, so a tenant's retained bytes and the tier's used bytes are in one unit (a
partial block's frame is counted as a full one: the retention's upper bound).

Tenant labels are bounded as every per-tenant series is (``metrics.TenantLabels``: the
top N tenants by prompt tokens looked up keep their name, the rest are ``other``), and
the counters are carried the same way: what a tenant's label last took stays there,
so no counter ever goes down when a tenant enters or leaves the top N.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from prefixcache.cache.retention import Level, TenantRetention
from prefixcache.cache.stats import CacheStats, TierStats
from prefixcache.ops.metrics import OTHER, TIER_LABELS, TenantLabels

__all__ = ["AT_CAP", "RetentionMetrics", "RetentionRow", "fold", "retention_rows"]

TOP_TENANTS = 20  # as the serving metrics label them
# A tenant holding this share of a cap is at it (the cap ends its oldest retention before
# the next block, so a capped tenant sits within a block of it): the dashboard, diagnose
# and the alert rule (ops/alerts.yml) say so from here
AT_CAP = 0.9


@dataclass(frozen=True, slots=True)
class RetentionRow:
    """One tenant's (or one label's) retention: per level, tokens in the cache (level 0)
    and bytes in each tier; its caps the same way (0 where the cap does not bind)."""

    tenant: str
    held: tuple[int, ...]
    caps: tuple[int, ...]
    expired_tokens: int  # ended at their deadline
    capped_tokens: int  # ended, or never retained, by the cap
    cap_hits: int
    refused: int

    def at_cap(self, ratio: float) -> list[int]:
        """The levels where this row holds at least ``ratio`` of a binding cap."""
        return [i for i, (h, c) in enumerate(zip(self.held, self.caps, strict=True)) if c > 0 and h >= ratio * c]


def _unit(level: Level, tiers: Mapping[str, TierStats]) -> int:
    """Bytes of one counted unit of ``level``: 1 for the cache's tokens, a full block's
    frame for a tier (as its byte gauge counts it; 0 for a tier the stats do not name)."""
    if level.per_token:
        return 1
    tier = tiers.get(level.name)
    return tier.frame_bytes if tier is not None else 0


def retention_rows(stats: CacheStats) -> list[RetentionRow]:
    """Each tenant's retention in tokens (the cache) and bytes (each tier)."""
    tiers = {t.name: t for t in stats.tiers}
    levels = stats.retention_levels
    units = [_unit(level, tiers) for level in levels]
    return [_row(r, levels, units) for r in stats.retention]


def _row(r: TenantRetention, levels: Sequence[Level], units: Sequence[int]) -> RetentionRow:
    held = tuple(h * u for h, u in zip(r.held, units, strict=True))
    caps = tuple(c * u if level.binding else 0 for c, u, level in zip(r.caps, units, levels, strict=True))
    return RetentionRow(r.tenant, held, caps, r.expired_tokens, r.capped_tokens, r.cap_hits, r.refused)


def fold(rows: Iterable[RetentionRow], label_of: Callable[[str], str]) -> list[RetentionRow]:
    """``rows`` summed by label (``label_of(tenant)``), in order of the first of each."""
    out: dict[str, RetentionRow] = {}
    for row in rows:
        label = label_of(row.tenant)
        was = out.get(label)
        out[label] = _plus(label, was, row) if was is not None else dataclasses.replace(row, tenant=label)
    return list(out.values())


def _plus(label: str, a: RetentionRow, b: RetentionRow) -> RetentionRow:
    return RetentionRow(
        label,
        tuple(x + y for x, y in zip(a.held, b.held, strict=True)),
        tuple(x + y for x, y in zip(a.caps, b.caps, strict=True)),
        a.expired_tokens + b.expired_tokens,
        a.capped_tokens + b.capped_tokens,
        a.cap_hits + b.cap_hits,
        a.refused + b.refused,
    )


# ============================================================================ /metrics

_COUNTERS = ("expired_tokens", "capped_tokens", "cap_hits", "refused")


class RetentionMetrics:
    """The retention families of ``/metrics``, their tenant labels bounded (see the module
    docstring). One per ``CacheCollector``; it keeps what each label has exported."""

    def __init__(self, top_tenants: int = TOP_TENANTS, max_label_values: int | None = None) -> None:
        self.labels = TenantLabels(top_tenants, max_label_values)
        self._fed: dict[str, int] = {}  # tenant -> its lookup tokens the guard has seen
        self._seen: dict[str, tuple[int, ...]] = {}  # tenant -> its counters at the last scrape
        self._exported: dict[str, list[int]] = {}  # label -> counters exported under it
        self._lock = threading.Lock()  # NOTE: two scrapes at once must not count a delta twice

    def families(self, stats: CacheStats) -> list[Metric]:
        with self._lock:
            self._feed(stats)
            rows = retention_rows(stats)
            for row in rows:
                self._carry(row)
            if not rows and not self._exported:
                return []  # NOTE: no family at all until a tenant retains (a cache without retention looks as before)
            return _families(stats, fold(rows, self.label), self._exported)

    def label(self, tenant: str) -> str:
        return tenant if tenant in self.labels.labelled else OTHER

    def _feed(self, stats: CacheStats) -> None:
        """Give the guard each tenant's new traffic, the most first (so the top N are the
        tenants with the most prompt tokens looked up, as the serving metrics have them)."""
        new = {name: t.lookup_tokens - self._fed.get(name, 0) for name, t in stats.tenants.items()}
        new |= {r.tenant: 0 for r in stats.retention if r.tenant not in self._fed and r.tenant not in new}
        for tenant, tokens in sorted(new.items(), key=lambda kv: (-kv[1], kv[0])):
            if tokens > 0 or tenant not in self._fed:
                self.labels.observe(tenant, max(tokens, 0))
                self._fed[tenant] = self._fed.get(tenant, 0) + max(tokens, 0)

    def _carry(self, row: RetentionRow) -> None:
        now = tuple(getattr(row, name) for name in _COUNTERS)
        then = self._seen.get(row.tenant, (0,) * len(now))
        self._seen[row.tenant] = now
        counts = self._exported.setdefault(self.label(row.tenant), [0] * len(now))
        for i, (a, b) in enumerate(zip(now, then, strict=True)):
            counts[i] += a - b if a >= b else a  # NOTE: a count that went down started again


def _families(stats: CacheStats, rows: Sequence[RetentionRow], exported: Mapping[str, list[int]]) -> list[Metric]:
    tier_labels = {t.name: [t.name, t.kind, t.level] for t in stats.tiers}
    levels = stats.retention_levels
    tokens = GaugeMetricFamily(
        "prefixcache_retained_tokens", "Tokens a tenant keeps retained in the cache.", labels=["tenant"]
    )
    cap_tokens = GaugeMetricFamily(
        "prefixcache_retention_cap_tokens", "A tenant's retention cap in the cache, in tokens.", labels=["tenant"]
    )
    by_tier = ["tenant", *TIER_LABELS]
    held_bytes = GaugeMetricFamily(
        "prefixcache_retained_bytes",
        "Bytes of a tier a tenant keeps retained (its retained frames times a full block's frame).",
        labels=by_tier,
    )
    cap_bytes = GaugeMetricFamily(
        "prefixcache_retention_cap_bytes",
        "A tenant's retention cap in a tier, in bytes (only where the cap binds: the last tier).",
        labels=by_tier,
    )
    for row in rows:
        for i, level in enumerate(levels):
            if level.per_token:
                tokens.add_metric([row.tenant], row.held[i])
                cap_tokens.add_metric([row.tenant], row.caps[i])
                continue
            labels = [row.tenant, *tier_labels.get(level.name, [level.name, "", ""])]
            held_bytes.add_metric(labels, row.held[i])
            if level.binding:
                cap_bytes.add_metric(labels, row.caps[i])
    expired = CounterMetricFamily(
        "prefixcache_retention_expired_tokens",
        "Retained tokens whose retention ended, by reason: deadline (it ran out) or cap (the tenant's cap ended "
        "it or cut a span short).",
        labels=["tenant", "reason"],
    )
    hits = CounterMetricFamily(
        "prefixcache_retention_cap_hits", "Times a tenant's cap ended or cut its retention.", labels=["tenant"]
    )
    refused = CounterMetricFamily(
        "prefixcache_retention_refused",
        "Retention requests refused (a tenant whose cap is zero: served without retention).",
        labels=["tenant"],
    )
    for label, (deadline, cap, cap_hits, refusals) in exported.items():
        expired.add_metric([label, "deadline"], deadline)
        expired.add_metric([label, "cap"], cap)
        hits.add_metric([label], cap_hits)
        refused.add_metric([label], refusals)
    return [tokens, cap_tokens, held_bytes, cap_bytes, expired, hits, refused]
