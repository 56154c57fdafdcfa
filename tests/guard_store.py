"""A store that fails when it is called under the cache's lock (invariant 9, structurally).

``LockGuard.factory`` wraps every tier's store; ``LockGuard.watch(cache)`` tells the
guard whose lock to ask about (``Owner.held``: does the calling thread hold it?). A
store call made while the calling thread holds the lock of any watched cache is a
violation: recorded on the guard (so that one made in the writer's thread, whose
errors the writer logs and survives, is still seen) and raised (``IOUnderLock``) in
the thread that made it.

Two calls are allowed under the lock, on a ``sync`` store only (a memory slab): the
slot bookkeeping ``delete`` and ``detach``, which move no bytes (a dict entry and a
free list under the slab's own lock) and must be atomic with the decision that makes
them, so that no new frame of the key lands in between (``cache/residency.py``). The
gauges ``len``, ``used_bytes`` and ``stats`` are not calls into the medium (every store
keeps them in its memory): ``stats()`` reads them under the lock, for one consistent
snapshot.

In a test module, ``from guard_store import guard_stores`` (an autouse fixture, named
``lock_guard`` for a test that asks for the guard) builds every cache of the module's
``PrefixCache`` and ``cache_with`` with guarded stores, and fails the test on any
violation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

import tier_worker
from prefixcache.cache import PrefixCache
from prefixcache.cache.facade import StoreFactory
from prefixcache.cache.owner import Owner
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.storage.base import Frame, TierStore
from prefixcache.storage.open import open_store
from prefixcache.storage.placed import Place, Placed

__all__ = ["Guarded", "IOUnderLock", "LockGuard", "guard_stores"]

_SLOT_BOOKKEEPING = frozenset({"delete", "detach"})  # allowed under the lock on a sync (memory) store


class IOUnderLock(AssertionError):
    """A store was called by a thread holding the cache's lock."""


class LockGuard:
    """The stores of some caches, and the calls they got under a cache's lock."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self._owners: list[weakref.ref[Owner]] = []

    def factory(self, inner: StoreFactory = open_store) -> StoreFactory:
        """A ``store_factory`` whose stores are ``inner``'s, guarded."""

        def open_guarded(config: TierConfig, frame_bytes: int, seed: str) -> TierStore:
            return Guarded(inner(config, frame_bytes, seed), self)

        return open_guarded

    def watch(self, cache: PrefixCache) -> PrefixCache:
        self._owners.append(weakref.ref(cache._owner))
        return cache

    def cache(self, config: CacheConfig | None = None, **kwargs: Any) -> PrefixCache:
        """``PrefixCache(config, **kwargs)`` with guarded stores, watched."""
        kwargs["store_factory"] = self.factory(kwargs.get("store_factory", open_store))
        return self.watch(PrefixCache(config, **kwargs))

    def cache_with(self, *tiers: TierConfig, **kwargs: Any) -> PrefixCache:
        """``tier_worker.cache_with`` with guarded stores, watched."""
        kwargs["store_factory"] = self.factory(kwargs.get("store_factory", open_store))
        return self.watch(tier_worker.cache_with(*tiers, **kwargs))

    def held(self) -> bool:
        """Whether the calling thread holds the lock of a watched cache."""
        return any(owner is not None and owner.held() for owner in (ref() for ref in self._owners))

    def check(self, store: TierStore, name: str) -> None:
        if (store.sync and name in _SLOT_BOOKKEEPING) or not self.held():
            return
        violation = f"{store.kind}.{name} called under the cache's lock"
        self.violations.append(violation)
        raise IOUnderLock(violation)


class Guarded(TierStore):
    """``inner``, every call into it checked by ``guard`` first; seen by the cache exactly
    as ``inner`` is (its kind, flags, counters and the methods only some stores offer)."""

    def __init__(self, inner: TierStore, guard: LockGuard) -> None:
        super().__init__(inner.capacity_bytes)
        self.inner = inner
        self.guard = guard
        self.kind = inner.kind  # type: ignore[misc]
        self.verifies_reads = inner.verifies_reads  # type: ignore[misc]
        self.private = inner.private  # type: ignore[misc]
        self.sync = inner.sync  # type: ignore[misc]
        self.places_reads = inner.places_reads  # type: ignore[misc]
        self.read_width = inner.read_width
        self.stats = inner.stats

    def __getattr__(self, name: str) -> Any:
        """What only some stores offer (a disk's ``keys``, a device's ``tensor``), guarded."""
        if name == "inner":  # NOTE: not set yet: no recursion through ``self.inner``
            raise AttributeError(name)
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def checked(*args: Any, **kwargs: Any) -> Any:
            self.guard.check(self, name)
            return attr(*args, **kwargs)

        return checked

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def __len__(self) -> int:
        return len(self.inner)

    def put(self, key: bytes, frame: Frame) -> None:
        self.guard.check(self, "put")
        self.inner.put(key, frame)

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        self.guard.check(self, "get_many")
        return self.inner.get_many(keys)

    def read_placed(self, key: bytes, buffer: bytearray, place: Place) -> Placed | None:
        self.guard.check(self, "read_placed")
        return self.inner.read_placed(key, buffer, place)

    def delete(self, key: bytes) -> bool:
        self.guard.check(self, "delete")
        return self.inner.delete(key)

    def detach(self, key: bytes) -> Callable[[], Frame | None] | None:
        self.guard.check(self, "detach")
        return self.inner.detach(key)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        self.guard.check(self, "contains_prefix")
        return self.inner.contains_prefix(keys)

    def __contains__(self, key: object) -> bool:
        self.guard.check(self, "__contains__")
        return key in self.inner

    def room_for(self, frame_bytes: int) -> int:
        self.guard.check(self, "room_for")
        return self.inner.room_for(frame_bytes)

    def footprint(self, frame_bytes: int) -> int:
        self.guard.check(self, "footprint")
        return self.inner.footprint(frame_bytes)

    def close(self) -> None:
        self.guard.check(self, "close")
        self.inner.close()


@pytest.fixture(autouse=True, name="lock_guard")
def guard_stores(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[LockGuard]:
    """Every cache the test module builds (its ``PrefixCache`` and ``cache_with``) gets
    guarded stores; the test fails on any store call under a cache's lock."""
    guard = LockGuard()
    module = request.module

    class GuardedCache(PrefixCache):
        def __init__(self, config: CacheConfig | None = None, **kwargs: Any) -> None:
            kwargs["store_factory"] = guard.factory(kwargs.get("store_factory", open_store))
            super().__init__(config, **kwargs)
            guard.watch(self)

    if getattr(module, "PrefixCache", None) is PrefixCache:
        monkeypatch.setattr(module, "PrefixCache", GuardedCache)
    if getattr(module, "cache_with", None) is tier_worker.cache_with:
        monkeypatch.setattr(module, "cache_with", guard.cache_with)
    yield guard
    assert not guard.violations, guard.violations
