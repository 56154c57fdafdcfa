"""The worker connector's hooks, free of vLLM's classes, each behind the wall.

vLLM's model runner calls these every step, in the worker process, where an exception
fails the step of every request in the batch and kills the engine (``wall.py``, design
invariant 17). The cache operations are ``ConnectorWorker``'s (``worker.py``); this adds
what a step does with them: loads run inside the step or on I/O threads (``async_load``),
finished async loads are reported, the blocks no load filled go back to vLLM to be
recomputed. What each hook answers when its body raises:

===============================  ====================================================
hook (vLLM's name)               on failure
===============================  ====================================================
start_load_kv                    that load's blocks are reported as load errors (async:
                                 and its request finished), so vLLM recomputes them
get_transfer_results             a load whose commit raised is reported finished, all
 (get_finished)                  its blocks as load errors
wait_for_save                    that save is skipped: a future miss
get_block_ids_with_load_errors   cannot fail (a set handed over)
get_kv_connector_stats           no stats this step (the failures are counted still)
get_kv_connector_kv_cache_events no events this step
===============================  ====================================================

A ``VoidLoad`` (a load the scheduler promised vLLM but could not plan, ``scheduler.py``)
is reported as failed: its blocks as load errors, or, async, the request as a failed
receive (``failed_recving``), which vLLM recomputes from its start.

A model of several KV cache groups (a hybrid, ``groups.py``) loads asynchronously only,
and a load that did not fill every block is a failed receive: vLLM takes block-level
load errors from one group only (its block ids are unique only within a group).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final

from prefixcache.cache import Stamp
from prefixcache.fleet import wire
from prefixcache.fleet.journal import DiskRecorder, beside
from prefixcache.fleet.translate import stored_whole, wire_events
from prefixcache.integrations.vllm.wall import Wall
from prefixcache.integrations.vllm.worker import ConnectorWorker, Loaded, LoadSpec, SaveSpec, Tally, VoidLoad

__all__ = ["WorkerHooks"]

STAMPS_KEPT: Final = 4096  # requests whose stamps are kept: far more than vLLM runs at once
JOURNAL_NAME: Final = "vllm-connector"  # its disk tier's journal (one store per folder: one name is enough)


class WorkerHooks:
    def __init__(
        self, worker: ConnectorWorker, *, async_load: bool = True, load_threads: int = 2, wall: Wall | None = None
    ) -> None:
        if worker.groups.hybrid and not async_load:
            raise ValueError("a model of several KV cache groups loads asynchronously only (async_load)")
        self.worker = worker
        self.wall = wall or Wall()
        self.async_load = async_load
        self._threads = load_threads
        self._loader: ThreadPoolExecutor | None = None
        self._loading: dict[str, tuple[LoadSpec, Future[Loaded]]] = {}  # async loads in flight, by request
        self._load_errors: set[int] = set()
        self._done: set[str] = set()  # async loads that failed to start: reported finished next
        self._failed: set[str] = set()  # async loads voided whole: reported finished and failed next
        self._failing: set[str] = set()  # loads of a hybrid that did not fill every block: failed now
        # NOTE: a request's saves carry the stamp of the first step that named it (its load,
        # or its first save), taken before that step's forward: a purge or epoch bump the
        # cache learns of while the request computes voids them (``cache/invalidations.py``).
        # A request whose first chunk completed no block is stamped one step late.
        self._step: Stamp | None = None
        self._stamps: OrderedDict[str, Stamp] = OrderedDict()
        self._journal_opened = False  # the disk tier's journal is opened at the first events call
        self._recorder: DiskRecorder | None = None

    def start_loads(self, loads: Sequence[LoadSpec], voids: Sequence[VoidLoad] = ()) -> None:
        """vLLM's ``start_load_kv``: this step's loads, inside the step or on I/O threads."""
        with self.wall.hold("start_load_kv"):
            self._step = self.worker.cache.stamp()
        for spec in loads:
            self._stamp(spec.req_id)
        for void in voids:
            if void.whole:
                self._failed.add(void.req_id)
            else:
                self._load_errors.update(void.block_ids)
        for spec in loads:
            with self.wall.hold("start_load_kv"):
                self._start(spec)
                continue
            self._lost(spec)  # vLLM recomputes them
            if self.async_load and spec.req_id not in self._loading:
                self._done.add(spec.req_id)  # vLLM waits for it: reported at once

    def _start(self, spec: LoadSpec) -> None:
        if not self.async_load:
            self._load_errors.update(self.worker.load(spec))
            return
        if self._loader is None:
            self._loader = ThreadPoolExecutor(self._threads, thread_name_prefix="prefixcache-load")
        self._loading[spec.req_id] = (spec, self._loader.submit(self.worker.fetch, spec))

    def transfers(self) -> tuple[set[str], set[str]]:
        """vLLM's ``get_transfer_results``: the requests whose async loads are done, and
        of them those that failed as a whole. Their unfilled blocks go to ``load_errors``,
        which vLLM asks in the same step."""
        done, failed = self._done | self._failed, self._failed
        self._done, self._failed = set(), set()
        for req_id, (spec, future) in list(self._loading.items()):
            if not future.done():
                continue
            done.add(req_id)  # NOTE: first: a request vLLM waits for is never dropped
            del self._loading[req_id]
            with self.wall.hold("get_finished"):
                unfilled = self.worker.commit(future.result())  # fetch never raises: a miss
                if unfilled:
                    self._lost(spec, unfilled)
                continue
            self._lost(spec)
        return done, failed | self._failed_now()

    def _lost(self, spec: LoadSpec, blocks: Sequence[int] | None = None) -> None:
        """``spec``'s load did not fill ``blocks`` (default: any): vLLM recomputes them, or,
        for a hybrid, the whole request."""
        if self.worker.groups.hybrid:
            self._failing.add(spec.req_id)
        else:
            self._load_errors.update(spec.block_ids[0] if blocks is None else blocks)

    def _failed_now(self) -> set[str]:
        failing, self._failing = self._failing, set()
        return failing

    def load_errors(self) -> set[int]:
        """vLLM's ``get_block_ids_with_load_errors``: the blocks to recompute."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def save(self, saves: Sequence[SaveSpec]) -> None:
        """vLLM's ``wait_for_save``: store this step's computed prompt blocks."""
        for spec in saves:
            with self.wall.hold("wait_for_save"):
                self.worker.save(spec, self._stamp(spec.req_id))

    def _stamp(self, req_id: str) -> Stamp | None:
        """The stamp of ``req_id``'s stores: the first it got, or this step's."""
        stamp = self._stamps.get(req_id)
        if stamp is None and self._step is not None:
            stamp = self._stamps[req_id] = self._step
            if len(self._stamps) > STAMPS_KEPT:
                self._stamps.popitem(last=False)
        return stamp

    def take_tally(self) -> Tally | None:
        """vLLM's ``get_kv_connector_stats``: the worker's counts and this side's failures."""
        with self.wall.hold("get_kv_connector_stats"):
            tally = self.worker.take_tally() or Tally()
            tally.hook_failures.update(self.wall.take())
            return None if tally.is_empty() else tally
        return None

    def events(self) -> list[wire.BlockStored | wire.BlockRemoved]:
        """The cache's tier moves since the last call (for ``get_kv_connector_kv_cache_events``).

        The first call also announces what the disk tier kept from before a restart and
        a journal beside it names (``fleet/journal.py``, as a server's publisher does),
        and every call keeps that journal for the next start."""
        with self.wall.hold("get_kv_connector_kv_cache_events"):
            cache = self.worker.cache
            size = cache.config.block_size
            kinds = [tier.kind for tier in cache.config.tiers]
            first = not self._journal_opened
            if first:
                self._journal_opened = True
                journal = beside(cache.config.tiers, JOURNAL_NAME)
                self._recorder = DiskRecorder(journal, size) if journal is not None else None
            drained = cache.drain(residency=first and self._recorder is not None)
            out: list[wire.BlockStored | wire.BlockRemoved] = list(wire_events(drained.events, size, kinds))
            if self._recorder is not None:
                self._recorder.observe(drained)
                if drained.resident is not None:  # NOTE: the first call only, not every step
                    out += stored_whole(self._recorder.orphans(drained), size, kinds)
            return out
        return []

    def close(self, flush_timeout_s: float) -> bool:
        """Stop the I/O threads, flush queued writes (bounded); False when some were dropped."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        return self.worker.closed or self.worker.close(flush_timeout_s)
