"""One shelf of the decode batch: rows of about one length, their KV in one left-padded
buffer per layer (``batch.py`` holds a shelf per length class).

    buffer (per layer, keys and values)       columns:  start ............ end   cap
      slot 0  [ pad pad pad | k0 k1 k2 ... k_{L0-1} ]    each row's KV ends at ``end``;
      slot 1  [ k0 k1 k2 k3 k4 ........ k_{L1-1}   ]    the next token of every row is
      slot 2  [ (free: zeros, one live column)     ]    written at column ``end``

A buffer is as wide as the shelf's longest row (with room to decode in), so a shelf of
short rows never pays for a long one's columns. A row joins with the KV of its prefill
(copied in once) and leaves without a copy: its columns stay untouched until
``release`` (the store reads them meanwhile), or until the buffer is laid out anew,
which never writes the old buffer. Free slots below the last one in use still run, so
that rows never move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixcache.engine.kv import to_numpy

__all__ = ["RowKV", "Shelf"]

_GRAIN = 64  # columns are allocated in multiples of this
_HEADROOM = 64  # columns of room past the longest row after a new layout, at least (half its length at most)


def _nbytes(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in (*keys, *values))


@dataclass(frozen=True, eq=False)
class RowKV:
    """A ``KVSource`` over a row that left: positions ``begin..end-1`` of its sequence."""

    keys: tuple[torch.Tensor, ...]  # per layer, the buffer the row was in
    values: tuple[torch.Tensor, ...]
    row: int  # its slot in that buffer
    first: int  # the buffer column of the sequence's position 0
    length: int

    @property
    def nbytes(self) -> int:
        """The bytes of the buffers it reads (what goes when it is the last over them)."""
        return _nbytes(self.keys, self.values)

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


class Shelf:
    """The buffers of one length class: ``layers`` x [slots, heads, cap, dim], keys and values."""

    def __init__(self, layers: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self._shape = (layers, heads, dim)
        self._dtype, self._device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.start = self.end = 0  # the columns the live rows' KV spans
        self.lengths: list[int | None] = []  # per slot: its sequence's length, None when free
        self.draining: set[int] = set()  # slots that left, their columns still read
        self.layout(rows=0, width=0)

    # ------------------------------------------------------------------ state

    @property
    def live(self) -> list[int]:
        return [slot for slot, n in enumerate(self.lengths) if n is not None]

    @property
    def idle(self) -> bool:
        """No row in use and none read: the shelf can go."""
        return not self.live and not self.draining

    @property
    def forwarded(self) -> int:
        """Slots a step runs: up to the last one in use."""
        live = self.live
        return max(live) + 1 if live else 0

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values)

    def owns(self, kv: RowKV) -> bool:
        return kv.keys[0] is self.keys[0]

    # ------------------------------------------------------------------ rows

    def join(self, layers: Sequence[Any], length: int) -> int:
        """Copy ``length`` positions of a prefill's layers (``.keys``/``.values`` [1, H, T, D]) in; the slot."""
        slot = self._free_slot()
        if slot >= self.keys[0].shape[0] or length > self.end or self.end + 1 > self.keys[0].shape[2]:
            live = [n for n in self.lengths if n is not None]
            self.layout(rows=max(len(self.lengths), slot + 1), width=max([length, *live]))
            slot = self._free_slot()
        if slot == len(self.lengths):
            self.lengths.append(None)
        first = self.end - length
        self.start = min(self.start, first)
        for index, layer in enumerate(layers):
            keys, values = self.keys[index], self.values[index]
            keys[slot, :, :first].zero_()
            values[slot, :, :first].zero_()
            keys[slot, :, first : self.end].copy_(layer.keys[0, :, :length])
            values[slot, :, first : self.end].copy_(layer.values[0, :, :length])
        self.lengths[slot] = length
        return slot

    def _free_slot(self) -> int:
        """The first slot neither in use nor draining (past the last: a new one)."""
        free = (i for i, n in enumerate(self.lengths) if n is None and i not in self.draining)
        return next(free, len(self.lengths))

    def leave(self, slot: int) -> RowKV:
        """Take ``slot`` out; its KV stays readable through the result until ``release``."""
        length = self.lengths[slot]
        assert length is not None
        out = RowKV(tuple(self.keys), tuple(self.values), slot, self.end - length, length)
        self.lengths[slot] = None
        self.draining.add(slot)
        self._trim()
        live = [n for n in self.lengths if n is not None]
        if not live:
            self.layout(rows=0, width=0)  # NOTE: the memory of a burst is not kept once it is over
        elif self.end - self.start > 2 * max(live) + _HEADROOM:
            self.layout(rows=len(self.lengths), width=max(live))  # the buffer shrinks back
        return out

    def release(self, kv: RowKV) -> None:
        """The KV of a slot that left is no longer read (unless a new layout freed it already)."""
        if self.owns(kv):
            self.draining.discard(kv.row)
        self._trim()

    def _trim(self) -> None:
        while self.lengths and self.lengths[-1] is None and len(self.lengths) - 1 not in self.draining:
            self.lengths.pop()

    # ------------------------------------------------------------------ a step

    def make_room(self) -> None:
        """Before a step: a column for every row's next token."""
        if self.live and self.end + 1 > self.keys[0].shape[2]:
            self.layout(rows=len(self.lengths), width=max(n for n in self.lengths if n is not None))

    def stepped(self) -> None:
        """After a step: every row in use is one position longer."""
        if self.live:
            self.end += 1
            for slot in self.live:
                length = self.lengths[slot]
                assert length is not None
                self.lengths[slot] = length + 1

    # ------------------------------------------------------------------ layout

    def layout(self, rows: int, width: int) -> None:
        """New buffers for ``rows`` slots whose longest holds ``width`` positions, with room
        to grow; the rows in use copied in. Slots draining read the old buffers, so they are free here."""
        layers, heads, dim = self._shape
        cap_rows = max(1, 1 << max(0, rows - 1).bit_length())
        end = -(-width // _GRAIN) * _GRAIN if width else 0
        cap = end + max(_HEADROOM, end // 2)  # NOTE: room to decode in, growing with the rows' length
        keys = [torch.zeros((cap_rows, heads, cap, dim), dtype=self._dtype, device=self._device)]
        keys += [torch.zeros_like(keys[0]) for _ in range(layers - 1)]
        values = [torch.zeros_like(keys[0]) for _ in range(layers)]
        for slot, length in enumerate(self.lengths):
            if length is None:
                continue
            for index in range(layers):
                old = slice(self.end - length, self.end)
                keys[index][slot, :, end - length : end].copy_(self.keys[index][slot, :, old])
                values[index][slot, :, end - length : end].copy_(self.values[index][slot, :, old])
        self.keys, self.values = keys, values
        self.end = end
        live = [n for n in self.lengths if n is not None]
        self.start = end - max(live) if live else end
        self.draining.clear()
        while self.lengths and self.lengths[-1] is None:
            self.lengths.pop()
