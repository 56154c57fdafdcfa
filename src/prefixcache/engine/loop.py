"""The worker's step loop: one forward a step that decodes every running request and
carries the prompts' next chunks, tenants in turn.

    loop:  new slots ─> I/O workers stage them (match + load); one whose client left
             or whose deadline passed before it was staged ends at once (``overdue``)
           a step: every decoding job's token, and the next chunk of ready prompts
             (tenants in turn, up to ``chunk_tokens`` prompt tokens), in one forward;
             each decoding job samples its next token, a job that ended leaves its row;
             a prompt whose last chunk ran joins the batch, its prompt's KV stored
             (I/O workers) for the requests that wait for that prefix
           an ended job: its store queued on the I/O workers, its slot freed, then its
             end event out

A long prompt delays the others by at most one chunk a step, and a decoding request
gets a token every step. A chunk that cannot run (``Batch.check``) fails its own job
before the forward; what fails inside a forward fails every job of that step. With
``batched`` off, each decoding job gets a batch of its own (one forward each) and a
chunk runs alone, followed by ``decode_steps`` steps: the engine without batching, for
comparisons.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

from prefixcache.engine.batch import Batch, RowKV
from prefixcache.engine.cacheio import CacheIO
from prefixcache.engine.job import Job, Phase
from prefixcache.engine.kv import SequenceKV
from prefixcache.engine.memory import TRIM_BYTES, give_back
from prefixcache.engine.model import LoadedModel
from prefixcache.engine.runner import Chunk
from prefixcache.engine.scheduler import Scheduler

__all__ = ["StepLoop"]

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # a bound on a wait for work, so that a deadline is noticed while idle


def _gone(job: Job) -> bool:
    """Whether ``job`` ends before its first step: its client left or its deadline passed."""
    return job.handle.cancelled or job.expired()


class StepLoop:
    """Runs on the worker thread until the scheduler closes and its jobs ended."""

    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: Scheduler[Job],
        io: CacheIO,
        settled: Callable[[], None],
        *,
        batched: bool,
        chunk_tokens: int,
        decode_steps: int,
    ) -> None:
        self._loaded = loaded
        self._scheduler = scheduler
        self._io = io
        self._settled = settled  # a job's end and store are done
        self._batched = batched
        self._chunk_tokens = chunk_tokens  # prompt tokens a step carries (one chunk at least)
        self._decode_steps = decode_steps  # without batching: decode steps after a chunk
        self._held: Job | None = None  # its chunk did not fit in the last step: it goes first
        self._shared = Batch(loaded)
        self._rows: dict[Job, Batch] = {}  # the decoding jobs, and their batch
        self._released: queue.SimpleQueue[tuple[Batch, RowKV]] = queue.SimpleQueue()

    @property
    def decoding(self) -> int:
        return len(self._rows)

    def run(self) -> None:
        scheduler = self._scheduler
        while True:
            seen = scheduler.version
            self.stage_started()
            # NOTE: a waiting job past its deadline ends now, its 504 on time
            for expired in scheduler.reap(Job.expired):
                expired.prefill()
                self._finish(expired, active=False)
            # NOTE: and so does one with a slot not staged yet (its lookup queued or running,
            # or following a prompt in flight): its 504 or its cancel on time, its slot freed
            for gone in self._io.overdue(_gone):
                gone.prefill()
                self._finish(gone)
            self._release_stored()
            worked = self._step(self._chunks()) if self._batched else self._apart()
            if not worked and not scheduler.wait(seen, _IDLE_WAIT_S):
                return

    def _release_stored(self) -> None:
        """The rows whose store ended may be reused; their KV goes with its last reference
        (a method of its own, so that none stays in the loop's frame while it waits), and
        much of it freed at once goes back to the system."""
        freed = 0
        while not self._released.empty():
            freed += self._release(self._released.get())
        if freed >= TRIM_BYTES:
            give_back()

    @staticmethod
    def _release(item: tuple[Batch, RowKV]) -> int:
        """Release one row's KV: the bytes of its buffers when they are no shelf's any more."""
        batch, kv = item
        return 0 if batch.release(kv) else kv.nbytes

    def _chunks(self) -> list[tuple[Job, Chunk]]:
        """The prompt chunks of this step: the ready jobs' in turn, up to ``chunk_tokens``
        tokens (at least one chunk). One that does not fit goes first at the next step."""
        out: list[tuple[Job, Chunk]] = []
        budget, seen = self._chunk_tokens, set()
        held, self._held = self._held, None
        while budget > 0:
            job: Job | None = None
            if held is not None and held.ready():
                job, held = held, None
            else:
                job = self._scheduler.next(lambda j: j.ready() and j not in seen)
            if job is None:
                break
            seen.add(job)
            chunk = job.chunk()
            if chunk is None:  # it decodes or ended now, or its mode ran a step of its own
                self._settle(job)
                continue
            try:
                self._shared.check(chunk)
            except ValueError as exc:  # NOTE: it would raise in the forward, failing every job of the step
                job.fail(exc)
                self._finish(job)
                continue
            if out and len(chunk.tokens) > budget:
                self._held = job
                break
            out.append((job, chunk))
            budget -= len(chunk.tokens)
        return out

    def _apart(self) -> bool:
        """Without batching: the next ready job's chunk alone, then decode steps."""
        job = self._scheduler.next(Job.ready)
        if job is not None:
            job.prefill()
            self._settle(job)
        worked = job is not None
        for _ in range(self._decode_steps if job is not None else 1):
            if not self._rows:
                break
            worked = self._step([]) or worked
        return worked

    def _settle(self, job: Job) -> None:
        """After a prefill step: a job that decodes now joins the batch, one that ended finishes."""
        if job.phase is Phase.DECODE:
            self._join(job)
        elif job.phase is Phase.DONE:
            self._finish(job)

    def stage_started(self) -> None:
        """Hand the jobs that took a slot to the I/O workers (from any thread)."""
        for job in self._scheduler.started():
            job.phase = Phase.STAGING
            self._io.stage(job)

    def _join(self, job: Job) -> None:
        batch = self._shared if self._batched else Batch(self._loaded)
        seq = job.sequence
        try:
            job.row = batch.join(seq.cache, seq.length)
        except Exception as exc:
            job.fail(exc)
            return self._finish(job)
        self._rows[job] = batch
        # NOTE: the prompt's KV goes to the cache now, not at the end, for those that wait
        # for it; the sequence's copy is dropped after that (the row holds its own)
        self._io.store_prompt(job, SequenceKV(seq.cache), seq.length, seq.drop_kv)

    def _step(self, chunks: list[tuple[Job, Chunk]]) -> bool:
        """One forward of every batch: each decoding job's token in, its next token
        sampled; ``chunks`` ride in the shared batch's. False when there was nothing to run."""
        steps: dict[Batch, dict[int, tuple[Job, int]]] = {}
        for job, batch in list(self._rows.items()):
            token = job.fed()
            if token is None:
                self._finish(job)
            else:
                assert job.row is not None
                steps.setdefault(batch, {})[job.row] = (job, token)
        if chunks:
            steps.setdefault(self._shared, {})
        for batch, fed in steps.items():
            jobs = {row: job for row, (job, _) in fed.items()}
            mine = chunks if batch is self._shared else []
            try:
                logits, kept = batch.step({row: token for row, (_, token) in fed.items()}, [c for _, c in mine])
            except Exception as exc:  # the batch's state is unknown now: its jobs fail, a new one starts
                log.error("a batch step failed", exc_info=exc)
                for job in [*jobs.values(), *(job for job, _ in mine)]:
                    job.fail(exc)
                    self._finish(job)
                if batch is self._shared:
                    self._shared = Batch(self._loaded)
                continue
            for row, job in jobs.items():
                job.decoded(logits[row])
                if job.phase is Phase.DONE:
                    self._finish(job)
            for (job, _), out in zip(mine, kept, strict=True):
                job.prefilled(out)
                self._settle(job)
        return bool(steps)

    def _finish(self, job: Job, active: bool = True) -> None:
        """``job`` ended: queue its store on the I/O workers (so that a request sent after
        its end event finds the KV), free its slot, then send its end event (so that a
        client at its tenant's limit may send its next request the moment it reads it)."""
        batch = self._rows.pop(job, None)
        if batch is not None and job.row is not None:
            kv = batch.leave(job.row)

            def after() -> None:
                self._released.put((batch, kv))
                self._scheduler.poke()  # NOTE: an idle loop wakes to release it: its memory goes now
                self._settled()

            self._io.store(job, kv if job.storable else None, kv.length, after)
        elif job.storable:
            seq = job.sequence
            self._io.store(job, SequenceKV(seq.cache), seq.length, self._settled)
        else:
            self._io.store(job, None, 0, self._settled)
        if active:
            self._scheduler.finish(job)
        job.send_end()
