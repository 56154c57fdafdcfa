"""One forward for a batch step and prompt chunks together: their tokens packed in one row.

    packed sequence:  [ r0 r1 r2 ... r_{R-1} | chunk a: t t t t t t | chunk b: t t t ]
    positions:          each row's length      a's KV length + 0..n-1   b's + 0..m-1
    attention:          rows: one query each,  a: causal over a's own KV (its cached prefix
                        over the batch's        and the chunk), b: over b's; every other
                        window (``batch.py``)   layer sees tokens, not sequences

Every layer but attention works token by token, so a prompt's chunk rides along the
decoding rows' step: the weights are read once for both, where a chunk alone and a step
alone would read them twice. The attention splits the packed queries back by sequence
and runs transformers' SDPA on each part with the inputs and masks it has when that part
runs alone: a chunk's KV and logits are those of its forward alone, up to the rounding
of the larger matrix products (a chunk packed with nothing else is its forward alone).

``Packed`` is the plan of one forward; the model finds it in its keyword arguments
(``packed=``) on every attention call, and the batch's cache layers fill in each layer's
KV (``Packed.layer``) just before. A forward without it is transformers' SDPA, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from prefixcache.engine.runner import Chunk

__all__ = ["NAME", "Packed", "use_packed_attention"]

NAME = "prefixcache_packed"
_OURS = ("sdpa", NAME)

# per layer: the rows' window (keys, values) or None, then each chunk's whole KV
LayerKV = tuple[tuple[torch.Tensor, torch.Tensor] | None, list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass(eq=False)
class Packed:
    """One packed forward: ``rows`` batch rows (a token each, the first ``rows`` tokens),
    then ``chunks``, each over ``spans[i]`` of the packed tokens."""

    rows: int
    window: int  # W: the rows' columns the step reads, the last W of the batch's buffer
    window_mask: torch.Tensor | None  # [rows, 1, 1, W]: which of them each row sees
    chunks: tuple[Chunk, ...]
    spans: tuple[tuple[int, int], ...] = field(init=False)
    chunk_masks: tuple[torch.Tensor | None, ...] = field(init=False)
    layer: LayerKV | None = None  # the current layer's KV, set by the cache's update

    def __post_init__(self) -> None:
        spans, begin = [], self.rows
        for chunk in self.chunks:
            spans.append((begin, begin + len(chunk.tokens)))
            begin += len(chunk.tokens)
        self.spans = tuple(spans)
        self.chunk_masks = tuple(_causal(chunk.seq.length, len(chunk.tokens)) for chunk in self.chunks)

    def positions(self, lengths: list[int | None]) -> torch.Tensor:
        """[1, tokens]: each row's length (a free row's: 0), then each chunk's positions."""
        out = [length or 0 for length in lengths[: self.rows]]
        for chunk in self.chunks:
            out += range(chunk.seq.length, chunk.seq.length + len(chunk.tokens))
        return torch.tensor([out], dtype=torch.long)

    def kept(self) -> torch.Tensor:
        """The packed positions whose logits are wanted: every row, each chunk's last ``keep``."""
        out = list(range(self.rows))
        for chunk, (_, end) in zip(self.chunks, self.spans, strict=True):
            out += range(end - chunk.keep, end)
        return torch.tensor(out, dtype=torch.long)


def _causal(past: int, tokens: int) -> torch.Tensor | None:
    """The mask of ``tokens`` queries after ``past`` positions of KV, as transformers builds
    it for the chunk alone: none at all without past (SDPA's causal flag), else a boolean
    [1, 1, tokens, past + tokens] (transformers' SDPA mask is then such a tensor)."""
    if past == 0:
        return None
    columns = torch.arange(past + tokens)
    return (columns[None, :] <= past + torch.arange(tokens)[:, None])[None, None]


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    plan: Packed | None = kwargs.pop("packed", None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    assert plan.layer is not None, "the packed forward's cache did not give this layer's KV"
    window, chunks = plan.layer
    plan.layer = None
    parts = []
    if window is not None:
        rows = query[0, :, : plan.rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        out, _ = sdpa_attention_forward(module, rows, window[0], window[1], plan.window_mask, **kwargs)
        parts.append(out.transpose(0, 1))  # [1, rows, heads, dim]
    for (begin, end), (keys, values), mask in zip(plan.spans, chunks, plan.chunk_masks, strict=True):
        out, _ = sdpa_attention_forward(module, query[:, :, begin:end], keys, values, mask, **kwargs)
        parts.append(out)
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0], None


AttentionInterface.register(NAME, _attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_packed_attention(model: Any) -> None:
    """Switch ``model`` from transformers' SDPA to this module's (the same for every
    forward without a plan); a model on another attention cannot run packed forwards."""
    current = getattr(model.config, "_attn_implementation", None)
    if current not in _OURS:
        raise ValueError(f"batched decoding needs the model on SDPA attention, it is on {current!r}")
    if current != NAME:
        model.set_attn_implementation(NAME)
