"""Reading one backend's Redis stream into the index (a thread per backend).

Two positions: ``cursor`` (what ``XREAD`` continues after) and ``applied`` (the entry
of the last batch applied). They differ only when entries were read and lost on the
way (``lose_next``, which tests use to drop events on purpose): the next batch is then
a ``GAP``, and the reader replays with ``XRANGE`` after ``applied``. When the stream no
longer starts at the next batch, it loads a snapshot over HTTP and finds its place in
the stream by walking back from the end to the snapshot's batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from prefixcache.fleet.follow import Follower, Verdict
from prefixcache.fleet.wire import Entry, Snapshot, WireError, decode_entry

__all__ = ["StreamReader"]

log = logging.getLogger("prefixcache.route")

READ_BLOCK_MS = 200  # how long one XREAD waits: also how fast a stop is noticed
READ_COUNT = 256
BACKOFF_S = (0.05, 0.2, 1.0, 2.0)  # after failures of Redis or of a snapshot, in turn


class StreamReader:
    """Follows ``stream`` for ``follower``; ``snapshot`` fetches the backend's index."""

    def __init__(self, follower: Follower, client: redis.Redis, stream: str, snapshot: Callable[[], Snapshot]) -> None:
        self.follower, self.client, self.stream, self.fetch = follower, client, stream, snapshot
        self.cursor = b"0-0"
        self.applied = b"0-0"
        self.lost = 0  # entries read and discarded on purpose, still to lose
        self.errors = 0
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"route-{follower.backend}", daemon=True)

    def start(self) -> StreamReader:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def pause(self, paused: bool = True) -> None:
        """Stop (or resume) reading, as a router that falls behind would (for tests)."""
        if paused:
            self._paused.set()
        else:
            self._paused.clear()

    def lose_next(self, n: int) -> None:
        """Discard the next ``n`` entries read, as a lossy transport would (for tests)."""
        self.lost += n

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            if self._paused.is_set():
                self._stop.wait(READ_BLOCK_MS / 1000)
                continue
            try:
                if not self.follower.synced:
                    self._resync()
                self._read()
                failures = 0
            except (redis.RedisError, OSError, WireError, ValueError) as exc:
                self.errors += 1
                wait = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                log.warning(
                    "event=route_follow_error backend=%s kind=%s retry_s=%.2f",
                    self.follower.backend,
                    type(exc).__name__,
                    wait,
                )
                self._stop.wait(wait)

    def _read(self) -> None:
        reply: Any = self.client.xread({self.stream: self.cursor}, count=READ_COUNT, block=READ_BLOCK_MS)
        for _stream, raw in reply or ():
            for entry_id, fields in _entries(raw):
                self.cursor = entry_id
                if self.lost > 0:
                    self.lost -= 1
                    continue
                if not self._offer(entry_id, decode_entry(fields)):
                    return

    def _offer(self, entry_id: bytes, entry: Entry) -> bool:
        """Apply one entry; False when the reader had to resynchronize (reading goes on
        from the new position)."""
        verdict = self.follower.offer(entry)
        if verdict is Verdict.APPLIED:
            self.applied = entry_id
        elif verdict is Verdict.GAP:
            if not self._replay():
                self.follower.inc = None
                self._resync()
            return False
        elif verdict is Verdict.RESYNC:
            self._resync()
            return False
        return True

    def _replay(self) -> bool:
        """Apply the entries after ``applied``; False when the next batch is not there."""
        start = b"(" + self.applied
        expected = self.follower.seq + 1
        while True:
            entries = _entries(self.client.xrange(self.stream, min=start, count=READ_COUNT))
            if not entries:
                break
            for entry_id, fields in entries:
                entry = decode_entry(fields)
                if entry.inc != self.follower.inc or entry.seq > expected:
                    return False
                if self.follower.offer(entry) is Verdict.APPLIED:
                    self.applied = entry_id
                    expected += 1
            start = b"(" + entries[-1][0]
        self.cursor = self.applied
        self.follower.stats.replays += 1
        return True

    def _resync(self) -> None:
        """Load a snapshot and find the first stream entry after it."""
        snapshot = self.fetch()
        position = self._position_of(snapshot)
        self.follower.load(snapshot)
        self.cursor = self.applied = position
        log.info(
            "event=route_snapshot backend=%s inc=%s seq=%d blocks=%d",
            self.follower.backend,
            snapshot.inc,
            snapshot.seq,
            self.follower.index.held(self.follower.backend),
        )

    def _position_of(self, snapshot: Snapshot) -> bytes:
        """The id of the last entry at or before the snapshot's batch (``0-0`` when none
        is), walking back from the end of the stream."""
        end = b"+"
        while True:
            entries = _entries(self.client.xrevrange(self.stream, max=end, count=READ_COUNT))
            if not entries:
                return b"0-0"
            for entry_id, fields in entries:
                entry = decode_entry(fields)
                if entry.inc != snapshot.inc or entry.seq <= snapshot.seq:
                    return entry_id
            end = b"(" + entries[-1][0]


def _entries(raw: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Stream entries as redis-py returns them (bytes, the client decodes nothing)."""
    return [(bytes(entry_id), dict(fields)) for entry_id, fields in raw or ()]
