"""LFUDA: LFU with dynamic aging. A block's priority is its frequency plus the cache's
age ``L``, and ``L`` becomes the priority of each victim; the lowest priority leaves
first, the least recent among equals.

Plain LFU (retired, see ``policies.RETIRED``) never forgets: a block hot once keeps
its count forever and the cache fills with yesterday's favourites. Here a new or hit
block starts from the current ``L``, which rises with every eviction, so old counts
fade relative to what is being used now (Arlitt et al., "Evaluating content management
techniques for Web proxy caches", 2000; libCacheSim's ``LFUDA.c``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import ClassVar

from prefixcache.policies.base import Evictable, EvictionPolicy, Key, always


class LFUDAPolicy(EvictionPolicy):
    """O(1) LFUDA with one ``OrderedDict`` bucket per priority.

    An entry starts at frequency 1 and priority ``L + 1``; a hit adds 1 to its
    frequency and moves it to the tail of bucket ``L + frequency``. The victim is the
    oldest entry of the lowest bucket, and its priority becomes ``L``. Frequencies are
    forgotten on eviction. Priorities are integers, so buckets are exact.
    """

    __slots__ = ("_age", "_buckets", "_entries", "_min")
    name: ClassVar[str] = "lfuda"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._age = 0  # L: the priority of the last victim
        self._entries: dict[Key, tuple[int, int]] = {}  # key -> (frequency, priority)
        # Only non-empty buckets are kept, so ``min(self._buckets)`` is exact.
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        self._min = 0  # the lowest non-empty priority; 0 means unknown (recomputed on demand)

    def insert(self, key: Key, size: int = 1) -> None:
        if key in self._entries:
            raise KeyError(key)
        self._place(key, 1, self._age + 1)

    def access(self, key: Key) -> None:
        self.access_many((key,))

    def access_many(self, keys: Iterable[Key]) -> None:
        entries = self._entries
        for key in keys:
            f, p = entries[key]
            self._unbucket(key, p)
            self._place(key, f + 1, self._age + f + 1)

    def _place(self, key: Key, f: int, p: int) -> None:
        self._entries[key] = (f, p)
        bucket = self._buckets.get(p)
        if bucket is None:
            bucket = self._buckets[p] = OrderedDict()
        bucket[key] = None
        if self._min and p < self._min:
            self._min = p

    def _unbucket(self, key: Key, p: int) -> None:
        bucket = self._buckets[p]
        del bucket[key]
        if not bucket:
            del self._buckets[p]
            if self._min == p:
                self._min = 0

    def remove(self, key: Key) -> None:
        _, p = self._entries.pop(key)
        self._unbucket(key, p)

    def victim(self, evictable: Evictable = always) -> Key | None:
        if not self._entries:
            return None
        if self._min == 0:
            self._min = min(self._buckets)
        key = self._first_evictable(self._min, evictable)
        if key is not None:
            return key
        # NOTE: slow path, only when every entry of the lowest bucket is blocked:
        # try the next buckets up. Blocked entries went to the back of their bucket,
        # so a later call tries the others first.
        for p in sorted(self._buckets):
            if p != self._min:
                key = self._first_evictable(p, evictable)
                if key is not None:
                    return key
        return None

    def _first_evictable(self, p: int, evictable: Evictable) -> Key | None:
        """Evict and return the oldest evictable entry of bucket ``p`` (its priority
        becomes ``L``), moving the blocked ones passed over to its back; ``None`` after
        one pass."""
        bucket = self._buckets[p]
        for _ in range(len(bucket)):
            key = next(iter(bucket))
            if evictable(key):
                del self._entries[key]
                self._unbucket(key, p)
                self._age = p
                return key
            bucket.move_to_end(key)
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
