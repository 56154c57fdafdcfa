"""What ``prefixcache diagnose`` reports (``Finding``) and when a figure needs action
(``Thresholds``): apart from the checks, so that a check may live in a module of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.ops.retention import AT_CAP

__all__ = ["SEVERITY_ORDER", "Finding", "Thresholds"]

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class Thresholds:
    """When a figure needs action (defaults: those of ops/alerts.yml where it has one)."""

    evictions_per_s: dict[str, float] = field(default_factory=lambda: {"L0": 5000.0, "L1": 100.0})
    full: float = 0.90  # occupancy at which a tier counts as full
    churn: float = 0.5  # evictions per block asked of a tier, when there is no interval for a rate
    error_ratio: float = 0.01
    slow_load_seconds: float = 0.05  # p95 load time of an L2 tier
    storm_miss_ratio: float = 0.90
    bumps_per_minute: float = 1.0
    crowding_share: float = 0.60  # one tenant's share of the computed tokens
    low_hit_rate: float = 0.20
    min_lookup_tokens: float = 1000  # below this the hit rate says nothing
    retain_at_cap: float = AT_CAP  # the share of its retention cap at which a tenant is at it


@dataclass(frozen=True)
class Finding:
    severity: str  # critical | warning | info
    problem: str
    evidence: str
    action: str

    @property
    def needs_action(self) -> bool:
        return self.severity != "info"
