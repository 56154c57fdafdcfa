"""A circuit breaker for a network tier: a dead or stalled server becomes immediate misses.

A tier that times out on every call would make each request pay a read timeout; the
breaker stops touching the network after a few consecutive failures and tries again,
once, after a backoff that doubles while the server stays away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Literal

__all__ = ["BreakerState", "CircuitBreaker"]

BreakerState = Literal["closed", "open", "half_open"]

log = logging.getLogger("prefixcache.tiers")


class CircuitBreaker:
    """Closed -> open after ``failure_threshold`` consecutive failures; open -> half-open after a backoff.

    While open, ``allow()`` says no without touching the network. When the backoff has
    passed, one trial call is allowed (half-open): success closes the breaker and resets
    the backoff to ``reset_after``; failure reopens it with the backoff doubled, up to
    ``max_backoff``. The clock is injected so tests (and the simulator) drive it.

    NOTE: a trial that never reports (its caller died) does not wedge the breaker: the
    half-open state restarts the backoff timer, so another trial is allowed after it.
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        reset_after: float = 1.0,
        max_backoff: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "redis",
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not 0 < reset_after <= max_backoff:
            raise ValueError(f"need 0 < reset_after <= max_backoff, got {reset_after} and {max_backoff}")
        self.failure_threshold = failure_threshold
        self.reset_after = reset_after
        self.max_backoff = max_backoff
        self.name = name  # what its log lines call the tier (an address without credentials)
        self._clock = clock
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._failures = 0
        self._backoff = reset_after
        self._since = 0.0  # when the breaker last opened (or half-opened)

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def backoff(self) -> float:
        """Seconds an open breaker waits before its next trial."""
        return self._backoff

    def allow(self) -> bool:
        """Whether a call may go to the network now (a ``True`` in the open state is the trial)."""
        with self._lock:
            if self._state == "closed":
                return True
            now = self._clock()
            if now - self._since < self._backoff:
                return False
            self._state, self._since = "half_open", now
            return True

    def record_success(self) -> None:
        with self._lock:
            was = self._state
            self._state, self._failures, self._backoff = "closed", 0, self.reset_after
        if was != "closed":
            log.warning("event=tier_breaker_closed tier=%s state=closed (reachable again)", self.name)

    def record_failure(self) -> None:
        with self._lock:
            if self._state == "closed":
                self._failures += 1
                opened = self._failures >= self.failure_threshold
                if opened:
                    self._state, self._since = "open", self._clock()
                failures, backoff = self._failures, self._backoff
            else:
                # a failed trial (or a late failure of a call made before the breaker opened)
                if self._state == "half_open":
                    self._backoff = min(self._backoff * 2, self.max_backoff)
                self._state, self._since = "open", self._clock()
                opened, failures, backoff = False, self._failures, self._backoff
        if opened:
            log.warning(
                "event=tier_breaker_open tier=%s state=open failures=%d next_trial_s=%.1f "
                "(its reads are misses and its writes are dropped until it answers)",
                self.name,
                failures,
                backoff,
            )
