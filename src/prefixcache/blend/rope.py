"""Moving cached keys to new positions: ``K' = R(delta) K``.

A rotary model stores each key already rotated by its position: for every pair of
channels ``(i, i + D/2)`` (the ``rotate_half`` convention of Llama and its kin) the key
at position ``p`` is the unrotated key turned by the angle ``p * inv_freq[i]`` and scaled
by ``attention_scaling``. Rotations compose, ``R(b) R(a) = R(a + b)``, so a key cached at
position ``p`` becomes the key at ``p + delta`` by one more rotation of ``delta * inv_freq``,
without the hidden state that produced it. The scaling is already inside the cached key
and is not applied again: re-rotation is a pure rotation.

The frequencies are the model's own, read from its rotary embedding module (whatever
its ``rope_type``: default, linear, llama3, yarn... all end up as ``inv_freq`` plus
``attention_scaling``), never recomputed from a theta. Rope types whose frequencies
change with the sequence length (dynamic, longrope) are refused: no single rotation
moves a key between two lengths.

The math runs in float32 (angles in float64) whatever the cache's dtype, and the
result is cast back to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True, slots=True)
class RotaryFrequencies:
    """A model's rotary embedding: per channel pair, the angle per position."""

    inv_freq: torch.Tensor  # [head_dim / 2], float32, on the CPU
    attention_scaling: float  # applied once to cos/sin by the model; inside every cached key
    rope_type: str

    def __post_init__(self) -> None:
        if self.inv_freq.dim() != 1 or self.inv_freq.numel() == 0:
            raise ValueError(f"inv_freq must be a non-empty vector, got shape {tuple(self.inv_freq.shape)}")

    @property
    def head_dim(self) -> int:
        return 2 * int(self.inv_freq.numel())


def rotary_of(model: Any) -> RotaryFrequencies:
    """The rotary frequencies of ``model`` (a causal LM or its base model), read from its
    ``rotary_emb`` module. Raises ``ValueError`` for a model without one."""
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if rotary is None or not isinstance(inv_freq, torch.Tensor):
        raise ValueError(f"{type(model).__name__} has no rotary embedding (rotary_emb.inv_freq); cannot re-rotate")
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if rope_type in _LENGTH_DEPENDENT:
        raise ValueError(f"rope_type {rope_type!r} changes its frequencies with the length; cannot re-rotate")
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    return RotaryFrequencies(inv_freq.detach().to(device="cpu", dtype=torch.float32).clone(), scaling, rope_type)


def rotation(delta: int | torch.Tensor, freqs: RotaryFrequencies, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``delta * inv_freq`` ([tokens, head_dim], float32, rotate_half layout);
    ``delta`` is one shift for all tokens or one per token."""
    if isinstance(delta, torch.Tensor):
        if delta.dim() != 1 or delta.numel() != tokens:
            raise ValueError(f"per-token deltas must be a vector of {tokens}, got shape {tuple(delta.shape)}")
        shifts = delta.detach().to(device="cpu", dtype=torch.float64)
    else:
        shifts = torch.full((tokens,), float(delta), dtype=torch.float64)
    angles = shifts[:, None] * freqs.inv_freq.to(torch.float64)[None, :]  # [tokens, D/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def rerotate(keys: torch.Tensor, delta: int | torch.Tensor, freqs: RotaryFrequencies) -> torch.Tensor:
    """``keys`` ([..., tokens, head_dim], any leading axes: layers, batch, heads) turned by
    ``delta`` positions (an int, or a [tokens] tensor of per-token shifts). A new tensor
    in ``keys``' dtype and device; ``keys`` is not modified."""
    if keys.dim() < 2:
        raise ValueError(f"keys must be [..., tokens, head_dim], got shape {tuple(keys.shape)}")
    if keys.shape[-1] != freqs.head_dim:
        raise ValueError(f"keys have head_dim {keys.shape[-1]}, the rotary embedding {freqs.head_dim}")
    tokens = int(keys.shape[-2])
    if not isinstance(delta, torch.Tensor) and delta == 0:
        return keys.clone()
    cos, sin = rotation(delta, freqs, tokens)
    cos, sin = cos.to(keys.device), sin.to(keys.device)
    k = keys.to(torch.float32)
    half = k.shape[-1] // 2
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)  # rotate_half
    return (k * cos + rotated * sin).to(keys.dtype)
