"""vLLM's KV cache groups, as the connector stores and loads them (vLLM-free).

With its hybrid KV cache manager (HMA) vLLM keeps one block table per *KV cache group*:
the layers of one kind (full attention, a sliding window, a recurrent Mamba or
linear-attention state), every group's block the same bytes. A block of group ``g``
at index ``i`` of a request is what that group's layers hold for tokens ``i * block_size
..``; what a request needs of each group to resume at a block boundary ``j`` differs:

- ``FULL``: every block before ``j`` (a chain, as the cache has always stored them);
- ``SLIDING`` with window ``w``: only the blocks vLLM keeps for a prefix of ``j`` blocks,
  from ``first_kept(j)`` on (``SlidingWindowManager.get_num_skipped_tokens``: the tokens
  before ``j * block_size - w + 1`` are skipped, their blocks are vLLM's null block);
- ``STATE``: the one block that holds the state after block ``j - 1``.

So a cached prefix is a *boundary*: the full groups' chain up to ``j``, and each other
group's blocks for ``j``. A boundary exists only where a request stored it (``Boundaries``
says which: where a save ends, and every ``stride`` blocks of a long prompt); elsewhere
the full chain may go further than the cache can resume, and the lookup says why
(``MissReason``). The sliding and state groups' blocks are each stored on their own,
keyed by the group and a digest of every token before them (``digests``), so a block
two boundaries need is stored once, and none needs its parents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from prefixcache.hashing import CacheContext
from prefixcache.integrations.vllm.scope import Bypass
from prefixcache.kv_groups import LayerKind  # the planner's kinds: one description of a layer group

__all__ = ["NULL_BLOCK", "Found", "KVGroup", "KVGroups", "LayerKind", "MissReason", "describe", "digests", "kv_groups"]

NULL_BLOCK = 0  # vLLM's null block (``BlockPool.null_block``): a skipped block, never read or written


class MissReason(Enum):
    """Why a lookup found less than the full chain it matched (counted per request)."""

    SHORT = "shorter_than_a_block"  # the prompt has no whole block before its last token
    WINDOW = "window_not_kept"  # a sliding group's window for that boundary was not stored
    STATE = "state_not_kept"  # no recurrent state was stored at that boundary


@dataclass(frozen=True, slots=True)
class Found:
    """A lookup's answer: the tokens the cache can resume from (whole blocks), and why it
    is less than the full groups' chain reached, when it is."""

    tokens: int
    reason: MissReason | None = None


@dataclass(frozen=True)
class KVGroup:
    index: int  # vLLM's group index (the position of its block ids)
    kind: LayerKind
    layers: tuple[str, ...]
    window: int = 0  # tokens, SLIDING only

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"KV cache group {self.index} has no layers")
        if (self.kind is LayerKind.SLIDING) != (self.window > 0):
            raise ValueError(f"KV cache group {self.index}: a window belongs to sliding groups only")

    @property
    def signature(self) -> str:
        """What keys this group's blocks apart from every other group's (its kind, window
        and layers: a block of one group never loads into another)."""
        layers = hashlib.blake2b("\x00".join(self.layers).encode(), digest_size=8).hexdigest()
        return f"{self.kind.value}:{self.window}:{len(self.layers)}:{layers}"

    def needed(self, boundary: int, block_size: int) -> range:
        """The block indices of this group a prefix of ``boundary`` blocks needs."""
        if self.kind is LayerKind.FULL:
            return range(0, boundary)
        if self.kind is LayerKind.STATE:
            return range(boundary - 1, boundary) if boundary > 0 else range(0)
        skipped = max(0, boundary * block_size - self.window + 1)
        return range(skipped // block_size, boundary)


@dataclass(frozen=True)
class KVGroups:
    """A model's groups and where its boundaries are kept: at every save's end, and every
    ``stride`` blocks (0: only at save ends)."""

    groups: tuple[KVGroup, ...]
    block_size: int
    stride: int = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("no KV cache groups")
        if not any(g.kind is LayerKind.FULL for g in self.groups):
            raise ValueError("no full-attention KV cache group: the connector needs one to chain a prefix")
        if [g.index for g in self.groups] != list(range(len(self.groups))):
            raise ValueError("KV cache groups must be numbered 0.. in order")

    @classmethod
    def uniform(cls, block_size: int) -> KVGroups:
        """A model of one full-attention group (every layer alike): keyed as ever."""
        return cls((KVGroup(0, LayerKind.FULL, ("all",)),), block_size)

    @property
    def hybrid(self) -> bool:
        """More than one group: each group's blocks are keyed and stored apart."""
        return len(self.groups) > 1

    @property
    def full(self) -> tuple[KVGroup, ...]:
        return tuple(g for g in self.groups if g.kind is LayerKind.FULL)

    @property
    def partial(self) -> tuple[KVGroup, ...]:
        """The groups that keep only some blocks of a prefix (sliding, state)."""
        return tuple(g for g in self.groups if g.kind is not LayerKind.FULL)

    def boundaries(self, before: int, end: int) -> list[int]:
        """The boundaries a save of blocks ``before .. end`` keeps: ``end`` and the
        stride's multiples after ``before``, largest first."""
        out = [end] if end > before else []
        if self.stride:
            step = (end - 1) // self.stride * self.stride
            while step > before:
                out.append(step)
                step -= self.stride
        return out

    def context(self, base: CacheContext, group: KVGroup, digest: bytes | None = None) -> CacheContext:
        """The context of a group's blocks: the full group of a one-group model is the
        request's own context (today's keys); every other group's adds its signature,
        and a partial group's block also the digest of every token before it."""
        if not self.hybrid:
            return base
        extra = (*base.extra, "kv_group", group.signature)
        if digest is not None:
            extra = (*extra, digest)
        return CacheContext(base.tenant, base.model, base.adapter, extra, base.tokenizer)


def digests(tokens: Sequence[int] | np.ndarray, block_size: int, media: Sequence[tuple[int, str]] = ()) -> list[bytes]:
    """``out[i]``, for each whole block ``i``: a digest of every token before block ``i``
    and of each media item (``(offset, key)``) that starts before block ``i`` ends. A
    partial group's block ``i`` is keyed by it with block ``i``'s own tokens, which the
    cache verifies (invariant 3); the tokens before are those that the full groups' chain
    verified on the way to the boundary."""
    ids = np.asarray(tokens, dtype="<u4")
    h = hashlib.blake2b(b"prefixcache-group-digest", digest_size=16)
    items = sorted(media)
    out: list[bytes] = []
    for i in range(len(ids) // block_size):
        end = (i + 1) * block_size
        while items and items[0][0] < end:
            offset, key = items.pop(0)
            h.update(offset.to_bytes(8, "little") + len(key).to_bytes(4, "little") + key.encode())
        out.append(h.copy().digest())
        h.update(ids[i * block_size : end].tobytes())
    return out


# vLLM's KV cache spec classes, by name, as the group kinds the connector stores
_KINDS = {"FullAttentionSpec": LayerKind.FULL, "SlidingWindowSpec": LayerKind.SLIDING, "MambaSpec": LayerKind.STATE}


def kv_groups(kv_cache_config: Any, block_size: int, stride_tokens: int | None) -> KVGroups | Bypass:
    """vLLM's ``KVCacheConfig`` groups as the connector's (read by class and field names,
    no vLLM import), or why the connector cannot store this model (a layer kind it does
    not know, groups of several block sizes: every request bypasses)."""
    specs = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not specs:
        return KVGroups.uniform(block_size)
    groups = []
    for index, spec in enumerate(specs):
        kind_name = type(spec.kv_cache_spec).__name__
        kind = _KINDS.get(kind_name)
        if kind is None:
            return Bypass(f"unsupported_layers:{kind_name}")
        window = 0
        if kind is LayerKind.SLIDING:
            window = int(spec.kv_cache_spec.sliding_window) + int(
                getattr(spec.kv_cache_spec, "extra_retained_tokens", 0)
            )
        groups.append(KVGroup(index, kind, tuple(spec.layer_names), window))
    sizes = {int(spec.kv_cache_spec.block_size) for spec in specs}
    if len(sizes) != 1:
        return Bypass(f"unsupported_layers:block_sizes_{'_'.join(map(str, sorted(sizes)))}")
    size = sizes.pop()
    if stride_tokens is None:  # every 4 windows, at least 1,024 tokens: a window's share of a long prompt
        stride_tokens = max([1024] + [4 * g.window for g in groups])
    try:
        return KVGroups(tuple(groups), size, -(-stride_tokens // size))
    except ValueError as exc:
        return Bypass(f"unsupported_layers:{exc}")


def describe(groups: KVGroups) -> str:
    return ", ".join(
        f"{g.index}: {g.kind.value}{f' window {g.window}' if g.window else ''} x {len(g.layers)} layers"
        for g in groups.groups
    )
