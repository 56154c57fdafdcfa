"""What a fleet replay runs and measures: the fleet (``FleetSpec``) and, per routing, the
result of every backend and of the whole (``RoutingResult``).

Definitions the reports share:

- **token hit rate**: hit tokens over prompt tokens, per backend and over the fleet
  (the backends' hit tokens add up to the fleet's).
- **compute avoided**: the cost-weighted hit rate, prefill FLOPs saved over prefill
  FLOPs of all prompts, with the replay's cost model (``costmodel``).
- **load imbalance**: the busiest backend's prefill work over the mean backend's
  (GPU-seconds of prefill of the uncached tokens of the requests it served); 1.0 is
  an even spread, N means one backend of N did everything.
- **TTFT**: time to first token in the simulated fleet, queueing for the backend's
  prefill engine included (``routing.BackendQueue``).
- **stale routes**: requests routed on a cache view that disagreed with the chosen
  backend's real match (events not yet delivered); always 0 for the oracle.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from prefixcache.fleet.scoring import Routing, Scorer
from prefixcache.sim.results import ReplayConfig

DEFAULT_EVENT_LAG = 4
DEFAULT_DECODE_SECONDS = 0.02

POOLED = "pooled"  # the ceiling row: one cache of N x the capacity, no routing


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """N backends, each with the configuration's cache, and the routings to compare.

    ``event_lag``: the requests routed between a backend's KV event and the router seeing
    it. ``decode_seconds``: time per generated token on a backend (decode is batched, so
    it delays a request's completion, not other requests' prefill)."""

    backends: int
    routings: tuple[Routing, ...] = tuple(Routing)
    event_lag: int = DEFAULT_EVENT_LAG
    decode_seconds: float = DEFAULT_DECODE_SECONDS
    scorer: Scorer = field(default_factory=Scorer)
    oracle: bool = True  # also run each cache-reading routing with exact knowledge
    pooled: bool = True  # also replay one cache of backends x capacity (when backends > 1)

    def __post_init__(self) -> None:
        if isinstance(self.backends, bool) or not isinstance(self.backends, int) or self.backends < 1:
            raise ValueError(f"backends must be an integer >= 1, got {self.backends!r}")
        if not self.routings:
            raise ValueError("give at least one routing")
        for routing in self.routings:
            if not isinstance(routing, Routing):
                raise ValueError(f"unknown routing {routing!r}; valid: {', '.join(r.value for r in Routing)}")
        if isinstance(self.event_lag, bool) or not isinstance(self.event_lag, int) or self.event_lag < 0:
            raise ValueError(f"event_lag must be an integer >= 0 requests, got {self.event_lag!r}")
        if not (isinstance(self.decode_seconds, int | float) and math.isfinite(self.decode_seconds)):
            raise ValueError(f"decode_seconds must be a finite number, got {self.decode_seconds!r}")
        if self.decode_seconds < 0:
            raise ValueError(f"decode_seconds must be >= 0, got {self.decode_seconds!r}")


@dataclass(frozen=True, slots=True)
class BackendResult:
    """One backend's share of the counted requests."""

    name: str
    requests: int
    lookup_tokens: int
    hit_tokens: int
    prefill_seconds: float  # GPU-seconds of prefill of the uncached tokens
    evictions: int  # over the whole replay

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "token_hit_rate": self.token_hit_rate}


@dataclass(frozen=True, slots=True)
class RoutingResult:
    """One routing (or the pooled ceiling) over the fleet. ``view`` says what the router
    knew of the caches: ``events`` (KV events, ``event_lag`` requests late), ``oracle``
    (exact), ``none`` (it reads no cache) or ``pooled``."""

    routing: str
    view: str
    event_lag: int | None
    config: ReplayConfig  # each backend's cache (the pooled row: the one big cache)
    trace: str
    engine: str
    warmup_requests: int
    backends: tuple[BackendResult, ...]
    prefill_flops_total: float
    prefill_flops_saved: float
    cost_profile: str
    ttft_mean: float | None
    ttft_p99: float | None
    stale_routes: int | None  # None for the routers that read no cache
    seconds: float

    @property
    def label(self) -> str:
        if self.view == "events":
            return f"{self.routing} (events, lag {self.event_lag})"
        return f"{self.routing} (oracle)" if self.view == "oracle" else self.routing

    @property
    def requests(self) -> int:
        return sum(b.requests for b in self.backends)

    @property
    def lookup_tokens(self) -> int:
        return sum(b.lookup_tokens for b in self.backends)

    @property
    def hit_tokens(self) -> int:
        return sum(b.hit_tokens for b in self.backends)

    @property
    def token_hit_rate(self) -> float:
        lookup = self.lookup_tokens
        return self.hit_tokens / lookup if lookup else 0.0

    @property
    def compute_avoided(self) -> float | None:
        """The cost-weighted hit rate: prefill FLOPs saved over all prompts' prefill FLOPs."""
        return self.prefill_flops_saved / self.prefill_flops_total if self.prefill_flops_total else None

    @property
    def load_imbalance(self) -> float | None:
        """Max over mean of the backends' prefill seconds (None for the pooled row, or
        when no backend prefilled anything)."""
        if self.view == POOLED:
            return None
        work = [b.prefill_seconds for b in self.backends]
        mean = sum(work) / len(work)
        return max(work) / mean if mean > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "routing": self.routing,
            "view": self.view,
            "event_lag": self.event_lag,
            "label": self.label,
            **self.config.to_json(),
            "trace": self.trace,
            "engine": self.engine,
            "warmup_requests": self.warmup_requests,
            "requests": self.requests,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": self.token_hit_rate,
            "prefill_flops_total": self.prefill_flops_total,
            "prefill_flops_saved": self.prefill_flops_saved,
            "compute_avoided": self.compute_avoided,
            "cost_profile": self.cost_profile,
            "load_imbalance": self.load_imbalance,
            "load_imbalance_definition": "max / mean of per-backend prefill GPU-seconds",
            "ttft_mean_seconds": self.ttft_mean,
            "ttft_p99_seconds": self.ttft_p99,
            "stale_routes": self.stale_routes,
            "seconds": self.seconds,
            "per_backend": [b.to_json() for b in self.backends],
        }
