"""The chunk store's books: which chunk is in which tier, pins, pools and their policies.

The ledger decides and never moves bytes: every call runs under the store's lock and
leaves the deletes it decided in ``take_drops()``, for the store to run outside the lock.
Chunks are independent (no tree, no ancestors), so each tier is a flat cache::

    tier k:  capacity_k, used_k
             pools: {pool name: (used, policy)}    one pool ("*") unless partitioned,
                                                   where each namespace has its own
    chunk:   held {k, ...}      tiers whose frame is written
             pending {k, ...}   tiers a write of it is in flight to (reserved, not evictable)
             pins               readers and blended prefills using it (not evictable)

A put writes through to every tier whose slots fit the frame (each tier then evicts by
its own policy, independently); a chunk leaves the store when no tier holds it. In
partitioned mode a namespace's pool in tier k holds at most its share of capacity_k
(its configured quota over the cache's capacity, or an equal share of what is left),
so one tenant's chunks never push out another's: a put evicts from its own pool first,
and from pools over their share before any other when the tier itself is full.
"""

from __future__ import annotations

import math
from collections import Counter

from prefixcache.blend.chunk_keys import ChunkKeys, Epochs
from prefixcache.blend.chunk_types import ORPHAN, Chunk, Drop, Pool, Read, TierBook
from prefixcache.config import CacheConfig
from prefixcache.events import RemovalReason
from prefixcache.tenancy import GLOBAL, PUBLIC

__all__ = ["ChunkLedger"]


class ChunkLedger:
    """The books of every chunk; see the module's docstring. Not thread-safe: the store
    holds its lock around every call."""

    def __init__(self, config: CacheConfig, tiers: list[TierBook], keys: ChunkKeys, ttl: float | None) -> None:
        self.config = config
        self.tiers = tiers
        self.keys = keys
        self.ttl = ttl
        self.index: dict[bytes, Chunk] = {}
        self.removed: Counter[RemovalReason] = Counter()
        self.collisions = 0
        self._partitioned = config.isolation == "partitioned"
        self._names: set[str] = set()  # namespaces seen: the partitioned shares are split among them
        self._busy: Counter[bytes] = Counter()  # keys with a delete decided and not yet run
        self._doomed: dict[bytes, Chunk] = {}  # removed, still pinned or being written
        self._drops: list[Drop] = []

    # ------------------------------------------------------------------ drops

    def take_drops(self) -> list[Drop]:
        drops, self._drops = self._drops, []
        return drops

    def dropped(self, drops: list[Drop]) -> None:
        """The deletes of ``drops`` ran: their keys may be written again."""
        for drop in drops:
            self._busy[drop.key] -= 1
            if self._busy[drop.key] <= 0:
                del self._busy[drop.key]

    def _drop(self, key: bytes, tier: int) -> None:
        self._busy[key] += 1
        self._drops.append(Drop(key, tier))

    # ------------------------------------------------------------------ puts

    def begin_put(
        self, chunk: Chunk, epochs: Epochs | None, now: float, have: int | None = None
    ) -> tuple[Chunk | None, tuple[int, ...]]:
        """Decide a put (or, with ``have``, the adoption of a frame found in tier ``have``):
        the chunk to write and the tiers to write it to, reserved. ``(None, ())`` when
        nothing is to be written (refused, already there, or no tier has room)."""
        self.reap(now)
        key = chunk.key
        if key in self._busy or key in self._doomed:
            return None, ()
        if epochs is not None and chunk.model is not None and not self._current(chunk, epochs):
            return None, ()  # the key is of an epoch bumped since: never store stale
        known = self.index.get(key)
        if known is not None:
            if known.orphan and have is not None:
                self._adopt(known, chunk)
            elif known.data != chunk.data:
                self.collisions += 1
                return None, ()
            self._touch(known, now, None)
            if have is None:
                return None, ()  # a put of what is stored: nothing to write
            chunk = known
        elif have is not None:
            self._hold(chunk, have)
        chunk.expires = now + self.ttl if self.ttl is not None else math.inf
        targets = tuple(k for k in range(len(self.tiers)) if self._reserve(chunk, k))
        if not chunk.held and not targets:
            return None, ()
        if known is None:
            self.index[key] = chunk
            self._names.add(self._pool(chunk))
        return chunk, targets

    def end_put(self, chunk: Chunk, ok: set[int], failed: set[int]) -> None:
        """The writes ran: ``ok`` tiers hold the frame now, ``failed`` ones do not."""
        chunk.pending -= ok | failed
        if chunk.removed:  # removed while written: its accounting is gone, drop the bytes
            chunk.held |= ok
            self._release(chunk)
            return
        chunk.held |= ok
        for k in failed:
            self._unaccount(chunk, k, forgotten=False)
        if not chunk.held and not chunk.pending:
            self._forget(chunk, None)

    def adopt_orphans(self, tier: int, frames: list[tuple[bytes, int]]) -> None:
        """Frames a disk held at open: chunks of an earlier process, owner unknown until
        a get computes their key and checks their tokens."""
        for key, size in frames:
            if key in self.index:
                continue
            chunk = Chunk(key, None, None, None, None, b"", size)
            self._hold(chunk, tier)
            self.index[key] = chunk

    def _current(self, chunk: Chunk, epochs: Epochs) -> bool:
        assert chunk.model is not None
        return epochs == self.keys.current(chunk.model, chunk.adapter)

    def _pool(self, chunk: Chunk) -> str:
        """The pool a chunk takes room from: its namespace's when partitioned, else the one pool."""
        if not self._partitioned:
            return GLOBAL
        return ORPHAN if chunk.namespace is None else chunk.namespace

    def _adopt(self, orphan: Chunk, found: Chunk) -> None:
        for k in orphan.held:
            self._unaccount(orphan, k, forgotten=False)
        for name in ("namespace", "owner", "model", "adapter", "data"):
            setattr(orphan, name, getattr(found, name))
        for k in list(orphan.held):
            orphan.held.discard(k)
            self._hold(orphan, k)
        self._names.add(self._pool(orphan))

    def _hold(self, chunk: Chunk, k: int) -> None:
        """Record a frame that is in tier ``k`` already (charged even past capacity: the bytes are there)."""
        book = self.tiers[k]
        charge = book.charge(chunk.frame_bytes)
        self._make_room(k, self._pool(chunk), charge)
        book.used += charge
        pool = book.pool(self._pool(chunk))
        pool.used += charge
        pool.policy.insert(chunk.key, charge)
        chunk.held.add(k)

    def _reserve(self, chunk: Chunk, k: int) -> bool:
        book = self.tiers[k]
        if k in chunk.held or k in chunk.pending or not book.fits(chunk.frame_bytes):
            return False
        charge = book.charge(chunk.frame_bytes)
        if not self._make_room(k, self._pool(chunk), charge):
            return False
        book.used += charge
        pool = book.pool(self._pool(chunk))
        pool.used += charge
        pool.policy.insert(chunk.key, charge)
        chunk.pending.add(k)
        return True

    # ------------------------------------------------------------------ room

    def quota(self, k: int, name: str) -> int:
        """Bytes the pool ``name`` may hold in tier ``k``: the tier's capacity unless partitioned."""
        book = self.tiers[k]
        if not self._partitioned:
            return book.capacity
        if name == ORPHAN:
            return 0
        cfg = self.config
        fixed = {n: cfg.to_tokens(q) for n, q in cfg.quotas.items()}
        if cfg.shared_quota is not None:
            fixed[PUBLIC] = cfg.to_tokens(cfg.shared_quota)
        total = max(cfg.capacity, 1)
        if name in fixed:
            return book.capacity * fixed[name] // total
        floating = len((self._names | {name}) - set(fixed) - {ORPHAN})
        return book.capacity * max(total - sum(fixed.values()), 0) // total // max(floating, 1)

    def _make_room(self, k: int, name: str, charge: int) -> bool:
        book = self.tiers[k]
        quota = min(self.quota(k, name), book.capacity)
        if charge > quota and name != ORPHAN:
            return False
        own = book.pool(name)
        while own.used + charge > quota and name != ORPHAN:
            if not self._evict(k, own):
                return False
        while book.used + charge > book.capacity:
            over = sorted(
                (p for n, p in book.pools.items() if p is not own and p.used > self.quota(k, n)),
                key=lambda p: p.used,
                reverse=True,
            )
            if not any(self._evict(k, pool) for pool in (*over, own)):
                return False
        return True

    def _evict(self, k: int, pool: Pool) -> bool:
        def evictable(key: object) -> bool:
            chunk = self.index.get(key) if isinstance(key, bytes) else None
            return chunk is not None and chunk.pins == 0 and k not in chunk.pending

        key = pool.policy.victim(evictable)
        if key is None:
            return False
        assert isinstance(key, bytes)
        chunk = self.index[key]
        self.tiers[k].evictions += 1
        self._unaccount(chunk, k, forgotten=True)
        chunk.held.discard(k)
        self._drop(chunk.key, k)
        if not chunk.held and not chunk.pending:
            self._forget(chunk, RemovalReason.EVICTED)
        return True

    def _unaccount(self, chunk: Chunk, k: int, forgotten: bool) -> None:
        book = self.tiers[k]
        charge = book.charge(chunk.frame_bytes)
        book.used -= charge
        pool = book.pool(self._pool(chunk))
        pool.used -= charge
        if not forgotten:
            pool.policy.remove(chunk.key)

    # ------------------------------------------------------------------ reads and pins

    def begin_get(self, keys: list[bytes], data: bytes, now: float) -> Read | None:
        """The first of ``keys`` held, with tokens equal to ``data``, pinned; ``None`` when none is."""
        self.reap(now)
        for key in keys:
            chunk = self.index.get(key)
            if chunk is None or not chunk.held or chunk.orphan:
                continue  # an orphan is read by the store's probe, which adopts it
            if chunk.data != data:
                self.collisions += 1
                continue
            chunk.pins += 1
            return Read(chunk, tuple(sorted(chunk.held)))
        return None

    def end_get(self, chunk: Chunk, tier: int | None, now: float) -> None:
        """A reader is done; ``tier`` served it (``None``: nothing did)."""
        chunk.pins -= 1
        if tier is not None and not chunk.removed:
            self._touch(chunk, now, tier)
        self._release(chunk)

    def lose(self, chunk: Chunk, tier: int) -> None:
        """Tier ``tier`` returned a missing or bad frame of ``chunk``: it leaves that tier."""
        if chunk.removed or tier not in chunk.held:
            return
        self._unaccount(chunk, tier, forgotten=False)
        chunk.held.discard(tier)
        self._drop(chunk.key, tier)
        if not chunk.held and not chunk.pending:
            self._forget(chunk, RemovalReason.LOST)

    def pin(self, keys: list[bytes]) -> list[Chunk]:
        chunks = [c for key in keys if (c := self.index.get(key)) is not None and c.held and not c.orphan]
        for chunk in chunks:
            chunk.pins += 1
        return chunks

    def unpin(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            chunk.pins -= 1
            self._release(chunk)

    def visible(self, keys: list[bytes], data: bytes, now: float) -> bool:
        self.reap(now)
        return any((c := self.index.get(k)) is not None and c.held and c.data == data for k in keys)

    def _touch(self, chunk: Chunk, now: float, tier: int | None) -> None:
        if self.ttl is not None:
            chunk.expires = now + self.ttl
        for k in chunk.held if tier is None else (tier,):
            self.tiers[k].pool(self._pool(chunk)).policy.access(chunk.key)

    # ------------------------------------------------------------------ removal

    def bump(self, model: str, adapter: str | None) -> int:
        epoch = self.keys.bump(model, adapter)
        for chunk in list(self.index.values()):
            if chunk.model == model and (adapter is None or chunk.adapter == adapter):
                self._remove(chunk, RemovalReason.STALE)
        return epoch

    def purge(self, tenant: str | None) -> int:
        """Remove ``tenant``'s chunks (those it stored, and its namespace's), or everything."""
        gone = [c for c in self.index.values() if tenant is None or tenant in (c.owner, c.namespace)]
        for chunk in gone:
            self._remove(chunk, RemovalReason.PURGED)
        return len(gone)

    def reap(self, now: float) -> None:
        """Remove expired chunks.

        NOTE: a scan of every chunk, run only when a TTL is configured: chunks are few
        (each is a whole document's KV), so a heap would cost more code than time."""
        if self.ttl is None:
            return
        for chunk in [c for c in self.index.values() if c.expires <= now and not c.orphan]:
            self._remove(chunk, RemovalReason.EXPIRED)

    def _remove(self, chunk: Chunk, reason: RemovalReason) -> None:
        for k in chunk.held | chunk.pending:
            self._unaccount(chunk, k, forgotten=False)
        self._forget(chunk, reason)
        self._release(chunk)

    def _forget(self, chunk: Chunk, reason: RemovalReason | None) -> None:
        del self.index[chunk.key]
        chunk.removed = True
        if reason is not None:
            self.removed[reason] += 1
        if chunk.pins or chunk.pending:
            self._doomed[chunk.key] = chunk

    def _release(self, chunk: Chunk) -> None:
        """A removed chunk that nobody reads or writes any more: delete its frames."""
        if not chunk.removed or chunk.pins or chunk.pending:
            return
        for k in sorted(chunk.held):
            self._drop(chunk.key, k)
        chunk.held.clear()
        if self._doomed.get(chunk.key) is chunk:
            del self._doomed[chunk.key]
