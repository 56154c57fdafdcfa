"""The chunks a ``Blender`` stored, as the embedding fallback knows them: their tokens
(what a fallback hit resolves to) and their embeddings (``ann.ChunkIndex``), per
namespace and per epoch, following what the cache removes.

The cache owns the chunks: it evicts, expires, purges and invalidates them without
telling anyone but its event log, which has a consumer already (the fleet publisher).
So the book follows removals by pulling, never by a callback into ``cache/``::

    query   every candidate the index returns is checked (``Chunks.contains``, a peek:
            nothing pinned, touched or counted); a dead one leaves the index now
    sweep   each ``add`` also checks the ``SWEEP`` oldest entries, round-robin, so a
            chunk nobody asks about leaves within len/SWEEP adds of its removal
    admin   purge, purge_prefix and an epoch bump drop their entries at once
    bound   at most ``KNOWN_CHUNKS`` entries: the oldest leave the index first

NOTE: an entry is a hint, never a promise: what a hit resolves to is loaded from the
cache with the requester's own context, so a stale entry can cost a lookup, never an
answer or another tenant's chunk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from prefixcache.blend.ann import ChunkEntry, ChunkIndex
from prefixcache.blend.chunks import Chunks, chunk_context
from prefixcache.hashing import CacheContext, encode, token_bytes
from prefixcache.tenancy import PUBLIC

__all__ = ["KNOWN_CHUNKS", "SWEEP", "KnownChunk", "KnownChunks"]

KNOWN_CHUNKS = 4096  # entries kept; the oldest leave the index too
SWEEP = 4  # entries checked against the cache per add


@dataclass(frozen=True, slots=True)
class KnownChunk:
    """A chunk stored in ``ctx`` (the storing tenant's context): its whole chunk's tokens."""

    ctx: CacheContext
    namespace: str
    epoch: int
    tokens: tuple[int, ...]


class KnownChunks:
    """Chunk id -> ``KnownChunk``, and the index of their embeddings (None: no fallback,
    the book still serves purges). Thread-safe: one lock, held for dict operations only
    (never while the cache or the index is asked)."""

    def __init__(
        self, chunks: Chunks, index: ChunkIndex | None = None, capacity: int = KNOWN_CHUNKS, sweep: int = SWEEP
    ) -> None:
        self.chunks = chunks
        self.index = index
        self.capacity = capacity
        self.sweep_size = sweep
        self._entries: OrderedDict[bytes, KnownChunk] = OrderedDict()
        self._epochs: dict[str, int] = {}  # model -> the index's epoch of its chunks now
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def epoch(self, model: str) -> int:
        with self._lock:
            return self._epochs.get(model, 0)

    @staticmethod
    def chunk_id(ctx: CacheContext, namespace: str, tokens: Sequence[int]) -> bytes:
        """A chunk's id in the index: its chunk context (less the tenant, which the
        namespace stands for) and tokens; the same in every request that stores it."""
        name = encode((namespace, ctx.model, ctx.adapter, ctx.tokenizer, chunk_context(ctx).extra))
        return xxhash.xxh3_128_digest(name + token_bytes(tokens))

    # ------------------------------------------------------------------ add, query

    def add(self, ctx: CacheContext, tokens: Sequence[int], vector: np.ndarray | None) -> bool:
        """Know the chunk of ``tokens`` stored in ``ctx`` (and index ``vector``); whether
        it was taken (False: its epoch was bumped meanwhile). Sweeps a few old entries."""
        tokens = tuple(int(t) for t in tokens)
        namespace = self.chunks.namespace(ctx)
        epoch = self.epoch(ctx.model)
        key = self.chunk_id(ctx, namespace, tokens)
        indexed = ChunkEntry(key, namespace, ctx.model, epoch)
        if self.index is not None and vector is not None and not self.index.insert(indexed, vector):
            return False
        with self._lock:
            self._entries[key] = KnownChunk(ctx, namespace, epoch, tokens)
            self._entries.move_to_end(key)
            evicted = [self._entries.popitem(last=False) for _ in range(len(self._entries) - self.capacity)]
        for old, entry in evicted:
            self._unindex(old, entry)
        self.sweep()
        return True

    def candidates(
        self, ctx: CacheContext, vector: np.ndarray, k: int, min_similarity: float
    ) -> list[tuple[bytes, KnownChunk]]:
        """The index's nearest chunks ``ctx`` may reuse that the cache still holds, best
        first; those it no longer holds leave the index now."""
        if self.index is None:
            return []
        namespace = self.chunks.namespace(ctx)
        hits = self.index.query(vector, namespace, ctx.model, self.epoch(ctx.model), k, min_similarity)
        out = []
        for hit in hits:
            with self._lock:
                entry = self._entries.get(hit.chunk_id)
            if entry is None or entry.namespace != hit.entry.namespace:
                self.index.remove(hit.chunk_id, hit.entry.namespace)  # NOTE: not ours to resolve: cannot be used
                continue
            if not self.chunks.contains(ctx, entry.tokens):
                self.forget(hit.chunk_id)
                continue
            out.append((hit.chunk_id, entry))
        return out

    # ------------------------------------------------------------------ removal

    def forget(self, key: bytes) -> bool:
        """The chunk ``key`` is gone from the cache: it leaves the book and the index."""
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is not None:
            self._unindex(key, entry)
        return entry is not None

    def sweep(self, n: int | None = None) -> int:
        """Check the ``n`` oldest entries against the cache (then they are the newest);
        the dead leave. Returns how many left."""
        with self._lock:
            n = min(self.sweep_size if n is None else n, len(self._entries))
            batch = []
            for _ in range(n):
                key, entry = self._entries.popitem(last=False)
                self._entries[key] = entry
                batch.append((key, entry))
        dead = [key for key, entry in batch if not self.chunks.contains(entry.ctx, entry.tokens)]
        return sum(self.forget(key) for key in dead)

    def forget_tenant(self, tenant: str) -> int:
        """Every chunk ``tenant`` stored leaves the book and the index; how many of them
        the cache still held (checked first: the caller purges the cache after)."""
        with self._lock:
            mine = [(k, e) for k, e in self._entries.items() if e.ctx.tenant == tenant]
        held = sum(1 for _, e in mine if self.chunks.contains(e.ctx, e.tokens))
        for key, _ in mine:
            self.forget(key)
        return held

    def forget_prefix(self, ctx: CacheContext, prefix: Sequence[int]) -> int:
        """The chunks ``ctx`` can see whose tokens start with ``prefix`` leave; how many."""
        prefix = tuple(int(t) for t in prefix)
        visible = {self.chunks.namespace(ctx), PUBLIC}
        with self._lock:
            gone = [
                k
                for k, e in self._entries.items()
                if e.namespace in visible
                and (e.ctx.model, e.ctx.adapter, e.ctx.tokenizer, e.ctx.extra)
                == (ctx.model, ctx.adapter, ctx.tokenizer, ctx.extra)
                and e.tokens[: len(prefix)] == prefix
            ]
        return sum(self.forget(key) for key in gone)

    def bump(self, model: str) -> int:
        """A new epoch of ``model``: every entry of its chunks leaves, and the index refuses
        late inserts of the old one. Returns the new epoch."""
        with self._lock:
            old = self._epochs.get(model, 0)
            self._epochs[model] = old + 1
            gone = [k for k, e in self._entries.items() if e.ctx.model == model]
            for key in gone:
                del self._entries[key]
        if self.index is not None:
            self.index.drop_epoch(model, old)
        return old + 1

    def _unindex(self, key: bytes, entry: KnownChunk) -> None:
        if self.index is not None:
            self.index.remove(key, entry.namespace)
