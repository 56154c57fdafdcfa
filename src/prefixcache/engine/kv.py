"""Moving KV between the model's ``DynamicCache`` and the cache's block payload.

The payload of ``T`` tokens is one C-contiguous array::

    [layers, 2, kv_heads, T, head_dim]      axis 1: 0 = keys, 1 = values
       |     |
       |     +-- layer l's keys are payload[l, 0], a [kv_heads, T, head_dim] view
       +-- one entry per decoder layer, in order

and the model's cache holds, per layer, keys and values of shape ``[1, kv_heads, T, head_dim]``.
Both directions are one tensor operation per layer and per side, never a loop over tokens.

numpy has no bfloat16: a bfloat16 payload travels as its raw 16-bit words (int16) and
is viewed back as bfloat16 on the torch side, bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache


def to_torch(array: np.ndarray[Any, Any], dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        # NOTE: a payload read zero-copy from a tier is read-only; the model never
        # writes into the tensors it is given (a DynamicCache concatenates into new ones).
        warnings.simplefilter("ignore", UserWarning)
        if dtype == torch.bfloat16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def fill_cache(
    payload: np.ndarray[Any, Any] | torch.Tensor, model_config: Any, device: torch.device, dtype: torch.dtype
) -> DynamicCache:
    """A ``DynamicCache`` holding ``payload`` ([layers, 2, H, T, D]) as its first T positions."""
    kv = payload if isinstance(payload, torch.Tensor) else to_torch(payload, dtype)
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV payload must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(kv.shape)}")
    cache = DynamicCache(config=model_config)
    kv = kv.to(device=device, dtype=dtype, non_blocking=True)
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
    return cache


def cut_cache(cache: DynamicCache, tokens: int, begin: int = 0) -> torch.Tensor:
    """Positions ``begin..tokens-1`` of ``cache`` as one CPU payload [layers, 2, H, tokens - begin, D]
    (one copy; a bfloat16 cache stays bfloat16)."""
    layers: list[Any] = list(cache.layers)  # full-attention layers (DynamicLayer) only
    first = layers[0].keys
    assert first is not None, "cut_cache needs a filled cache"
    heads, dim = first.shape[1], first.shape[3]
    if not 0 <= begin <= tokens <= first.shape[2]:
        raise ValueError(f"KV range {begin}..{tokens} is outside the sequence's {first.shape[2]} positions")
    out = torch.empty((len(layers), 2, heads, tokens - begin, dim), dtype=first.dtype)
    for index, layer in enumerate(layers):
        assert layer.keys is not None and layer.values is not None
        out[index, 0].copy_(layer.keys[0, :, begin:tokens])
        out[index, 1].copy_(layer.values[0, :, begin:tokens])
    return out


class SequenceKV:
    """A ``KVSource`` over a model's ``DynamicCache``: ``read(begin, end)`` copies only
    positions ``begin..end-1`` to the host, so that storing a turn of a conversation
    copies its new tokens' KV, not the whole history's."""

    def __init__(self, cache: DynamicCache) -> None:
        self._cache = cache

    def read(self, begin: int, end: int) -> np.ndarray[Any, Any]:
        return to_numpy(cut_cache(self._cache, end, begin))


def to_numpy(payload: torch.Tensor) -> np.ndarray[Any, Any]:
    """A CPU payload as numpy (bfloat16 as its int16 words), without a copy."""
    if payload.dtype == torch.bfloat16:
        return payload.view(torch.int16).numpy()
    return payload.numpy()
