"""A hybrid model's blocks in the cache: the partial groups' blocks at boundaries.

The full groups' blocks are chains, stored and loaded as a one-group model's
(``worker.py``). A sliding or state group's block is stored on its own (``groups.py``):
keyed by the group, the digest of every token before it and its own tokens, so a block
that two boundaries need is stored once and none needs a parent. ``GroupBlocks`` answers
where a prompt can resume (a boundary whose every partial block is held), loads a
boundary's blocks into vLLM's, and stores the boundaries a save completes, reading only
blocks vLLM still holds for the request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefixcache.cache.facade import PrefixCache
from prefixcache.cache.invalidations import Stamp
from prefixcache.hashing import CacheContext
from prefixcache.integrations.vllm.groups import NULL_BLOCK, KVGroup, KVGroups, LayerKind, MissReason
from prefixcache.integrations.vllm.paged import GroupedKV, PagedSource

__all__ = ["GroupBlocks"]


class GroupBlocks:
    def __init__(self, cache: PrefixCache, groups: KVGroups, paged: GroupedKV) -> None:
        self.cache = cache
        self.groups = groups
        self.paged = paged

    def _block(self, tokens: Sequence[int] | np.ndarray, i: int) -> Sequence[int] | np.ndarray:
        n = self.groups.block_size
        return tokens[i * n : (i + 1) * n]

    def _held(
        self, base: CacheContext, group: KVGroup, tokens: Sequence[int] | np.ndarray, i: int, digest: bytes
    ) -> bool:
        seen = self.cache.peek(self._block(tokens, i), self.groups.context(base, group, digest))
        return seen.num_blocks == 1

    def resumable(
        self, base: CacheContext, tokens: Sequence[int] | np.ndarray, full: int, digests: Sequence[bytes]
    ) -> tuple[int, MissReason | None]:
        """The largest boundary at most ``full`` blocks (the full groups' chain) whose every
        partial block is held: ``full`` itself or a multiple of the stride below it."""
        groups, n = self.groups, self.groups.block_size
        stride = groups.stride
        candidates = [full, *(range((full - 1) // stride * stride, 0, -stride) if stride else ())]
        reason: MissReason | None = None
        for j in candidates:
            if j <= 0:
                break
            missing = next(
                (
                    g
                    for g in groups.partial
                    for i in reversed(g.needed(j, n))
                    if not self._held(base, g, tokens, i, digests[i])
                ),
                None,
            )
            if missing is None:
                return j, (reason if j < full else None)
            reason = reason or (MissReason.STATE if missing.kind is LayerKind.STATE else MissReason.WINDOW)
        return 0, reason

    def load(
        self,
        base: CacheContext,
        tokens: Sequence[int],
        first: int,
        block_ids: Sequence[Sequence[int]],
        digests: Sequence[bytes],
    ) -> bool:
        """Fill every partial group's non-null blocks of ``first ..`` (vLLM allocated them
        for this boundary); False when one is not held, or not whole: the load fails."""
        n = self.groups.block_size
        for g in self.groups.partial:
            for k, block_id in enumerate(block_ids[g.index]):
                if block_id == NULL_BLOCK:
                    continue
                i = first + k
                with self.cache.match(self._block(tokens, i), self.groups.context(base, g, digests[i])) as m:
                    if m.num_blocks < 1:
                        return False
                    got = self.cache.load(m)
                    if got.tokens < n:
                        return False
                    self.paged[g.index].scatter(got.kv[:, :, :, :n, :], [block_id])
        return True

    def save(
        self,
        base: CacheContext,
        tokens: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        *,
        since_block: int,
        computed: int,
        reached: int,
        digests: Sequence[bytes],
        since: Stamp | None,
        retain_s: float = 0.0,
    ) -> int:
        """Store the partial blocks of each boundary this save completes (its end and the
        stride's multiples after ``since_block``), when vLLM still holds every one of them:
        a sliding group's blocks before the window of the ``computed`` tokens (those before
        the step) may already belong to another request, and a state block holds the state
        at its boundary only when the step ended there (``reached``); each retained for
        ``retain_s`` when asked, as the full groups' chain is. Returns the blocks newly
        stored."""
        groups, n = self.groups, self.groups.block_size
        stored = 0
        for j in groups.boundaries(since_block, len(tokens) // n):
            needed = [(g, i) for g in groups.partial for i in g.needed(j, n)]
            if not all(self._alive(g, i, block_ids[g.index], computed, reached) for g, i in needed):
                continue
            for g, i in needed:
                source = PagedSource(self.paged[g.index], [block_ids[g.index][i]])
                ctx = groups.context(base, g, digests[i])
                stored += self.cache.insert(self._block(tokens, i), ctx, kv=source, since=since) // n
                if retain_s:
                    self.cache.retain(self._block(tokens, i), ctx, retain_s)
        return stored

    def _alive(self, group: KVGroup, i: int, ids: Sequence[int], computed: int, reached: int) -> bool:
        n = self.groups.block_size
        if i >= len(ids) or ids[i] == NULL_BLOCK:
            return False
        if group.kind is LayerKind.SLIDING:
            return i >= max(0, computed - group.window + 1) // n
        return (i + 1) * n == reached  # STATE: the state after block i, if the step ended there
