"""One forward for a batch step and prompt chunks together: their tokens packed in one row.

    packed sequence:  [ r0 r1 | r2 ... r_{R-1} | chunk a: t t t t t t | chunk b: t t t ]
    positions:          each row's length         a's KV length + 0..n-1   b's + 0..m-1
    attention:          rows: one query each,     a: causal over a's own KV (its cached prefix
                        over its shelf's          and the chunk), b: over b's; every other
                        columns (``batch.py``)    layer sees tokens, not sequences

Every layer but attention works token by token, so a prompt's chunk rides along the
decoding rows' step: the weights are read once for both, where a chunk alone and a step
alone would read them twice. The attention splits the packed queries back by sequence
and runs transformers' SDPA on each part (the rows of each shelf, each chunk) with the
inputs and masks it has when that part runs alone: a chunk's KV and logits are those of
its forward alone, up to the rounding of the larger matrix products (a chunk packed with
nothing else is its forward alone).

A layer with a sliding window (``arch.py``: Mistral's, Gemma's sliding layers) gets the
masks transformers gives it alone: a query at position p sees the keys at p - window + 1
to p. A row reads only the last ``window`` columns of its shelf's buffer; a chunk's mask
covers its sequence's whole KV, as transformers' does, so that a chunk packed with
nothing else stays its forward alone. What makes the rest exact (one rotation per
position whatever the other positions in the forward) is checked at start (``arch.py``).

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

# per layer: its window (None: full attention), each group's rows' KV over the columns
# it reads, then each chunk's whole KV
KV = tuple[torch.Tensor, torch.Tensor]
LayerKV = tuple[int | None, list[KV], list[KV]]


@dataclass(eq=False)
class Packed:
    """One packed forward: a row for each of ``lengths`` (a token each, the first tokens)
    in ``groups`` (spans of rows whose KV shares one buffer: a shelf's), then ``chunks``,
    each over ``spans[i]`` of the packed tokens."""

    lengths: tuple[int, ...]  # per row: its token's position, its sequence's length (a free row: 0)
    chunks: tuple[Chunk, ...]
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    device: torch.device
    groups: tuple[tuple[int, int], ...] | None = None  # None: every row in one group
    spans: tuple[tuple[int, int], ...] = field(init=False)
    layer: LayerKV | None = None  # the current layer's KV, set by the cache's update
    # the masks built for this forward: the rows' per window, a chunk's per (chunk, window)
    _row_masks: dict[tuple[int, int | None], torch.Tensor] = field(init=False, default_factory=dict)
    _chunk_masks: dict[tuple[int, int | None], torch.Tensor | None] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.groups is None:
            self.groups = ((0, self.rows),) if self.rows else ()
        covered = [i for begin, end in self.groups for i in range(begin, end)]
        if covered != list(range(self.rows)) or any(begin >= end for begin, end in self.groups):
            raise ValueError(f"the groups {self.groups} do not split the {self.rows} rows in order")
        spans, begin = [], self.rows
        for chunk in self.chunks:
            spans.append((begin, begin + len(chunk.tokens)))
            begin += len(chunk.tokens)
        self.spans = tuple(spans)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def columns(self, group: int, window: int | None) -> int:
        """The columns a layer with ``window`` reads for the rows of ``group``, the last of
        its buffer: its longest row's and the new one's, at most ``window``."""
        assert self.groups is not None
        begin, end = self.groups[group]
        width = 1 + max(self.lengths[begin:end], default=0)
        return width if window is None else min(width, window)

    def positions(self) -> torch.Tensor:
        """[1, tokens]: each row's length, then each chunk's positions."""
        out = list(self.lengths)
        for chunk in self.chunks:
            out += range(chunk.seq.length, chunk.seq.length + len(chunk.tokens))
        return torch.tensor([out], dtype=torch.long)

    def kept(self) -> torch.Tensor:
        """The packed positions whose logits are wanted: every row, each chunk's last ``keep``."""
        out = list(range(self.rows))
        for chunk, (_, end) in zip(self.chunks, self.spans, strict=True):
            out += range(end - chunk.keep, end)
        return torch.tensor(out, dtype=torch.long)

    def row_mask(self, group: int, window: int | None) -> torch.Tensor:
        """[rows, 1, 1, columns]: which of a layer's columns each row of ``group`` sees,
        its last ones (a free row: its own column only, so that its values stay finite)."""
        key = (group, window)
        if key not in self._row_masks:
            assert self.groups is not None
            begin, end = self.groups[group]
            columns = self.columns(group, window)
            seen = torch.tensor([min(length + 1, columns) for length in self.lengths[begin:end]])
            mask = torch.arange(columns)[None, :] >= columns - seen[:, None]
            self._row_masks[key] = mask[:, None, None, :].to(self.device)
        return self._row_masks[key]

    def chunk_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """The mask of chunk ``index`` in a layer with ``window``, over its sequence's KV."""
        key = (index, window)
        if key not in self._chunk_masks:
            chunk = self.chunks[index]
            mask = _causal(chunk.seq.length, len(chunk.tokens), window)
            self._chunk_masks[key] = mask.to(self.device) if mask is not None else None
        return self._chunk_masks[key]


def _causal(past: int, tokens: int, window: int | None) -> torch.Tensor | None:
    """The mask of ``tokens`` queries after ``past`` positions of KV, as transformers builds
    it for the chunk alone (``masking_utils.sdpa_mask``): none at all where SDPA's own
    causal flag (or none) is the same (one query, or no past, and all of it within the
    window), else a boolean [1, 1, tokens, past + tokens]."""
    if (tokens == 1 or past == 0) and (window is None or past + tokens < window):
        return None
    keys = torch.arange(past + tokens)[None, :]
    queries = past + torch.arange(tokens)[:, None]
    mask = keys <= queries
    if window is not None:
        mask &= keys > queries - window
    return mask[None, None]


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
    window, rows_kv, chunks = plan.layer
    plan.layer = None
    parts = []
    assert plan.groups is not None and len(rows_kv) == len(plan.groups)
    for group, ((begin, end), (keys, values)) in enumerate(zip(plan.groups, rows_kv, strict=True)):
        rows = query[0, :, begin:end].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        out, _ = sdpa_attention_forward(module, rows, keys, values, plan.row_mask(group, window), **kwargs)
        parts.append(out.transpose(0, 1))  # [1, rows, heads, dim]
    for index, ((begin, end), (keys, values)) in enumerate(zip(plan.spans, chunks, strict=True)):
        mask = plan.chunk_mask(index, window)
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
