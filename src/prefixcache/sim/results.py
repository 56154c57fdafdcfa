"""What one replay runs and what it measured: the configuration (a ``CacheConfig`` and a
mode) and its result, the boundary between the replay, the cost model and the reports."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from prefixcache.config import CacheConfig, PublishConfig
from prefixcache.sim.retention import RETENTION_OFF, RetentionCounts, RetentionSpec

UNLIMITED = sys.maxsize
"""``capacity_tokens`` of a cache without a limit: more than any trace can fill. Labels
show it as ``inf``, JSON as ``null`` with ``unlimited: true``."""

_NO_PUBLISH = PublishConfig()  # JSON's publish_min_tokens when publication is off: the default


def cache_capacity(tokens: float) -> int:
    """A capacity in tokens as ``CacheConfig`` takes it: ``math.inf`` becomes ``UNLIMITED``."""
    return UNLIMITED if math.isinf(tokens) else int(tokens)


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One configuration of a replay: the cache as a server would be configured, and how
    the simulator drives it. ``mode`` is ``"tree"`` (the real ``PrefixCache``, or its
    compiled twin) or ``"flat"`` (block ids as independent objects in a bare policy). The
    cache's ``ttl_seconds`` count trace time.

    NOTE: ``cache`` is the one source of truth; the properties below only read it, for
    the code that compares configurations. What a pre-hashed trace changes (its own
    block size, capacity in native blocks) is derived from it when the replay starts
    (``summary.effective_configs``, ``engines.engine_config``).

    ``codec`` names the frames a byte capacity was counted in (``replay --codec``), and
    ``stored_bytes`` that capacity: the cache's capacity in tokens is already what those
    bytes hold, so the replay itself never reads them; labels and JSON show them.
    ``None``: no codec was asked for.

    ``retention`` says how long each prompt is retained after its access (``replay
    --retention``; ``sim/retention.py``), within the caps of ``cache.retention``; only
    the ``PrefixCache`` models it, so such a configuration runs the Python engine."""

    cache: CacheConfig
    mode: str = "tree"
    codec: str | None = None
    stored_bytes: float | None = None  # with a codec: the byte budget (math.inf: unlimited)
    retention: RetentionSpec = RETENTION_OFF

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise ValueError(f"cache must be a CacheConfig, got {type(self.cache).__name__}")
        if self.cache.tiers or self.cache.capacity_bytes is not None:
            raise ValueError("a replay moves no KV bytes: give capacity_tokens, not tiers or capacity_bytes")
        if not isinstance(self.retention, RetentionSpec):
            raise ValueError(f"retention must be a RetentionSpec, got {type(self.retention).__name__}")
        if self.retention.on and self.mode != "tree":
            raise ValueError("retention needs tree mode: flat mode has no clock and no tenants' caps")

    @property
    def policy(self) -> str:
        return self.cache.policy

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def isolation(self) -> str:
        return self.cache.isolation

    @property
    def unlimited(self) -> bool:
        return self.cache.capacity_tokens == UNLIMITED

    @property
    def capacity_tokens(self) -> float:
        """The capacity in tokens, ``math.inf`` when unlimited (what reports sort and plot)."""
        return math.inf if self.unlimited else float(self.cache.capacity)

    @property
    def label(self) -> str:
        cap = "inf" if self.unlimited else f"{self.capacity_tokens:.3g}"
        publish = self.cache.publish
        promo = f" publish>={publish.min_tenants}" if publish is not None else ""
        codec = f" codec={self.codec}" if self.codec is not None else ""
        retain = f" retain={self.retention.label}@{self.cache.retention.share:g}" if self.retention.on else ""
        return f"{self.policy} cap={cap} bs={self.block_size} {self.isolation}{promo} {self.mode}{codec}{retain}"

    def to_json(self) -> dict[str, Any]:
        """The configuration as flat JSON fields (an unlimited capacity is ``null`` with
        ``unlimited: true``)."""
        cache, publish = self.cache, self.cache.publish
        codec = {}
        if self.codec is not None:
            stored = self.stored_bytes
            codec = {
                "codec": self.codec,
                "capacity_stored_bytes": None if stored is None or math.isinf(stored) else stored,
            }
        return {
            "policy": cache.policy,
            "capacity_tokens": None if self.unlimited else cache.capacity,
            "block_size": cache.block_size,
            "isolation": cache.isolation,
            "partial_blocks": cache.partial_blocks,
            "mode": self.mode,
            "ttl_seconds": cache.ttl_seconds,
            "publish_min_tenants": None if publish is None else publish.min_tenants,
            "publish_min_tokens": (publish or _NO_PUBLISH).min_tokens,
            "unlimited": self.unlimited,
            "retention": self.retention.label,
            "retention_share": cache.retention.share if self.retention.on else None,
            **codec,
        }


COVERAGE = {
    "counted": "requests after the warm-up: requests, lookup_tokens, hit_tokens, hit rates, optimal, "
    "blocks_looked_up, block_hit_rate, seconds, prefill_*, gpu_hours_saved, prompts_over_context, per_tenant, "
    "timeline",
    "whole_replay": "evictions (the warm-up's too: it fills the cache)",
    "retention": "the whole replay (the warm-up's retain calls too): calls, capped, refused, asked_tokens, "
    "retained_tokens",
    "seconds": "time in this configuration's own replay steps of the counted requests; reading the trace and "
    "the warm-up excluded",
}
"""What the fields of a result cover, for the JSON report (``report.to_json``)."""


@dataclass(slots=True)
class TenantResult:
    requests: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass(slots=True)
class TimePoint:
    """Counters over one window of the (counted part of the) trace."""

    t_start: float  # trace time, seconds
    t_end: float
    requests: int
    lookup_tokens: int
    hit_tokens: int
    evictions: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass(slots=True)
class ReplayResult:
    """The measured outcome of one configuration. Only requests after the warm-up are
    counted: the rates, tokens, ``blocks_looked_up``, ``seconds``, the cost, tenants and
    timeline all cover the same requests (``COVERAGE``); evictions count over the whole
    replay."""

    config: ReplayConfig
    trace: str
    requests: int = 0  # counted (after warm-up)
    warmup_requests: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    evictions: int = 0
    blocks_looked_up: int = 0
    block_hits: int | None = None  # flat mode: block lookups that hit, prefix or not (libCacheSim's view)
    optimal_hit_tokens: int | None = None  # Belady with bypass, same capacity; None if not computed
    seconds: float = 0.0  # this configuration's own replay of the counted requests (trace reading excluded)
    engine: str = "python"  # tree mode: "native" (the compiled kernel) or "python" (the PrefixCache)
    tenants: dict[str, TenantResult] = field(default_factory=dict)
    timeline: list[TimePoint] = field(default_factory=list)
    retention: RetentionCounts | None = None  # with retention on: what its retain calls got (whole replay)
    # Filled by the cost model (sim/costmodel.py) when a profile is given.
    prefill_flops_total: float | None = None
    prefill_flops_saved: float | None = None
    gpu_hours_saved: float | None = None
    cost_profile: str | None = None
    cost_defaults: tuple[str, ...] = ()  # the profile's parts nobody chose ("model", "gpu", "utilization")
    context_length: int | None = None  # the profile's context
    prompts_over_context: int | None = None  # counted prompts longer than it (costed all the same)
    kv_bytes_per_token: int | None = None  # the profile's KV layout, when it has one

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        """Share of counted requests that reused at least one cached token."""
        return self.hit_requests / self.requests if self.requests else 0.0

    @property
    def block_hit_rate(self) -> float | None:
        """Flat mode: the share of block lookups that hit (1 - libCacheSim's miss ratio)."""
        if self.block_hits is None or not self.blocks_looked_up:
            return None
        return self.block_hits / self.blocks_looked_up

    @property
    def optimal_token_hit_rate(self) -> float | None:
        if self.optimal_hit_tokens is None:
            return None
        return self.optimal_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def prefill_compute_avoided(self) -> float | None:
        if self.prefill_flops_saved is None or not self.prefill_flops_total:
            return None
        return self.prefill_flops_saved / self.prefill_flops_total

    @property
    def prompts_over_context_share(self) -> float | None:
        if self.prompts_over_context is None:
            return None
        return self.prompts_over_context / self.requests if self.requests else 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (an unlimited capacity is ``null`` with ``unlimited: true``)."""
        bpt = self.kv_bytes_per_token
        return {
            **self.config.to_json(),
            "trace": self.trace,
            "requests": self.requests,
            "warmup_requests": self.warmup_requests,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": self.token_hit_rate,
            "request_hit_rate": self.request_hit_rate,
            "optimal_token_hit_rate": self.optimal_token_hit_rate,
            "evictions": self.evictions,
            "blocks_looked_up": self.blocks_looked_up,
            "block_hit_rate": self.block_hit_rate,
            "seconds": self.seconds,
            "engine": self.engine,
            "retention_counts": None if self.retention is None else asdict(self.retention),
            "prefill_flops_total": self.prefill_flops_total,
            "prefill_flops_saved": self.prefill_flops_saved,
            "prefill_compute_avoided": self.prefill_compute_avoided,
            "gpu_hours_saved": self.gpu_hours_saved,
            "cost_profile": self.cost_profile,
            "cost_defaults": list(self.cost_defaults),
            "context_length": self.context_length,
            "prompts_over_context": self.prompts_over_context,
            "prompts_over_context_share": self.prompts_over_context_share,
            "kv_bytes_per_token": bpt,
            "capacity_kv_bytes": None if bpt is None or self.config.unlimited else bpt * self.config.cache.capacity,
            "per_tenant": {
                name: {**asdict(t), "token_hit_rate": t.token_hit_rate} for name, t in sorted(self.tenants.items())
            },
            "timeline": [{**asdict(p), "token_hit_rate": p.token_hit_rate} for p in self.timeline],
        }
