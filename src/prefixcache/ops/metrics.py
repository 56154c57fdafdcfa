"""Prometheus metrics: what an SRE needs to act, not one hit-rate figure per engine.

Two sources, each registered on a ``CollectorRegistry`` the caller owns (no global
registry, so two servers or two tests in one process never share a counter):

- ``ServingMetrics``: what the server sees per request (tenant x model x endpoint):
  lookups, prompt and hit tokens, tokens served from each tier, prefill seconds spent
  and saved, and the queue / time-to-first-token / total latency histograms. The
  engine calls ``record_request`` once per request and ``set_prefill_seconds_per_token``
  whenever it has measured its own prefill speed.
- ``CacheCollector``: reads ``PrefixCache.stats()`` at scrape time, so the cache itself
  keeps plain integers and never imports prometheus_client. It exports occupancy,
  per-tier counters and latency, removals by reason, epochs, collisions, promotions.

Every name has the ``prefixcache_`` prefix and a base unit (seconds, bytes, tokens,
blocks); counters end in ``_total``. The list is in ``METRIC_NAMES`` (the dashboard and
alert tests check every expression against it).

Saved prefill share, in PromQL::

    sum(rate(prefixcache_prefill_seconds_saved_total[5m]))
      / (sum(rate(prefixcache_prefill_seconds_saved_total[5m])) + sum(rate(prefixcache_prefill_seconds_total[5m])))

``prefixcache_prefill_seconds_total`` is the prefill time actually spent (the tokens
computed), ``..._saved_total`` the time the cached tokens would have taken at the
measured per-token speed; their sum is what prefill would have cost without the cache.

Tenant cardinality guard (``TenantLabels``)::

    traffic (prompt tokens) per tenant ->  top N keep  tenant="<name>"
                                           the rest -> tenant="other"

NOTE: when a folded tenant's traffic overtakes the smallest labelled tenant, the two
swap: the newcomer gets its own label *from then on* (its earlier traffic stays in
``other``: counters are never moved between series, which would break their
monotonicity), and the displaced tenant's series stay exported, frozen, while its new
traffic goes to ``other``. No series is ever removed, so every counter and every
``sum by`` over them only grows. Since frozen series accumulate, the number of tenant
label values ever exported is capped (``max_label_values``, default 2 N): once reached,
the labelled set stops changing until restart. A tenant that comes back to the top N
resumes its old series.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prefixcache.config import LEVELS

OTHER = "other"  # the tenant label of every tenant outside the top N

# Request latencies: a queue of a few ms to a long generation of a minute or more.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, math.inf)

SERVING_LABELS = ("tenant", "model", "endpoint")
TIER_LABELS = ("tier", "kind", "level")

# Every family this module exports (histograms also expose _bucket, _sum and _count).
SERVING_METRICS = {
    "prefixcache_lookups_total": "counter",
    "prefixcache_prompt_tokens_total": "counter",
    "prefixcache_hit_tokens_total": "counter",
    "prefixcache_tier_hit_tokens_total": "counter",
    "prefixcache_prefill_seconds_saved_total": "counter",
    "prefixcache_prefill_seconds_total": "counter",
    "prefixcache_prefill_seconds_per_token": "gauge",
    "prefixcache_request_queue_seconds": "histogram",
    "prefixcache_time_to_first_token_seconds": "histogram",
    "prefixcache_request_duration_seconds": "histogram",
    "prefixcache_tenant_label_changes_total": "counter",
}
CACHE_METRICS = {
    "prefixcache_cache_lookups_total": "counter",
    "prefixcache_cache_lookup_tokens_total": "counter",
    "prefixcache_cache_hit_tokens_total": "counter",
    "prefixcache_cache_inserted_tokens_total": "counter",
    "prefixcache_used_tokens": "gauge",
    "prefixcache_capacity_tokens": "gauge",
    "prefixcache_blocks": "gauge",
    "prefixcache_stale_roots_pending": "gauge",
    "prefixcache_evictions_total": "counter",
    "prefixcache_evicted_tokens_total": "counter",
    "prefixcache_epoch_bumps_total": "counter",
    "prefixcache_purges_total": "counter",
    "prefixcache_hash_collisions_total": "counter",
    "prefixcache_published_blocks_total": "counter",
    "prefixcache_events_dropped_total": "counter",
    "prefixcache_tier_capacity_bytes": "gauge",
    "prefixcache_tier_used_bytes": "gauge",
    "prefixcache_tier_blocks": "gauge",
    "prefixcache_tier_hits_total": "counter",
    "prefixcache_tier_misses_total": "counter",
    "prefixcache_tier_read_bytes_total": "counter",
    "prefixcache_tier_written_bytes_total": "counter",
    "prefixcache_tier_promotions_total": "counter",
    "prefixcache_tier_demotions_total": "counter",
    "prefixcache_tier_evictions_total": "counter",
    "prefixcache_tier_errors_total": "counter",
    "prefixcache_tier_load_seconds": "histogram",
    "prefixcache_tier_writes_pending": "gauge",
    "prefixcache_tier_writes_dropped_total": "counter",
    "prefixcache_tier_writes_failed_total": "counter",
    "prefixcache_write_queue_bytes": "gauge",
    "prefixcache_write_queue_limit_bytes": "gauge",
    "prefixcache_writes_abandoned_total": "counter",
    "prefixcache_kv_bytes_in_total": "counter",
}
# Each tenant's retention (``retention.py``), from the same collector
RETENTION_METRICS = {
    "prefixcache_retained_tokens": "gauge",
    "prefixcache_retained_bytes": "gauge",
    "prefixcache_retention_cap_tokens": "gauge",
    "prefixcache_retention_cap_bytes": "gauge",
    "prefixcache_retention_expired_tokens_total": "counter",
    "prefixcache_retention_cap_hits_total": "counter",
    "prefixcache_retention_refused_total": "counter",
}


def metric_names() -> set[str]:
    """Every sample name exported: counters and gauges as is, histograms with their series."""
    names: set[str] = set()
    for name, kind in (SERVING_METRICS | CACHE_METRICS | RETENTION_METRICS).items():
        if kind == "histogram":
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return names


def tier_level(kind: str) -> str:
    """The level the alerts and runbook name a tier by (``TierConfig.level``)."""
    return LEVELS.get(kind, "L2")


# ============================================================================ tenants


class TenantLabels:
    """The cardinality guard: which tenants keep their own label (see the module docstring)."""

    def __init__(self, top_n: int, max_label_values: int | None = None) -> None:
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
            raise ValueError(f"top_tenants must be an integer >= 0, got {top_n!r}")
        cap = 2 * top_n if max_label_values is None else max_label_values
        if cap < top_n:
            raise ValueError(f"max_label_values must be >= top_tenants ({top_n}), got {cap}")
        self.top_n = top_n
        self.max_label_values = cap
        self.traffic: dict[str, int] = {}  # tenant -> prompt tokens since start
        self.labelled: set[str] = set()  # the current top N, exported under their own name
        self.exported: set[str] = set()  # every tenant label value ever exported (frozen ones too)
        self.changes = 0  # swaps into the top N after it first filled

    def observe(self, tenant: str, tokens: int) -> str:
        """Count ``tokens`` of traffic for ``tenant``; the label this request goes under."""
        total = self.traffic.get(tenant, 0) + tokens
        self.traffic[tenant] = total
        if tenant in self.labelled:
            return tenant
        if tenant == OTHER:  # NOTE: a tenant really named "other" is always folded, never mislabelled
            return OTHER
        if len(self.labelled) < self.top_n:
            self._label(tenant)
            return tenant
        if self.top_n == 0 or (tenant not in self.exported and len(self.exported) >= self.max_label_values):
            return OTHER
        # NOTE: min() over N tenants only runs for folded tenants' requests; N is small (tens).
        smallest = min(self.labelled, key=lambda t: (self.traffic[t], t))
        if total > self.traffic[smallest]:
            self.labelled.discard(smallest)
            self._label(tenant)
            self.changes += 1
            return tenant
        return OTHER

    def _label(self, tenant: str) -> None:
        self.labelled.add(tenant)
        self.exported.add(tenant)


# ============================================================================ serving


class PrefillRate:
    """The running model's prefill seconds per token, measured on its own uncached
    prefills (what ``prefill_seconds_saved`` multiplies the hit tokens by).

    NOTE: the first qualifying prefill is skipped (it pays the model's warm-up), short
    ones too (below ``min_tokens`` fixed costs dominate and overstate the rate), and the
    rest are smoothed (an exponential moving average) so that one slow request on a busy
    machine moves the figure little."""

    def __init__(self, min_tokens: int = 128, alpha: float = 0.2) -> None:
        self.min_tokens = min_tokens
        self.alpha = alpha
        self.seen = 0
        self.value: float | None = None

    def observe(self, seconds: float, tokens: int) -> float | None:
        """Take one uncached prefill; the estimate when there is one."""
        if tokens < self.min_tokens or not (math.isfinite(seconds) and seconds > 0):
            return self.value
        self.seen += 1
        if self.seen == 1:
            return None
        rate = seconds / tokens
        self.value = rate if self.value is None else self.value + self.alpha * (rate - self.value)
        return self.value


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, as the server (or a replay) counts it.

    ``cached_tokens`` is what the client was told (the tokens actually loaded);
    ``tier_tokens`` splits it by tier level (``{"L1": 96, "L2": 32}``) and sums to it.
    ``prefill_seconds``, when the engine timed this request's prefill, is counted as
    spent; otherwise the computed tokens at the measured per-token time."""

    tenant: str
    model: str
    endpoint: str
    prompt_tokens: int
    cached_tokens: int
    tier_tokens: Mapping[str, int] = field(default_factory=dict)
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    prefill_seconds: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError(
                f"cached_tokens must be in [0, prompt_tokens={self.prompt_tokens}], got {self.cached_tokens}"
            )
        tiers = self.tier_tokens
        if any(n < 0 for n in tiers.values()) or sum(tiers.values()) != self.cached_tokens:
            raise ValueError(f"tier_tokens {dict(tiers)} must be >= 0 and sum to cached_tokens={self.cached_tokens}")


@dataclass
class Totals:
    """Plain running sums per (tenant label, model, endpoint), for the dashboard page."""

    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefill_seconds_saved: float = 0.0
    prefill_seconds: float = 0.0


class ServingMetrics:
    """Per-request metrics of the server, on ``registry``.

    ``prefill_seconds_per_token`` is measured by the engine on its own prefills (time
    of a prefill / tokens computed); until it is set, cached tokens save nothing on
    paper (``prefill_seconds_saved`` stays 0) rather than a guessed figure.
    """

    def __init__(self, registry: CollectorRegistry, top_tenants: int = 20, max_label_values: int | None = None) -> None:
        self.tenants = TenantLabels(top_tenants, max_label_values)
        self._lock = threading.Lock()
        self._seconds_per_token: float | None = None
        self.totals: dict[tuple[str, str, str], Totals] = {}
        self.tier_tokens: dict[str, int] = {}  # tier -> tokens served from it, all tenants
        r = registry
        self.lookups = Counter("prefixcache_lookups", "Requests that looked up the cache.", SERVING_LABELS, registry=r)
        self.prompt_tokens = Counter(
            "prefixcache_prompt_tokens", "Prompt tokens looked up.", SERVING_LABELS, registry=r
        )
        self.hit_tokens = Counter(
            "prefixcache_hit_tokens", "Prompt tokens loaded from the cache (not prefilled).", SERVING_LABELS, registry=r
        )
        self.tier_hit_tokens = Counter(
            "prefixcache_tier_hit_tokens",
            "Prompt tokens loaded from the cache, by the tier they came from.",
            ("tenant", "model", "tier"),
            registry=r,
        )
        self.saved = Counter(
            "prefixcache_prefill_seconds_saved",
            "Prefill seconds the cached tokens would have cost, at the measured per-token prefill time.",
            SERVING_LABELS,
            registry=r,
        )
        self.spent = Counter(
            "prefixcache_prefill_seconds",
            "Prefill seconds spent on the tokens that were not cached.",
            SERVING_LABELS,
            registry=r,
        )
        self.per_token = Gauge(
            "prefixcache_prefill_seconds_per_token",
            "Measured prefill time per token of the running model (0 until measured).",
            registry=r,
        )
        hist_labels = ("model", "endpoint")
        self.queue = Histogram(
            "prefixcache_request_queue_seconds",
            "Time from arrival to the start of prefill.",
            hist_labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "prefixcache_time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            hist_labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "prefixcache_request_duration_seconds",
            "Time from arrival to the last output token.",
            hist_labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.label_changes = Counter(
            "prefixcache_tenant_label_changes",
            "Times a folded tenant entered the top N (tenant label guard churn).",
            registry=r,
        )

    @property
    def prefill_seconds_per_token(self) -> float | None:
        return self._seconds_per_token

    def set_prefill_seconds_per_token(self, seconds: float) -> None:
        """The engine's measured prefill time per token; used for every later request."""
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"prefill seconds per token must be a finite number > 0, got {seconds!r}")
        with self._lock:
            self._seconds_per_token = float(seconds)
            self.per_token.set(seconds)

    def record_request(self, r: RequestRecord) -> str:
        """Count one finished request; returns the tenant label it was counted under."""
        with self._lock:
            changes = self.tenants.changes
            label = self.tenants.observe(r.tenant, r.prompt_tokens)
            if self.tenants.changes != changes:
                self.label_changes.inc()
            per_token = self._seconds_per_token or 0.0
            saved = r.cached_tokens * per_token
            spent = (
                r.prefill_seconds if r.prefill_seconds is not None else (r.prompt_tokens - r.cached_tokens) * per_token
            )
            labels = (label, r.model, r.endpoint)
            self.lookups.labels(*labels).inc()
            self.prompt_tokens.labels(*labels).inc(r.prompt_tokens)
            self.hit_tokens.labels(*labels).inc(r.cached_tokens)
            self.saved.labels(*labels).inc(saved)
            self.spent.labels(*labels).inc(spent)
            for tier, n in r.tier_tokens.items():
                if n:
                    self.tier_hit_tokens.labels(label, r.model, tier).inc(n)
                    self.tier_tokens[tier] = self.tier_tokens.get(tier, 0) + n
            self.queue.labels(r.model, r.endpoint).observe(r.queue_seconds)
            self.ttft.labels(r.model, r.endpoint).observe(r.ttft_seconds)
            self.duration.labels(r.model, r.endpoint).observe(r.total_seconds)
            totals = self.totals.get(labels)
            if totals is None:
                totals = self.totals[labels] = Totals()
            totals.lookups += 1
            totals.prompt_tokens += r.prompt_tokens
            totals.hit_tokens += r.cached_tokens
            totals.prefill_seconds_saved += saved
            totals.prefill_seconds += spent
            return label

    def snapshot(self) -> dict[tuple[str, str, str], Totals]:
        """A copy of the running sums, keyed by (tenant label, model, endpoint)."""
        with self._lock:
            return {k: Totals(**vars(v)) for k, v in self.totals.items()}
