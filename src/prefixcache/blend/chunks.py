"""Chunks are blocks: a segment of a prompt (a document, a tool list, a message) with
its KV computed alone, from position 0, stored in the one ``PrefixCache`` as a block
chain under a chunk root, and found by content wherever it appears in a prompt.

A chunk's KV is computed from position 0, so it is a prefix in a context of its own::

    prompt context  CacheContext(tenant, model, adapter, tokenizer, extra)
    chunk context   the same, with extra + (CHUNK_EXTRA,)     <- ``chunk_context``
                      root ── block ── block ── [tail]        <- the chunk's tokens

Everything else is the cache's: keys (the marker is one more typed, length-prefixed
field of the root, so a chunk's key never equals a prompt's, invariant 1), isolation
(the tenant's namespace or pool, the public one, ``declare_public`` and k-anonymous
publication), model and adapter epochs (one ``bump_epoch`` invalidates blocks and
chunks), ``purge`` and ``purge_prefix``, TTL, quotas, eviction, tiers, the background
writer (a chunk's write to a disk or Redis tier never runs on the caller's thread),
restarts (a reopened disk is probed) and processes sharing Redis, events and metrics.

The whole-chunk rule. A chunk is stored as the cache stores any sequence: its full
blocks, and its tail as a partial block when the cache keeps them (``partial_blocks``).
A hit covers a whole chunk of the line asked for: the line whole, or its whole-block
prefix (what a cache without partial blocks holds, and what a public copy holds: the
cache publishes full blocks only). Never a cut inside a block: a match that ends
elsewhere, or a load that returns less than the chunk (a tier lost a block), is a miss.
The rest of a line that hit its whole-block prefix is prefilled fresh with the prompt.

NOTE: what the rule costs without partial blocks: a line of n tokens reuses
``n // block_size * block_size`` of them, losing ``n mod block_size`` (on average
``(block_size - 1) / 2``), which the blended prefill computes with the fresh tokens
around it. On the gate's evaluation set (14 paragraphs, 121 tokens on average) that
keeps 93.5 % of the chunk tokens at block_size 16 and 86.9 % at 32. A cache with
``partial_blocks`` (the server's default) loses nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixcache.cache import Match, PrefixCache
from prefixcache.hashing import CacheContext
from prefixcache.tenancy import namespace_of

__all__ = ["CHUNK_EXTRA", "ChunkKV", "Chunks", "chunk_context"]

CHUNK_EXTRA = ("prefixcache/blend/chunk", 1)  # the marker of a chunk root: a typed field of the key
Tokens = Sequence[int] | np.ndarray


def chunk_context(ctx: CacheContext) -> CacheContext:
    """The context ``ctx``'s chunks are stored in: the same tenant, model, adapter and
    tokenizer (so the same isolation and epochs), one more extra key."""
    return dataclasses.replace(ctx, extra=(*ctx.extra, CHUNK_EXTRA))


@dataclass(frozen=True, slots=True)
class ChunkKV:
    """A whole chunk's KV, ``[layers, 2, kv_heads, tokens, head_dim]``, positions from 0:
    the first ``tokens`` tokens of the line asked for."""

    tokens: int
    kv: np.ndarray[Any, Any]
    tier_tokens: Mapping[str, int]


class Chunks:
    """The chunks of one ``PrefixCache`` (which owns every byte and book of them); see
    the module's docstring. Thread-safe as the cache is: this holds no state of its own."""

    def __init__(self, cache: PrefixCache, max_chunk_tokens: int = 4096) -> None:
        if cache.config.kv_layout is None or not cache.config.tiers:
            raise ValueError("chunks need a cache with tiers and a kv_layout: they are KV blocks")
        if isinstance(max_chunk_tokens, bool) or not isinstance(max_chunk_tokens, int) or max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be an integer >= 1, got {max_chunk_tokens!r}")
        self.cache = cache
        self.max_chunk_tokens = max_chunk_tokens

    def namespace(self, ctx: CacheContext) -> str:
        """Where ``ctx``'s chunks live: the cache's rule (shared: public; else the tenant)."""
        return namespace_of(self.cache.config.isolation, ctx.tenant)

    def reusable(self, n: int) -> int:
        """How many leading tokens of a line of ``n`` are stored as its chunk."""
        if self.cache.config.partial_blocks:
            return n
        bs = self.cache.config.block_size
        return n // bs * bs

    def whole(self, n: int, cached: int) -> int:
        """The whole chunk of a line of ``n`` tokens a match of ``cached`` covers: the line
        (with partial blocks), else its whole-block prefix; 0 when neither is covered."""
        if cached >= n and self.cache.config.partial_blocks:
            return n
        floor = n // self.cache.config.block_size * self.cache.config.block_size
        return floor if cached >= floor else 0

    # ------------------------------------------------------------------ reads

    def match(self, ctx: CacheContext, tokens: Tokens) -> Match:
        """The cache's match of the line in ``ctx``'s chunk context: a pin on it until
        released (a context manager); ``whole(len(tokens), m.cached_tokens)`` is the chunk."""
        return self.cache.match(self._check(tokens), chunk_context(ctx))

    def get(self, ctx: CacheContext, tokens: Tokens) -> ChunkKV | None:
        """The KV of the line's whole chunk that ``ctx`` may see (its own namespace's or a
        public copy), verified by the cache; ``None`` on a miss (absent, stale, expired,
        purged, cut inside a block, or a tier that returned less)."""
        line = self._check(tokens)
        with self.cache.match(line, chunk_context(ctx)) as m:
            take = self.whole(len(line), m.cached_tokens)
            if not take:
                return None
            loaded = self.cache.load(m)
        if loaded.tokens < take:
            return None  # NOTE: the whole-chunk rule: a shorter load is a miss, never a shorter chunk
        kv = loaded.kv if loaded.tokens == take else np.ascontiguousarray(loaded.kv[:, :, :, :take])
        return ChunkKV(take, kv, loaded.tier_tokens)

    def contains(self, ctx: CacheContext, tokens: Tokens) -> bool:
        """Whether the line's chunk, as this cache stores it, is there for ``ctx`` now
        (``PrefixCache.peek``: nothing pinned, touched or counted)."""
        line = self._check(tokens)
        want = self.reusable(len(line))
        return bool(want) and self.cache.peek(line, chunk_context(ctx)).cached_tokens >= want

    # ------------------------------------------------------------------ writes

    def put(self, ctx: CacheContext, tokens: Tokens, kv: Any) -> int:
        """Store the line's chunk: ``kv`` holds the KV of at least its first
        ``reusable(len(tokens))`` tokens, computed alone from position 0. Returns the
        tokens newly stored (0: there already, too short for one block, or no room).
        The first tier's copy is made now; slower tiers' are queued for the writer."""
        line = self._check(tokens)
        n = self.reusable(len(line))
        if not n:
            return 0
        return self.cache.insert(line[:n], chunk_context(ctx), kv=kv)

    def declare_public(self, ctx: CacheContext, tokens: Tokens) -> None:
        """An operator's word that this chunk may be reused by every tenant of the model
        (``PrefixCache.declare_public``): its full blocks go to the public pool when next stored."""
        self.cache.declare_public(self._check(tokens), chunk_context(ctx))

    def purge_prefix(self, ctx: CacheContext, tokens: Tokens) -> int:
        """Remove every chunk ``ctx`` can see whose tokens start with ``tokens``; the
        tokens removed (``PrefixCache.purge_prefix`` in the chunk context)."""
        prefix = [int(t) for t in tokens]
        if len(prefix) > self.max_chunk_tokens:
            return 0  # no chunk is that long
        return self.cache.purge_prefix(prefix, chunk_context(ctx))

    def _check(self, tokens: Tokens) -> list[int]:
        line = [int(t) for t in tokens]
        if not line:
            raise ValueError("a chunk needs at least one token")
        if len(line) > self.max_chunk_tokens:
            raise ValueError(f"a chunk of {len(line)} tokens is above max_chunk_tokens={self.max_chunk_tokens}")
        return line
