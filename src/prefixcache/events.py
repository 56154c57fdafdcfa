"""Typed cache events, drained with ``PrefixCache.take_events()``.

The way vLLM publishes KV events: a router learns which blocks a node holds, the
metrics learn why blocks left, without either reaching into the cache's internals.
The buffer is bounded; when a consumer falls behind, the oldest events are dropped
and counted (``stats().events_dropped``), so a forgotten consumer never grows
memory without bound.

Two views of the same blocks: ``BlocksStored`` / ``BlocksRemoved`` say when a block
joins or leaves the cache (the tree); ``TierEntered`` / ``TierLeft`` say when it gains
or loses a copy of a tier kind (a cache with tiers only). A router wants the second
(where the KV is, and how fast it loads); the metrics count the first.
"""

from __future__ import annotations

import sys
from array import array
from collections import deque
from dataclasses import dataclass
from enum import StrEnum


class RemovalReason(StrEnum):
    """Why a block left the cache (or a tier); ``label`` is how metrics name it."""

    EVICTED = "evicted"  # capacity pressure, chosen by the pool's (or the last tier's) policy
    STALE = "stale"  # its model or adapter epoch was bumped
    EXPIRED = "expired"  # its TTL ran out
    PURGED = "purged"  # an operator purged its tenant or prefix
    REPLACED = "replaced"  # a partial tail block superseded by a longer block
    LOST = "lost"  # a tier lost its bytes or returned bad ones (with what hung below it)

    @property
    def label(self) -> str:
        """The ``reason`` label of ``prefixcache_evictions_total`` and ``prefixcache_tier_evictions_total``."""
        return _LABELS[self]


_LABELS = {
    RemovalReason.EVICTED: "capacity",
    RemovalReason.STALE: "stale",
    RemovalReason.EXPIRED: "ttl",
    RemovalReason.PURGED: "purge",
    RemovalReason.REPLACED: "replaced",
    RemovalReason.LOST: "lost",
}


def token_ids(data: bytes) -> list[int]:
    """Token ids from their little-endian uint32 bytes (``hashing.token_bytes``)."""
    ids = array("I", data)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        ids.byteswap()
    return ids.tolist()


@dataclass(frozen=True, slots=True)
class BlocksStored:
    keys: tuple[bytes, ...]  # root-most first
    parent: bytes | None  # key of the block they hang under; None under a context root
    num_tokens: int
    tenant: str
    model: str
    pool: str
    public: bool
    tokens: bytes = b""  # the blocks' tokens, concatenated, as little-endian uint32 (``token_ids``)

    @property
    def token_ids(self) -> list[int]:
        return token_ids(self.tokens)


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    keys: tuple[bytes, ...]
    num_tokens: int
    reason: RemovalReason
    pool: str


@dataclass(frozen=True, slots=True)
class EpochBumped:
    model: str
    adapter: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class PrefixPublished:
    keys: tuple[bytes, ...]  # the public blocks created, root-most first
    num_tokens: int
    model: str
    tenants: int  # distinct tenants seen when it crossed the threshold (0 = declared by an operator)


@dataclass(frozen=True, slots=True)
class TierEntered:
    """A block gained a copy in a tier of ``kind`` (it had none of that kind): its bytes
    landed there (a queued write is announced when it lands). Self-contained, so
    that a consumer never reads the cache back: ``namespace`` is the tenancy namespace
    (``""`` public, or every block in shared isolation), ``tokens`` little-endian uint32."""

    key: bytes
    parent: bytes | None  # None under a context root
    tokens: bytes
    namespace: str
    model: str
    adapter: str | None
    kind: str  # the tier kind: device, memory, disk or redis
    end: int  # the token offset its tokens end at (a parent's is smaller than its children's)

    @property
    def token_ids(self) -> list[int]:
        return token_ids(self.tokens)


@dataclass(frozen=True, slots=True)
class TierLeft:
    """A block lost its last copy in the tiers of ``kind``."""

    key: bytes
    num_tokens: int
    kind: str


Event = BlocksStored | BlocksRemoved | EpochBumped | PrefixPublished | TierEntered | TierLeft


@dataclass(frozen=True, slots=True)
class Drained:
    """``PrefixCache.drain``: the events since the last drain, how many the log has
    dropped since the cache opened (a consumer that sees it grow knows it missed some),
    and, when asked, every block's tier residency after those events, parents first, and
    the keys of the frames the tiers hold that no block owns (found on open: a disk's
    from before a restart) by tier kind."""

    events: list[Event]
    dropped: int
    resident: list[TierEntered] | None = None
    orphans: dict[str, frozenset[bytes]] | None = None


class EventLog:
    """A bounded FIFO of events; capacity 0 records nothing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.dropped = 0
        self._events: deque[Event] = deque()

    def record(self, event: Event) -> None:
        if self.capacity == 0:
            return
        if len(self._events) >= self.capacity:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)

    def take(self) -> list[Event]:
        events = list(self._events)
        self._events.clear()
        return events
