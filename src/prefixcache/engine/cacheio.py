"""The engine's I/O thread: the prefix cache's match and load before a job prefills, its
inserts after the prefill and after the end, never on the worker's step loop.

    worker ──stage(job)──────────> [ FIFO ] ──> job.lookup()         ready (poke the worker),
                                                                      or follow a lead (inflight.py)
    worker ──store_prompt(job)───> [      ] ──> job.store_prompt()   its followers staged again
    worker ──store(job, kv)──────> [      ] ──> job.store()          then ``after()``

One thread, first in first out: a store queued before a later request's stage runs
before it, so the next turn of a conversation, sent once the answer went out (after
its store was queued), finds that answer's KV.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from prefixcache.cache.kv import KVSource
from prefixcache.engine.inflight import InFlight
from prefixcache.engine.job import Job
from prefixcache.engine.threads import serial_torch

__all__ = ["CacheIO"]

log = logging.getLogger(__name__)


class CacheIO:
    """Runs stages and stores in order on one thread; ``poke`` wakes the worker after a stage."""

    def __init__(self, poke: Callable[[], None], *, share: bool = True) -> None:
        self._poke = poke
        self._inflight = InFlight() if share else None
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def stage(self, job: Job) -> None:
        self._put(lambda: self._stage(job))

    def store_prompt(self, job: Job, kv: KVSource, length: int, after: Callable[[], None]) -> None:
        """Store ``job``'s prompt (``length`` positions of ``kv``) now that it is computed,
        then call ``after`` (always)."""
        self._put(lambda: self._storing(job, lambda: job.store_prompt(kv, length), after))

    def store(self, job: Job, kv: KVSource | None, length: int, after: Callable[[], None]) -> None:
        """Store ``length`` positions of ``kv`` for ``job`` (it ended), then call ``after`` (always)."""
        self._put(lambda: self._storing(job, lambda: job.store(kv, length), after))

    def close(self, timeout: float) -> None:
        """Run what is queued, then stop the thread."""
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------ on the thread

    def _stage(self, job: Job) -> None:
        staged = job.lookup()
        if self._inflight is not None:
            lead = self._inflight.leader(job, staged.cached)
            if lead is not None and not job.handle.cancelled:
                return self._inflight.follow(lead, job)  # staged again once the lead's prompt is stored
            self._inflight.lead(job)
        job.staged = staged
        self._poke()

    def _storing(self, job: Job, store: Callable[[], None], after: Callable[[], None]) -> None:
        try:
            store()
        finally:
            after()
            self._led(job)

    def _led(self, job: Job) -> None:
        """``job``'s prompt is stored, or it ended: who waited for it is staged again."""
        if self._inflight is not None:
            for follower in self._inflight.done(job):
                assert isinstance(follower, Job)
                self._stage(follower)

    def _put(self, task: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="prefixcache-cache-io", daemon=True)
            self._thread.start()
        self._tasks.put(task)

    def _run(self) -> None:
        serial_torch()  # NOTE: the worker's OpenMP team stays the only one (``threads.py``)
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception:  # a bug in one task must not stop the others
                log.exception("a prefix cache task failed")
