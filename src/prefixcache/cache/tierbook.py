"""One tier as the ledger sees it: its store, its policy, its room, and its counters
(``counts``, which change only in ``stats.py``). Room (``used``) is not a counter but
the ledger's reservation, changed by the decisions that reserve and give it back.
"""

from __future__ import annotations

from collections import Counter

from prefixcache.cache.stats import TierCounters, TierStats
from prefixcache.config import TierConfig
from prefixcache.policies import EvictionPolicy
from prefixcache.storage.base import TierStore
from prefixcache.storage.transfer import Outcome

__all__ = ["TierBook"]

# The error kinds a failed write is counted under by the cache, for the outcomes no store
# counts: a store that fails a write counts its cause itself (io, timeout, connection...).
_CACHE_ERRORS = {Outcome.FULL: "full", Outcome.NO_FRAME: "source", Outcome.UNENCODABLE: "codec"}


class TierBook:
    """One tier as the ledger sees it: its store, its policy, its room and its counters."""

    def __init__(
        self, index: int, config: TierConfig, store: TierStore, policy: EvictionPolicy, frames: int, frame_bytes: int
    ) -> None:
        self.index = index
        self.bit = 1 << index
        self.name = config.label
        self.config = config
        self.store = store
        self.policy = policy
        self.capacity = frames  # room, in frames of a full block
        self.frame_bytes = frame_bytes  # what one such frame takes of the store's ``used_bytes``
        self.used = 0  # frames held, queued or reserved
        self.sync = store.sync  # its writes are memory copies, done by the deciding thread
        self.orphans: set[bytes] = set()  # frames held that no block owns (found on open)
        self.counts = TierCounters()  # NOTE: changed only by its own methods (``stats.py``)

    @property
    def free(self) -> int:
        return max(self.capacity - self.used, 0)

    @property
    def probes(self) -> bool:
        """Whether a request should ask this store for keys the tree does not know: a
        shared store (Redis, an S3 bucket: other servers write there), or one that held
        blocks when it was opened (a disk after a restart)."""
        return self.config.kind in ("redis", "s3") or bool(self.orphans)

    def snapshot(self, pending: int) -> TierStats:
        store, c = self.store, self.counts
        errors = Counter(c.errors)
        errors.update(store.stats.errors)
        return TierStats(
            name=self.name,
            kind=self.config.kind,
            level=self.config.level,
            write=self.config.write,
            capacity_bytes=store.capacity_bytes,
            used_bytes=store.used_bytes,
            frame_bytes=self.frame_bytes,
            blocks=len(store),
            hits=c.hits,
            misses=c.misses,
            bytes_read=store.stats.bytes_read,
            bytes_written=store.stats.bytes_written,
            promotions=c.promotions,
            demotions=c.demotions,
            evictions=c.evictions,
            removals=dict(c.removals),
            errors=dict(errors),
            load_seconds=c.latency.snapshot(),
            writes_pending=pending,
            writes_dropped=c.writes_dropped,
            writes_failed=c.writes_failed,
        )

    def failed_write(self, outcome: Outcome) -> None:
        """One failed write into this tier, counted under the kind the cache knows (the
        store counts the others' causes itself)."""
        self.counts.failed_write(_CACHE_ERRORS.get(outcome))
