"""The KV boundary between a model and the cache.

``insert`` takes a *source* of the sequence's KV and reads from it only the range of
the blocks it stores (the tokens past the cached prefix), so that the bytes copied per
turn of a conversation grow with the new tokens, not with the history. A source is a
numpy array or a CPU torch tensor ``[layers, 2, kv_heads, >= tokens, head_dim]``
(sliced, without a copy), or any object with ``read(begin, end)`` (an engine cuts that
range out of its own cache; see ``engine/kv.py``). ``load`` returns ``LoadedKV``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from prefixcache.config import KVLayout
from prefixcache.storage import codec

__all__ = ["ArraySource", "KVSource", "LoadedKV", "as_kv_array", "kv_source"]


@dataclass(frozen=True)
class LoadedKV:
    """The KV of a match's tokens ``start .. tokens``, ``[layers, 2, kv_heads, tokens -
    start, head_dim]``, C-contiguous (so ``kv[layer]`` is one contiguous block per layer).

    ``tokens`` is the true end (invariant 6): below ``requested`` (the match's
    ``cached_tokens``) when a block was missing or bad; ``tier_tokens`` says how many of
    the tokens read came from each tier. ``start`` is 0 for a whole load; a load from
    ``first_block`` on starts where the caller's own copy of the prefix ends, and its
    ``kv`` holds only what was read."""

    tokens: int
    kv: np.ndarray
    tier_tokens: dict[str, int]
    requested: int
    start: int = 0

    @property
    def lost_tokens(self) -> int:
        return self.requested - self.tokens


@runtime_checkable
class KVSource(Protocol):
    """A sequence's KV, read by token range."""

    def read(self, begin: int, end: int) -> Any:
        """``[layers, 2, kv_heads, end - begin, head_dim]`` (numpy or CPU torch), positions ``begin..end-1``."""


class ArraySource:
    """A whole sequence's KV in one array: ranges are views of it."""

    def __init__(self, kv: np.ndarray) -> None:
        self.kv = kv

    def read(self, begin: int, end: int) -> np.ndarray:
        return self.kv[:, :, :, begin:end, :]


def kv_source(kv: Any, layout: KVLayout, n_tokens: int) -> KVSource:
    """The source ``insert`` reads from: a ``KVSource`` as it is, an array checked
    against the layout and the number of tokens (a ``ValueError`` when it does not fit)."""
    if isinstance(kv, KVSource):
        return kv
    return ArraySource(as_kv_array(kv, layout, n_tokens))


def as_kv_array(kv: Any, layout: KVLayout, n_tokens: int) -> np.ndarray:
    """A caller's KV (numpy array or CPU torch tensor, ``[layers, 2, kv_heads, >=
    n_tokens, head_dim]``) as a numpy array in the layout's wire dtype, without a copy
    where the input allows it. A wrong shape or dtype is a ``ValueError``."""
    if type(kv).__module__.startswith("torch"):
        tensor = kv.detach()
        if str(tensor.device) != "cpu":
            tensor = tensor.cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            import torch  # only when the caller already uses torch

            kv = tensor.view(torch.int16).numpy().view(np.uint16)
        else:
            kv = tensor.numpy()
    if not isinstance(kv, np.ndarray):
        raise ValueError(f"kv must be a numpy array, a torch tensor or a KVSource, got {type(kv).__name__}")
    want = layout.shape(n_tokens)
    if kv.ndim != 5 or kv.shape[:3] != want[:3] or kv.shape[4] != want[4] or kv.shape[3] < n_tokens:
        raise ValueError(f"kv has shape {kv.shape}; need [layers, 2, kv_heads, >= tokens, head_dim] = {want}")
    wire = codec.WIRE_DTYPES[layout.dtype]
    if kv.dtype.name == "bfloat16" and layout.dtype == "bfloat16":  # ml_dtypes
        return kv.view(np.uint16)
    if kv.dtype.newbyteorder("<") != wire:
        raise ValueError(f"kv dtype {kv.dtype} does not match the layout's {layout.dtype}")
    return kv
