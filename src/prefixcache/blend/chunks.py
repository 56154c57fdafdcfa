"""The chunk store: segments of a prompt (documents, tool lists, messages) with their KV
computed alone, from position 0, found by content wherever they appear.

A chunk is named by ``chunk_keys.ChunkKeys.key``: its context root (seed, model and
epoch, adapter and epoch, tokenizer, namespace, extra key) and its tokens, never its
position. Everything else is the block cache's rules, applied to chunks:

- namespaces: tenancy's rule (shared: public; namespace and partitioned: the tenant).
  A get looks in the tenant's namespace, then in the public one. A chunk is public only
  when stored with ``public=True`` (an operator's declaration, like
  ``PrefixCache.declare_public``) or published by ``publish`` (``min_tenants`` distinct
  tenants sent it, and it has ``min_tokens`` tokens): a tenant never sees another's.
- capacity: the tiers of ``config.tiers``, each with its policy; in partitioned mode each
  namespace's pool in a tier holds at most its share (``chunk_ledger``).
- epochs: ``bump_epoch`` changes the keys of the model's chunks (unreachable at once)
  and reclaims their frames; ``purge`` removes a tenant's, or all; ``ttl_seconds``
  expires chunks not used for that long.
- storage: frames of the codec, each read verified (key, token checksum, shape, dtype,
  payload checksum where the store did not check it) and the stored tokens compared:
  a missing or bad frame is a miss, counted, never wrong bytes.

Decide, move, commit: the ledger decides under the lock; frames are encoded, written,
read, verified and deleted outside it; a short commit records what happened.

A restart: a disk tier's frames are listed on open as orphans (owner unknown, evicted by
the policy, removed by ``purge()``); a get computes its key, finds the frame, checks its
tokens and adopts it. A Redis tier is probed on a local miss, so processes sharing it
share chunks. Disk tiers use ``<path>/chunks`` and Redis keys ``<namespace>:chunks:``,
beside (never inside) the block cache's.

NOTE: epochs live in this process (as the block cache's do): a restarted process starts
every model at epoch 0 again, and a bump in one process does not reach another sharing a
Redis tier; purge such a tier when a model changes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import numpy as np

from prefixcache.blend.chunk_keys import ChunkKeys, Epochs
from prefixcache.blend.chunk_ledger import ChunkLedger
from prefixcache.blend.chunk_types import Chunk, ChunkKV, ChunkStats, Drop, Pinned, Read, TierBook
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.events import RemovalReason
from prefixcache.hashing import CacheContext, get_hash, token_bytes
from prefixcache.storage import codec
from prefixcache.storage.base import TierError, TierFull, TierStore
from prefixcache.storage.disk import DiskStore
from prefixcache.storage.memory import MemoryStore
from prefixcache.storage.open import open_store
from prefixcache.tenancy import PUBLIC, Tenancy

__all__ = ["ChunkKV", "ChunkStats", "ChunkStore", "Pinned"]

Tokens = Sequence[int] | np.ndarray


class ChunkStore:
    """Chunks in the tiers of ``config``; see the module's docstring."""

    def __init__(
        self,
        config: CacheConfig,
        layout: KVLayout | None = None,
        *,
        max_chunk_tokens: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        stores: Sequence[TierStore] | None = None,
    ) -> None:
        layout = layout if layout is not None else config.kv_layout
        if layout is None:
            raise ValueError("a chunk store needs a KVLayout (layout= or config.kv_layout)")
        if not config.tiers:
            raise ValueError("a chunk store needs at least one tier (config.tiers)")
        if isinstance(max_chunk_tokens, bool) or not isinstance(max_chunk_tokens, int) or max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be an integer >= 1, got {max_chunk_tokens!r}")
        self.config = config
        self.layout = layout
        self.max_chunk_tokens = max_chunk_tokens
        self._clock = clock
        self._tenancy = Tenancy(config)
        key_len = len(get_hash(config.hash)().digest())
        frame_bytes = codec.encoded_size(layout.shape(max_chunk_tokens), layout.dtype, key_len)
        if stores is None:
            stores = [open_store(_chunk_tier(t, config.seed), frame_bytes, config.seed) for t in config.tiers]
        if len(stores) != len(config.tiers):
            raise ValueError(f"{len(stores)} stores for {len(config.tiers)} tiers")
        self._stores = list(stores)
        self._names = [t.label for t in config.tiers]
        books = [_book(store, tier.policy or config.policy) for store, tier in zip(stores, config.tiers, strict=True)]
        self._keys = ChunkKeys(config.seed, get_hash(config.hash))
        self._ledger = ChunkLedger(config, books, self._keys, config.ttl_seconds)
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self._errors: dict[str, int] = {}
        for k, store in enumerate(self._stores):
            if isinstance(store, DiskStore):
                held = store.keys()
                self._ledger.adopt_orphans(k, [(key, _frame_len(store, key)) for key in held])

    # ------------------------------------------------------------------ keys

    def namespace(self, ctx: CacheContext, public: bool = False) -> str:
        return PUBLIC if public else self._tenancy.namespace(ctx.tenant)

    def key(self, ctx: CacheContext, tokens: Tokens, public: bool = False) -> bytes:
        """The chunk's key in ``ctx``'s namespace (or the public one) at the current epochs."""
        with self._lock:
            epochs = self._keys.epochs(ctx)
        return self._keys.key(ctx, self._tokens(tokens), self.namespace(ctx, public), epochs)

    def epoch(self, ctx: CacheContext) -> int:
        """The model epoch ``ctx``'s chunks are keyed at now (an embedding index partitions by it)."""
        with self._lock:
            return self._keys.epochs(ctx).model

    def _lookup_keys(self, ctx: CacheContext, data: bytes) -> tuple[list[bytes], list[bool], Epochs]:
        """The keys a get of ``ctx`` may find: its own namespace's, then the public one's."""
        with self._lock:
            epochs = self._keys.epochs(ctx)
        own = self.namespace(ctx)
        spaces = [own] if own == PUBLIC else [own, PUBLIC]
        keys = [self._keys.key(ctx, data, ns, epochs) for ns in spaces]
        return keys, [ns == PUBLIC for ns in spaces], epochs

    def _tokens(self, tokens: Tokens) -> bytes:
        data = token_bytes(tokens, self.config.vocab_size)
        if not data:
            raise ValueError("a chunk needs at least one token")
        if len(data) // 4 > self.max_chunk_tokens:
            raise ValueError(f"a chunk of {len(data) // 4} tokens is above max_chunk_tokens={self.max_chunk_tokens}")
        return data

    # ------------------------------------------------------------------ put

    def put(self, ctx: CacheContext, tokens: Tokens, kv: np.ndarray, *, public: bool = False) -> bool:
        """Store ``kv`` (``layout.shape(len(tokens))``) as the chunk of ``tokens``; whether
        it was written (``False``: stored already, or no room that is not pinned).
        ``public=True`` stores it in the public namespace, where every tenant of the
        context finds it: an operator's declaration, never a tenant's."""
        data = self._tokens(tokens)
        shape = self.layout.shape(len(data) // 4)
        if not isinstance(kv, np.ndarray) or kv.shape != shape:
            raise ValueError(f"kv must be a numpy array of shape {shape}, got {getattr(kv, 'shape', type(kv))}")
        with self._lock:
            epochs = self._keys.epochs(ctx)
        namespace = self.namespace(ctx, public)
        stored = self._store(ctx, data, kv, namespace, epochs, ctx.tenant if not public else PUBLIC)
        self._publish(ctx, data, kv, epochs)
        return stored

    def _store(
        self, ctx: CacheContext, data: bytes, kv: np.ndarray, namespace: str, epochs: Epochs, owner: str
    ) -> bool:
        key = self._keys.key(ctx, data, namespace, epochs)
        frame = codec.encode(key, data, kv, dtype=self.layout.dtype)
        chunk = Chunk(key, namespace, owner, ctx.model, ctx.adapter, data, len(frame))
        with self._lock:
            planned, tiers = self._ledger.begin_put(chunk, epochs, self._clock())
            drops = self._ledger.take_drops()
        self._run(drops)
        if planned is None:
            return False
        self._write(planned, frame, tiers)
        return True

    def _write(self, chunk: Chunk, frame: bytes, tiers: tuple[int, ...]) -> None:
        ok: set[int] = set()
        for k in tiers:
            try:
                self._stores[k].put(chunk.key, frame)
                ok.add(k)
            except TierError as exc:
                self._error("full" if isinstance(exc, TierFull) else "write")
        with self._lock:
            self._ledger.end_put(chunk, ok, set(tiers) - ok)
            drops = self._ledger.take_drops()
        self._run(drops)

    def _publish(self, ctx: CacheContext, data: bytes, kv: np.ndarray, epochs: Epochs) -> None:
        """hot-chunk publication, by the block cache's rule: ``min_tenants`` distinct tenants."""
        promo = self._tenancy.publish
        if promo is None or len(data) // 4 < promo.min_tokens:
            return
        public_key = self._keys.key(ctx, data, PUBLIC, epochs)
        with self._lock:
            seen = self._tenancy.count(public_key, ctx.tenant)
            known = public_key in self._ledger.index
        if seen >= promo.min_tenants and not known:
            self._store(ctx, data, np.ascontiguousarray(kv), PUBLIC, epochs, PUBLIC)

    # ------------------------------------------------------------------ get

    def get(self, ctx: CacheContext, tokens: Tokens) -> ChunkKV | None:
        """The chunk's KV, verified against ``tokens``, from ``ctx``'s namespace or the
        public one; ``None`` on any miss (absent, stale, expired, missing or bad frame)."""
        data = self._tokens(tokens)
        keys, publics, epochs = self._lookup_keys(ctx, data)
        with self._lock:
            read = self._ledger.begin_get(keys, data, self._clock())
            drops = self._ledger.take_drops()
        self._run(drops)
        found = self._read(read, data) if read is not None else None
        if found is None:
            found = self._probe(ctx, keys, data, epochs)
        with self._lock:
            if found is None:
                self._misses += 1
            else:
                self._hits += 1
        if found is not None:
            self._publish(ctx, data, found.kv, epochs)
        return found if found is None else dataclasses.replace(found, public=publics[keys.index(found.key)])

    def _read(self, read: Read, data: bytes) -> ChunkKV | None:
        chunk, served, found = read.chunk, None, None
        try:
            for k in read.tiers:
                found = self._fetch(k, chunk.key, data)
                if found is not None:
                    served = k
                    break
                with self._lock:
                    self._ledger.lose(chunk, k)
        finally:
            with self._lock:
                self._ledger.end_get(chunk, served, self._clock())
                drops = self._ledger.take_drops()
            self._run(drops)
        if served is not None and served > 0 and found is not None:
            self._promote(chunk, served, found)
        return found

    def _promote(self, chunk: Chunk, served: int, found: ChunkKV) -> None:
        """A hit below the fastest tier: copy the chunk into the tiers that lack it."""
        with self._lock:
            planned, tiers = self._ledger.begin_put(chunk, None, self._clock(), have=served)
            drops = self._ledger.take_drops()
        self._run(drops)
        if planned is not None and tiers:
            self._write(planned, codec.encode(chunk.key, chunk.data, found.kv, dtype=self.layout.dtype), tiers)

    def _fetch(self, k: int, key: bytes, data: bytes, probe: bool = False) -> ChunkKV | None:
        """Tier ``k``'s frame of ``key``, verified against ``data``; copied out of a slab
        before it is checked, so that a slot reused meanwhile fails the check."""
        store = self._stores[k]
        try:
            frame = store.get_many([key])[0]
        except TierError:
            frame = None
        if frame is None:
            if not probe:
                self._error("missing")
            return None
        if store.private:
            frame = bytes(frame)
        try:
            kv = codec.decode(
                frame,
                key=key,
                tokens=data,
                shape=self.layout.shape(len(data) // 4),
                dtype=self.layout.dtype,
                check_payload=not store.verifies_reads,
            )
        except codec.FrameError as exc:
            self._error(type(exc).__name__)
            return None
        return ChunkKV(key, len(data) // 4, kv, False, self._names[k])

    def _probe(self, ctx: CacheContext, keys: list[bytes], data: bytes, epochs: Epochs) -> ChunkKV | None:
        """A local miss: read the shared tiers (Redis), and the orphans of a disk, for the
        request's own keys; adopt what verifies, and copy it into the other tiers."""
        with self._lock:
            orphans = [c for key in keys if (c := self._ledger.index.get(key)) is not None and c.orphan]
            for chunk in orphans:
                chunk.pins += 1
        try:
            for key in keys:
                for k, store in enumerate(self._stores):
                    orphan = next((c for c in orphans if c.key == key and k in c.held), None)
                    if store.kind != "redis" and orphan is None:
                        continue
                    found = self._fetch(k, key, data, probe=orphan is None)
                    if found is not None:
                        self._adopt(ctx, key, data, epochs, k, found)
                        return found
                    if orphan is not None:
                        with self._lock:
                            self._ledger.lose(orphan, k)
        finally:
            with self._lock:
                self._ledger.unpin(orphans)
                drops = self._ledger.take_drops()
            self._run(drops)
        return None

    def _adopt(self, ctx: CacheContext, key: bytes, data: bytes, epochs: Epochs, k: int, found: ChunkKV) -> None:
        public = key != self._keys.key(ctx, data, self.namespace(ctx), epochs)
        namespace = self.namespace(ctx, public)
        frame = codec.encode(key, data, found.kv, dtype=self.layout.dtype)
        owner = PUBLIC if public else ctx.tenant
        chunk = Chunk(key, namespace, owner, ctx.model, ctx.adapter, data, len(frame))
        with self._lock:
            planned, tiers = self._ledger.begin_put(chunk, epochs, self._clock(), have=k)
            drops = self._ledger.take_drops()
        self._run(drops)
        if planned is not None and tiers:
            self._write(planned, frame, tiers)

    # ------------------------------------------------------------------ pins, epochs, purge

    def contains(self, ctx: CacheContext, tokens: Tokens) -> bool:
        """Whether this process knows the chunk (visible to ``ctx``); no I/O, so a chunk
        only another process put in a shared tier is not known until a get finds it."""
        data = self._tokens(tokens)
        keys, _, _ = self._lookup_keys(ctx, data)
        with self._lock:
            visible = self._ledger.visible(keys, data, self._clock())
            drops = self._ledger.take_drops()
        self._run(drops)
        return visible

    @contextmanager
    def pin(self, ctx: CacheContext, chunks: Sequence[Tokens]) -> Iterator[Pinned]:
        """Hold the stored ones of ``chunks`` in their tiers (never evicted) while a
        blended prefill uses them; a purge or bump still hides them at once."""
        lookups = [self._lookup_keys(ctx, self._tokens(tokens))[0] for tokens in chunks]
        with self._lock:
            pinned = [self._ledger.pin(keys)[:1] for keys in lookups]
        try:
            yield Pinned(tuple(p[0].key if p else None for p in pinned))
        finally:
            with self._lock:
                self._ledger.unpin([c for p in pinned for c in p])
                drops = self._ledger.take_drops()
            self._run(drops)

    def bump_epoch(self, model: str, adapter: str | None = None) -> int:
        """A new epoch for ``model`` (or one adapter of it): its chunks are unreachable at
        once and their frames deleted (once no prefill pins them)."""
        with self._lock:
            epoch = self._ledger.bump(model, adapter)
            drops = self._ledger.take_drops()
        self._run(drops)
        return epoch

    def purge(self, tenant: str | None = None) -> int:
        """Remove ``tenant``'s chunks (or every chunk this store knows); how many."""
        with self._lock:
            count = self._ledger.purge(tenant)
            drops = self._ledger.take_drops()
        self._run(drops)
        return count

    def _run(self, drops: list[Drop]) -> None:
        """Delete frames outside the lock, then let their keys be written again."""
        if not drops:
            return
        for drop in drops:
            try:
                self._stores[drop.tier].delete(drop.key)
            except TierError:
                self._error("delete")
        with self._lock:
            self._ledger.dropped(drops)

    def _error(self, kind: str) -> None:
        with self._lock:
            self._errors[kind] = self._errors.get(kind, 0) + 1

    # ------------------------------------------------------------------ stats, close

    def stats(self) -> ChunkStats:
        with self._lock:
            ledger = self._ledger
            chunks = [c for c in ledger.index.values() if c.held]
            return ChunkStats(
                chunks=len(chunks),
                bytes=sum(c.frame_bytes for c in chunks),
                pinned=sum(1 for c in chunks if c.pins),
                hits=self._hits,
                misses=self._misses,
                collisions=ledger.collisions,
                errors=MappingProxyType(dict(self._errors)),
                removed=MappingProxyType({r.label: ledger.removed[r] for r in RemovalReason}),
                tier_bytes=tuple(book.used for book in ledger.tiers),
                tier_evictions=tuple(book.evictions for book in ledger.tiers),
            )

    def close(self) -> None:
        for store in self._stores:
            store.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False


def _chunk_tier(tier: TierConfig, seed: str) -> TierConfig:
    """The tier's configuration for chunks: a disk's subdirectory, Redis keys of their own."""
    if tier.kind == "disk":
        assert tier.path is not None
        return dataclasses.replace(tier, path=str(Path(tier.path) / "chunks"))
    if tier.kind == "redis":
        return dataclasses.replace(tier, namespace=f"{tier.namespace or seed}:chunks")
    return tier


def _book(store: TierStore, policy: str) -> TierBook:
    slot = store.slot_bytes if isinstance(store, MemoryStore) else None  # a device store is one too
    return TierBook(store.capacity_bytes, slot, policy)


def _frame_len(store: DiskStore, key: bytes) -> int:
    # NOTE: the length the disk's own scan found on open; the store offers no accessor.
    return store._index.get(key, 0)
