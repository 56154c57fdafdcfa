"""The engine's I/O workers: the prefix cache's match and load before a job prefills, its
inserts after the prefill and after the end, never on the worker's step loop.

    worker ──stage(job)────────> ┌ IOQueue ┐ ──> job.lookup()        ready (poke the worker),
                                 │ per job │                          or follow a lead (inflight.py)
    worker ──store_prompt(job)─> │ per     │ ──> job.store_prompt()  its followers staged again
                                 │ tenant  │
    worker ──store(job, kv)────> └─────────┘ ──> job.store()         then ``after()``
                                      │
                           ``workers`` threads, at most ``per_tenant`` of them on one tenant

Several workers, so that one tenant's slow shared tier (a far bucket, a loaded Redis:
slow answers that never open the breaker) costs that tenant's requests, never another
tenant's memory hit (invariants 9 and 16); ordered per conversation (``ioqueue.py``): a
turn's store runs before the same conversation's next match, which the next turn, sent
once the answer went out (after its store was queued), relies on to hit on it.

A stalled tier holds the workers whose tasks touch it: at most ``per_tenant`` of each
tenant's. With the defaults (8 workers, 2 a tenant) three tenants whose lookups all
stall leave two workers to every other tenant; a fourth would take the last ones. No
limit is set per tier: whether a match probes a shared tier is the cache's decision,
taken under its lock when the match runs, not known when the task is queued.

One lock (``self._cond``) owns the queue, the in-flight leads and followers and the jobs
being staged; no cache call runs under it. A job not staged yet whose client left or
whose deadline passed (queued, looking, or following a lead) is handed back to the step
loop by ``overdue``, which ends it at once: its slot frees on time. Its stage, when it
runs, does nothing, and a lookup already running for it is dropped; its end's store
comes after that lookup (one job's tasks keep their order), and holds no slot.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from prefixcache.cache.kv import KVSource
from prefixcache.engine.inflight import InFlight
from prefixcache.engine.ioqueue import IOQueue, Kind, Task
from prefixcache.engine.job import Job, Staged
from prefixcache.engine.threads import serial_torch

__all__ = ["IO_PER_TENANT", "IO_WORKERS", "CacheIO"]

log = logging.getLogger(__name__)

# NOTE: a worker waiting on a tier costs a thread and no CPU, so there are several; a
# tenant holds at most IO_PER_TENANT of them, so that the stalled tiers of three tenants
# still leave two workers to every other tenant, and a tenant's memory hits (milliseconds)
# are served two at a time, which keeps up with its prefills
IO_WORKERS = 8
IO_PER_TENANT = 2


class CacheIO:
    """Runs stages and stores on ``workers`` threads; ``poke`` wakes the worker after a stage."""

    def __init__(
        self,
        poke: Callable[[], None],
        *,
        share: bool = True,
        workers: int = IO_WORKERS,
        per_tenant: int = IO_PER_TENANT,
    ) -> None:
        self._poke = poke
        self._cond = threading.Condition()  # NOTE: an RLock: ``_led`` queues while it holds it
        self._queue: IOQueue[Callable[[], None]] = IOQueue(workers, per_tenant)
        self._inflight = InFlight() if share else None
        self._staging: dict[Job, None] = {}  # handed to stage, not staged yet (insertion order)
        self._threads: list[threading.Thread] = []
        self._generation = 0  # of the threads running now: those of a closed one drain and end
        self._closed = -1  # the last closed generation

    @property
    def workers(self) -> int:
        return self._queue.workers

    @property
    def per_tenant(self) -> int:
        return self._queue.per_tenant

    def stage(self, job: Job) -> None:
        """Match and load ``job``'s cached prefix; it is ready (``job.staged``) after."""
        with self._cond:
            self._staging[job] = None
            self._queue_job(job, Kind.STAGE, lambda: self._stage(job))

    def store_prompt(self, job: Job, kv: KVSource, length: int, after: Callable[[], None]) -> None:
        """Store ``job``'s prompt (``length`` positions of ``kv``) now that it is computed,
        then call ``after`` (always)."""
        self._queue_job(job, Kind.STORE, lambda: self._storing(job, lambda: job.store_prompt(kv, length), after))

    def store(self, job: Job, kv: KVSource | None, length: int, after: Callable[[], None]) -> None:
        """Store ``length`` positions of ``kv`` for ``job`` (it ended), then call ``after`` (always)."""
        self._queue_job(job, Kind.STORE, lambda: self._storing(job, lambda: job.store(kv, length), after))

    def overdue(self, gone: Callable[[Job], bool]) -> list[Job]:
        """The jobs not staged yet for which ``gone`` holds (client left, deadline passed),
        in the order they came: never staged now (a lookup running for one is dropped, a
        follower leaves its lead). The caller ends them."""
        with self._cond:
            out = [job for job in self._staging if gone(job)]
            for job in out:
                del self._staging[job]
                if self._inflight is not None:
                    self._inflight.unfollow(job)
            return out

    @property
    def following(self) -> int:
        """Jobs waiting for another's prompt to be stored (``inflight.py``)."""
        with self._cond:
            return self._inflight.followers if self._inflight is not None else 0

    @property
    def idle(self) -> bool:
        """Whether no task is queued or running."""
        with self._cond:
            return self._queue.idle

    def close(self, timeout: float) -> None:
        """Run what is queued, then stop the threads (waiting ``timeout`` seconds in all
        for them: a task stalled in a tier is left to its thread, a daemon)."""
        with self._cond:
            self._closed, self._generation = self._generation, self._generation + 1
            threads, self._threads = self._threads, []  # NOTE: a later task starts new ones
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ on a worker

    def _stage(self, job: Job) -> None:
        with self._cond:
            if job not in self._staging:
                return  # ended while queued (``overdue``)
        try:
            staged = job.lookup()
        except Exception:  # NOTE: a bug must cost the hit only, not leave the job unstaged until its deadline
            log.exception("the lookup of request %d failed", job.handle.id)
            staged = Staged()
        with self._cond:
            if job not in self._staging:
                return  # ended while it looked: its end went out, what it loaded is dropped
            # NOTE: one whose client left or whose deadline passed ends at its first step:
            # it neither waits for a lead nor is one
            if self._inflight is not None and not (job.handle.cancelled or job.expired()):
                lead = self._inflight.leader(job, staged.cached)
                if lead is not None:
                    return self._inflight.follow(lead, job)  # staged again once the lead's prompt is stored
                self._inflight.lead(job)
            del self._staging[job]
            job.staged = staged
        self._poke()

    def _storing(self, job: Job, store: Callable[[], None], after: Callable[[], None]) -> None:
        try:
            store()
        finally:
            try:
                after()
            finally:
                self._led(job)

    def _led(self, job: Job) -> None:
        """``job``'s prompt is stored, or it ended: who waited for it is staged again."""
        if self._inflight is None:
            return
        with self._cond:
            for follower in self._inflight.done(job):
                assert isinstance(follower, Job)
                if follower in self._staging:
                    self._queue_job(follower, Kind.STAGE, functools.partial(self._stage, follower))

    def _queue_job(self, job: Job, kind: Kind, task: Callable[[], None]) -> None:
        self._put(task, owner=job, tenant=job.tenant, scope=job.context, prompt=job.prompt, kind=kind)

    def _put(
        self,
        task: Callable[[], None],
        *,
        owner: Hashable = None,
        tenant: str = "",
        scope: Hashable = None,
        prompt: Sequence[int] = (),
        kind: Kind = Kind.STORE,
    ) -> None:
        """Queue ``task`` (the caller may hold the lock: it is reentrant). The defaults: a
        bare task of nobody's, after the bare tasks before it (``test_threads.py``)."""
        with self._cond:
            if not self._threads:
                self._start()
            self._queue.put(task, owner=owner, tenant=tenant, scope=scope, prompt=prompt, kind=kind)
            self._cond.notify()

    def _start(self) -> None:
        """Start a generation of workers (under the lock): the first task, or the first
        after a ``close``."""
        generation = self._generation
        self._threads = [
            threading.Thread(target=self._run, args=(generation,), name=f"prefixcache-cache-io-{i}", daemon=True)
            for i in range(self._queue.workers)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, generation: int) -> None:
        serial_torch()  # NOTE: the worker's OpenMP team stays the only one (``threads.py``)
        while (task := self._take(generation)) is not None:
            try:
                task.item()
            except Exception:  # a bug in one task must not stop the others
                log.exception("a prefix cache task failed")
            finally:
                with self._cond:
                    self._queue.done(task)
                    self._cond.notify_all()
            # NOTE: a done task's closure (a job, a row's KV) is not kept while this worker waits
            del task

    def _take(self, generation: int) -> Task[Callable[[], None]] | None:
        """The next task this worker runs; None once its generation closed and nothing is left."""
        with self._cond:
            while True:
                task = self._queue.take()
                if task is not None:
                    return task
                if generation <= self._closed and self._queue.idle:
                    return None
                self._cond.wait()
