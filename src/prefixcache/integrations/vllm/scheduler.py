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
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache.integrations.vllm.scope import Bypass, Scope
from prefixcache.integrations.vllm.worker import LoadSpec, SaveSpec

__all__ = ["SchedulerState", "StepPlan"]

log = logging.getLogger("prefixcache.vllm")

Lookup = Callable[[Sequence[int], Scope], int]
Scoper = Callable[[Any], Scope | Bypass]  # a vLLM Request -> its scope, or why it bypasses the cache


@dataclass
class _Tracked:
    scope: Scope
    prompt: tuple[int, ...]
    block_ids: list[int]
    saved: int  # prompt tokens already sent to be saved (or loaded from the cache)


@dataclass(frozen=True, slots=True)
class _Load:
    first: int  # the first block loaded (vLLM holds the ones before)
    block_ids: tuple[int, ...]  # vLLM blocks the load fills, from ``first`` on


@dataclass
class StepPlan:
    """What the worker does this step (vLLM's connector metadata)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class SchedulerState:
    def __init__(self, block_size: int, lookup: Lookup, scoper: Scoper, *, async_load: bool = False) -> None:
        self.block_size = block_size
        self.async_load = async_load
        self._lookup = lookup
        self._scoper = scoper
        self._asked: dict[str, tuple[int, int]] = {}  # req_id -> (vLLM's own hit, ours beyond it)
        self._pending: dict[str, tuple[int, int]] = {}  # req_id -> (vLLM's own hit, tokens to load)
        self._tracked: dict[str, _Tracked] = {}
        # vLLM's NewRequestData carries no salt, adapter path or media: read by ``seen``
        self._scopes: dict[str, Scope | Bypass] = {}
        self._requests: dict[str, Any] = {}  # req_id -> vLLM's Request, until it finishes
        self._loaded: dict[str, _Load] = {}  # req_id -> its last load, as far as it succeeded
        self._ready: list[LoadSpec] = []  # async loads decided at allocation, for the next step
        self.bypassed: Counter[str] = Counter()  # reason -> requests served without the cache

    def scope(self, request: Any) -> Scope | Bypass:
        known = self._scopes.get(request.request_id)
        if known is None:
            known = self._scopes[request.request_id] = self._scoper(request)
            self._requests[request.request_id] = request
            if isinstance(known, Bypass):
                if not self.bypassed[known.reason]:
                    log.warning("prefixcache: a request bypasses the cache (%s); counted from now on", known.reason)
                self.bypassed[known.reason] += 1
        return known

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        prompt = request.prompt_token_ids
        scope = self.scope(request)
        if not prompt or isinstance(scope, Bypass):
            return 0
        n = self.block_size
        limit = (len(prompt) - 1) // n * n
        if limit <= num_computed_tokens or num_computed_tokens % n:
            return 0
        cached = self._lookup(list(prompt[:limit]), scope)
        extra = max(0, min(cached, limit) - num_computed_tokens)  # whole blocks: both ends are
        self._asked[request.request_id] = (num_computed_tokens, extra)
        return extra

    def allocated(self, request: Any, num_external_tokens: int, block_ids: Sequence[int] = ()) -> None:
        """vLLM allocated blocks for the tokens ``matched`` offered (``block_ids``: all the
        request's blocks, needed for an async load, whose request is not scheduled)."""
        local, _ = self._asked.pop(request.request_id, (request.num_computed_tokens, 0))
        if num_external_tokens <= 0:
            return
        scope = self._scopes.get(request.request_id)
        if not self.async_load or not isinstance(scope, Scope):
            self._pending[request.request_id] = (local, num_external_tokens)
            return
        self._ready.append(
            self._plan_load(request.request_id, scope, request.prompt_token_ids, block_ids, local, num_external_tokens)
        )

    def step(self, output: Any) -> StepPlan:
        plan = StepPlan(loads=self._ready)
        self._ready = []
        for new in output.scheduled_new_reqs:
            if not new.prompt_token_ids:
                continue
            scope = self._scopes.get(new.req_id)
            if not isinstance(scope, Scope):  # bypasses the cache (or was never seen): nothing to load or save
                continue
            tracked = _Tracked(scope, tuple(new.prompt_token_ids), list(new.block_ids[0]), 0)
            self._tracked[new.req_id] = tracked
            self._load(plan, new.req_id, tracked)
            self._save(
                plan, new.req_id, tracked, new.num_computed_tokens + output.num_scheduled_tokens.get(new.req_id, 0)
            )
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            known = self._tracked.get(req_id)
            if known is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                known.block_ids = list(new_ids[0]) if new_ids else []
                known.saved = 0  # its blocks were freed: nothing of them is vouched for
                self._load(plan, req_id, known)  # preempted, then matched again on its return
            elif new_ids:
                known.block_ids.extend(new_ids[0])
            self._save(plan, req_id, known, cached.num_computed_tokens[i] + output.num_scheduled_tokens.get(req_id, 0))
        for req_id in output.finished_req_ids:
            self._forget(req_id)
        return plan

    def _load(self, plan: StepPlan, req_id: str, tracked: _Tracked) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        local, external = pending
        spec = self._plan_load(req_id, tracked.scope, tracked.prompt, tracked.block_ids, local, external)
        plan.loads.append(spec)
        tracked.saved = len(spec.tokens)

    def _plan_load(
        self, req_id: str, scope: Scope, prompt: Sequence[int], block_ids: Sequence[int], local: int, external: int
    ) -> LoadSpec:
        """The load of the ``external`` tokens after vLLM's own ``local`` ones (both whole
        blocks), remembered for ``load_failed``."""
        n = self.block_size
        first, end = local // n, (local + external) // n
        blocks = tuple(block_ids[first:end])
        self._loaded[req_id] = _Load(first, blocks)
        return LoadSpec(req_id, scope, tuple(prompt[: end * n]), first, blocks)

    def _save(self, plan: StepPlan, req_id: str, tracked: _Tracked, computed: int) -> None:
        n = self.block_size
        end = min(computed, len(tracked.prompt)) // n * n
        end = min(end, len(tracked.block_ids) * n)
        if end > tracked.saved:
            plan.saves.append(
                SaveSpec(req_id, tracked.scope, tracked.prompt[:end], tuple(tracked.block_ids[: end // n]))
            )
            tracked.saved = end

    def load_failed(self, block_ids: Collection[int]) -> None:
        """The worker could not fill these vLLM blocks; vLLM recomputes them. Each
        request that loaded into one saves its prompt again from that block on, and its
        reported cached tokens (vLLM's prefill stats, while not yet sent) become what
        was really loaded."""
        if not block_ids:
            return
        n = self.block_size
        for req_id, load in list(self._loaded.items()):
            bad = next((i for i, b in enumerate(load.block_ids) if b in block_ids), None)
            if bad is None:
                continue
            tracked = self._tracked.get(req_id)  # an async load's request is not scheduled yet: saved from 0
            if tracked is not None:
                tracked.saved = min(tracked.saved, (load.first + bad) * n)
            self._loaded[req_id] = _Load(load.first, load.block_ids[:bad])
            stats = getattr(self._requests.get(req_id), "prefill_stats", None)
            if stats is not None:
                lost = (len(load.block_ids) - bad) * n
                stats.set(
                    num_prompt_tokens=stats.num_prompt_tokens,
                    num_local_cached_tokens=stats.num_local_cached_tokens,
                    num_external_cached_tokens=max(0, stats.num_external_cached_tokens - lost),
                )

    def seen(self, request: Any) -> None:
        self.scope(request)

    def finished(self, request: Any) -> None:
        self._forget(request.request_id)
        self._pending.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        # NOTE: an async load already in ``_ready`` still goes out: vLLM keeps the
        # request's blocks until the worker reports the load finished.

    def _forget(self, req_id: str) -> None:
        for book in (self._tracked, self._scopes, self._requests, self._loaded):
            book.pop(req_id, None)
