"""The writer: runs the write queue's jobs, and has each outcome committed.

``writer="background"`` (the default) runs them in a thread of its own, so that no
request waits for a disk or Redis write; ``"inline"`` runs them in the thread that
queued them, after it let go of the lock (every write done when the call returns);
``"deferred"`` runs them only when ``flush`` is called (a test or a batch job decides
when). In every mode one thread runs jobs at a time, in the queue's order, and the
deletes a commit asks for run before the next job: the order of the decisions is the
order on the medium.

What a job changed is committed by the lock's owner (``Owner.commit_write``, with
``writesteps.commit_write``), the one function the writer is handed. NOTE: why the
writer commits rather than returning its outcomes for someone else to commit: in the
background mode no caller waits for a job, so nobody else could commit it without a
second queue of outcomes and a thread to drain it, and until it did, residency would
lag the medium (a block written would still read as pending). Handed the commit step
alone, the writer can neither take the lock nor decide: it moves bytes and reports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prefixcache.storage.queue import Job, WriteQueue
from prefixcache.storage.transfer import Outcome, Transfer

__all__ = ["Commit", "Writer"]

log = logging.getLogger(__name__)

Commit = Callable[[Job, Outcome], list[tuple[int, bytes]]]  # a job's outcome -> the (tier, key) deletes it asks for


class Writer:
    """Runs one cache's write queue."""

    def __init__(self, mode: str, transfer: Transfer, commit: Commit) -> None:
        self.mode = mode
        self.transfer = transfer
        self._commit = commit
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
            deletes = self._commit(job, outcome)
            for tier, key in deletes:
                self.transfer.delete(tier, key)
        except Exception:  # NOTE: a bug must not stop the writer: every later flush would wait forever
            log.exception("the write of %s to tier %d failed", job.key.hex()[:12], job.tier)
            outcome = Outcome.FAILED
        finally:
            self.queue.finish(job, failed=outcome not in (Outcome.DONE, Outcome.SKIPPED))
