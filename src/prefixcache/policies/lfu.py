"""LFU: the least frequently hit block leaves first, the least recent among equals."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import ClassVar

from prefixcache.policies.base import Evictable, EvictionPolicy, Key, always


class LFUPolicy(EvictionPolicy):
    """O(1) LFU with one ``OrderedDict`` bucket per frequency.

    An entry starts at frequency 1 and gains 1 per hit, moving to the tail of the
    next bucket; so within a bucket entries are ordered by their last access, and
    the victim is the oldest entry of the lowest bucket. This is libCacheSim's
    ``LFU.c`` (frequency nodes, FIFO among equals), without its per-object list.
    Frequencies are forgotten on eviction, as there.
    """

    __slots__ = ("_buckets", "_freq", "_min")
    name: ClassVar[str] = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._freq: dict[Key, int] = {}
        # Only non-empty buckets are kept, so ``min(self._buckets)`` is exact.
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        # The lowest non-empty frequency; 0 means unknown (recomputed on demand).
        self._min = 0

    def insert(self, key: Key, size: int = 1) -> None:
        if key in self._freq:
            raise KeyError(key)
        self._freq[key] = 1
        bucket = self._buckets.get(1)
        if bucket is None:
            bucket = self._buckets[1] = OrderedDict()
        bucket[key] = None
        self._min = 1

    def access(self, key: Key) -> None:
        self.access_many((key,))

    def access_many(self, keys: Iterable[Key]) -> None:
        freq = self._freq
        buckets = self._buckets
        for key in keys:
            f = freq[key]
            bucket = buckets[f]
            del bucket[key]
            if not bucket:
                del buckets[f]
                if self._min == f:
                    self._min = f + 1
            f += 1
            freq[key] = f
            up = buckets.get(f)
            if up is None:
                up = buckets[f] = OrderedDict()
            up[key] = None

    def remove(self, key: Key) -> None:
        self._forget(key, self._freq[key])

    def victim(self, evictable: Evictable = always) -> Key | None:
        if not self._freq:
            return None
        if self._min == 0:
            self._min = min(self._buckets)
        key = self._first_evictable(self._min, evictable)
        if key is not None:
            return key
        # NOTE: slow path, only when every entry of the lowest bucket is blocked:
        # try the next buckets up. Blocked entries went to the back of their bucket,
        # so a later call tries the others first; still, a bucket that is blocked
        # throughout is rescanned by every call, which is the price of keeping the
        # frequency order exact.
        for f in sorted(self._buckets):
            if f != self._min:
                key = self._first_evictable(f, evictable)
                if key is not None:
                    return key
        return None

    def _first_evictable(self, f: int, evictable: Evictable) -> Key | None:
        """Evict and return the oldest evictable entry of bucket ``f``, moving the
        blocked ones passed over to its back; ``None`` after one pass."""
        bucket = self._buckets[f]
        for _ in range(len(bucket)):
            key = next(iter(bucket))
            if evictable(key):
                self._forget(key, f)
                return key
            bucket.move_to_end(key)
        return None

    def _forget(self, key: Key, f: int) -> None:
        del self._freq[key]
        bucket = self._buckets[f]
        del bucket[key]
        if not bucket:
            del self._buckets[f]
            if self._min == f:
                self._min = 0

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
