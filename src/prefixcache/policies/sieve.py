"""SIEVE (Zhang et al., "SIEVE is Simpler than LRU", NSDI'24)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import ClassVar

from prefixcache.policies.base import Evictable, EvictionPolicy, Key, always


class SievePolicy(EvictionPolicy):
    """One FIFO queue, a visited bit per entry and a hand that sweeps it.

    A hit only sets the visited bit, so the request path never reorders anything.
    To evict, the hand walks from the oldest entry toward the newest, clearing the
    visited bits it passes, and evicts the first unvisited entry; it stays where it
    stopped and the next eviction resumes there. New entries join at the newest end.

    The queue, split at the hand (no linked list, no per-entry objects)::

        oldest                                            newest
        [ behind: already swept this round ][ ahead: hand -> ... ]
                                              ^ hand = first of ahead

    Sweeping an entry moves it from the front of ``ahead`` to the back of
    ``behind``, which keeps the whole queue in order; when ``ahead`` runs out the
    hand wraps to the oldest entry, so ``behind`` becomes ``ahead``. Invariant:
    ``ahead`` is empty only when the queue is.
    """

    __slots__ = ("_ahead", "_behind", "_visited")
    name: ClassVar[str] = "sieve"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._visited: dict[Key, bool] = {}
        self._ahead: OrderedDict[Key, None] = OrderedDict()
        self._behind: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, size: int = 1) -> None:
        if key in self._visited:
            raise KeyError(key)
        self._visited[key] = False
        self._ahead[key] = None

    def access(self, key: Key) -> None:
        if key not in self._visited:
            raise KeyError(key)
        self._visited[key] = True

    def access_many(self, keys: Iterable[Key]) -> None:
        visited = self._visited
        for key in keys:
            if key not in visited:
                raise KeyError(key)
            visited[key] = True

    def remove(self, key: Key) -> None:
        del self._visited[key]
        if key in self._ahead:
            del self._ahead[key]
            if not self._ahead:
                self._wrap()
        else:
            del self._behind[key]

    def victim(self, evictable: Evictable = always) -> Key | None:
        visited = self._visited
        # NOTE: a blocked entry is passed over like a visited one but keeps its bit
        # clear. Each step either clears a bit (at most one pass's worth, since
        # nothing sets bits meanwhile) or passes a blocked entry; ``run`` counts
        # consecutive steps with nothing to clear, and once it covers the whole
        # queue every entry is blocked. So at most two passes.
        run = 0
        while run < len(visited):
            key = next(iter(self._ahead))
            if visited[key]:
                visited[key] = False
                run = 0
            elif evictable(key):
                del visited[key]
                del self._ahead[key]
                if not self._ahead:
                    self._wrap()
                return key
            else:
                run += 1
            del self._ahead[key]
            self._behind[key] = None
            if not self._ahead:
                self._wrap()
        return None

    def _wrap(self) -> None:
        """The hand ran past the newest entry: it starts again at the oldest."""
        self._ahead, self._behind = self._behind, self._ahead

    def __len__(self) -> int:
        return len(self._visited)

    def __contains__(self, key: object) -> bool:
        return key in self._visited
