"""Invalidations win over the stores decided before them.

A request matches, computes its KV, and stores it when it ends (``engine/job.py``); an
insert with tiers decides its blocks under the lock, frames them outside it and links
them at a commit. A purge or an epoch bump that lands in between must stay final: the
store decided before it must not bring the purged prefix back (issue 39, finding 9). So
every invalidation is numbered and remembered here, and a store carries the number it
was decided at (a ``Stamp``)::

    stamp = cache.stamp()                 seq 7   (the engine: before its match)
    ...                                   purge("acme") -> seq 8, TenantPurged("acme")
    cache.insert(..., since=stamp)        plan:   seq 8 > 7 and it covers acme -> nothing stored
                                          commit: the same check, for what was planned at 7

A store without a stamp is stamped when it is planned, so the window between its plan and
its commit is covered too. Which stores an invalidation covers:

    TenantPurged(t)            every store of tenant t (its own blocks and what it would publish)
    EpochBumped(m, a)          every store of model m (of adapter a only, when given)
    PrefixPurged(names, p)     stores under one of the purged roots whose tokens start with p
    GenerationRaised(n)        stores under a root of the namespace named n (``generation_name``):
                               another server's purge, read from a shared tier

TTL is not an invalidation: a block expires for want of use, and a store is a use.

NOTE: the log keeps the last ``keep`` invalidations; a stamp older than all of them is
treated as covered (its store is dropped, which costs a hit and is never wrong).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from prefixcache.cache.contexts import generation_name
from prefixcache.hashing import CacheContext

__all__ = ["EpochBumped", "GenerationRaised", "Invalidations", "PrefixPurged", "Stamp", "TenantPurged"]

KEEP: Final = 4096  # invalidations remembered: admin calls, far more than a request outlives

Names = Iterable[tuple[object, ...]]  # the root-table names of a store's roots (``Root.ctx_name``)


@dataclass(frozen=True, slots=True)
class Stamp:
    """When a store was decided: how many invalidations the cache had made by then.
    Only meaningful to the cache that gave it."""

    seq: int


@dataclass(frozen=True, slots=True)
class TenantPurged:
    tenant: str

    def covers(self, ctx: CacheContext, names: Names, data: bytes) -> bool:
        return ctx.tenant == self.tenant


@dataclass(frozen=True, slots=True)
class EpochBumped:
    model: str
    adapter: str | None

    def covers(self, ctx: CacheContext, names: Names, data: bytes) -> bool:
        return ctx.model == self.model and (self.adapter is None or ctx.adapter == self.adapter)


@dataclass(frozen=True, slots=True)
class PrefixPurged:
    names: frozenset[tuple[object, ...]]  # the roots the purge searched (its own, the public one)
    prefix: bytes  # the purged tokens, as ``token_bytes``

    def covers(self, ctx: CacheContext, names: Names, data: bytes) -> bool:
        return data.startswith(self.prefix) and any(name in self.names for name in names)


@dataclass(frozen=True, slots=True)
class GenerationRaised:
    name: str  # the namespace's record name: all a shared tier tells of it
    seed: str  # the deployment seed its name is keyed by

    def covers(self, ctx: CacheContext, names: Names, data: bytes) -> bool:
        return any(generation_name(self.seed, str(name[0])) == self.name for name in names)


Scope = TenantPurged | EpochBumped | PrefixPurged | GenerationRaised


class Invalidations:
    """The numbered log of invalidations; read and written under the cache's lock."""

    def __init__(self, keep: int = KEEP) -> None:
        self.seq = 0
        self._log: deque[tuple[int, Scope]] = deque(maxlen=keep)

    def stamp(self) -> Stamp:
        return Stamp(self.seq)

    def record(self, scope: Scope) -> None:
        self.seq += 1
        self._log.append((self.seq, scope))

    def purged_from(self, names: Names, data: bytes) -> int | None:
        """The shortest prefix of ``data`` (token bytes) that a prefix purge this cache
        remembers covers under ``names``, in bytes; None when none does. A frame a probing
        tier holds at or past it (written before the purge, by this process before a
        restart or by another server) is never adopted, since nothing tells when it was
        written. One pass over the log. NOTE: as far back as the log goes (``keep``)."""
        names = tuple(names)
        lengths = [
            len(scope.prefix)
            for _, scope in self._log
            if isinstance(scope, PrefixPurged) and data.startswith(scope.prefix) and not scope.names.isdisjoint(names)
        ]
        return min(lengths, default=None)

    def voids(self, since: int, ctx: CacheContext, names: Names, data: bytes) -> bool:
        """Whether an invalidation made after ``since`` covers a store of ``data`` (token
        bytes from the root) under the roots ``names`` for ``ctx``."""
        if since >= self.seq:
            return False
        if not self._log or since < self._log[0][0] - 1:
            return True  # older than what is remembered: assume the worst
        names = tuple(names)
        for seq, scope in reversed(self._log):
            if seq <= since:
                return False
            if scope.covers(ctx, names, data):
                return True
        return False
