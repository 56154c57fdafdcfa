"""prefixcache's figures on vLLM's own ``/metrics``.

The worker's ``Tally`` travels to vLLM's front end as ``PrefixCacheStats`` (vLLM ships
connector stats between its processes); there ``PrefixCachePromMetrics`` records them
on vLLM's registry, labelled like vLLM's own series plus ``tenant`` (and ``tier`` for
hits). Tenants beyond the first ``MAX_TENANTS`` share the label ``other``.

Without a gateway secret the tenant is the request's ``cache_salt``, the key to that
tenant's cache: its label is then ``identity.salt_label`` (a hash), never the salt; the
default tenant keeps its name. With a secret, tenants are the names the gateway vouched
for, labelled as they are.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from prefixcache.identity import salt_label
from prefixcache.integrations.vllm.settings import parse_settings, read_secret
from prefixcache.integrations.vllm.worker import Tally

__all__ = ["PrefixCachePromMetrics", "PrefixCacheStats"]

MAX_TENANTS = 50
SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PrefixCacheStats(KVConnectorStats):
    """A ``Tally`` as vLLM's connector stats (``data`` is ``Tally.to_dict()``)."""

    def tally(self) -> Tally:
        return Tally.from_dict(self.data)

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return PrefixCacheStats(self.tally().merge(Tally.from_dict(other.data)).to_dict())

    def reduce(self) -> dict[str, int | float]:
        t = self.tally()
        loads = t.load_seconds
        return {
            "prefixcache_hit_tokens": sum(t.hit_tokens.values()),
            "prefixcache_lost_tokens": sum(t.lost_tokens.values()),
            "prefixcache_saved_tokens": sum(t.saved_tokens.values()),
            "prefixcache_loads": len(loads),
            "prefixcache_mean_load_ms": round(1000 * sum(loads) / len(loads), 3) if loads else 0.0,
            "prefixcache_errors": sum(t.errors.values()),
            "prefixcache_hook_failures": sum(t.hook_failures.values()),
            "prefixcache_bypassed": sum(t.bypassed.values()),
            "prefixcache_misses": sum(t.misses.values()),
        }

    def is_empty(self) -> bool:
        return self.tally().is_empty()


class PrefixCachePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter, histogram = self._counter_cls, self._histogram_cls
        self.hit_tokens = counter(
            name="prefixcache_vllm_hit_tokens",
            documentation="Prompt tokens whose KV prefixcache loaded into vLLM, by tenant and serving tier",
            labelnames=[*labelnames, "tenant", "tier"],
        )
        self.lost_tokens = counter(
            name="prefixcache_vllm_lost_tokens",
            documentation="Tokens the scheduler was promised but the worker could not load (vLLM recomputed them)",
            labelnames=[*labelnames, "tenant"],
        )
        self.saved_tokens = counter(
            name="prefixcache_vllm_saved_tokens",
            documentation="Prompt tokens newly stored in prefixcache from vLLM's KV",
            labelnames=[*labelnames, "tenant"],
        )
        self.errors = counter(
            name="prefixcache_vllm_errors",
            documentation="Loads or saves that raised (the request went on without them)",
            labelnames=[*labelnames, "op"],
        )
        self.hook_failures = counter(
            name="prefixcache_vllm_hook_failures",
            documentation="Connector hooks that raised, by hook and exception type (each answered as a miss)",
            labelnames=[*labelnames, "hook", "kind"],
        )
        self.bypassed = counter(
            name="prefixcache_vllm_bypassed_requests",
            documentation="Requests served without the cache, by reason (hook_failed: one of its hooks raised)",
            labelnames=[*labelnames, "reason"],
        )
        self.misses = counter(
            name="prefixcache_vllm_miss_reasons",
            documentation="Requests that hit less than the cache's chain held, or could not hit, by reason "
            "(shorter_than_a_block, window_not_kept, state_not_kept: docs/vllm.md, hybrid models)",
            labelnames=[*labelnames, "reason"],
        )
        self.load_seconds = histogram(
            name="prefixcache_vllm_load_seconds",
            documentation="Time to match, load and place one request's cached prefix",
            labelnames=labelnames,
            buckets=SECONDS,
        )
        self.save_seconds = histogram(
            name="prefixcache_vllm_save_seconds",
            documentation="Time to store one request's new blocks (their copy to host memory)",
            labelnames=labelnames,
            buckets=SECONDS,
        )
        self._tenants: set[str] = set()
        try:
            settings = parse_settings(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None))
            self._salted, self._default = read_secret(settings) is None, settings.default_tenant
        except ValueError:  # the engine refuses these settings at start, and says why
            self._salted, self._default = True, ""

    def _tenant(self, tenant: str) -> str:
        label = salt_label(tenant) if self._salted and tenant != self._default else tenant
        if label in self._tenants or len(self._tenants) < MAX_TENANTS:
            self._tenants.add(label)
            return label
        return "other"

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        t = Tally.from_dict(transfer_stats_data)
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for (tenant, tier), n in t.hit_tokens.items():
            self.hit_tokens.labels(*labels, self._tenant(tenant), tier).inc(n)
        for tenant, n in t.lost_tokens.items():
            self.lost_tokens.labels(*labels, self._tenant(tenant)).inc(n)
        for tenant, n in t.saved_tokens.items():
            self.saved_tokens.labels(*labels, self._tenant(tenant)).inc(n)
        for op, n in t.errors.items():
            self.errors.labels(*labels, op).inc(n)
        for (hook, kind), n in t.hook_failures.items():
            self.hook_failures.labels(*labels, hook, kind).inc(n)
        for reason, n in t.bypassed.items():
            self.bypassed.labels(*labels, reason).inc(n)
        for reason, n in t.misses.items():
            self.misses.labels(*labels, reason).inc(n)
        for seconds in t.load_seconds:
            self.load_seconds.labels(*labels).observe(seconds)
        for seconds in t.save_seconds:
            self.save_seconds.labels(*labels).observe(seconds)
