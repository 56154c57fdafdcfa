"""Decoding many sequences in one forward: their KV on shelves, one per length class.

    shelf 0 (rows up to 512 positions at join)    [ slots of short rows ]  one buffer per layer
    shelf 2 (rows up to 2,048)                    [ the long row        ]  as wide as its rows

A row joins the shelf of its length class (``shelf.py``: a left-padded buffer per layer
as wide as that shelf's longest row), so the rows of one step never all pay for the
longest one's columns: a shelf's width is within a small factor of its own rows'. A
step feeds one token per row at its own position (its length) with a mask that lets
each row see only its own columns (in a layer with a sliding window, the last
``window`` of them), the rows of each shelf attending in one call over that shelf's
buffer, so a row's logits are those of its sequence alone (up to float rounding of the
larger matrix products); prompts' chunks may ride along in the same forward, each on
its own sequence's KV (``packed.py``). A row leaves without a copy (its columns read
until ``release``); an emptied shelf's buffers go.

No threads here: the engine's worker drives it; ``RowKV.read`` may run on another
thread while the worker steps (it reads only columns no step writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from prefixcache.engine.arch import serving
from prefixcache.engine.model import LoadedModel
from prefixcache.engine.packed import KV, Packed, use_packed_attention
from prefixcache.engine.runner import Chunk
from prefixcache.engine.shelf import RowKV, Shelf

__all__ = ["Batch", "RowKV", "shelf_class"]

_SHELF_BASE = 512  # shelf k holds the rows of at most _SHELF_BASE * 2**k positions when they join


def shelf_class(length: int) -> int:
    """The shelf a row of ``length`` positions joins: the least k with length <= 512 * 2**k."""
    return max(0, (-(-length // _SHELF_BASE) - 1).bit_length())


class _Layer(DynamicLayer):  # type: ignore[no-untyped-call]
    """One decoder layer's view of the batch: the model's ``update`` writes each shelf's column ``end``."""

    def __init__(self, batch: Batch, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._batch, self._index = batch, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token into its shelf's column ``end``, each chunk's onto its sequence's
        KV; the packed attention reads them from the plan (what this returns goes unread)."""
        b, index = self._batch, self._index
        plan = b._plan
        assert plan is not None and plan.groups is not None, "a batch's cache runs only in its own step"
        window, rows = plan.windows[index], []
        for group, (shelf, (begin, end)) in enumerate(zip(b._stepping, plan.groups, strict=True)):
            keys, values, n, column = shelf.keys[index], shelf.values[index], end - begin, shelf.end
            keys[:n, :, column].copy_(key_states[0, :, begin:end].transpose(0, 1))
            values[:n, :, column].copy_(value_states[0, :, begin:end].transpose(0, 1))
            first = column + 1 - plan.columns(group, window)
            rows.append((keys[:n, :, first : column + 1], values[:n, :, first : column + 1]))
        chunks: list[KV] = [
            chunk.seq.cache.update(key_states[:, :, begin:end], value_states[:, :, begin:end], index)
            for chunk, (begin, end) in zip(plan.chunks, plan.spans, strict=True)
        ]
        plan.layer = window, rows, chunks
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max((shelf.end - shelf.start for shelf in self._batch._shelves.values()), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


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
        self._shelves: dict[int, Shelf] = {}  # by length class
        self._rows: dict[int, tuple[int, int]] = {}  # row -> (its shelf's class, its slot there)
        self._stepping: list[Shelf] = []  # the step running: the shelves it forwards, in order
        self._cache = DynamicCache(config=config)
        self._cache.layers = [_Layer(self, i) for i in range(self._layers)]
        self._plan: Packed | None = None  # the step running
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self._device)
        use_packed_attention(loaded.model)

    # ------------------------------------------------------------------ rows

    @property
    def rows(self) -> int:
        """Rows in use (decoding)."""
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        """The bytes of every shelf's buffers (the rows' KV with its padding and room)."""
        return sum(shelf.nbytes for shelf in self._shelves.values())

    def length(self, row: int) -> int:
        where = self._rows.get(row)
        if where is None:
            raise ValueError(f"row {row} is free")
        length = self._shelves[where[0]].lengths[where[1]]
        assert length is not None
        return length

    @torch.inference_mode()
    def join(self, cache: DynamicCache, length: int) -> int:
        """Copy the ``length`` positions of a prefilled ``cache`` in as a new row; its index."""
        kind = shelf_class(length)
        shelf = self._shelves.get(kind)
        if shelf is None:
            shelf = self._shelves[kind] = Shelf(self._layers, self._heads, self._dim, self._dtype, self._device)
        slot = shelf.join(list(cache.layers), length)
        row = next(i for i in range(len(self._rows) + 1) if i not in self._rows)
        self._rows[row] = (kind, slot)
        return row

    @torch.inference_mode()
    def leave(self, row: int) -> RowKV:
        """Take ``row`` out; its KV stays readable through the result until ``release(row)``."""
        self.length(row)
        kind, slot = self._rows.pop(row)
        out = self._shelves[kind].leave(slot)
        self._drop_idle(kind)
        return out

    def release(self, kv: RowKV) -> bool:
        """The KV of a row that left is no longer read: its slot may be reused (unless a
        new layout freed it already, and it is another row's now). Whether its buffers
        are still a shelf's (False: they go with the last ``RowKV`` over them)."""
        for kind, shelf in list(self._shelves.items()):
            if shelf.owns(kv):
                shelf.release(kv)
                self._drop_idle(kind)
                return kind in self._shelves
        return False

    def _drop_idle(self, kind: int) -> None:
        if self._shelves[kind].idle:
            del self._shelves[kind]  # NOTE: its memory goes with it

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
        live = set(self._rows)
        if set(tokens) != live:
            raise ValueError(f"a step needs one token for each row in use {sorted(live)}, got {sorted(tokens)}")
        if not live and not chunks:
            return {}, []
        rows_at = {where: row for row, where in self._rows.items()}
        shelves = [(kind, self._shelves[kind]) for kind in sorted(self._shelves) if self._shelves[kind].live]
        order: list[int | None] = []  # per packed row: the batch's row, None for a free slot
        lengths: list[int] = []
        groups: list[tuple[int, int]] = []
        for kind, shelf in shelves:
            shelf.make_room()
            begin = len(order)
            for slot in range(shelf.forwarded):
                order.append(rows_at.get((kind, slot)))
                lengths.append(shelf.lengths[slot] or 0)  # a free slot: position 0
            groups.append((begin, len(order)))
        if max(lengths, default=0) >= self.context_length:
            raise ValueError(f"a row is at position {max(lengths)}, past the {self.context_length} a step serves")
        for chunk in chunks:
            self.check(chunk)
        ids = [tokens[row] if row is not None else 0 for row in order]
        plan = Packed(tuple(lengths), tuple(chunks), self._arch.windows, self._device, groups=tuple(groups))
        for chunk in chunks:
            ids += chunk.tokens
        self._plan, self._stepping = plan, [shelf for _, shelf in shelves]
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
            self._plan, self._stepping = None, []
        logits = out.logits[0].float().cpu()
        for _, shelf in shelves:
            shelf.stepped()
        kept, begin = [], len(order)
        for chunk in chunks:
            kept.append(logits[begin : begin + chunk.keep])
            begin += chunk.keep
        return {row: logits[i] for i, row in enumerate(order) if row is not None}, kept
