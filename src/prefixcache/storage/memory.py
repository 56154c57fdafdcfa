"""Host-memory tier (L1): one preallocated slab of fixed-size slots, read through zero-copy views.

Every block of one model encodes to a frame of the same length (``codec.encoded_size``
of its shape, dtype and key length), so fixed-size slots waste nothing in the common
case and make allocation a pop from a free list: no allocator, no fragmentation, no
per-put ``malloc`` on the serving path::

    slab (numpy uint8, capacity_bytes // slot_bytes slots, allocated once)
    +---------------------+---------------------+-----+---------------------+
    | slot 0              | slot 1              | ... | slot n-1            |
    | frame | unused tail | frame | unused tail |     |                     |
    +---------------------+---------------------+-----+---------------------+
    ^ 0                   ^ slot_bytes          ^ 2 * slot_bytes

    free:  [n-1, ..., 3, 2]         stack of free slots (here 0 and 1 are taken): put pops, delete pushes
    where: {key: (slot, length)}    which slot holds a key, and its frame's length

A store holds no policy (``storage/base.py``): when no slot is free ``put`` raises
``TierFull`` and the cache evicts first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import ClassVar, Final

import numpy as np

from prefixcache.storage import codec
from prefixcache.storage.base import Frame, TierError, TierFull, TierStore

__all__ = ["SLAB_ALIGN", "MemoryStore"]

# NOTE: the slab starts on a 64-byte (cache line) boundary, and ``for_blocks`` rounds
# slots up to a multiple of 16, so every frame's payload (16-aligned inside the frame,
# see codec.py) is 16-aligned in memory: aligned tensor views are faster to copy from.
SLAB_ALIGN: Final = 64


def _aligned_slab(nbytes: int) -> np.ndarray:
    """A zeroed uint8 buffer of ``nbytes`` whose first byte is ``SLAB_ALIGN``-aligned."""
    raw = np.zeros(nbytes + SLAB_ALIGN - 1, dtype=np.uint8)
    start = -raw.ctypes.data % SLAB_ALIGN
    slab: np.ndarray = raw[start : start + nbytes]
    return slab


def _byte_view(frame: Frame) -> memoryview:
    """``frame`` as flat bytes; a non-contiguous buffer is a caller bug, not a miss."""
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if not view.c_contiguous:
        raise TypeError("frame must be a contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


class MemoryStore(TierStore):
    """Frames in fixed-size slots of one host-memory slab; ``get_many`` copies nothing.

    ``capacity_bytes`` is rounded down to whole slots, and ``used_bytes`` counts whole
    slots (slots in use times ``slot_bytes``): that is the memory really held, whatever
    the frames' own lengths, so the cache's byte budget matches the process's footprint.
    """

    kind: ClassVar[str] = "memory"
    private: ClassVar[bool] = True
    sync: ClassVar[bool] = True

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        super().__init__(capacity_bytes)
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ValueError(f"slot_bytes must be an integer >= 1, got {slot_bytes!r}")
        slots = capacity_bytes // slot_bytes
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.capacity_bytes = slots * slot_bytes
        self._slab, self._readonly = self._allocate(self.capacity_bytes)
        self._free = list(range(slots - 1, -1, -1))  # slot 0 on top: low addresses are used first
        self._where: dict[bytes, tuple[int, int]] = {}
        self._lock = threading.Lock()  # the slot table; never held while bytes are copied
        self._closed = False

    def _allocate(self, nbytes: int) -> tuple[np.ndarray, memoryview]:
        """The slab, and one read-only view of it.

        NOTE: views handed out are read-only: a consumer cannot scribble into a slot
        another key may reuse. Slicing this one read-only view is O(1) and copies nothing."""
        slab = _aligned_slab(nbytes)
        return slab, slab.data.toreadonly()

    def _write(self, start: int, view: memoryview) -> None:
        self._slab[start : start + view.nbytes] = np.frombuffer(view, dtype=np.uint8)

    def _read(self, start: int, length: int) -> Frame:
        return self._readonly[start : start + length]

    @classmethod
    def for_blocks(cls, blocks: int, shape: Sequence[int], dtype: str, key_len: int = 16) -> MemoryStore:
        """A store of ``blocks`` slots, each exactly one frame of this block shape (rounded up to 16)."""
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise ValueError(f"blocks must be an integer >= 0, got {blocks!r}")
        slot = cls.slot_for(codec.encoded_size(shape, dtype, key_len))
        return cls(blocks * slot, slot)

    @staticmethod
    def slot_for(frame_bytes: int) -> int:
        """The slot that holds a frame of ``frame_bytes``: rounded up to 16, so that every
        payload in the slab stays 16-aligned."""
        return -(-frame_bytes // codec.HEADER_ALIGN) * codec.HEADER_ALIGN

    @property
    def used_bytes(self) -> int:
        """Whole slots in use times ``slot_bytes``: the memory held, not the sum of frame lengths."""
        return (self.slots - len(self._free)) * self.slot_bytes if not self._closed else 0

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def room_for(self, frame_bytes: int) -> int:
        """Free slots: one frame each, whatever its length (none fits when it is too long)."""
        return len(self._free) if frame_bytes <= self.slot_bytes else 0

    def footprint(self, frame_bytes: int) -> int:
        """A whole slot, whatever the frame's length: ``used_bytes`` counts slots (a frame
        longer than a slot fits nowhere, see ``room_for``)."""
        return self.slot_bytes

    def put(self, key: bytes, frame: Frame) -> None:
        """Copy ``frame`` into a slot: the key's own slot when it is replaced, else a free one.

        NOTE: a replace writes in place, so a view of the old frame read earlier now shows
        the new bytes (or a mix, mid-copy); the codec's key and checksums catch a reader
        that kept such a view. The cache never replaces a frame someone may be reading:
        it puts a key only where no frame of it is held.
        NOTE: the copy runs outside the store's lock; a new key is findable only once
        its bytes are in place.
        """
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        view = _byte_view(frame)
        length = view.nbytes
        if length > self.slot_bytes:
            raise ValueError(f"frame of {length} bytes does not fit a {self.slot_bytes}-byte slot")
        with self._lock:
            if self._closed:
                raise TierError("memory store is closed")
            held = self._where.get(key)
            if held is not None:
                slot = held[0]
            elif self._free:
                slot = self._free.pop()
            else:
                raise TierFull(f"all {self.slots} slots of {self.slot_bytes} bytes are in use")
        self._write(slot * self.slot_bytes, view)
        with self._lock:
            self._where[key] = (slot, length)
            self.stats.puts += 1
            self.stats.bytes_written += length

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        """Read-only ``memoryview``s into the slab, one per key (``None`` for a miss).

        NOTE: a view is zero-copy and so valid only until its key is deleted or replaced:
        after that its slot may hold another block's frame. The cache pins what it loads
        until the tensor is copied out of the view.
        """
        with self._lock:
            where = [self._where.get(key) for key in keys]
            hits = [held for held in where if held is not None]
            self.stats.hits += len(hits)
            self.stats.misses += len(where) - len(hits)
            self.stats.bytes_read += sum(length for _, length in hits)
        # NOTE: read outside the lock (a device slab's read is a copy to the host)
        return [None if held is None else self._read(held[0] * self.slot_bytes, held[1]) for held in where]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            held = self._where.pop(key, None)
            if held is None:
                return False
            self._free.append(held[0])
            self.stats.deletes += 1
            return True

    def detach(self, key: bytes) -> Callable[[], Frame | None] | None:
        """Unname ``key``'s frame but keep its slot: returns a call that reads the frame
        once and frees the slot (None when the key is not held). A frame moving to a
        slower tier is read out this way, after the cache has let go of the key, so that
        a new frame of the same key can never land in the slot meanwhile."""
        with self._lock:
            held = self._where.pop(key, None)
        if held is None:
            return None
        slot, length = held

        def read_and_free() -> Frame | None:
            data = bytes(self._read(slot * self.slot_bytes, length))
            with self._lock:
                self._free.append(slot)
                self.stats.deletes += 1
                self.stats.bytes_read += length
            return data

        return read_and_free

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        """Forget every frame and drop the slab; views still held keep their bytes alive."""
        if self._closed:
            return
        self._closed = True
        self._where.clear()
        self._free.clear()
        self._slab = np.zeros(0, dtype=np.uint8)
        self._readonly = self._slab.data.toreadonly()
