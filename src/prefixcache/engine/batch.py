"""Decoding many sequences in one forward: their KV in one left-padded buffer per layer.

    buffer (per layer, keys and values)       columns:  start ............ end   cap
      row 0  [ pad pad pad | k0 k1 k2 ... k_{L0-1} ]    each row's KV ends at ``end``;
      row 1  [ k0 k1 k2 k3 k4 ........ k_{L1-1}   ]    the next token of every row is
      row 2  [ (free: zeros, one live column)     ]    written at column ``end``

A step feeds one token per row at its own position (its length) with a mask that lets
each row see only its own columns (in a layer with a sliding window, the last ``window``
of them), so a row's logits are those of its sequence alone
(up to float rounding of the larger matrix products); prompts' chunks may ride along in
the same forward, each on its own sequence's KV (``packed.py``). A row joins with the KV of its
prefill (copied in once) and leaves without a copy: its columns stay untouched until
``release`` (the store reads them meanwhile), or until the buffer is laid out anew,
which never writes the old buffer. Rows that are free still run (a zero row that sees
one column keeps every value finite) so that rows never move; the batch forwards only
up to its last row in use.

No threads here: the engine's worker drives it; ``RowKV.read`` may run on another
thread while the worker steps (it reads only columns no step writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from prefixcache.engine.arch import serving
from prefixcache.engine.kv import to_numpy
from prefixcache.engine.model import LoadedModel
from prefixcache.engine.packed import Packed, use_packed_attention
from prefixcache.engine.runner import Chunk

__all__ = ["Batch", "RowKV"]

_GRAIN = 64  # columns are allocated in multiples of this
_HEADROOM = 64  # columns of room past the longest row after a new layout, at least (half its length at most)


class _Layer(DynamicLayer):  # type: ignore[no-untyped-call]
    """One decoder layer's view of the batch: the model's ``update`` writes column ``end``."""

    def __init__(self, batch: Batch, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._batch, self._index = batch, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token into column ``end``, each chunk's onto its sequence's KV; the
        packed attention reads them from the plan (what this returns goes unread)."""
        b, index = self._batch, self._index
        plan = b._plan
        assert plan is not None, "a batch's cache runs only in its own step"
        window, rows = plan.windows[index], None
        if plan.rows:
            keys, values = b._keys[index], b._values[index]
            keys[: plan.rows, :, b._end].copy_(key_states[0, :, : plan.rows].transpose(0, 1))
            values[: plan.rows, :, b._end].copy_(value_states[0, :, : plan.rows].transpose(0, 1))
            first = b._end + 1 - plan.columns(window)
            rows = keys[: plan.rows, :, first : b._end + 1], values[: plan.rows, :, first : b._end + 1]
        chunks = [
            chunk.seq.cache.update(key_states[:, :, begin:end], value_states[:, :, begin:end], index)
            for chunk, (begin, end) in zip(plan.chunks, plan.spans, strict=True)
        ]
        plan.layer = window, rows, chunks
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self._batch._end - self._batch._start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


@dataclass(frozen=True, eq=False)
class RowKV:
    """A ``KVSource`` over a row that left: positions ``begin..end-1`` of its sequence."""

    keys: tuple[torch.Tensor, ...]  # per layer, the buffer the row was in
    values: tuple[torch.Tensor, ...]
    row: int
    first: int  # the buffer column of the sequence's position 0
    length: int

    def read(self, begin: int, end: int) -> np.ndarray[Any, Any]:
        if not 0 <= begin <= end <= self.length:
            raise ValueError(f"KV range {begin}..{end} is outside the row's {self.length} positions")
        first = self.keys[0]
        out = torch.empty((len(self.keys), 2, first.shape[1], end - begin, first.shape[3]), dtype=first.dtype)
        a, z = self.first + begin, self.first + end
        for index, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            out[index, 0].copy_(k[self.row, :, a:z])
            out[index, 1].copy_(v[self.row, :, a:z])
        return to_numpy(out)


class Batch:
    """Rows of sequences that decode together, one token per row per ``step``."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        config = loaded.model.config
        self._arch = serving(config)  # NOTE: an ArchError for a model no packed step serves exactly
        self._layers = len(self._arch.windows)
        self._heads = loaded.kv.kv_heads
        self._dim = loaded.kv.head_dim
        self._dtype = next(loaded.model.parameters()).dtype
        embeddings: Any = loaded.model.get_input_embeddings()
        self._vocab = int(embeddings.weight.shape[0])
        self._device = loaded.device
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._start = self._end = 0
        self._lengths: list[int | None] = []  # per row: its sequence's length, None when free
        self._draining: set[int] = set()  # rows that left, their columns still read
        self._cache = DynamicCache(config=config)
        self._cache.layers = [_Layer(self, i) for i in range(self._layers)]
        self._plan: Packed | None = None  # the step running
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self._device)
        use_packed_attention(loaded.model)
        self._layout(rows=0, width=0)

    # ------------------------------------------------------------------ rows

    @property
    def rows(self) -> int:
        """Rows in use (decoding)."""
        return sum(length is not None for length in self._lengths)

    def length(self, row: int) -> int:
        length = self._lengths[row] if 0 <= row < len(self._lengths) else None
        if length is None:
            raise ValueError(f"row {row} is free")
        return length

    @torch.inference_mode()
    def join(self, cache: DynamicCache, length: int) -> int:
        """Copy the ``length`` positions of a prefilled ``cache`` in as a new row; its index."""
        row = self._free_row()
        if row >= self._keys[0].shape[0] or length > self._end or self._end + 1 > self._keys[0].shape[2]:
            live = [n for n in self._lengths if n is not None]
            self._layout(rows=max(len(self._lengths), row + 1), width=max([length, *live]))
            row = self._free_row()
        if row == len(self._lengths):
            self._lengths.append(None)
        first = self._end - length
        self._start = min(self._start, first)
        layers: list[Any] = list(cache.layers)
        for index in range(self._layers):
            keys, values = self._keys[index], self._values[index]
            keys[row, :, :first].zero_()
            values[row, :, :first].zero_()
            keys[row, :, first : self._end].copy_(layers[index].keys[0, :, :length])
            values[row, :, first : self._end].copy_(layers[index].values[0, :, :length])
        self._lengths[row] = length
        return row

    def _free_row(self) -> int:
        """The first row neither in use nor draining (past the last: a new one)."""
        free = (i for i, n in enumerate(self._lengths) if n is None and i not in self._draining)
        return next(free, len(self._lengths))

    @torch.inference_mode()
    def leave(self, row: int) -> RowKV:
        """Take ``row`` out; its KV stays readable through the result until ``release(row)``."""
        length = self.length(row)
        out = RowKV(tuple(self._keys), tuple(self._values), row, self._end - length, length)
        self._lengths[row] = None
        self._draining.add(row)
        while self._lengths and self._lengths[-1] is None and len(self._lengths) - 1 not in self._draining:
            self._lengths.pop()
        live = [n for n in self._lengths if n is not None]
        if not live:
            self._layout(rows=0, width=0)  # NOTE: the memory of a burst is not kept once it is over
        elif self._end - self._start > 2 * max(live) + _HEADROOM:
            self._layout(rows=len(self._lengths), width=max(live))  # the buffer shrinks back
        return out

    def release(self, kv: RowKV) -> None:
        """The KV of a row that left is no longer read: the row may be reused (unless a
        new layout freed it already, and it is another row's now)."""
        if kv.keys[0] is self._keys[0]:
            self._draining.discard(kv.row)
        while self._lengths and self._lengths[-1] is None and len(self._lengths) - 1 not in self._draining:
            self._lengths.pop()

    # ------------------------------------------------------------------ a step

    @property
    def context_length(self) -> int:
        """Positions a step serves exactly (``arch.py``): a row or a chunk never goes past."""
        return self._arch.context_length

    def check(self, chunk: Chunk) -> None:
        """Raise ``ValueError`` when ``chunk`` cannot run in a step: tokens outside the
        vocabulary, positions past the exact ones, or a sequence's KV not of this model's
        shape. Run before the forward, since what raises inside it fails every sequence
        of the step, not this one alone."""
        tokens, seq = chunk.tokens, chunk.seq
        if not tokens or not 1 <= chunk.keep <= len(tokens):
            raise ValueError(f"a chunk of {len(tokens)} tokens cannot keep the logits of {chunk.keep}")
        if min(tokens) < 0 or max(tokens) >= self._vocab:
            raise ValueError(f"a chunk's token ids must be in [0, {self._vocab})")
        if seq.length + len(tokens) > self.context_length:
            raise ValueError(
                f"a chunk reaches position {seq.length + len(tokens) - 1}, past the {self.context_length} a step serves"
            )
        layers: list[Any] = list(seq.cache.layers)
        if seq.length == 0 and all(layer.keys is None or layer.keys.numel() == 0 for layer in layers):
            return
        expected = (1, self._heads, seq.length, self._dim)
        if len(layers) != self._layers:
            raise ValueError(f"a chunk's sequence has the KV of {len(layers)} layers, the model {self._layers}")
        for index, layer in enumerate(layers):
            for kv in (layer.keys, layer.values):
                if kv is None or tuple(kv.shape) != expected or kv.dtype != self._dtype:
                    shape = None if kv is None else (tuple(kv.shape), kv.dtype)
                    raise ValueError(f"a chunk's KV at layer {index} is {shape}, not {expected} of {self._dtype}")

    @torch.inference_mode()
    def step(
        self, tokens: dict[int, int], chunks: Sequence[Chunk] = ()
    ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
        """Feed ``tokens[row]`` to each row in use (all of them) and run ``chunks`` of
        prompts in the same forward (``packed.py``): each row's next-token logits, and
        each chunk's logits ([keep, vocab]). A chunk's sequence gets its KV (its
        ``length`` is the prefill's to move)."""
        live = {i for i, n in enumerate(self._lengths) if n is not None}
        if set(tokens) != live:
            raise ValueError(f"a step needs one token for each row in use {sorted(live)}, got {sorted(tokens)}")
        if not live and not chunks:
            return {}, []
        rows = max(live) + 1 if live else 0
        if live and self._end + 1 > self._keys[0].shape[2]:
            self._layout(rows=len(self._lengths), width=max(n for n in self._lengths if n is not None))
        # NOTE: a row's columns end at the new one; those the step reads hold the longest
        # row in use (the buffer may reach further back, to rows that left)
        lengths = tuple(self._lengths[row] or 0 for row in range(rows))  # a free row: position 0
        if max(lengths, default=0) >= self.context_length:
            raise ValueError(f"a row is at position {max(lengths)}, past the {self.context_length} a step serves")
        for chunk in chunks:
            self.check(chunk)
        ids = [tokens.get(row, 0) for row in range(rows)]
        plan = Packed(lengths, tuple(chunks), self._arch.windows, self._device)
        for chunk in chunks:
            ids += chunk.tokens
        self._plan = plan
        try:
            out = self._loaded.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=self._device),
                position_ids=plan.positions().to(self._device),
                attention_mask=self._no_mask,  # NOTE: a 4-D mask is taken as it is: the plan holds the real ones
                cache=self._cache,
                use_cache=True,
                logits_to_keep=plan.kept().to(self._device),
                packed=plan,
            )
        finally:
            self._plan = None
        logits = out.logits[0].float().cpu()
        if live:
            self._end += 1
            for row in live:
                self._lengths[row] = self.length(row) + 1
        kept, begin = [], rows
        for chunk in chunks:
            kept.append(logits[begin : begin + chunk.keep])
            begin += chunk.keep
        return {row: logits[row] for row in live}, kept

    # ------------------------------------------------------------------ layout

    def _layout(self, rows: int, width: int) -> None:
        """New buffers for ``rows`` rows whose longest holds ``width`` positions, with room
        to grow; the rows in use copied in. Rows draining read the old buffers, so they are free here."""
        cap_rows = max(1, 1 << max(0, rows - 1).bit_length())
        end = -(-width // _GRAIN) * _GRAIN if width else 0
        cap = end + max(_HEADROOM, end // 2)  # NOTE: room to decode in, growing with the rows' length
        keys = [torch.zeros((cap_rows, self._heads, cap, self._dim), dtype=self._dtype, device=self._device)]
        keys += [torch.zeros_like(keys[0]) for _ in range(self._layers - 1)]
        values = [torch.zeros_like(keys[0]) for _ in range(self._layers)]
        for row, length in enumerate(self._lengths):
            if length is None:
                continue
            for index in range(self._layers):
                keys[index][row, :, end - length : end].copy_(self._keys[index][row, :, self._end - length : self._end])
                values[index][row, :, end - length : end].copy_(
                    self._values[index][row, :, self._end - length : self._end]
                )
        self._keys, self._values = keys, values
        self._end = end
        live = [n for n in self._lengths if n is not None]
        self._start = end - max(live) if live else end
        self._draining.clear()
        while self._lengths and self._lengths[-1] is None:
            self._lengths.pop()
