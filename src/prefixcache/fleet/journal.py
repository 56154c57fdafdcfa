"""What a disk tier holds, kept beside it for the next incarnation's announcements.

A disk tier's frames outlive the process (a ``kill -9``, a restart), but its tree does
not: the blocks found on open are orphans, adopted when a request asks for them
(``cache/facade.py``). A router builds its index from token ids, and an orphan's frame
holds only a checksum of its tokens, so without more a restarted backend would
announce nothing of what it holds and be scored cold. The publisher therefore appends
each block that enters the disk tier (its ``TierEntered``: key, parent, tokens,
namespace, model) to this journal, in the disk tier's folder (``<dir>/fleet/``); the
next incarnation reads it and announces the orphans it names (``orphan_entries``).

    file:    MAGIC, then records   [u32 length][u32 crc32 of the payload][payload: msgpack]

A record torn by a crash (a short or corrupt tail) ends the read there; a record that
does not decode is skipped. The journal is a routing hint, never the truth about bytes:
an announced orphan is loaded like any other (verified against the request's tokens),
and a record names a block only while the tier still holds its key. It is rewritten
whole (temp file, rename) with the blocks that are still there when it has grown to
several times their number.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec

from prefixcache.config import TierConfig
from prefixcache.events import Drained, TierEntered, TierLeft

__all__ = ["COMPACT_AT", "JOURNALED", "MAX_RECORD", "DiskRecorder", "Journal", "beside", "orphan_entries"]

log = logging.getLogger("prefixcache.fleet")

JOURNALED = "disk"  # the tier kind whose blocks outlive the process and the tree
COMPACT_AT = 4  # the journal is rewritten once it has this many records per block it names
MAGIC = b"PXJOURNAL1\n"
MAX_RECORD = 1 << 16  # bytes of one record's payload: a block's tokens and names, with room
_HEAD = struct.Struct("<II")
_SAFE = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a server's name as a file name; any other is hashed
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TierEntered)


class Journal:
    """The append-only record of one disk tier's blocks (one writer: the publisher's step)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.appended = 0  # records appended since the last rewrite

    def read(self) -> list[TierEntered]:
        """Every record that reads whole, in the order written (none when there is no file)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("event=fleet_journal_unreadable path=%s (%s)", self.path, type(exc).__name__)
            return []
        if not data.startswith(MAGIC):
            log.warning("event=fleet_journal_foreign path=%s: not a journal, ignored", self.path)
            return []
        return list(_records(memoryview(data)[len(MAGIC) :]))

    def append(self, entries: Iterable[TierEntered]) -> None:
        """Add ``entries`` at the end (the file and its folder made when missing)."""
        records = [r for r in map(_record, entries) if r]
        if not records:
            return
        blob = b"".join(records)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size == 0:
                blob = MAGIC + blob
            os.write(fd, blob)
        finally:
            os.close(fd)
        self.appended += len(records)

    def rewrite(self, entries: Iterable[TierEntered]) -> None:
        """Replace the journal with ``entries`` alone, whole or not at all."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(MAGIC + b"".join(_record(e) for e in entries))
        os.replace(tmp, self.path)
        self.appended = 0


class DiskRecorder:
    """Keeps a journal from a cache's drains (``observe``: what entered and left the disk
    tier, the whole residency when one was taken, a rewrite once it has grown) and says
    which of the last incarnation's blocks to announce (``orphans``). One caller at a
    time: the publisher's step, or the vLLM connector's events hook."""

    def __init__(self, journal: Journal, block_size: int) -> None:
        self.journal = journal
        self._whole = 4 * block_size  # the token bytes of a whole block: only those are announced
        self._journaled: dict[bytes, TierEntered] = {}  # the disk's blocks the tree knows, as recorded
        self._kept: dict[bytes, TierEntered] | None = None  # the journal's orphans, read at the first residency

    def observe(self, drained: Drained) -> None:
        journal = self.journal
        if drained.resident is not None:
            self._journaled = {e.key: e for e in drained.resident if self._ours(e)}
            if self._kept is None:  # NOTE: the first residency: what the last incarnation left
                held = (drained.orphans or {}).get(JOURNALED, frozenset())
                self._kept = {e.key: e for e in journal.read() if e.key in held}
                self._guarded(lambda: journal.rewrite(self._named()))
        came: list[TierEntered] = []
        for event in drained.events:
            if isinstance(event, TierEntered) and self._ours(event):
                self._journaled[event.key] = event
                if self._kept is not None:
                    self._kept.pop(event.key, None)
                came.append(event)
            elif isinstance(event, TierLeft) and event.kind == JOURNALED:
                self._journaled.pop(event.key, None)
                if self._kept is not None:
                    self._kept.pop(event.key, None)
        if came:
            self._guarded(lambda: journal.append(came))
        if journal.appended > COMPACT_AT * max(len(self._journaled) + len(self._kept or ()), 1024):
            self._guarded(lambda: journal.rewrite(self._named()))

    def orphans(self, drained: Drained) -> list[TierEntered]:
        """The last incarnation's blocks to announce beside ``drained``'s residency (taken
        with it): those the disk still holds, under announced parents, parents first."""
        held = (drained.orphans or {}).get(JOURNALED, frozenset())
        if not self._kept or not held:
            return []
        return orphan_entries(self._kept.values(), set(held), {e.key for e in drained.resident or ()})

    def _ours(self, entry: TierEntered) -> bool:
        return entry.kind == JOURNALED and len(entry.tokens) == self._whole

    def _named(self) -> list[TierEntered]:
        """What the journal names now: the last incarnation's orphans still held, then the tree's."""
        return [*(self._kept or {}).values(), *self._journaled.values()]

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except OSError as exc:  # NOTE: the journal is a hint for the next incarnation: serving goes on
            log.warning("event=fleet_journal_failed path=%s (%s: %s)", self.journal.path, type(exc).__name__, exc)


def beside(tiers: Iterable[TierConfig], name: str) -> Journal | None:
    """The journal of server ``name`` in its first disk tier's folder; None without one."""
    safe = name if _SAFE.fullmatch(name) else hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
    for tier in tiers:
        if tier.kind == "disk" and tier.path:
            return Journal(Path(tier.path) / "fleet" / f"{safe}.journal")
    return None


def _record(entry: TierEntered) -> bytes:
    """One record; empty for an entry too large to be one (it is then not kept)."""
    payload = _ENCODER.encode(entry)
    if len(payload) > MAX_RECORD:
        return b""
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def _records(view: memoryview) -> Iterator[TierEntered]:
    at = 0
    while at + _HEAD.size <= len(view):
        length, crc = _HEAD.unpack_from(view, at)
        body = view[at + _HEAD.size : at + _HEAD.size + length]
        if length > MAX_RECORD or len(body) < length or zlib.crc32(body) != crc:
            return  # NOTE: a torn tail (a crash mid-append): nothing after it is trusted
        at += _HEAD.size + length
        try:
            yield _DECODER.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue


def orphan_entries(records: Iterable[TierEntered], held: set[bytes], announced: set[bytes]) -> list[TierEntered]:
    """The records of the blocks a tier still holds (``held``: its orphans' keys) whose
    parents are announced too (``announced``: the keys already resident, as it grows),
    parents first: a router places a block only under a parent it knows. The last
    record of a key wins."""
    last: dict[bytes, TierEntered] = {}
    for record in records:
        if record.key in held:
            last[record.key] = record
    out: list[TierEntered] = []
    for record in sorted(last.values(), key=lambda r: r.end):
        if record.parent is None or record.parent in announced:
            announced.add(record.key)
            out.append(record)
    return out
