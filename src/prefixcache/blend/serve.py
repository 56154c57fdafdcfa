"""The blend mode's request path: which cached chunks a prompt reuses beyond its exact
prefix, the segments a blended prefill runs, and the chunks kept for later prompts.

    prompt tokens  [ exact prefix (PrefixCache) | line | \\n | line | ... | suffix ]
                                                   |
                   every line after the prefix of min..max_chunk_tokens is a candidate:
                     1. the cache, by content (chunk context: own namespace, then public)
                     2. else the embedding fallback: the nearest chunks of the tenant's
                        ANN partition, then token alignment decides the reused spans
                   ──> [Reused prefix] Fresh | Reused | Fresh | Reused ... | Fresh suffix
                   after the answer: each line that missed is prefilled alone, stored
                   and embedded

A line is a run of tokens with no newline and no special token: in a chat, a paragraph
of a message (a RAG document, a tool description), whichever message it is in and
wherever the prompt puts it. Lines stop before the prompt's last token, whose logits
start decoding, so a blended prompt always ends with a fresh segment.

Chunks are blocks of the one ``PrefixCache`` under a chunk root (``chunks``): a line's
chunk is what the cache stores of it (the whole line with ``partial_blocks``, else its
whole-block prefix), and a hit covers a whole chunk; the rest of a line is prefilled
fresh. Isolation is the cache's (a get finds the tenant's own chunks and public ones)
and the index's (a query opens the tenant's partition and the public one); a fallback
candidate is loaded from the cache with the requester's own context, so a chunk of
another tenant can be neither found nor loaded. The fallback's book (``known``)
follows the cache's removals: a chunk evicted, expired, purged or invalidated leaves it.

NOTE: one ``Blender`` serves one engine's worker thread; the admin routes purge and bump
from others: the book locks itself, and the cache and the index lock themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixcache.blend.align import align
from prefixcache.blend.ann import ChunkIndex
from prefixcache.blend.chunks import Chunks
from prefixcache.blend.embed import Embedder
from prefixcache.blend.known import KnownChunks
from prefixcache.blend.plan import Epic, Fresh, Reused, Segment
from prefixcache.blend.prefill import BlendResult, prefill_chunk
from prefixcache.blend.serve_types import BlendConfig, BlendUsage, Outcome
from prefixcache.engine.kv import to_numpy, to_torch
from prefixcache.engine.model import LoadedModel, dtype_of
from prefixcache.hashing import CacheContext

__all__ = ["Blender", "Found", "Line", "Lookup", "account"]

log = logging.getLogger(__name__)

CANDIDATES = 3  # nearest chunks tried per line by the fallback


@dataclass(frozen=True, slots=True)
class Line:
    """``tokens[start:end]`` of the prompt: a candidate chunk."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Found:
    """Cached KV for ``tokens[start : start + kv.shape[3]]``, computed at positions
    ``original_start..`` of its chunk."""

    start: int
    kv: torch.Tensor
    original_start: int

    @property
    def length(self) -> int:
        return int(self.kv.shape[3])


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the cache holds for a prompt's lines: the reused pieces in prompt
    order, and the lines to store after the request (missed, or only similar)."""

    found: tuple[Found, ...]
    store: tuple[Line, ...]
    exact: int
    similar: int
    missed: int


class Blender:
    """Finds, lays out and keeps the chunks of one model's prompts."""

    def __init__(
        self,
        config: BlendConfig,
        loaded: LoadedModel,
        chunks: Chunks,
        embedder: Embedder | None = None,
        index: ChunkIndex | None = None,
    ) -> None:
        if (embedder is None) != (index is None):
            raise ValueError("the embedding fallback needs both an embedder and an index")
        self.config = config
        self.loaded = loaded
        self.chunks = chunks
        self.embedder = embedder
        self.index = index
        self.known = KnownChunks(chunks, index)
        self._dtype = dtype_of(loaded.kv.dtype)
        tokenizer = loaded.tokenizer
        self._special = frozenset(int(i) for i in tokenizer.all_special_ids) | frozenset(
            int(i) for i in tokenizer.get_added_vocab().values()
        )
        self._breaks: dict[int, bool] = {}  # token id -> ends a line (newline or special)

    # ------------------------------------------------------------------ lines

    def lines(self, tokens: Sequence[int], begin: int) -> list[Line]:
        """The candidate chunks of ``tokens`` from position ``begin`` (see the module)."""
        out: list[Line] = []
        start = begin
        last = len(tokens) - 1  # NOTE: the last token is always prefilled: no line reaches it
        for i in range(begin, last + 1):
            if i == last or self._breaks_line(int(tokens[i])):
                if self.config.min_chunk_tokens <= i - start <= self.config.max_chunk_tokens:
                    out.append(Line(start, i))
                start = i + 1
        return out

    def _text(self, piece: Sequence[int]) -> str:
        return str(self.loaded.tokenizer.decode(list(piece)))

    def _breaks_line(self, token: int) -> bool:
        known = self._breaks.get(token)
        if known is None:
            known = token in self._special or "\n" in self._text([token])
            self._breaks[token] = known
        return known

    # ------------------------------------------------------------------ lookup

    def lookup(self, ctx: CacheContext, tokens: Sequence[int], begin: int) -> Lookup:
        """The cached KV the lines of ``tokens`` after ``begin`` may reuse."""
        found: list[Found] = []
        keep: list[Line] = []
        exact = similar = 0
        for line in self.lines(tokens, begin):
            piece = tuple(int(t) for t in tokens[line.start : line.end])
            chunk = self.chunks.get(ctx, piece)
            if chunk is not None:  # the whole line, or its whole-block prefix: the rest is fresh
                found.append(Found(line.start, to_torch(chunk.kv, self._dtype), 0))
                exact += 1
                continue
            keep.append(line)
            spans = self._similar(ctx, piece, line.start)
            if spans:
                found.extend(spans)
                similar += 1
        return Lookup(tuple(found), tuple(keep), exact, similar, len(keep) - similar)

    def _similar(self, ctx: CacheContext, piece: tuple[int, ...], start: int) -> list[Found]:
        """The embedding fallback: the first near chunk of the tenant's that shares runs of
        tokens with ``piece``; its KV for those runs, at their places in the prompt."""
        if self.embedder is None or self.index is None:
            return []
        vector = self.embedder.embed([self._text(piece)])[0]
        for key, known in self.known.candidates(ctx, vector, CANDIDATES, self.config.min_similarity):
            spans = align(piece, known.tokens, self.config.min_span_tokens)
            if not spans:
                continue
            chunk = self.chunks.get(ctx, known.tokens)  # the requester's own context: isolation holds
            if chunk is None or chunk.tokens < len(known.tokens):
                self.known.forget(key)  # removed since it was checked
                continue
            kv = to_torch(chunk.kv, self._dtype)
            return [
                Found(start + s.prompt_start, kv[:, :, :, s.chunk_start : s.chunk_end], s.chunk_start)
                for s in sorted(spans, key=lambda s: s.prompt_start)
            ]
        return []

    # ------------------------------------------------------------------ segments

    @staticmethod
    def segments(
        tokens: Sequence[int], prefix: int, prefix_kv: torch.Tensor | None, found: Sequence[Found]
    ) -> list[Segment]:
        """The prompt as segments: the exact prefix (KV from the prefix cache, at its own
        positions), the reused pieces, and fresh tokens around them, ending fresh."""
        out: list[Segment] = []
        if prefix:
            if prefix_kv is None or prefix_kv.shape[3] != prefix:
                raise ValueError(f"the exact prefix of {prefix} tokens needs its KV")
            out.append(Reused(tuple(tokens[:prefix]), prefix_kv, 0))
        cursor = prefix
        for piece in found:
            if piece.start < cursor:
                raise ValueError(f"reused pieces overlap or precede the prefix at {piece.start}")
            if piece.start > cursor:
                out.append(Fresh(tuple(tokens[cursor : piece.start])))
            cursor = piece.start + piece.length
            out.append(Reused(tuple(tokens[piece.start : cursor]), piece.kv, piece.original_start))
        out.append(Fresh(tuple(tokens[cursor:])))
        return out

    # ------------------------------------------------------------------ keep

    def remember(self, ctx: CacheContext, tokens: Sequence[int], lines: Sequence[Line]) -> int:
        """Prefill each line's chunk alone, store it in the cache (its slower tiers through
        the writer) and index its embedding; how many were stored whole."""
        stored = 0
        for line in lines:
            piece = tuple(int(t) for t in tokens[line.start : line.end])
            chunk = piece[: self.chunks.reusable(len(piece))]  # NOTE: what the cache would not keep is not computed
            if not chunk or self.chunks.contains(ctx, chunk):
                continue
            self.chunks.put(ctx, chunk, to_numpy(prefill_chunk(self.loaded, chunk)))
            if self.chunks.contains(ctx, chunk):  # whole: room was made for every block of it
                stored += 1
                vector = None if self.embedder is None else self.embedder.embed([self._text(chunk)])[0]
                self.known.add(ctx, chunk, vector)
        return stored

    def purge(self, tenant: str) -> int:
        """The fallback's side of purging ``tenant``: its chunks leave the index. Returns
        how many of them the cache held. The cache's ``purge(tenant)``, which the admin
        route runs after this, removes them, with every other block the tenant stored."""
        return self.known.forget_tenant(tenant)

    def purge_prefix(self, tokens: Sequence[int], ctx: CacheContext) -> int:
        """Remove every chunk ``ctx`` can see whose tokens start with ``tokens`` (in the
        chunk context: prompts' blocks are the cache's ``purge_prefix``), from the cache
        and the index. Returns the chunk tokens removed, as ``PrefixCache.purge_prefix``."""
        self.known.forget_prefix(ctx, tokens)
        return self.chunks.purge_prefix(ctx, tokens)

    def bump_epoch(self, model: str) -> int:
        """The index's side of a new epoch for ``model``: its entries leave, and late
        inserts of the old epoch are refused. The cache's ``bump_epoch`` (which the admin
        route runs too) invalidates the chunks themselves, with every block of the model.
        Returns the index's new epoch."""
        return self.known.bump(model)


def account(
    config: BlendConfig, result: BlendResult, prefix: int, found: Sequence[Found], lookup: Lookup
) -> BlendUsage:
    """Split a blended prefill's reused and recomputed tokens between the exact prefix
    and the chunks: only the chunks' are the blend's.

    NOTE: with ``Epic(k)`` the prefix's share is known (its first ``k`` tokens). A
    deviation plan does not say which tokens it chose; the recomputed ones are counted
    against the chunks first, so ``reused`` is never over-stated (a prefix token, exact
    already, hardly deviates and is rarely chosen)."""
    chunk_tokens = sum(piece.length for piece in found)
    plan = config.plan
    in_prefix = min(plan.k, prefix) if isinstance(plan, Epic) else 0
    recomputed = max(0, min(result.recomputed - in_prefix, chunk_tokens))
    return BlendUsage(
        Outcome.BLENDED,
        reused=chunk_tokens - recomputed,
        recomputed=recomputed,
        lookups_exact=lookup.exact,
        lookups_similar=lookup.similar,
        lookups_missed=lookup.missed,
    )
