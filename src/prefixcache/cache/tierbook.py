"""One tier as the ledger sees it: its store, its policy, its room, and its counters.

Every tier counter (hits, misses, errors, promotions, demotions, evictions, removals,
dropped and failed writes, load latency) changes here and nowhere else, by the methods
below, each called under the cache's lock by the step that commits the event it
counts: an outcome a byte mover reports is counted when its commit runs, never by the
thread that moved the bytes. Room (``used``) is not a counter but the ledger's
reservation, changed by the decisions that reserve and give it back.
"""

from __future__ import annotations

from collections import Counter

from prefixcache.cache.stats import LatencyHistogram, TierStats
from prefixcache.config import TierConfig
from prefixcache.events import RemovalReason
from prefixcache.policies import EvictionPolicy
from prefixcache.storage.base import TierStore
from prefixcache.storage.transfer import Outcome

__all__ = ["TierBook"]

# The error kinds a failed write is counted under by the cache, for the outcomes no store
# counts: a store that fails a write counts its cause itself (io, timeout, connection...).
_CACHE_ERRORS = {Outcome.FULL: "full", Outcome.NO_FRAME: "source"}


class TierBook:
    """One tier as the ledger sees it: its store, its policy, its room and its counters."""

    def __init__(self, index: int, config: TierConfig, store: TierStore, policy: EvictionPolicy, frames: int) -> None:
        self.index = index
        self.bit = 1 << index
        self.name = config.label
        self.config = config
        self.store = store
        self.policy = policy
        self.capacity = frames  # room, in frames of a full block
        self.used = 0  # frames held, queued or reserved
        self.sync = store.sync  # its writes are memory copies, done by the deciding thread
        self.orphans: set[bytes] = set()  # frames held that no block owns (found on open)
        self.hits = 0
        self.misses = 0
        self.promotions = 0
        self.demotions = 0
        self.evictions = 0
        self.removals: Counter[RemovalReason] = Counter()
        self.errors: Counter[str] = Counter()
        self.writes_dropped = 0
        self.writes_failed = 0
        self.latency = LatencyHistogram()

    @property
    def free(self) -> int:
        return max(self.capacity - self.used, 0)

    @property
    def probes(self) -> bool:
        """Whether a request should ask this store for keys the tree does not know."""
        return self.config.kind == "redis" or bool(self.orphans)

    def snapshot(self, pending: int) -> TierStats:
        store = self.store
        errors = Counter(self.errors)
        errors.update(store.stats.errors)
        return TierStats(
            name=self.name,
            kind=self.config.kind,
            level=self.config.level,
            write=self.config.write,
            capacity_bytes=store.capacity_bytes,
            used_bytes=store.used_bytes,
            blocks=len(store),
            hits=self.hits,
            misses=self.misses,
            bytes_read=store.stats.bytes_read,
            bytes_written=store.stats.bytes_written,
            promotions=self.promotions,
            demotions=self.demotions,
            evictions=self.evictions,
            removals=dict(self.removals),
            errors=dict(errors),
            load_seconds=self.latency.snapshot(),
            writes_pending=pending,
            writes_dropped=self.writes_dropped,
            writes_failed=self.writes_failed,
        )

    # ------------------------------------------------------------------ counting (under the lock)

    def count_hit(self) -> None:
        self.hits += 1

    def count_miss(self, failure: str | None) -> None:
        """A block this tier should have given back and did not (absent, or bad bytes)."""
        self.misses += 1
        self.errors[failure or "missing"] += 1

    def count_seconds(self, seconds: float) -> None:
        self.latency.observe(seconds)

    def count_promotion(self) -> None:
        self.promotions += 1

    def count_demotion(self) -> None:
        self.demotions += 1

    def count_eviction(self) -> None:
        self.evictions += 1

    def count_removal(self, reason: RemovalReason) -> None:
        """A block held here left the cache for ``reason``."""
        self.removals[reason] += 1

    def count_dropped(self) -> None:
        """A write into this tier was decided but not queued (no room in the queue)."""
        self.writes_dropped += 1

    def count_failed_write(self, outcome: Outcome) -> None:
        """One failed write into this tier: one more in ``writes_failed``, and one error
        under one kind. NOTE: counting ``"write"`` here on top of the store's own kind made
        one failed disk write two errors (``io`` and ``write``)."""
        self.writes_failed += 1
        kind = _CACHE_ERRORS.get(outcome)
        if kind is not None:
            self.errors[kind] += 1
