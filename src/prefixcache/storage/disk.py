"""Local-disk tier (L2): one file per frame, published atomically, indexed again on open.

A restarted server must still hit on yesterday's prefixes (a warm restart), and a
crash, a full disk or a rotten sector must never hand out wrong bytes. So every write
goes to a temp file that is published with one atomic ``os.replace``, every read is
verified in full by the codec, and anything that fails is moved aside, counted, and
treated as a miss::

    directory/
      blocks/                      published frames, one file each
        00/ .. ff/                 first byte of the key, in hex (256 small dirs, not one huge one)
          <key hex>.blk            a whole codec frame; its header's key equals its name
      tmp/                         writes in progress: <key hex>.<random>.tmp
      quarantine/                  bad files moved aside for a human: <name>.<random>
      epochs/<name>.epoch          the cache's epoch records (``cache/epochbook.py``)
      generations/<name>.epoch     the generations of tenant namespaces (the same book's)

    put:   tmp/x.tmp --write--> [fsync file] --os.replace--> blocks/ab/x.blk --> [fsync blocks/ab/]
                                 "data", "full"                                    "full" only
    open:  tmp/*           deleted (half-written by a crash)          errors["partial"]
           blocks/**       header peeked, key == name, size == frame  else quarantined

Error kinds counted in ``stats.errors`` (each one a miss or a refused write, never bytes served):

    partial   a temp file left by a crash, deleted on open
    stray     a file in blocks/ whose name or place is not a key's, quarantined on open
    key       a frame of another key under this key's name, quarantined on open
    checksum  a frame that fails the codec (header, length or payload), quarantined
    io        the medium failed: a read (file quarantined) or a write (nothing published)
    missing   a file deleted behind the store's back: dropped from the index

The index (key -> frame length) lives in memory and is rebuilt from blocks/ on open,
which reads only each file's header: opening does not hash payloads. Payload checksums
are verified on every read instead, where a bad block costs one miss.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, Final, TypeVar

from prefixcache.storage import codec
from prefixcache.storage.base import (
    EPOCH_NAME,
    EPOCH_RECORD_BYTES,
    EPOCH_RECORDS,
    MAX_FRAME_BYTES,
    Frame,
    TierError,
    TierFull,
    TierStore,
    epoch_book,
)
from prefixcache.storage.placed import Place, Placed, read_placed

__all__ = ["FSYNC_POLICIES", "MAX_KEY_BYTES", "DiskStore"]

FSYNC_POLICIES: Final = ("none", "data", "full")
# NOTE: a key is its file's name in hex, and a file name has at most 255 bytes on
# common file systems: 120 bytes -> 240 hex digits + ".blk". Block keys are 16-32 bytes.
MAX_KEY_BYTES: Final = 120
_SUFFIX: Final = ".blk"
_EPOCH_SUFFIX: Final = ".epoch"
# NOTE: a header is at most 256 bytes for a key of MAX_KEY_BYTES, so one small read
# finds it; a header that claims to be longer cannot be a key this store writes.
_HEADER_PROBE: Final = 4096

log = logging.getLogger("prefixcache.tiers")
T = TypeVar("T")


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable: on POSIX the directory entry needs its own fsync."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    """``os.write`` may write less than asked (signals, some file systems): loop until done."""
    while view:
        view = view[os.write(fd, view) :]


def _key_of(path: Path) -> bytes | None:
    """The key a file in blocks/ is named for, or ``None`` when it is not a block file's name."""
    stem = path.name.removesuffix(_SUFFIX)
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    # NOTE: the round trip refuses what fromhex forgives (upper case, spaces), so one key has one name.
    named = path.name.endswith(_SUFFIX) and key.hex() == stem and stem[:2] == path.parent.name
    return key if named and 1 <= len(key) <= MAX_KEY_BYTES else None


class DiskStore(TierStore):
    """Frames as files under ``directory``; the index survives a restart by a scan on open.

    ``fsync`` says what a finished ``put`` survives: ``"none"`` a process crash (the page
    cache still holds the file), ``"data"`` also a power loss for the file's bytes, and
    ``"full"`` also for its name (the directory is synced after the rename). Whatever the
    policy, a reader never sees a half-written frame: files are published whole or not at all.

    NOTE: one store per directory. A second store opened on a live directory deletes the
    first one's temp files as crash leftovers; its writes then fail (counted ``io``), which
    is safe but useless. Reads may run beside writes (the cache's writer thread): the
    index has a lock of its own, never held during file I/O.
    """

    kind: ClassVar[str] = "disk"
    verifies_reads: ClassVar[bool] = True  # get_many decodes every frame it returns
    places_reads: ClassVar[bool] = True

    def __init__(
        self, directory: str | Path, capacity_bytes: int, fsync: str = "data", *, max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        super().__init__(capacity_bytes)
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"unknown fsync policy {fsync!r}; valid: {', '.join(FSYNC_POLICIES)}")
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes  # a file longer is no frame of this tier (never read whole)
        self.directory = Path(directory)
        self.fsync = fsync
        self.quarantined = 0  # files moved to quarantine/ since open
        self._blocks = self.directory / "blocks"
        self._blocks_dir = str(self._blocks)
        self._tmp = self.directory / "tmp"
        self._quarantine = self.directory / "quarantine"
        self._index: dict[bytes, int] = {}
        self._used = 0
        self._lock = threading.Lock()  # the index and its byte count
        self._closed = False
        self.stats.where = f"disk:{self.directory}"
        for path in (self._blocks, self._tmp, self._quarantine):
            path.mkdir(parents=True, exist_ok=True)
        # NOTE: the 256 fan-out directories are made up front (and again on every open,
        # should one vanish), so a put never creates a directory whose entry needs a sync.
        for byte in range(256):
            (self._blocks / f"{byte:02x}").mkdir(exist_ok=True)
        if fsync == "full":
            _fsync_dir(self._blocks)
        self._scan()
        rejected = sum(self.stats.errors.values())
        log.info(
            "event=tier_opened tier=disk path=%s blocks=%d bytes=%d rejected=%d (kept from before: the warm restart)",
            self.directory,
            len(self._index),
            self._used,
            rejected,
        )

    # ------------------------------------------------------------------ state

    @property
    def used_bytes(self) -> int:
        """Sum of the lengths of the frames held.

        NOTE: the one case where this exceeds ``capacity_bytes`` is a store reopened with a
        lower cap than its files fill. Nothing is dropped on open (the cache's policy, not
        the store, picks what leaves); instead every put raises ``TierFull`` until deletes
        bring the store back under its cap, so the cap is never exceeded by a write.
        """
        return self._used

    def keys(self) -> list[bytes]:
        """Keys held now: what a restarted cache may find here (the warm restart)."""
        with self._lock:
            return list(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, key: bytes) -> Path:
        return Path(self._file(key))

    def _file(self, key: bytes) -> str:
        """The key's file as a plain string: a read skips pathlib's per-call parsing."""
        name = key.hex()
        return os.path.join(self._blocks_dir, name[:2], name + _SUFFIX)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._used -= self._index.pop(key, 0)

    # ------------------------------------------------------------------ write

    def put(self, key: bytes, frame: Frame) -> None:
        """Write ``frame`` to a temp file and publish it under ``key`` with one rename.

        On ``TierFull`` nothing is written; on ``TierError`` (the medium failed, e.g.
        ENOSPC) the temp file is removed and the key keeps its old frame, if it had one.
        """
        view = self._check_frame(key, frame)
        if self._closed:
            raise TierError("disk store is closed")
        size = view.nbytes
        with self._lock:
            after = self._used - self._index.get(key, 0) + size
        if after > self.capacity_bytes:
            raise TierFull(f"a {size}-byte frame would bring the store to {after} of {self.capacity_bytes} bytes")
        path = self._path(key)
        tmp = self._tmp / f"{key.hex()}.{uuid.uuid4().hex}.tmp"
        published = False
        try:
            self._write_file(tmp, view)
            os.replace(tmp, path)
            published = True
            if self.fsync == "full":
                _fsync_dir(path.parent)
        except OSError as exc:
            self.stats.error("io", f"write: {exc.strerror or exc}")
            self._remove(tmp)
            if published:
                # NOTE: the rename happened but could not be made durable; the old frame is
                # gone already, so drop the new one too rather than hold an unsynced file.
                self._remove(path)
                self._forget(key)
            raise TierError(f"disk write failed: {exc}") from exc
        with self._lock:
            self._used += size - self._index.get(key, 0)
            self._index[key] = size
            self.stats.puts += 1
            self.stats.bytes_written += size

    def _check_frame(self, key: bytes, frame: Frame) -> memoryview:
        """A frame that is not a whole codec frame of ``key`` is a caller bug (ValueError):
        stored, it would only be quarantined by the next open's scan."""
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"key must be 1 to {MAX_KEY_BYTES} bytes (it names a file), got {len(key)}")
        view = frame if isinstance(frame, memoryview) else memoryview(frame)
        if not view.c_contiguous:
            raise TypeError("frame must be a contiguous buffer")
        view = view if view.ndim == 1 and view.format == "B" else view.cast("B")
        head = codec.peek_header(view)
        if head.key != key:
            raise ValueError(f"frame is for key {head.key.hex()}, not {key.hex()}")
        if head.frame_length != view.nbytes:
            raise ValueError(f"frame is {view.nbytes} bytes, its header says {head.frame_length}")
        return view

    def _write_file(self, tmp: Path, view: memoryview) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, view)
            if self.fsync != "none":
                os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ read

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        """Each key's frame as ``bytes``, verified in full by the codec; ``None`` for a miss.

        A file that fails verification or cannot be read is quarantined and dropped from
        the index, so it is never served, now or after a restart.
        """
        return [self._get(key) for key in keys]

    def read_placed(self, key: bytes, buffer: bytearray, place: Place) -> Placed | None:
        """As ``get_many``, read straight into ``place`` (``placed.read_placed``); the
        payload is not verified here but by the caller, against the checksum computed on
        the way. A file whose length cannot be such a frame is quarantined."""
        return self._read(key, lambda path: read_placed(path, buffer, place), lambda got: len(got.frame))

    def _get(self, key: bytes) -> bytes | None:
        return self._read(key, _read_frame(key, self.max_frame_bytes), len)

    def _read(self, key: bytes, read: Callable[[str], T], size: Callable[[T], int]) -> T | None:
        """``read`` the file of ``key``; a missing, unreadable or bad file is a miss (and
        quarantined when it is there but bad), never an error to the caller."""
        if key not in self._index:
            self.stats.misses += 1
            return None
        path = self._file(key)
        try:
            got = read(path)
        except FileNotFoundError:
            self._miss(key, "missing")
            return None
        except OSError:
            self._miss(key, "io", Path(path))
            return None
        except codec.FrameError:
            self._miss(key, "checksum", Path(path))
            return None
        self._count_read(key, size(got))
        return got

    def _count_read(self, key: bytes, size: int) -> None:
        # NOTE: a whole frame of this key whose length differs from the index's (replaced
        # behind our back) is still right to serve; only the accounting follows it.
        with self._lock:
            if self._index.get(key, size) != size:
                self._used += size - self._index[key]
                self._index[key] = size
            self.stats.hits += 1
            self.stats.bytes_read += size

    def _miss(self, key: bytes, kind: str, bad: Path | None = None) -> None:
        self.stats.error(kind)
        self.stats.misses += 1
        self._forget(key)
        if bad is not None:
            self._quarantine_file(bad)

    # ------------------------------------------------------------------ delete, close

    def delete(self, key: bytes) -> bool:
        """Forget ``key`` and remove its file.

        NOTE: if the unlink fails (counted ``io``) the key is forgotten anyway; a restart
        may find the file again, which is harmless: a stale block's key is unreachable
        (epochs and purges change the keys the cache asks for, design.md invariant 7).
        """
        if key not in self._index:
            return False
        self._forget(key)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError:
            self.stats.error("io")
        self.stats.deletes += 1
        return True

    def close(self) -> None:
        """Forget the index (the files stay: the next open finds them). Idempotent."""
        self._closed = True
        with self._lock:
            self._index.clear()
            self._used = 0

    # ------------------------------------------------------------------ open

    def _scan(self) -> None:
        """Rebuild the index from blocks/ and clear tmp/: the warm restart."""
        for leftover in self._tmp.iterdir():
            self.stats.error("partial")
            self._remove(leftover)
        for sub in sorted(self._blocks.iterdir()):
            if not sub.is_dir() or sub.is_symlink():
                self._reject(sub, "stray")
                continue
            for path in sorted(sub.iterdir()):
                self._load(path)

    def _load(self, path: Path) -> None:
        key = _key_of(path)
        if key is None or not path.is_file() or path.is_symlink():
            return self._reject(path, "stray")
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = codec.peek_header(f.read(_HEADER_PROBE))
        except OSError:
            return self._reject(path, "io")
        except codec.FrameError:
            return self._reject(path, "checksum")
        if head.key != key:
            return self._reject(path, "key")
        if head.frame_length != size:  # truncated or with trailing bytes: the payload check would fail
            return self._reject(path, "checksum")
        self._index[key] = size
        self._used += size

    def _reject(self, path: Path, kind: str) -> None:
        self.stats.error(kind)
        self._quarantine_file(path)

    # ------------------------------------------------------------------ files

    def _quarantine_file(self, path: Path) -> None:
        """Move a bad file aside for a human to inspect; delete it if even that fails.

        NOTE: quarantine/ is outside the byte cap (it holds no frames the store serves)
        and is never emptied by the store: an operator clears it after looking.
        """
        target = self._quarantine / f"{path.name}.{uuid.uuid4().hex[:12]}"
        try:
            os.replace(path, target)
        except OSError:
            self._remove(path)
            return
        self.quarantined += 1

    @staticmethod
    def _remove(path: Path) -> None:
        """Best-effort unlink: what cannot be removed now is found again by the next open."""
        with contextlib.suppress(OSError):
            path.unlink()

    # ------------------------------------------------------------------ epoch records

    epoch_sync: ClassVar[bool] = False  # one store per directory: read when the cache opens

    def read_epochs(self, book: str = "epochs") -> list[tuple[str, bytes]]:
        """The records in <book>/ (``base.EpochKeeper``): regular files named for a record,
        each read no further than ``EPOCH_RECORD_BYTES``; anything else is skipped (counted
        ``epoch``)."""
        folder = self.directory / epoch_book(book)
        try:
            entries = sorted(os.listdir(folder))
        except FileNotFoundError:
            return []
        except OSError as exc:
            self.stats.error("io", f"epochs: {exc.strerror or exc}")
            raise TierError(f"disk epochs unreadable: {exc}") from exc
        found: list[tuple[str, bytes]] = []
        for entry in entries:
            name = entry.removesuffix(_EPOCH_SUFFIX)
            try:
                if entry == name or not EPOCH_NAME.fullmatch(name):
                    raise codec.CorruptFrame(f"{entry} is not a record's name")
                found.append((name, read_file(str(folder / entry), EPOCH_RECORD_BYTES)))
            except (OSError, codec.FrameError) as exc:
                self.stats.error("epoch", str(exc))
            if len(found) >= EPOCH_RECORDS:
                break
        return found

    def write_epoch(self, name: str, record: bytes, book: str = "epochs") -> None:
        """Publish ``record`` as <book>/<name>.epoch with one rename, the file and the
        folder synced whatever ``fsync`` says: a bump or a purge is rare and must outlive a
        power loss."""
        if not EPOCH_NAME.fullmatch(name):
            raise ValueError(f"not an epoch record's name: {name!r}")
        folder = self.directory / epoch_book(book)
        tmp = self._tmp / f"epoch-{name}.{uuid.uuid4().hex}.tmp"
        try:
            if not folder.is_dir():
                folder.mkdir(exist_ok=True)
                _fsync_dir(self.directory)  # NOTE: the folder's own entry, or a power loss may take the record
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, memoryview(record))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, folder / (name + _EPOCH_SUFFIX))
            _fsync_dir(folder)
        except OSError as exc:
            self.stats.error("io", f"epoch write: {exc.strerror or exc}")
            self._remove(tmp)
            raise TierError(f"disk epoch write failed: {exc}") from exc


# NOTE: a name in the folder that is not a plain file of ours (a FIFO, a device, a link
# to /dev/zero) must cost a miss, never a wait or an endless read: no link is followed,
# no open blocks, and only a regular file is read (``_placed.c`` opens the same way).
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def read_file(path: str, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them; a name that
    is a link or no regular file, or a file longer than ``limit``, is a ``CorruptFrame``
    (read no further than ``limit`` + 1 bytes)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise codec.CorruptFrame(f"{path} is a symbolic link, not a frame") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise codec.CorruptFrame(f"{path} is not a regular file")
        if st.st_size > limit:
            raise codec.CorruptFrame(f"{path} holds {st.st_size} bytes, more than a frame's {limit}")
        data = os.read(fd, st.st_size)  # NOTE: one read of a regular file; the loop is for the rare short one
        while len(data) < st.st_size and (more := os.read(fd, st.st_size - len(data))):
            data += more
        if len(data) == st.st_size and os.read(fd, 1):
            raise codec.CorruptFrame(f"{path} grew while it was read")
        return data  # shortened under us: the frame check refuses it
    finally:
        os.close(fd)


def _read_frame(key: bytes, limit: int) -> Callable[[str], bytes]:
    """A whole frame's file (at most ``limit`` bytes), read and verified against ``key``."""

    def read(path: str) -> bytes:
        data = read_file(path, limit)
        codec.verify(data, key=key)
        return data

    return read
