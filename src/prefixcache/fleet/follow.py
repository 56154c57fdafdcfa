"""Following one backend's event stream without ever trusting a gap.

A publisher numbers its batches 1, 2, ... within an incarnation. The follower applies
a batch only when it is the next one; otherwise:

* an older or repeated batch is ignored (a replay overlaps what was applied);
* a newer one means batches were missed: ``GAP``. The reader replays from the stream
  after the last batch applied (``replay``); when the stream no longer holds the next
  batch (older than the buffer, or never sent while Redis was down) it loads a
  snapshot of the backend's whole index;
* another incarnation (the backend restarted) or an index that cannot place an event
  (``IndexGap``) also takes a snapshot.

Transport-free: ``streams.py`` feeds it from Redis, tests feed it directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

from prefixcache.fleet.index import GlobalIndex, IndexGap
from prefixcache.fleet.keys import TokenRangeError
from prefixcache.fleet.wire import Entry, Snapshot

__all__ = ["Follower", "FollowerStats", "Verdict"]

log = logging.getLogger("prefixcache.route")


class Verdict(StrEnum):
    APPLIED = "applied"
    OLD = "old"  # already applied (a replay's overlap)
    GAP = "gap"  # batches are missing before this one: replay, else snapshot
    RESYNC = "resync"  # another incarnation, or an unplaceable event: snapshot


@dataclass(slots=True)
class FollowerStats:
    applied: int = 0
    gaps: int = 0
    replays: int = 0  # gaps closed from the stream
    snapshots: int = 0  # gaps closed by a snapshot
    resyncs: int = 0  # incarnation changes and unplaceable events


class Follower:
    """The position of one backend in its stream, and the index it feeds."""

    def __init__(self, backend: str, index: GlobalIndex, model: str) -> None:
        self.backend, self.index, self.model = backend, index, model
        self.inc: str | None = None
        self.seq = 0
        self.stats = FollowerStats()

    @property
    def synced(self) -> bool:
        return self.inc is not None

    def offer(self, entry: Entry) -> Verdict:
        """Apply ``entry`` if it is the next batch; say what to do otherwise."""
        if entry.inc != self.inc:
            self.stats.resyncs += 1
            return Verdict.RESYNC
        if entry.seq <= self.seq:
            return Verdict.OLD
        if entry.seq != self.seq + 1:
            self.stats.gaps += 1
            return Verdict.GAP
        try:
            for event in entry.batch.events:
                self.index.apply(self.backend, event, self.model)
        except (IndexGap, TokenRangeError) as exc:  # a store the index cannot place or key
            log.warning("event=route_index_gap backend=%s detail=%s", self.backend, exc or type(exc).__name__)
            self.stats.resyncs += 1
            self.inc = None  # the index of this backend is unreliable until a snapshot
            return Verdict.RESYNC
        self.seq = entry.seq
        self.stats.applied += 1
        return Verdict.APPLIED

    def load(self, snapshot: Snapshot) -> None:
        """Replace the backend's index with ``snapshot``; follow on from its seq."""
        self.index.clear(self.backend)
        try:
            for event in snapshot.events:
                self.index.apply(self.backend, event, self.model)
        except (IndexGap, TokenRangeError) as exc:  # a snapshot is parents-first and in range: the backend's bug
            self.index.clear(self.backend)
            self.inc = None
            raise IndexGap(f"{self.backend}: bad snapshot: {exc}") from None
        self.inc, self.seq = snapshot.inc, snapshot.seq
        self.stats.snapshots += 1

    def forget(self) -> None:
        """The backend left: drop its blocks; a later return starts from a snapshot."""
        self.index.clear(self.backend)
        self.inc, self.seq = None, 0
