"""A store that wraps a real one to inject faults: slow writes, failing writes, and
calls that hang until the test lets them go.

``PrefixCache(config, store_factory=faulty(...))`` opens every tier's real store (a
memory slab, a disk directory, Redis) and wraps the ones asked for; the cache sees the
wrapper exactly as it sees the store, sync-ness and all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prefixcache.config import TierConfig
from prefixcache.storage.base import Frame, TierError, TierStore
from prefixcache.storage.open import open_store


class Faulty(TierStore):
    """``inner`` with every write taking ``delay`` seconds, the next ``fail`` writes
    raising ``TierError`` (a broken or full medium), and, once ``hang(names)`` is called,
    every call of those names waiting inside the store until ``release()`` (a medium that
    stopped answering, for as long as the test says: ``parked`` tells how many wait)."""

    def __init__(self, inner: TierStore, delay: float = 0.0) -> None:
        super().__init__(inner.capacity_bytes)
        self.inner = inner
        self.delay = delay
        self.fail = 0
        self.puts = 0
        self.parked = 0
        self._parking = threading.Lock()
        self._hung: frozenset[str] = frozenset()
        self._go = threading.Event()
        self._go.set()
        self.kind = inner.kind  # type: ignore[misc]
        self.verifies_reads = inner.verifies_reads  # type: ignore[misc]
        self.private = inner.private  # type: ignore[misc]
        self.sync = inner.sync  # type: ignore[misc]
        self.stats = inner.stats

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def hang(self, *names: str) -> None:
        self._hung = frozenset(names)
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    def _wait(self, name: str) -> None:
        if name in self._hung and not self._go.is_set():
            with self._parking:
                self.parked += 1
            try:
                self._go.wait()
            finally:
                with self._parking:
                    self.parked -= 1

    def put(self, key: bytes, frame: Frame) -> None:
        self._wait("put")
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            self.fail -= 1
            self.stats.error("injected")  # as a real store counts the cause of its failure
            raise TierError("injected write failure")
        self.inner.put(key, frame)
        self.puts += 1

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        self._wait("get_many")
        return self.inner.get_many(keys)

    def delete(self, key: bytes) -> bool:
        return self.inner.delete(key)

    def detach(self, key: bytes) -> Any:
        return self.inner.detach(key)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        self._wait("contains_prefix")
        return self.inner.contains_prefix(keys)

    def room_for(self, frame_bytes: int) -> int:
        return self.inner.room_for(frame_bytes)

    def footprint(self, frame_bytes: int) -> int:
        return self.inner.footprint(frame_bytes)

    def __getattr__(self, name: str) -> Any:
        """What only some stores offer (a disk's ``keys``): ``inner``'s, or none."""
        if name == "inner":  # NOTE: not set yet: no recursion through ``self.inner``
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def close(self) -> None:
        self.inner.close()


def faulty(
    kinds: Sequence[str] = ("disk", "redis", "memory", "device"), delay: float = 0.0, opened: list[Faulty] | None = None
) -> Callable[[TierConfig, int, str], TierStore]:
    """A ``store_factory`` that wraps the stores of ``kinds`` (appending each to ``opened``)."""

    def factory(config: TierConfig, frame_bytes: int, seed: str) -> TierStore:
        store = open_store(config, frame_bytes, seed)
        if config.kind not in kinds:
            return store
        wrapped = Faulty(store, delay)
        if opened is not None:
            opened.append(wrapped)
        return wrapped

    return factory
