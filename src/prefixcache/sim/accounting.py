"""Per-request accounting of a replay: what every mode and engine counts the same way.

One owner for the counting rules (the warm-up is not counted, tenants and time windows
are tallied from the same numbers, evictions become per-window deltas), so that tree
and flat results, native and python ones, can be compared field for field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.sim.costmodel import CostAccumulator
from prefixcache.sim.results import ReplayResult, TenantResult, TimePoint
from prefixcache.sim.summary import TraceSummary
from prefixcache.sim.traces import Request

TIMELINE_WINDOWS = 48


@dataclass
class RequestCounter:
    """Counts the requests after the warm-up, overall, per tenant and per time window."""

    result: ReplayResult
    summary: TraceSummary
    warmup: int
    cost: CostAccumulator | None
    seen: int = 0
    _window: TimePoint | None = field(default=None, init=False)
    _index: int = field(default=0, init=False)
    _start: float | None = field(default=None, init=False)
    _width: float = field(default=0.0, init=False)

    def counts(self) -> bool:
        """Advance to the next request; whether it is counted."""
        self.seen += 1
        return self.seen > self.warmup

    def add(self, req: Request, hit: int, blocks: int, evictions: int) -> None:
        res = self.result
        res.requests += 1
        res.lookup_tokens += req.input_length
        res.hit_tokens += hit
        res.hit_requests += hit > 0
        res.blocks_looked_up += blocks
        tenant = res.tenants.get(req.tenant)
        if tenant is None:
            tenant = res.tenants[req.tenant] = TenantResult()
        tenant.requests += 1
        tenant.lookup_tokens += req.input_length
        tenant.hit_tokens += hit
        tenant.hit_requests += hit > 0
        if self.cost is not None:
            self.cost.add(req.input_length, hit)
        self._timeline(req, hit, evictions)

    def _timeline(self, req: Request, hit: int, evictions: int) -> None:
        """Windows of equal trace time over the counted requests; each starts with the
        eviction count so far, turned into a delta by ``finish``."""
        if self._start is None:
            self._start = req.timestamp
            self._width = max(self.summary.last_timestamp - req.timestamp, 0.0) / TIMELINE_WINDOWS
        index = min(int((req.timestamp - self._start) / self._width), TIMELINE_WINDOWS - 1) if self._width else 0
        window = self._window
        if window is None or index != self._index:
            start = self._start + index * self._width
            window = self._window = TimePoint(start, start + self._width, 0, 0, 0, evictions)
            self._index = index
            self.result.timeline.append(window)
        window.requests += 1
        window.lookup_tokens += req.input_length
        window.hit_tokens += hit

    def finish(self, evictions: int) -> None:
        """Turn each window's eviction baseline into the evictions within it."""
        points = self.result.timeline
        for i, point in enumerate(points):
            end = points[i + 1].evictions if i + 1 < len(points) else evictions
            point.evictions = end - point.evictions
        if self.cost is not None:
            self.cost.apply(self.result)
