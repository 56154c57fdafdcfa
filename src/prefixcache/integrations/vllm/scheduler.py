"""The scheduler's half of the connector, free of vLLM's classes (it reads the fields
of vLLM's ``Request`` and ``SchedulerOutput`` by name).

Per step it decides, and the worker moves bytes:

- ``seen``: a new request's ``Scope`` (tenant, adapter, media: ``scope.py``), or the
  reason it bypasses the cache;
- ``matched``: how many tokens beyond vLLM's own prefix-cache hit prefixcache holds
  (asked of the worker through ``lookup.py``, without side effects: vLLM may ask again
  for a request that stays waiting), whole blocks, never the last prompt token (vLLM
  must compute at least one);
- ``allocated``: vLLM gave blocks for them: a ``LoadSpec`` goes into the next step's
  metadata, for the blocks beyond vLLM's own hit only. With ``async_load`` the
  request waits (vLLM's ``WAITING_FOR_REMOTE_KVS``) while the worker loads, and the
  batch goes on without it; otherwise the load runs before the step's forward pass;
- ``step``: for every scheduled request, the full prompt blocks computed once this step
  has run become a ``SaveSpec`` (only the blocks not sent before);
- ``load_failed``: blocks the worker could not load, which vLLM recomputes: they are
  saved again once recomputed, and the request's reported cached tokens are cut to
  what was really loaded (design invariant 6).

Each of these is a hook vLLM's engine core calls, where an exception kills the engine
for every tenant: each runs behind the wall (``wall.py``, design invariant 17), and a
request whose hook raised bypasses the cache for the rest of its life (its books here
may be half-written, so none of them is trusted again). What each answers then:

==========================  =====================================================
hook (vLLM's name)          on failure
==========================  =====================================================
on_new_request              the request bypasses the cache
get_num_new_matched_tokens  0 tokens (nothing to load); the request bypasses
update_state_after_alloc    the request bypasses; tokens already promised to vLLM
                            are a ``VoidLoad``: reported failed, vLLM recomputes
build_connector_meta        the request whose part raised bypasses (its promised
                            load voided); if the step itself raised, every request
                            known bypasses and the promised loads are voided
update_connector_output     the request whose load it was cutting bypasses
request_finished            (vLLM's answer is fixed: its blocks may be freed)
==========================  =====================================================
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

from prefixcache.integrations.vllm.groups import Found, MissReason
from prefixcache.integrations.vllm.scope import Bypass, Scope
from prefixcache.integrations.vllm.steps import LoadMade, StepPlan, Tracked, by_group
from prefixcache.integrations.vllm.wall import Wall
from prefixcache.integrations.vllm.worker import LoadSpec, SaveSpec, Tally, VoidLoad

__all__ = ["HOOK_FAILED", "SchedulerState", "StepPlan"]

log = logging.getLogger("prefixcache.vllm")

Lookup = Callable[[Sequence[int], Scope], Found]
Scoper = Callable[[Any], Scope | Bypass]  # a vLLM Request -> its scope, or why it bypasses the cache
HOOK_FAILED = "hook_failed"  # the bypass reason of a request one of whose hooks raised


class SchedulerState:
    def __init__(
        self, block_size: int, lookup: Lookup, scoper: Scoper, *, async_load: bool = False, wall: Wall | None = None
    ) -> None:
        self.block_size = block_size
        self.async_load = async_load
        self.wall = wall or Wall()
        self._lookup = lookup
        self._scoper = scoper
        self._asked: dict[str, tuple[int, int]] = {}  # req_id -> (vLLM's own hit, ours beyond it)
        self._pending: dict[str, tuple[int, int]] = {}  # req_id -> (vLLM's own hit, tokens to load)
        self._voided: set[str] = set()  # of ``_pending``: promised sync loads to report failed, not to make
        self._tracked: dict[str, Tracked] = {}
        # vLLM's NewRequestData carries no salt, adapter path or media: read by ``seen``
        self._scopes: dict[str, Scope | Bypass] = {}
        self._requests: dict[str, Any] = {}  # req_id -> vLLM's Request, until it finishes
        self._loaded: dict[str, LoadMade] = {}  # req_id -> its last load, as far as it succeeded
        self._ready: list[LoadSpec] = []  # async loads decided at allocation, for the next step
        self._voids: list[VoidLoad] = []  # async loads voided at allocation, for the next step
        self.bypassed: Counter[str] = Counter()  # reason -> requests served without the cache
        self._new_bypassed: Counter[str] = Counter()  # the same, since ``take_tally``
        self._missed: dict[str, MissReason] = {}  # req_id -> why it hits less (counted once a request)
        self._new_misses: Counter[str] = Counter()  # reason -> requests, since ``take_tally``

    # ---------------------------------------------------------------- the hooks, walled

    def seen(self, request: Any) -> None:
        """vLLM's ``on_new_request``: the request's scope, read once."""
        with self.wall.hold("on_new_request"):
            self._scope(request)
            return
        self._fail(request, "on_new_request")

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        """vLLM's ``get_num_new_matched_tokens``: the tokens beyond vLLM's own hit."""
        with self.wall.hold("get_num_new_matched_tokens"):
            return self._matched(request, num_computed_tokens)
        self._fail(request, "get_num_new_matched_tokens")
        return 0

    def allocated(self, request: Any, num_external_tokens: int, blocks: Any = ()) -> None:
        """vLLM's ``update_state_after_alloc``: vLLM allocated blocks for the tokens
        ``matched`` offered (``blocks``: vLLM's ``KVCacheBlocks`` or the ids of the first
        group, all of the request's blocks, needed for an async load, whose request is not
        scheduled)."""
        with self.wall.hold("update_state_after_alloc"):
            self._allocated(request, num_external_tokens, blocks)
            return
        self._fail(request, "update_state_after_alloc", promised=num_external_tokens)

    def step(self, output: Any) -> StepPlan:
        """vLLM's ``build_connector_meta``: this step's loads and saves."""
        ready, voids, pending = self._ready, self._voids, dict(self._pending)
        self._ready, self._voids = [], []
        with self.wall.hold("build_connector_meta"):
            plan = StepPlan(loads=list(ready), voids=list(voids))
            self._step(plan, output)
            return plan
        return self._abandon(output, StepPlan(loads=ready, voids=voids), pending)

    def load_failed(self, block_ids: Collection[int]) -> None:
        """From vLLM's ``update_connector_output``: the worker could not fill these vLLM
        blocks, and vLLM recomputes them. Each request that loaded into one saves its
        prompt again from that block on, and its reported cached tokens (vLLM's prefill
        stats, while not yet sent) become what was really loaded."""
        if not block_ids:
            return
        for req_id, load in list(self._loaded.items()):
            with self.wall.hold("update_connector_output"):
                self._cut(req_id, load, block_ids)
                continue
            self._fail_id(req_id, "update_connector_output")

    def finished(self, request: Any) -> None:
        """vLLM's ``request_finished``."""
        with self.wall.hold("request_finished"):
            req_id = request.request_id
            self._forget(req_id)
            self._asked.pop(req_id, None)
            # NOTE: an async load already in ``_ready`` (or voided in ``_voids``) still goes
            # out: vLLM keeps the request's blocks until the worker reports it finished.

    def take_tally(self) -> Tally | None:
        """The bypasses and hook failures since the last call, for vLLM's stats."""
        tally = Tally(hook_failures=self.wall.take(), bypassed=self._new_bypassed, misses=self._new_misses)
        self._new_bypassed, self._new_misses = Counter(), Counter()
        return None if tally.is_empty() else tally

    # ---------------------------------------------------------------- decisions

    def _scope(self, request: Any) -> Scope | Bypass:
        known = self._scopes.get(request.request_id)
        if known is None:
            self._requests[request.request_id] = request
            known = self._scopes[request.request_id] = self._scoper(request)
            if isinstance(known, Bypass):
                self._count(known.reason)
        return known

    def _matched(self, request: Any, num_computed_tokens: int) -> int:
        prompt = request.prompt_token_ids
        scope = self._scope(request)
        if not prompt or isinstance(scope, Bypass):
            return 0
        n = self.block_size
        limit = (len(prompt) - 1) // n * n
        if not limit:
            self._missed_for(request.request_id, MissReason.SHORT)
        if limit <= num_computed_tokens or num_computed_tokens % n:
            return 0
        found = self._lookup(list(prompt[:limit]), scope)
        if found.reason is not None:
            self._missed_for(request.request_id, found.reason)
        extra = max(0, min(found.tokens, limit) - num_computed_tokens)  # whole blocks: both ends are
        self._asked[request.request_id] = (num_computed_tokens, extra)
        return extra

    def _allocated(self, request: Any, num_external_tokens: int, blocks: Any) -> None:
        req_id = request.request_id
        local, _ = self._asked.get(req_id, (request.num_computed_tokens, 0))
        if num_external_tokens > 0:
            scope = self._scopes.get(req_id)
            if not isinstance(scope, Scope):  # bypassed since it was offered: the promise stands
                self._void(req_id, local, num_external_tokens)
            elif not self.async_load:
                self._pending[req_id] = (local, num_external_tokens)
            else:
                prompt = request.prompt_token_ids
                self._ready.append(self._plan_load(req_id, scope, prompt, by_group(blocks), local, num_external_tokens))
        self._asked.pop(req_id, None)

    def _step(self, plan: StepPlan, output: Any) -> None:
        for new in output.scheduled_new_reqs:
            pending = self._pending.get(new.req_id)
            with self.wall.hold("build_connector_meta"):
                self._new(plan, new, output.num_scheduled_tokens.get(new.req_id, 0))
                continue
            self._fail_scheduled(plan, new.req_id, pending, getattr(new, "block_ids", None))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            pending = self._pending.get(req_id)
            with self.wall.hold("build_connector_meta"):
                self._cached(plan, req_id, cached, i, output.num_scheduled_tokens.get(req_id, 0))
                continue
            self._fail_scheduled(plan, req_id, pending, cached.new_block_ids[i])
        for req_id in output.finished_req_ids:
            self._forget(req_id)

    def _new(self, plan: StepPlan, new: Any, scheduled: int) -> None:
        scope = self._scopes.get(new.req_id)
        if not isinstance(scope, Scope) or new.req_id in self._voided:
            self._void_due(plan, new.req_id, new.block_ids[0])  # a promised load no plan is made for
            return
        if not new.prompt_token_ids:
            return
        tracked = Tracked(scope, tuple(new.prompt_token_ids), by_group(new.block_ids), 0)
        self._tracked[new.req_id] = tracked
        self._load(plan, new.req_id, tracked)
        self._save(plan, new.req_id, tracked, new.num_computed_tokens, scheduled)

    def _cached(self, plan: StepPlan, req_id: str, cached: Any, i: int, scheduled: int) -> None:
        new_ids = cached.new_block_ids[i]
        resumed = req_id in cached.resumed_req_ids
        known = self._tracked.get(req_id)
        if resumed and (known is None or req_id in self._voided):
            self._void_due(plan, req_id, new_ids[0] if new_ids else ())  # a promised load no plan is made for
            return
        if known is None:
            return
        if resumed:
            known.block_ids = by_group(new_ids) if new_ids else [[] for _ in known.block_ids]
            known.saved = 0  # its blocks were freed: nothing of them is vouched for
            self._load(plan, req_id, known)  # preempted, then matched again on its return
        elif new_ids:
            for ids, more in zip(known.block_ids, new_ids, strict=True):
                ids.extend(more)
        self._save(plan, req_id, known, cached.num_computed_tokens[i], scheduled)

    def _load(self, plan: StepPlan, req_id: str, tracked: Tracked) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        local, external = pending
        spec = self._plan_load(req_id, tracked.scope, tracked.prompt, tracked.block_ids, local, external)
        plan.loads.append(spec)
        tracked.saved = len(spec.tokens)

    def _plan_load(
        self,
        req_id: str,
        scope: Scope,
        prompt: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        local: int,
        external: int,
    ) -> LoadSpec:
        """The load of the ``external`` tokens after vLLM's own ``local`` ones (both whole
        blocks), remembered for ``load_failed``. Each group's ids from the first block
        loaded on; a sliding group's skipped blocks are vLLM's null block."""
        n = self.block_size
        first, end = local // n, (local + external) // n
        blocks = tuple(tuple(ids[first:end]) for ids in block_ids)
        if len(blocks) == 1:  # NOTE: vLLM takes block-level load errors from one group only
            self._loaded[req_id] = LoadMade(first, blocks[0])
        return LoadSpec(req_id, scope, tuple(prompt[: end * n]), first, blocks)

    def _save(self, plan: StepPlan, req_id: str, tracked: Tracked, computed: int, scheduled: int) -> None:
        """Send the prompt's blocks this step completes (``computed``: the tokens vLLM had
        computed before it, whose window a sliding group still keeps)."""
        n = self.block_size
        end = min(computed + scheduled, len(tracked.prompt)) // n * n
        end = min(end, min(len(ids) for ids in tracked.block_ids) * n)
        if end > tracked.saved:
            blocks = tuple(tuple(ids[: end // n]) for ids in tracked.block_ids)
            plan.saves.append(
                SaveSpec(
                    req_id,
                    tracked.scope,
                    tracked.prompt[:end],
                    blocks,
                    since_block=tracked.saved // n,
                    computed=computed,
                    reached=computed + scheduled,
                )
            )
            tracked.saved = end

    def _cut(self, req_id: str, load: LoadMade, block_ids: Collection[int]) -> None:
        n = self.block_size
        bad = next((i for i, b in enumerate(load.block_ids) if b in block_ids), None)
        if bad is None:
            return
        tracked = self._tracked.get(req_id)  # an async load's request is not scheduled yet: saved from 0
        if tracked is not None:
            tracked.saved = min(tracked.saved, (load.first + bad) * n)
        self._loaded[req_id] = LoadMade(load.first, load.block_ids[:bad])
        stats = getattr(self._requests.get(req_id), "prefill_stats", None)
        if stats is not None:
            lost = (len(load.block_ids) - bad) * n
            stats.set(
                num_prompt_tokens=stats.num_prompt_tokens,
                num_local_cached_tokens=stats.num_local_cached_tokens,
                num_external_cached_tokens=max(0, stats.num_external_cached_tokens - lost),
            )

    # ---------------------------------------------------------------- failure answers

    def _fail(self, request: Any, hook: str, promised: int = 0) -> None:
        """A hook raised for ``request``: it bypasses the cache for the rest of its life,
        and ``promised`` tokens vLLM counts on loading become a ``VoidLoad``."""
        with self.wall.hold(f"{hook}/fallback"):
            req_id = request.request_id
            asked = self._asked.pop(req_id, None)
            self._bypass(req_id)
            if promised > 0:
                self._void(req_id, asked[0] if asked else int(request.num_computed_tokens), promised)

    def _fail_id(self, req_id: str, hook: str) -> None:
        with self.wall.hold(f"{hook}/fallback"):
            self._bypass(req_id)
            self._loaded.pop(req_id, None)  # not cut again: its books are not trusted

    def _fail_scheduled(self, plan: StepPlan, req_id: str, pending: tuple[int, int] | None, groups: Any) -> None:
        """A scheduled request's part of the step raised: it bypasses the cache, and a sync
        load promised for it that did not make it into the plan is voided."""
        with self.wall.hold("build_connector_meta/fallback"):
            self._bypass(req_id)
            if pending is not None and not any(s.req_id == req_id for s in plan.loads):
                self._pending[req_id] = pending
                self._void_due(plan, req_id, groups[0])  # vLLM's block ids, by KV cache group

    def _abandon(self, output: Any, plan: StepPlan, pending: dict[str, tuple[int, int]]) -> StepPlan:
        """The step itself raised: its books may be half-written, so none of them is
        trusted again. Every request known bypasses the cache from now on; the sync loads
        promised to the requests this step schedules are voided, and the async loads
        decided at allocation go out (their specs were whole before the step began)."""
        with self.wall.hold("build_connector_meta/fallback"):
            for req_id in list(self._scopes):
                self._bypass(req_id)
            self._pending.update(pending)
            self._voided.update(pending)
            for new in output.scheduled_new_reqs:
                with self.wall.hold("build_connector_meta/fallback"):
                    self._void_due(plan, new.req_id, new.block_ids[0])
            cached = output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                with self.wall.hold("build_connector_meta/fallback"):
                    if req_id in pending and req_id in cached.resumed_req_ids:
                        self._void_due(plan, req_id, cached.new_block_ids[i][0])
        return plan

    def _void(self, req_id: str, local: int, external: int) -> None:
        """A load promised to vLLM that will not be made: async, it fails as a whole at
        the next step; sync, its blocks are reported failed when vLLM schedules it."""
        if self.async_load:
            self._voids.append(VoidLoad(req_id, whole=True))
        else:
            self._pending[req_id] = (local, external)
            self._voided.add(req_id)

    def _void_due(self, plan: StepPlan, req_id: str, block_ids: Sequence[int]) -> None:
        pending = self._pending.pop(req_id, None)
        self._voided.discard(req_id)
        if pending is not None:
            local, external = pending
            n = self.block_size
            plan.voids.append(VoidLoad(req_id, tuple(block_ids[local // n : (local + external) // n])))

    def _bypass(self, req_id: str) -> None:
        """``req_id`` is served without the cache from now on: nothing of it is tracked."""
        if not isinstance(self._scopes.get(req_id), Bypass):
            self._count(HOOK_FAILED)
        self._scopes[req_id] = Bypass(HOOK_FAILED)
        self._tracked.pop(req_id, None)

    def _missed_for(self, req_id: str, reason: MissReason) -> None:
        """Count why ``req_id`` hits less, once however often vLLM asks about it."""
        if self._missed.get(req_id) is not reason:
            self._missed[req_id] = reason
            self._new_misses[reason.value] += 1

    def _count(self, reason: str) -> None:
        if not self.bypassed[reason]:
            log.warning("prefixcache: a request bypasses the cache (%s); counted from now on", reason)
        self.bypassed[reason] += 1
        self._new_bypassed[reason] += 1

    def _forget(self, req_id: str) -> None:
        for book in (self._tracked, self._scopes, self._requests, self._loaded, self._pending, self._missed):
            book.pop(req_id, None)
        self._voided.discard(req_id)
