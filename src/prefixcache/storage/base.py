"""The interface of a tier store: a narrow key -> frame store with no policy inside.

A store holds codec frames (``prefixcache.codec``) under block keys. It decides
nothing: which block goes where, and which leaves when a tier is full, is the cache's
business (its pools and policies). A store only puts, gets, deletes and says what it
holds, and it turns every failure of its medium into a counted miss, never into
wrong bytes: ``get_many`` returns ``None`` for a block that is absent, unreadable or
fails its checksum.
"""

from __future__ import annotations

import logging
import re
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Final, Protocol, runtime_checkable

if TYPE_CHECKING:
    from prefixcache.storage.placed import Place, Placed

Frame = bytes | bytearray | memoryview

# NOTE: a store opened with its layout (``open.open_store``) reads no more than one frame
# of that layout; this is the bound of a store built without one. Whoever can write a
# shared tier (a Redis, a bucket, a disk folder) can put anything under a key: a read
# that takes whatever is there would let one object take the process's memory.
MAX_FRAME_BYTES = 1 << 30

log = logging.getLogger("prefixcache.tiers")

ERROR_LOG_EVERY_S = 60.0  # per store and kind: the first error is logged, then one line a minute at most
_QUIET_KINDS = frozenset({"breaker_open"})  # the breaker logs its own opening and closing


class TierError(Exception):
    """A store could not do what was asked (the medium failed); counted by kind."""


class TierFull(TierError):
    """No room for the frame: the cache must evict first (a store never evicts)."""


@dataclass
class TierStats:
    """Counters of one store since it was opened."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    deletes: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # kind -> count (e.g. "checksum", "io", "timeout")
    where: str = ""  # the store in log lines: a kind and a path or an address, never a credential
    _logged: dict[str, tuple[float, int]] = field(default_factory=dict, repr=False)  # kind -> (last line, since)

    def error(self, kind: str, detail: str = "") -> None:
        """Count an error of ``kind``, and say so in the log: the first at once, then at
        most one line per ``ERROR_LOG_EVERY_S`` with how many came in between."""
        self.errors[kind] += 1
        if kind in _QUIET_KINDS:
            return
        now = time.monotonic()
        last, since = self._logged.get(kind, (-ERROR_LOG_EVERY_S, 0))
        if now - last < ERROR_LOG_EVERY_S:
            self._logged[kind] = (last, since + 1)
            return
        self._logged[kind] = (now, 0)
        log.warning(
            "event=tier_error store=%s kind=%s total=%d unlogged_since_last=%d%s",
            self.where or "?",
            kind,
            self.errors[kind],
            since,
            f" detail={detail!r}" if detail else "",
        )


class TierStore(ABC):
    """One tier's storage. ``capacity_bytes`` is a hard cap on the bytes of frames held."""

    kind: ClassVar[str]
    # Whether ``get_many`` returns only immutable frames it has verified in full (codec
    # checksums): a loader may then skip the payload checksum (``codec.decode``).
    verifies_reads: ClassVar[bool] = False
    # Whether the frames live in this process's own memory, written only from KV the cache
    # encoded or a verifying store read: no medium or network between write and read, so a
    # loader may skip the payload checksum (the header, key and token checks still run).
    private: ClassVar[bool] = False
    # Whether a write is a copy into this process's memory: the cache then writes (and
    # frees) here from the thread that decided it, not through its write queue.
    sync: ClassVar[bool] = False
    # Whether ``read_placed`` is offered: a loader then reads frame by frame straight
    # into place rather than in batches of fresh frames it copies afterwards.
    places_reads: ClassVar[bool] = False
    # How many frames ``get_many`` fetches at once (a network store's parallel requests):
    # a loader asks for that many batches' worth in one call, so the requests overlap.
    read_width: int = 1

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an integer >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of frames held now (never above ``capacity_bytes``)."""

    @abstractmethod
    def put(self, key: bytes, frame: Frame) -> None:
        """Store ``frame`` under ``key`` (replacing what was there). ``TierFull`` when it
        does not fit, ``TierError`` when the medium fails; on either nothing is stored."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        """The frames of ``keys``, in order; ``None`` for a miss of any kind."""

    def read_placed(self, key: bytes, buffer: bytearray, place: Place) -> Placed | None:
        """For a store that ``places_reads``: ``key``'s frame read into ``buffer`` and its
        payload's rows copied to ``place`` in the same pass (``placed.read_placed``), or
        ``None`` for a miss. Unverified: the caller checks the frame against the
        checksum computed on the way before it trusts the placed bytes."""
        raise NotImplementedError(f"a {self.kind} store does not place its reads")

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Forget ``key``; whether it was there."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def room_for(self, frame_bytes: int) -> int:
        """How many more frames of ``frame_bytes`` fit now (the cache makes room until it is enough)."""
        return max(self.capacity_bytes - self.used_bytes, 0) // frame_bytes

    def footprint(self, frame_bytes: int) -> int:
        """The bytes of ``used_bytes`` one frame of ``frame_bytes`` takes here: its own
        length, for a store that counts the lengths of the frames it holds. A store that
        counts otherwise (fixed slots) says so by overriding this, so that whoever turns
        frames into bytes (retention's metrics) uses the unit of the store's own gauge."""
        return frame_bytes

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of the leading ``keys`` are held, counted up to the first hole.

        NOTE: not a binary search: one tier alone is not prefix-closed (invariant 4 holds
        for tiers 0..k together), so a slower tier may hold a child without its parent,
        which lived in a faster tier; after a restart (the faster tier gone) or a crash
        mid-write the chain has holes there. Membership here is an index lookup in memory."""
        held = 0
        for key in keys:
            if key not in self:
                break
            held += 1
        return held

    def detach(self, key: bytes) -> Callable[[], Frame | None] | None:
        """For a ``sync`` store: unname ``key``'s frame but keep its bytes, returning a call
        that reads them once and then frees them (see ``MemoryStore.detach``)."""
        raise NotImplementedError(f"a {self.kind} store cannot detach a frame")

    def close(self) -> None:
        """Release the medium (files, connections). Idempotent."""
        return None

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The most a store reads of one epoch record, and the most records it returns: what a
# tier another process can write hands back is bounded before it is looked at.
EPOCH_RECORD_BYTES: Final = 4096
EPOCH_RECORDS: Final = 1024
EPOCH_NAME: Final = re.compile(r"[0-9a-f]{32}")  # a record's name: 32 lower-case hex digits, nothing else
# The books a store keeps records in, apart, so that one's records never crowd the other's
# out of a read: model and adapter epochs, and the generations of tenant namespaces.
EPOCH_BOOKS: Final = ("epochs", "generations")


@runtime_checkable
class EpochKeeper(Protocol):
    """A store that keeps the cache's epoch records beside its frames (disk, Redis, S3),
    so that an epoch bump outlives a restart and reaches every server sharing the tier
    (``cache/epochbook.py`` writes and judges them; the store only moves the bytes).

    NOTE: a protocol, not methods of ``TierStore``: a store that keeps no records (a
    memory tier, whose frames a restart forgets anyway) simply has none."""

    epoch_sync: bool  # other processes write this tier too: re-read its records while the cache runs

    def read_epochs(self, book: str = "epochs") -> list[tuple[str, bytes]]:
        """Every record held in ``book`` (one of ``EPOCH_BOOKS``), as (name, bytes): at most
        ``EPOCH_RECORDS`` of them, each at most ``EPOCH_RECORD_BYTES`` (a longer one is
        skipped, counted ``epoch``). ``TierError`` when the medium fails."""
        ...

    def write_epoch(self, name: str, record: bytes, book: str = "epochs") -> None:
        """Publish ``record`` under ``name`` (``EPOCH_NAME``; another is a ValueError) in
        ``book``, whole or not at all, replacing what was there; ``TierError`` when the
        medium fails."""
        ...


def epoch_book(book: str) -> str:
    """``book`` when it is one of ``EPOCH_BOOKS``; a ValueError otherwise (it names a
    folder, a key or a prefix of the tier)."""
    if book not in EPOCH_BOOKS:
        raise ValueError(f"not a book of records: {book!r}; valid: {', '.join(EPOCH_BOOKS)}")
    return book
