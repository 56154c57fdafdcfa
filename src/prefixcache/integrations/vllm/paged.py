"""vLLM's paged KV cache, seen as prefixcache frames.

vLLM keeps one tensor per attention layer, in the layout of its attention backend;
prefixcache stores a block as ``[layers, 2 (K, V), kv_heads, block_tokens, head_dim]``.
``PagedKV`` recognizes the backend's layout from the tensors' shapes (checked against
the model's heads, head size and block size, so a layout it does not know is an error
that says what it saw, never a silent misreading) and moves whole blocks between the
two: ``gather`` copies some vLLM blocks out as one ``[layers, 2, kv_heads, tokens,
head_dim]`` array (what ``PrefixCache.insert`` reads), ``scatter`` copies such an
array into some vLLM blocks (what ``PrefixCache.load`` returns).

Layouts known:

- ``cpu``: vLLM's CPU attention backend, ``[blocks, kv_heads, block_size, 2 * head_size]``,
  which the backend reads as ``[blocks, kv_heads, 2, block_size, head_size]`` (each head's
  keys, then its values);
- ``flash``: the ``[2, blocks, block_size, kv_heads, head_size]`` of the GPU backends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from prefixcache.config import KVLayout
from prefixcache.engine.kv import to_torch

__all__ = ["GroupedKV", "Layout", "PagedKV", "PagedSource", "StatePages"]


class Layout(Enum):
    CPU = "cpu"
    FLASH = "flash"


@dataclass(frozen=True)
class _Geometry:
    kv_heads: int
    head_dim: int
    block_size: int


def _detect(shape: tuple[int, ...], g: _Geometry) -> Layout:
    h, d, n = g.kv_heads, g.head_dim, g.block_size
    if len(shape) == 4 and shape[1:] == (h, n, 2 * d):
        return Layout.CPU
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (n, h, d):
        return Layout.FLASH
    raise ValueError(
        f"unknown vLLM KV cache layout {tuple(shape)} for kv_heads={h}, head_size={d}, block_size={n}; "
        "known: [blocks, kv_heads, block_size, 2*head_size] (CPU) and [2, blocks, block_size, kv_heads, head_size]"
    )


def _blocks_view(tensor: torch.Tensor, layout: Layout, g: _Geometry) -> torch.Tensor:
    """``tensor`` as ``[blocks, 2, kv_heads, block_size, head_dim]``, a view (no copy)."""
    if layout is Layout.CPU:
        blocks = tensor.shape[0]
        return tensor.view(blocks, g.kv_heads, 2, g.block_size, g.head_dim).permute(0, 2, 1, 3, 4)
    return tensor.permute(1, 0, 3, 2, 4)


_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class PagedKV:
    """vLLM's per-layer KV tensors (in layer order), as blocks of prefixcache frames."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, kv_heads: int, head_dim: int, block_size: int) -> None:
        if not tensors:
            raise ValueError("no KV cache tensors to register")
        g = _Geometry(kv_heads, head_dim, block_size)
        self.names = tuple(tensors)
        first = next(iter(tensors.values()))
        if first.dtype not in _DTYPES:
            raise ValueError(f"KV cache dtype {first.dtype} is not supported; supported: {', '.join(_DTYPES.values())}")
        self.layout = _detect(tuple(first.shape), g)
        self.views: list[torch.Tensor] = []
        for name, tensor in tensors.items():
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise ValueError(f"layer {name}: {tuple(tensor.shape)} {tensor.dtype} differs from the first layer's")
            self.views.append(_blocks_view(tensor, self.layout, g))
        self.geometry = g
        self.dtype = first.dtype
        self.kv_layout = KVLayout(
            layers=len(self.views), kv_heads=kv_heads, head_dim=head_dim, dtype=_DTYPES[first.dtype]
        )

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The KV of these vLLM blocks, in order, as ``[layers, 2, kv_heads, len * block_size, head_dim]``
        (a tensor ``PrefixCache.insert`` takes as it is)."""
        g = self.geometry
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        out = torch.empty((len(self.views), 2, g.kv_heads, len(ids), g.block_size, g.head_dim), dtype=self.dtype)
        for layer, view in enumerate(self.views):
            # [n, 2, H, N, D] -> [2, H, n, N, D]
            out[layer].copy_(view.index_select(0, ids.to(view.device)).permute(1, 2, 0, 3, 4))
        return out.view(len(self.views), 2, g.kv_heads, len(ids) * g.block_size, g.head_dim)

    def scatter(self, kv: np.ndarray, block_ids: Sequence[int]) -> None:
        """Copy ``kv`` (``[layers, 2, kv_heads, len(block_ids) * block_size, head_dim]``)
        into these vLLM blocks."""
        g = self.geometry
        n = len(block_ids)
        expected = (len(self.views), 2, g.kv_heads, n * g.block_size, g.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"scatter of {tuple(kv.shape)} into {n} blocks: expected {expected}")
        source = to_torch(kv, self.dtype).view(len(self.views), 2, g.kv_heads, n, g.block_size, g.head_dim)
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        for layer, view in enumerate(self.views):
            view.index_copy_(0, ids.to(view.device), source[layer].permute(2, 0, 1, 3, 4).to(view.device))


class StatePages:
    """A recurrent (Mamba, linear-attention) group's blocks: each layer's state for a block
    is one page of bytes (vLLM gives every group's block the same bytes a layer: a state is
    padded to an attention block's page). A page is carried as an attention frame of the
    same bytes (``kv_layout``), opaque: only a lossless codec may hold it, and it goes back
    into a page of this group only (its key names the group)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], kv_layout: KVLayout, block_size: int) -> None:
        if not tensors:
            raise ValueError("no state tensors to register")
        self.names = tuple(tensors)
        self.geometry = _Geometry(kv_layout.kv_heads, kv_layout.head_dim, block_size)
        self.dtype = next(d for d, name in _DTYPES.items() if name == kv_layout.dtype)
        self.page = 2 * kv_layout.kv_heads * block_size * kv_layout.head_dim * self.dtype.itemsize
        self.views: list[torch.Tensor] = []
        for name, tensor in tensors.items():
            first = tensor[0] if isinstance(tensor, list | tuple) else tensor
            stride = first.stride(0) * first.element_size()
            if stride != self.page:
                raise ValueError(
                    f"state layer {name}: a block is {stride} bytes apart, an attention block's page {self.page}: "
                    "the connector stores groups of one page size"
                )
            blocks = first.shape[0]
            raw = first.view(torch.uint8)  # a page's bytes, whatever dtype vLLM viewed them as
            self.views.append(raw.as_strided((blocks, self.page), (self.page, 1), raw.storage_offset()))
        self.kv_layout = dataclasses.replace(kv_layout, layers=len(self.views))

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def layout(self) -> Layout:
        return Layout.CPU

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The pages of these blocks as ``[layers, 2, kv_heads, len * block_size, head_dim]``."""
        g, n = self.geometry, len(block_ids)
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        pages = torch.stack([view.index_select(0, ids) for view in self.views])  # [layers, n, page]
        shaped = (
            pages.view(len(self.views), n, -1)
            .view(self.dtype)
            .view(len(self.views), n, 2, g.kv_heads, g.block_size, g.head_dim)
        )
        return shaped.permute(0, 2, 3, 1, 4, 5).reshape(len(self.views), 2, g.kv_heads, n * g.block_size, g.head_dim)

    def scatter(self, kv: np.ndarray, block_ids: Sequence[int]) -> None:
        """Copy pages (as ``gather`` gives them) into these blocks."""
        g, n = self.geometry, len(block_ids)
        expected = (len(self.views), 2, g.kv_heads, n * g.block_size, g.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"scatter of {tuple(kv.shape)} into {n} state blocks: expected {expected}")
        source = to_torch(kv, self.dtype).reshape(len(self.views), 2, g.kv_heads, n, g.block_size, g.head_dim)
        pages = source.permute(0, 3, 1, 2, 4, 5).contiguous().view(torch.uint8).view(len(self.views), n, self.page)
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        for layer, view in enumerate(self.views):
            view.index_copy_(0, ids, pages[layer])


class GroupedKV:
    """vLLM's paged KV by KV cache group (``groups.py``): one ``PagedKV`` over each group's
    layers, every group's frame the same layout (vLLM gives every group the same number
    of layers and bytes a block), so that one cache holds them all."""

    def __init__(self, groups: Sequence[PagedKV | StatePages]) -> None:
        if not groups:
            raise ValueError("no KV cache groups to register")
        first = groups[0]
        for i, paged in enumerate(groups):
            if paged.kv_layout != first.kv_layout or paged.block_size != first.block_size:
                raise ValueError(
                    f"KV cache group {i}: {paged.kv_layout} x {paged.block_size} tokens differs from group 0's "
                    f"{first.kv_layout} x {first.block_size}: the connector stores groups of one frame layout"
                )
        self.groups = tuple(groups)

    @property
    def kv_layout(self) -> KVLayout:
        return self.groups[0].kv_layout

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def layout(self) -> Layout:
        return self.groups[0].layout

    @property
    def layers(self) -> int:
        return sum(len(p.views) for p in self.groups)

    def __getitem__(self, group: int) -> PagedKV | StatePages:
        return self.groups[group]


class PagedSource:
    """A ``KVSource`` over some of a request's vLLM blocks (block ``i`` holds its tokens
    ``i * block_size ..``): ``PrefixCache.insert`` reads from it only the range it stores."""

    def __init__(self, paged: PagedKV | StatePages, block_ids: Sequence[int]) -> None:
        self.paged = paged
        self.block_ids = list(block_ids)

    def read(self, begin: int, end: int) -> torch.Tensor:
        n = self.paged.block_size
        first, last = begin // n, -(-end // n)
        if end > len(self.block_ids) * n or begin < 0 or begin > end:
            raise ValueError(f"range {begin}..{end} is beyond the request's {len(self.block_ids)} blocks")
        kv = self.paged.gather(self.block_ids[first:last])
        return kv[:, :, :, begin - first * n : end - first * n, :]
