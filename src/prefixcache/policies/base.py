"""The eviction policy interface.

A policy only orders blocks; it never owns bytes or knows about the tree. The cache
tells it what became resident (``insert``), what was hit (``access``) and what left
for a reason of its own (``remove``: purge, invalidation, TTL), and asks it for a
``victim`` when a pool is full.

NOTE: in a prefix tree not every resident block may leave: a pinned block is in use,
and a block with children would orphan them (invariant 4 of design.md). ``victim``
therefore takes an ``evictable`` predicate. An entry for which it is false is
*blocked*: the policy passes over it the way it passes over an entry that is still in
use (LRU and FIFO re-queue it at the tail, S3-FIFO moves it on to main or reinserts
it, SIEVE's hand moves past it, LFUDA moves it to the back of its priority bucket).
That keeps every ``victim`` call O(1) amortized instead of rescanning the same blocked
entries, and on a flat sequence where everything is evictable each policy behaves
exactly as its reference describes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from typing import ClassVar

Key = Hashable
Evictable = Callable[[Key], bool]


def always(_key: Key) -> bool:
    """The predicate of a flat cache, where every entry may leave."""
    return True


class EvictionPolicy(ABC):
    """Orders the resident entries of one pool and picks the next one to leave.

    ``capacity`` is the pool's size in the same units as the ``size`` of entries
    (tokens in the cache, 1 per object in a flat test); only policies that size
    internal queues (S3-FIFO) use it.
    """

    name: ClassVar[str]
    tracks_leaves: ClassVar[bool] = False
    """Whether ``set_leaf`` means anything to this policy (the cache skips the calls
    otherwise)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"policy capacity must be >= 0, got {capacity}")
        self.capacity = capacity

    def resize(self, capacity: int) -> None:
        """The pool's capacity changed (a partitioned quota was rebalanced)."""
        if capacity < 0:
            raise ValueError(f"policy capacity must be >= 0, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key, size: int = 1) -> None:
        """A new resident entry. Inserting a key already present is a ``KeyError``."""

    @abstractmethod
    def access(self, key: Key) -> None:
        """A hit on a resident entry. An unknown key is a ``KeyError``."""

    def access_many(self, keys: Iterable[Key]) -> None:
        """Hits on several entries, in the given order (the cache passes a matched
        chain deepest block first, so that ancestors end up the more recent)."""
        for key in keys:
            self.access(key)

    def set_leaf(self, key: Key, leaf: bool) -> None:
        """The cache's news about a resident entry: it lost its last child (``leaf``) or
        gained its first. A policy that ranks only the entries that may leave (leaves)
        keeps the others out of its candidates; the rest ignore it (the default)."""
        return None

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Forget an entry that left for a reason other than eviction (no ghost).
        An unknown key is a ``KeyError``."""

    @abstractmethod
    def victim(self, evictable: Evictable = always) -> Key | None:
        """Choose the next entry to evict among those ``evictable`` accepts, forget it
        (recording it in a ghost queue where the policy keeps one) and return it;
        ``None`` when no resident entry is evictable. Terminates in a bounded number
        of steps even when every entry is blocked."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...
