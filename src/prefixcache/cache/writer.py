"""The writer: runs the write queue's jobs and commits each outcome to the ledger.

``writer="background"`` (the default) runs them in a thread of its own, so that no
request waits for a disk or Redis write; ``"inline"`` runs them in the thread that
queued them, after it let go of the lock (every write done when the call returns);
``"deferred"`` runs them only when ``flush`` is called (a test or a batch job decides
when). In every mode one thread runs jobs at a time, in the queue's order, and the
deletes a commit asks for run before the next job: the order of the decisions is the
order on the medium.

A job's commit, under the cache's lock:

    put done      the block holds it now (and a ``through`` tier queues the next copy);
                  a block that left meanwhile gets the frame deleted again
    put failed    residency rolls back; a block with no copy left is lost (invariant 6)
    moved frame   the copy it came from is deleted (its room was given back when decided)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from prefixcache.cache.ledger import Ledger
from prefixcache.cache.residency import TierBook
from prefixcache.cache.stats import WriterStats
from prefixcache.cache.tree import Block
from prefixcache.storage.queue import Job, JobKind, LazyFrame, WriteQueue
from prefixcache.storage.transfer import Outcome, Transfer

__all__ = ["Writer", "count_failed_write", "fill"]

log = logging.getLogger(__name__)

# The error kinds a failed write is counted under by the cache, for the outcomes no store
# counts: a store that fails a write counts its cause itself (io, timeout, connection...).
_CACHE_ERRORS = {Outcome.FULL: "full", Outcome.NO_FRAME: "source"}


def count_failed_write(tier: TierBook, outcome: Outcome) -> None:
    """One failed write into ``tier``: one more in ``writes_failed``, and one error under
    one kind. NOTE: counting ``"write"`` here on top of the store's own kind made one
    failed disk write two errors (``io`` and ``write``)."""
    tier.writes_failed += 1
    kind = _CACHE_ERRORS.get(outcome)
    if kind is not None:
        tier.errors[kind] += 1


def fill(copyouts: Iterable[LazyFrame]) -> None:
    """Copy out the frames a decision detached from memory slots, which frees the slots."""
    for source in copyouts:
        source.frame()


class Writer:
    """Runs one cache's write queue."""

    def __init__(self, mode: str, lock: threading.RLock, ledger: Ledger, transfer: Transfer) -> None:
        assert ledger.books is not None
        self.mode = mode
        self.lock = lock
        self.ledger = ledger
        self.books = ledger.books
        self.transfer = transfer
        self.queue: WriteQueue = transfer.queue
        self._runner = threading.Lock()  # one thread runs jobs at a time
        self._thread: threading.Thread | None = None
        if mode == "background":
            self._thread = threading.Thread(target=self._loop, name="prefixcache-writer", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ when jobs run

    def after_call(self) -> None:
        """End of a cache call that may have queued jobs (outside the lock)."""
        if self.mode == "inline":
            self.run_pending()

    def run_pending(self, limit: int | None = None) -> int:
        """Run queued jobs in this thread (``inline`` and ``deferred``); returns how many ran."""
        ran = 0
        with self._runner:
            while limit is None or ran < limit:
                job = self.queue.take(timeout=0)
                if job is None:
                    break
                self._run(job)
                ran += 1
        return ran

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (or, without a thread, do them now);
        False when ``timeout`` passed first."""
        if self._thread is None:
            self.run_pending()
            return True
        return self.queue.wait_empty(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush (at most ``timeout`` seconds), then stop: writes still queued are
        abandoned (counted). Returns whether everything was written."""
        done = self.flush(timeout)
        self.queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        return done

    def _loop(self) -> None:
        while True:
            job = self.queue.take()
            if job is None:
                if self.queue.closed:
                    return
                continue
            with self._runner:
                self._run(job)

    # ------------------------------------------------------------------ one job

    def _run(self, job: Job) -> None:
        outcome = Outcome.FAILED
        try:
            outcome = self.transfer.run(job)
            with self.lock:
                deletes = self._commit(job, outcome)
                copyouts = self.books.take_copyouts()
            fill(copyouts)
            for tier, key in deletes:
                self.transfer.delete(tier, key)
        except Exception:  # NOTE: a bug must not stop the writer: every later flush would wait forever
            log.exception("the write of %s to tier %d failed", job.key.hex()[:12], job.tier)
            outcome = Outcome.FAILED
        finally:
            self.queue.finish(job, failed=outcome in (Outcome.FAILED, Outcome.FULL, Outcome.NO_FRAME))

    def _commit(self, job: Job, outcome: Outcome) -> list[tuple[int, bytes]]:
        """Under the lock: what ``job`` changed; returns the deletes to run before the next job."""
        if job.kind is JobKind.DELETE:
            return []
        books, ledger = self.books, self.ledger
        block = job.ticket
        assert isinstance(block, Block)
        tier = books.tiers[job.tier]
        deletes = [(job.source_tier, job.key)] if job.source_tier >= 0 else []
        if outcome is Outcome.SKIPPED:
            return deletes  # canceled before it ran: its room went back when it was canceled
        res = block.res
        live = (
            not job.canceled and res is not None and bool(res.pending & tier.bit) and books.owner.get(job.key) is block
        )
        if outcome is Outcome.DONE:
            if live:
                books.commit_held(block, job.tier)
                self._onward(block, job)
            elif not self._claimed(job):
                deletes.append((job.tier, job.key))  # the block left while it was written
            return deletes
        count_failed_write(tier, outcome)
        if live:
            assert res is not None
            books.release(job.tier)
            books.set(block, res.held, res.pending & ~tier.bit)
            if not (res.held | res.pending) and block.pool is not None:
                ledger.lose(block)  # its only copy never landed: gone with what hangs below
        return deletes

    def _claimed(self, job: Job) -> bool:
        """Whether another block now owns ``job.key`` in its tier (its own write, queued
        after this one, replaces the frame: deleting it would take that one too)."""
        owner = self.books.owner.get(job.key)
        res = owner.res if owner is not None else None
        return res is not None and bool((res.held | res.pending) & (1 << job.tier))

    def _onward(self, block: Block, job: Job) -> None:
        """A ``through`` tier passes a block on to the next tier as soon as it holds it."""
        books = self.books
        below = job.tier + 1
        if books.tiers[job.tier].config.write != "through" or below >= len(books.tiers) or job.source is None:
            return
        frame = job.source.frame()
        if frame is not None:
            self.ledger.copy_down(block, below, frame)

    # ------------------------------------------------------------------ state

    def stats(self) -> WriterStats:
        q = self.queue
        return WriterStats(
            mode=self.mode,
            queued_jobs=len(q),
            queued_bytes=q.queued_bytes,
            limit_bytes=q.limit_bytes,
            done=q.done,
            dropped=sum(t.writes_dropped for t in self.books.tiers),
            failed=q.failed,
            abandoned=q.abandoned,
        )
