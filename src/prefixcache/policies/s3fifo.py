"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import ClassVar

from prefixcache.policies.base import Evictable, EvictionPolicy, Key, always


class S3FIFOPolicy(EvictionPolicy):
    """Three FIFO queues: a small probationary one, a main one, and a ghost of keys.

    ::

        insert --> [ small (10 %) ] --2+ hits--> [ main (90 %) ] <-- hit in ghost
                         | fewer hits                 |  ^ a hit left: reinsert,
                         v                            v  |   one hit fewer
                   [ ghost: keys only ]             evicted

    Most blocks of an LLM prefix cache are seen once; S3-FIFO lets them leave
    quickly from the small queue, while a block hit twice there earns a place in
    main, where a CLOCK-like counter keeps the popular ones.

    Where the paper leaves a choice, this follows libCacheSim's C reference, the
    2024 version (``libCacheSim/cache/eviction/S3FIFO.c``):

    * Sizes: small = ``int(capacity * 0.1)``, main = the rest, ghost =
      ``int(capacity * 0.9)``; all three count entry sizes, like its byte queues.
    * Frequency: 0 on insertion, +1 per hit, capped at 3 (it caps on reinsertion,
      ``MIN(freq, 3) - 1``, which decides the same). It is reset to 0 when an entry
      moves from small to main, which inserts a fresh object there.
    * Which queue: evict from main when main holds more than its share or small is
      empty, else from small. Evicting from small walks its oldest entries: those
      with ``freq >= 2`` (``move_to_main_threshold``) move to main, the first
      other one is evicted and its key recorded in ghost. Moving entries may push
      main over its share without evicting from it; if small drains without an
      eviction, main is next. Evicting from main reinserts every entry with
      ``freq >= 1`` with one less, and evicts the first with 0 (no ghost).
    * A new key found in ghost goes straight to main (and leaves ghost); others
      go to small, except before the first eviction, when a full small queue lets
      new entries overflow into main instead.

    Differences, both forced by the interface: libCacheSim refuses an object of at
    least the small queue's size; here the cache decides residency, so an entry
    larger than the small queue goes to main. And libCacheSim checks the ghost
    before it evicts for a miss, while the cache calls ``victim`` before
    ``insert``; so ghost overflow is trimmed at ``insert`` (after the lookup), not
    at ``victim``, which gives the same ghost contents (until then it may hold up
    to one extra key per eviction). Blocked entries (base.py): in small they move
    on to main, as a frequent entry would; in main their hits are used up as usual,
    and one with none left is reinserted at the tail instead of evicted.
    """

    __slots__ = (
        "_freq",
        "_ghost",
        "_ghost_cap",
        "_ghost_ratio",
        "_ghost_used",
        "_has_evicted",
        "_main",
        "_main_cap",
        "_main_used",
        "_move_threshold",
        "_small",
        "_small_cap",
        "_small_ratio",
        "_small_used",
    )
    name: ClassVar[str] = "s3fifo"

    FREQ_CAP: ClassVar[int] = 3

    def __init__(
        self,
        capacity: int,
        small_ratio: float = 0.1,
        ghost_ratio: float = 0.9,
        move_to_main_threshold: int = 2,
    ) -> None:
        super().__init__(capacity)
        if not 0.0 <= small_ratio <= 1.0 or ghost_ratio < 0.0:
            raise ValueError(f"bad S3-FIFO ratios: small {small_ratio}, ghost {ghost_ratio}")
        if not 1 <= move_to_main_threshold <= self.FREQ_CAP:
            raise ValueError(f"move_to_main_threshold must be in 1..{self.FREQ_CAP}")
        self._small_ratio, self._ghost_ratio = small_ratio, ghost_ratio
        self.resize(capacity)
        self._move_threshold = move_to_main_threshold
        # key -> frequency for every resident entry: the membership test too.
        self._freq: dict[Key, int] = {}
        # key -> size, oldest first.
        self._small: OrderedDict[Key, int] = OrderedDict()
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, int] = OrderedDict()
        self._small_used = 0
        self._main_used = 0
        self._ghost_used = 0
        self._has_evicted = False

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self._small_cap = int(capacity * self._small_ratio)
        self._main_cap = capacity - self._small_cap
        self._ghost_cap = int(capacity * self._ghost_ratio)

    def insert(self, key: Key, size: int = 1) -> None:
        if key in self._freq:
            raise KeyError(key)
        if size < 1:
            # NOTE: a size-0 entry would never be trimmed from the ghost.
            raise ValueError(f"entry size must be >= 1, got {size}")
        self._freq[key] = 0
        ghost_size = self._ghost.pop(key, None)
        if ghost_size is not None:
            self._ghost_used -= ghost_size
            self._to_main(key, size)
        elif size > self._small_cap or (not self._has_evicted and self._small_used >= self._small_cap):
            self._to_main(key, size)
        else:
            self._small[key] = size
            self._small_used += size
        self._trim_ghost()

    def access(self, key: Key) -> None:
        f = self._freq[key]
        if f < self.FREQ_CAP:
            self._freq[key] = f + 1

    def access_many(self, keys: Iterable[Key]) -> None:
        freq = self._freq
        cap = self.FREQ_CAP
        for key in keys:
            f = freq[key]
            if f < cap:
                freq[key] = f + 1

    def remove(self, key: Key) -> None:
        del self._freq[key]
        size = self._small.pop(key, None)
        if size is not None:
            self._small_used -= size
        else:
            self._main_used -= self._main.pop(key)

    def victim(self, evictable: Evictable = always) -> Key | None:
        self._has_evicted = True
        if self._small and self._main_used <= self._main_cap:
            key = self._evict_small(evictable)
            if key is not None:
                return key
            # small drained into main without an eviction: main is next
        key = self._evict_main(evictable)
        if key is not None or not self._small:
            return key
        # NOTE: main holds more than its share but every entry there is blocked:
        # evict from small after all. What small moves to main meanwhile may be
        # evictable, so main gets one more look if small yields nothing.
        key = self._evict_small(evictable)
        if key is not None:
            return key
        return self._evict_main(evictable)

    def _evict_small(self, evictable: Evictable) -> Key | None:
        """Walk small from its oldest entry: frequent or blocked entries move to
        main, the first other one is evicted into ghost. ``None`` if small drains."""
        small, freq = self._small, self._freq
        threshold = self._move_threshold
        while small:
            key = next(iter(small))
            if freq[key] < threshold and evictable(key):
                size = small.pop(key)
                self._small_used -= size
                del freq[key]
                if size <= self._ghost_cap:  # libCacheSim's ghost refuses larger ones
                    self._ghost[key] = size
                    self._ghost_used += size
                return key
            size = small.pop(key)
            self._small_used -= size
            self._to_main(key, size)
        return None

    def _evict_main(self, evictable: Evictable) -> Key | None:
        """Walk main from its oldest entry, reinserting those with hits left (one
        fewer) and the blocked ones; evict the first other one (no ghost)."""
        main, freq = self._main, self._freq
        # NOTE: ``run`` counts consecutive blocked entries with no hits left; once
        # it covers main, every entry there is blocked. Nothing enters main and no
        # count grows during the walk, so each pass lowers every nonzero count
        # and the walk ends within FREQ_CAP + 1 passes.
        run = 0
        while run < len(main):
            key = next(iter(main))
            f = freq[key]
            if f:
                freq[key] = f - 1
                run = 0
            elif evictable(key):
                self._main_used -= main.pop(key)
                del freq[key]
                return key
            else:
                run += 1
            main.move_to_end(key)
        return None

    def _to_main(self, key: Key, size: int) -> None:
        self._main[key] = size
        self._main_used += size
        self._freq[key] = 0

    def _trim_ghost(self) -> None:
        ghost = self._ghost
        while self._ghost_used > self._ghost_cap:
            _, size = ghost.popitem(last=False)
            self._ghost_used -= size

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
