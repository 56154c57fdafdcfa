"""Typed cache events, drained with ``PrefixCache.take_events()``.

The way vLLM publishes KV events: a router learns which blocks a node holds, the
metrics learn why blocks left, without either reaching into the cache's internals.
The buffer is bounded; when a consumer falls behind, the oldest events are dropped
and counted (``stats().events_dropped``), so a forgotten consumer never grows
memory without bound.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class BlocksStored:
    keys: tuple[bytes, ...]  # root-most first
    parent: bytes | None  # key of the block they hang under; None under a context root
    num_tokens: int
    tenant: str
    model: str
    pool: str
    public: bool


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


Event = BlocksStored | BlocksRemoved | EpochBumped | PrefixPublished


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
