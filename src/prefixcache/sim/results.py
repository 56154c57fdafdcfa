"""What one replay of one configuration measured: the boundary between the replay,
the cost model and the reports."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One configuration of a replay. ``capacity_tokens`` may be ``math.inf``."""

    policy: str = "lru"
    capacity_tokens: float = math.inf
    block_size: int = 16
    isolation: str = "shared"
    partial_blocks: bool = False
    mode: str = "tree"  # "tree": the real PrefixCache; "flat": block ids as independent objects
    ttl_seconds: float | None = None  # tree mode: expire blocks unused this long, in trace time
    promote_min_tenants: int | None = None  # tree mode, namespace/partitioned: hot-prefix promotion
    promote_min_tokens: int = 256

    @property
    def label(self) -> str:
        cap = "inf" if math.isinf(self.capacity_tokens) else f"{self.capacity_tokens:.3g}"
        promo = f" promote>={self.promote_min_tenants}" if self.promote_min_tenants else ""
        return f"{self.policy} cap={cap} bs={self.block_size} {self.isolation}{promo} {self.mode}"


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
    counted in the rates; evictions count over the whole replay."""

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
    seconds: float = 0.0  # time spent in this configuration's own replay (reading the trace excluded)
    engine: str = "python"  # tree mode: "native" (the compiled kernel) or "python" (the PrefixCache)
    tenants: dict[str, TenantResult] = field(default_factory=dict)
    timeline: list[TimePoint] = field(default_factory=list)
    # Filled by the cost model (sim/costmodel.py) when a profile is given.
    prefill_flops_total: float | None = None
    prefill_flops_saved: float | None = None
    gpu_hours_saved: float | None = None
    cost_profile: str | None = None

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

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (an unlimited capacity is ``null`` with ``unlimited: true``)."""
        cfg = asdict(self.config)
        unlimited = math.isinf(self.config.capacity_tokens)
        cfg["capacity_tokens"] = None if unlimited else int(self.config.capacity_tokens)
        return {
            **cfg,
            "unlimited": unlimited,
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
            "prefill_flops_total": self.prefill_flops_total,
            "prefill_flops_saved": self.prefill_flops_saved,
            "prefill_compute_avoided": self.prefill_compute_avoided,
            "gpu_hours_saved": self.gpu_hours_saved,
            "cost_profile": self.cost_profile,
            "per_tenant": {
                name: {**asdict(t), "token_hit_rate": t.token_hit_rate} for name, t in sorted(self.tenants.items())
            },
            "timeline": [{**asdict(p), "token_hit_rate": p.token_hit_rate} for p in self.timeline],
        }
