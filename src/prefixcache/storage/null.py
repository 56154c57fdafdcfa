"""A metadata-only tier for the trace simulator: residency and byte accounting, no bytes.

The simulator drives the real ``PrefixCache`` (design.md, "The path of a request"),
so its tiers must fill, refuse and free exactly like real ones, but holding millions
of blocks' KV would need the memory the simulation is meant to size. A ``NullStore``
keeps, per key, only the frame's length: ``used_bytes`` and ``TierFull`` behave as in a
store of the same capacity, and ``in`` says what is resident.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from prefixcache.storage.base import Frame, TierFull, TierStore

__all__ = ["NullStore"]


class NullStore(TierStore):
    """Keys and frame lengths only.

    NOTE: ``get_many`` returns ``None`` for every key, held or not, because there are no
    bytes to serve; returning a fake frame would be served as wrong KV (invariant 6).
    Residency is what the simulator counts, and that is ``key in store``. Reads of held
    keys are still counted as hits (and their lengths as ``bytes_read``), so the stats
    say what a real store of this capacity would have done.
    """

    kind: ClassVar[str] = "null"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._lengths: dict[bytes, int] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        """The sum of the lengths of the frames put and not deleted."""
        return self._used

    def put(self, key: bytes, frame: Frame) -> None:
        self.put_size(key, memoryview(frame).nbytes)

    def put_size(self, key: bytes, nbytes: int) -> None:
        """Account for a frame of ``nbytes`` under ``key`` without building it (what the simulator calls)."""
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an integer >= 0, got {nbytes!r}")
        used = self._used - self._lengths.get(key, 0) + nbytes
        if used > self.capacity_bytes:
            raise TierFull(f"a {nbytes}-byte frame does not fit: {self._used} of {self.capacity_bytes} bytes used")
        self._lengths[key] = nbytes
        self._used = used
        self.stats.puts += 1
        self.stats.bytes_written += nbytes

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        """``None`` for every key: nothing is held to serve (see the class NOTE)."""
        for key in keys:
            length = self._lengths.get(key)
            if length is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += length
        return [None] * len(keys)

    def delete(self, key: bytes) -> bool:
        length = self._lengths.pop(key, None)
        if length is None:
            return False
        self._used -= length
        self.stats.deletes += 1
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def close(self) -> None:
        """Forget every key: a closed tier holds nothing. Idempotent."""
        self._lengths.clear()
        self._used = 0
