"""The engine's I/O thread: the prefix cache's match and load before a job prefills, its
insert after the job ended, never on the worker's step loop.

    worker ──stage(job)────────> [ FIFO ] ──> job.stage()       then poke the worker
    worker ──store(job, kv)────> [      ] ──> job.store(kv)     then ``after()``

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
from prefixcache.engine.job import Job

__all__ = ["CacheIO"]

log = logging.getLogger(__name__)


class CacheIO:
    """Runs stages and stores in order on one thread; ``poke`` wakes the worker after a stage."""

    def __init__(self, poke: Callable[[], None]) -> None:
        self._poke = poke
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def stage(self, job: Job) -> None:
        def task() -> None:
            job.stage()
            self._poke()

        self._put(task)

    def store(self, job: Job, kv: KVSource | None, length: int, after: Callable[[], None]) -> None:
        """Store ``length`` positions of ``kv`` for ``job``, then call ``after`` (always)."""

        def task() -> None:
            try:
                job.store(kv, length)
            finally:
                after()

        self._put(task)

    def close(self, timeout: float) -> None:
        """Run what is queued, then stop the thread."""
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _put(self, task: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="prefixcache-cache-io", daemon=True)
            self._thread.start()
        self._tasks.put(task)

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception:  # a bug in one task must not stop the others
                log.exception("a prefix cache task failed")
