"""A frame read from a file straight into its place in a load's array.

``read_placed`` reads the file into the caller's buffer, computes the payload's
checksum and copies the payload's rows to their place, in one pass that holds no
lock and, with the compiled helper (``_placed.c``), one call outside the GIL, so the
threads of a load run side by side. Nothing is verified here: the caller checks the
frame (``codec.decode`` with ``computed_checksum``) before it trusts what was placed,
and a bad frame's rows are past the load's true length (design.md invariant 6).
Without a C compiler the same steps run in Python, one call each.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import xxhash

from prefixcache.storage.header import CorruptFrame, TruncatedFrame

__all__ = ["NATIVE", "Place", "Placed", "read_placed"]

_placed: ModuleType | None
try:
    from prefixcache.storage import _placed
except ImportError:  # NOTE: an optional extension, built where a C compiler exists
    _placed = None

NATIVE = _placed is not None


@dataclass(frozen=True, slots=True)
class Place:
    """Where a payload's rows go: ``rows`` rows of ``src_row`` bytes, each row's first
    ``copy_row`` bytes to ``out[offset + r * stride]`` (``out`` a writable byte view).
    For a ``[layers, 2, heads, tokens, dim]`` frame placed along the token axis of a
    ``[layers, 2, heads, T, dim]`` array, a row is one (layer, k/v, head)."""

    out: memoryview
    offset: int
    rows: int
    src_row: int
    copy_row: int
    stride: int

    def __post_init__(self) -> None:
        end = self.offset + (self.rows - 1) * self.stride + self.copy_row
        if min(self.rows, self.src_row) < 1 or self.offset < 0 or not 0 <= self.copy_row <= self.src_row:
            raise ValueError(f"a place needs rows and src_row >= 1, offset >= 0, 0 <= copy_row <= src_row: {self}")
        if self.stride < self.copy_row or end > self.out.nbytes:
            raise ValueError(f"the rows overlap or do not fit the {self.out.nbytes}-byte output: {self}")

    @property
    def payload_bytes(self) -> int:
        return self.rows * self.src_row


@dataclass(frozen=True, slots=True)
class Placed:
    """A frame read into the buffer (valid until the buffer is reused) and the checksum
    of its payload, computed as it was placed."""

    frame: memoryview
    checksum: bytes


def read_placed(path: str, buffer: bytearray, place: Place) -> Placed:
    """Read ``path`` into ``buffer``, hash its payload, place its rows. ``OSError`` when
    the file cannot be read; ``TruncatedFrame`` or ``CorruptFrame`` when its length
    cannot be a frame of this payload that ``buffer`` holds (nothing is placed then)."""
    if _placed is not None:
        size, checksum = _placed.read_placed(
            path, buffer, place.out, place.offset, place.rows, place.src_row, place.copy_row, place.stride
        )
    else:
        size, checksum = _read_placed(path, buffer, place)
    if checksum is None:
        if size < place.payload_bytes:
            raise TruncatedFrame(f"{size} bytes, less than the {place.payload_bytes}-byte payload")
        raise CorruptFrame(f"{size} bytes, more than a frame of a {place.payload_bytes}-byte payload")
    return Placed(memoryview(buffer)[:size], checksum)


def _read_placed(path: str, buffer: bytearray, place: Place) -> tuple[int, bytes | None]:
    """``_placed.read_placed`` in Python."""
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # as ``_placed.c``
    with open(fd, "rb", buffering=0, closefd=True) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        n = 0
        while n < len(view) and (got := f.readinto(view[n:])):
            n += got
        if n == len(view) and f.read(1):
            return n + 1, None  # NOTE: longer than the buffer: its size does not matter
    payload = place.payload_bytes
    if n < payload:
        return n, None
    src = view[n - payload : n]
    checksum = xxhash.xxh3_128_digest(src)
    rows = np.frombuffer(src, np.uint8).reshape(place.rows, place.src_row)
    dst = np.lib.stride_tricks.as_strided(
        np.frombuffer(place.out, np.uint8)[place.offset :], (place.rows, place.copy_row), (place.stride, 1)
    )
    dst[...] = rows[:, : place.copy_row]
    return n, checksum
