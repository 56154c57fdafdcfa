"""LRU: the block least recently inserted or hit leaves first."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import ClassVar

from prefixcache.policies.base import Key
from prefixcache.policies.fifo import FIFOPolicy


class LRUPolicy(FIFOPolicy):
    """A FIFO queue where a hit moves the entry to the tail (most recent end).

    Insertion, removal and victim selection, blocked entries included, are FIFO's:
    only the meaning of the order differs.
    """

    __slots__ = ()
    name: ClassVar[str] = "lru"

    def access(self, key: Key) -> None:
        self._order.move_to_end(key)

    def access_many(self, keys: Iterable[Key]) -> None:
        # NOTE: ``deque(map(f, xs), maxlen=0)`` runs the loop in C (the itertools
        # "consume" recipe); ``move_to_end`` raises KeyError for an unknown key, and
        # the keys before it have been moved, as a plain loop would have done.
        deque(map(self._order.move_to_end, keys), maxlen=0)
