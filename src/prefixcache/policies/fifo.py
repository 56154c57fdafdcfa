"""FIFO: blocks leave in the order they arrived; hits change nothing."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import filterfalse
from typing import ClassVar

from prefixcache.policies.base import Evictable, EvictionPolicy, Key, always


class FIFOPolicy(EvictionPolicy):
    """Insertion order in one ``OrderedDict`` (oldest first).

    It is also the queue that :class:`~prefixcache.policies.lru.LRUPolicy` reuses:
    LRU is this queue plus a move to the tail on every hit.
    """

    __slots__ = ("_order",)
    name: ClassVar[str] = "fifo"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # NOTE: an OrderedDict, not a dict: popping or rotating the oldest entry of a
        # plain dict leaves tombstones at the front that every later scan walks over.
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, size: int = 1) -> None:
        if key in self._order:
            raise KeyError(key)
        self._order[key] = None

    def access(self, key: Key) -> None:
        if key not in self._order:
            raise KeyError(key)

    def access_many(self, keys: Iterable[Key]) -> None:
        # The membership test runs in C; the loop body only runs on misuse.
        for key in filterfalse(self._order.__contains__, keys):
            raise KeyError(key)

    def remove(self, key: Key) -> None:
        del self._order[key]

    def victim(self, evictable: Evictable = always) -> Key | None:
        order = self._order
        # One pass at most: a blocked entry goes to the tail, so after len(order)
        # steps every entry has been offered once.
        for _ in range(len(order)):
            key = next(iter(order))
            if evictable(key):
                del order[key]
                return key
            order.move_to_end(key)
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
