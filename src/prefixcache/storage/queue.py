"""The write queue: puts and deletes for the tiers, in the order the cache decided them,
bounded in the bytes of the frames it holds.

::

    cache (under its lock)              queue (FIFO)                   writer (no cache lock)
      decide: put K in disk  ──offer──>  [del J@disk][put K@disk] ──>  take -> execute -> commit
      reader: K is pending   <─frame──   pending[(disk, K)] = job       (then the follow-up deletes)

Jobs are added while the cache holds its lock, so their order is the order of the
decisions: a delete decided before a put of the same key runs before it. A put the
queue has no room for is refused (and counted) at once: the cache then decides
without it, and a request never waits for the writer. Deletes carry no bytes and are
always accepted. A queued put's frame can be read (``frame``): that is how a block
whose only copy is on its way down is loaded meanwhile.

A frame source may be lazy: a frame still in a slot that no key names any more, or in
a store it is being moved out of. It is read once (by whoever asks first: the
deciding thread, a reader, or the writer) and then kept.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixcache.storage.base import Frame, TierError, TierStore

__all__ = ["FrameSource", "Job", "JobKind", "LazyFrame", "WriteQueue"]


class FrameSource:
    """A frame to write: the bytes in hand."""

    __slots__ = ("_frame", "size")

    def __init__(self, frame: Frame | None, size: int) -> None:
        self._frame = frame
        self.size = size

    def frame(self) -> Frame | None:
        return self._frame


class LazyFrame(FrameSource):
    """A frame read on first use from where it still is, then kept; ``read`` runs once,
    under a lock, so that the thread that frees the source after it (``then``) is never
    ahead of a reader."""

    __slots__ = ("_lock", "_read", "_then")

    def __init__(self, read: Callable[[], Frame | None], size: int, then: Callable[[], None] | None = None) -> None:
        super().__init__(None, size)
        self._lock = threading.Lock()
        self._read: Callable[[], Frame | None] | None = read
        self._then = then

    def frame(self) -> Frame | None:
        with self._lock:
            if self._read is not None:
                try:
                    got = self._read()
                    self._frame = bytes(got) if got is not None else None  # NOTE: a copy: the source goes next
                except TierError:
                    self._frame = None
                finally:
                    self._read = None
                    then, self._then = self._then, None
                    if then is not None:
                        then()
            return self._frame


def store_copy(store: TierStore, key: bytes, size: int) -> LazyFrame:
    """The frame of ``key`` in ``store``, read when first asked for."""
    return LazyFrame(lambda: store.get_many([key])[0], size)


class JobKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(eq=False, slots=True)
class Job:
    """One decided write. ``ticket`` is the cache's (the block it is for), handed back
    at commit; ``source_tier`` names the tier a moved frame leaves."""

    kind: JobKind
    tier: int
    key: bytes
    source: FrameSource | None = None
    ticket: object = None
    source_tier: int = -1
    canceled: bool = False
    size: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.size = self.source.size if self.source is not None else 0


class WriteQueue:
    """FIFO of jobs, bounded in bytes; thread-safe."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._cond = threading.Condition()
        self._jobs: deque[Job] = deque()
        self._running = 0  # jobs taken and not yet finished
        self._bytes = 0
        self._pending: dict[tuple[int, bytes], Job] = {}
        self.done = 0
        self.failed = 0
        self.abandoned = 0
        self.closed = False

    # ------------------------------------------------------------------ the cache's side

    def offer(self, job: Job) -> bool:
        """Queue ``job``; False when a put does not fit the byte bound (the cache counts it)."""
        with self._cond:
            if self.closed:
                return False
            if job.kind is JobKind.PUT:
                if self._bytes + job.size > self.limit_bytes:
                    return False
                self._bytes += job.size
                self._pending[(job.tier, job.key)] = job
            self._jobs.append(job)
            self._cond.notify_all()
            return True

    def cancel(self, tier: int, key: bytes, ticket: object) -> None:
        """The cache let go of a queued put (its block left): it is skipped if not yet
        running, and its commit undoes it if it is."""
        with self._cond:
            job = self._pending.get((tier, key))
            if job is not None and job.ticket is ticket:
                job.canceled = True

    def fits(self, size: int) -> bool:
        with self._cond:
            return not self.closed and self._bytes + size <= self.limit_bytes

    def frame(self, tier: int, key: bytes) -> Frame | None:
        """The frame of a queued (or running) put of ``key`` into ``tier``, if any."""
        with self._cond:
            job = self._pending.get((tier, key))
        return job.source.frame() if job is not None and job.source is not None else None

    # ------------------------------------------------------------------ the writer's side

    def take(self, timeout: float | None = None) -> Job | None:
        """The next job (None: nothing came within ``timeout``, or the queue closed empty)."""
        with self._cond:
            if not self._jobs and timeout != 0:
                self._cond.wait_for(lambda: self._jobs or self.closed, timeout)
            if not self._jobs:
                return None
            self._running += 1
            return self._jobs.popleft()

    def finish(self, job: Job, failed: bool = False) -> None:
        """``job`` ran and its outcome is committed: its bytes leave the bound."""
        with self._cond:
            self._running -= 1
            if job.kind is JobKind.PUT:
                self._bytes -= job.size
                if self._pending.get((job.tier, job.key)) is job:
                    del self._pending[(job.tier, job.key)]
            self.done += 1
            self.failed += failed
            self._cond.notify_all()

    def wait_empty(self, timeout: float | None) -> bool:
        """Wait until every queued job has finished; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._running, timeout)

    def close(self) -> list[Job]:
        """Refuse new jobs; returns the ones still queued (abandoned, counted)."""
        with self._cond:
            self.closed = True
            left = list(self._jobs)
            self._jobs.clear()
            for job in left:
                if job.kind is JobKind.PUT:
                    self._bytes -= job.size
                    self._pending.pop((job.tier, job.key), None)
            self.abandoned += len(left)
            self._cond.notify_all()
            return left

    # ------------------------------------------------------------------ state

    def __len__(self) -> int:
        with self._cond:
            return len(self._jobs) + self._running

    @property
    def queued_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def pending_for(self, tier: int) -> int:
        with self._cond:
            return sum(1 for t, _ in self._pending if t == tier)
