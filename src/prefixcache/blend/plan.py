"""What a blended prefill is asked to do: the prompt as segments, and which reused
tokens to recompute.

A prompt is a sequence of segments laid end to end from position 0. A ``Fresh``
segment has no KV and is prefilled. A ``Reused`` segment brings the KV its tokens had
when they were computed at positions ``original_start..`` (a chunk prefilled alone
starts at 0): keys are re-rotated to the chunk's new place, and everything the chunk
did not see when it was cached (the segments now before it) is missing from that KV.
The recompute plan says which of its tokens run through the model again, so that the
missing cross-attention is restored where it matters most:

* ``Epic(k)``: the first ``k`` tokens of every reused chunk (EPIC, arXiv 2410.15332),
  the tokens that soaked up the attention of the chunk when it was alone.
* ``CacheBlend(r)``: all reused tokens run through the layers up to ``check_layer``;
  there the ``r`` percent of them whose fresh K/V deviates most from the re-rotated
  cache are chosen, and only they go on through the later layers (CacheBlend,
  EuroSys 2025).
* ``EpicBlend(k, r)``: both: the first ``k`` tokens of every reused chunk always, and
  of the others the top ``r`` percent by deviation at ``check_layer``. The first rule
  repairs the chunk's own attention sink, which the deviation score need not rank high
  enough; the second spends the rest of the budget where the cache is most wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Fresh:
    """Tokens with no KV: prefilled, attending to everything before them."""

    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a Fresh segment needs at least one token")


@dataclass(frozen=True, slots=True)
class Reused:
    """Tokens whose KV was computed at positions ``original_start..``; ``kv`` is the
    engine's payload form ``[layers, 2, kv_heads, len(tokens), head_dim]`` (axis 1:
    keys, values), e.g. ``engine.kv.cut_cache`` of a prefill of the chunk alone."""

    tokens: tuple[int, ...]
    kv: torch.Tensor
    original_start: int = 0

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a Reused segment needs at least one token")
        if self.original_start < 0:
            raise ValueError(f"original_start must be >= 0, got {self.original_start}")
        shape = tuple(self.kv.shape)
        if self.kv.dim() != 5 or shape[1] != 2 or shape[3] != len(self.tokens):
            raise ValueError(
                f"kv must be [layers, 2, kv_heads, {len(self.tokens)} tokens, head_dim] for this segment, got {shape}"
            )


Segment = Fresh | Reused


@dataclass(frozen=True, slots=True)
class Epic:
    """Recompute the first ``k`` tokens of every reused chunk (all of a shorter one)."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"Epic's k must be >= 0, got {self.k}")


@dataclass(frozen=True, slots=True)
class CacheBlend:
    """Recompute the top ``r`` percent of reused tokens by KV deviation at ``check_layer``
    (layers ``0..check_layer`` run all reused tokens)."""

    r: float
    check_layer: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.r <= 100.0 or math.isnan(self.r):
            raise ValueError(f"CacheBlend's r is a percentage in [0, 100], got {self.r}")
        if self.check_layer < 0:
            raise ValueError(f"CacheBlend's check_layer must be >= 0, got {self.check_layer}")

    def chosen(self, candidates: int) -> int:
        """How many of ``candidates`` reused tokens are recomputed."""
        return min(candidates, math.ceil(candidates * self.r / 100.0 - 1e-9))


@dataclass(frozen=True, slots=True)
class EpicBlend:
    """Recompute the first ``k`` tokens of every reused chunk, and of its other tokens the
    top ``r`` percent by KV deviation at ``check_layer`` (as ``CacheBlend``)."""

    k: int
    r: float
    check_layer: int = 1

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"EpicBlend's k must be >= 0, got {self.k}")
        CacheBlend(self.r, self.check_layer)  # the same checks on r and check_layer

    @property
    def deviation(self) -> CacheBlend:
        """The deviation half of the plan, applied to the tokens past the first ``k``."""
        return CacheBlend(self.r, self.check_layer)


RecomputePlan = Epic | CacheBlend | EpicBlend


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each segment lands in the prompt, and which positions are which."""

    tokens: tuple[int, ...]
    starts: tuple[int, ...]  # new start position of each segment
    reused: torch.Tensor  # [length] bool: position comes from a Reused segment
    first: torch.Tensor  # [length] long: offset of the position inside its segment

    @property
    def length(self) -> int:
        return len(self.tokens)


def lay_out(segments: Sequence[Segment]) -> Layout:
    """The prompt the segments make, end to end from position 0."""
    if not segments:
        raise ValueError("the prompt is empty: give at least one segment")
    tokens: list[int] = []
    starts: list[int] = []
    reused: list[bool] = []
    offsets: list[int] = []
    for segment in segments:
        if not isinstance(segment, Fresh | Reused):
            raise TypeError(f"a segment is Fresh or Reused, got {type(segment).__name__}")
        starts.append(len(tokens))
        tokens.extend(segment.tokens)
        reused.extend([isinstance(segment, Reused)] * len(segment.tokens))
        offsets.extend(range(len(segment.tokens)))
    return Layout(tuple(tokens), tuple(starts), torch.tensor(reused), torch.tensor(offsets, dtype=torch.long))
