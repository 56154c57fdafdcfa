"""The scheduler's half of the connector, free of vLLM's classes (it reads the fields
of vLLM's ``Request`` and ``SchedulerOutput`` by name).

Per step it decides, and the worker moves bytes:

- ``matched``: how many tokens beyond vLLM's own prefix-cache hit prefixcache holds
  (asked of the worker through ``lookup.py``), whole blocks, never the last prompt
  token (vLLM must compute at least one);
- ``allocated``: vLLM gave blocks for them: a ``LoadSpec`` goes into this step's metadata;
- ``step``: for every scheduled request, the full prompt blocks computed once this step
  has run become a ``SaveSpec`` (only the blocks not sent before).

The tenant of a request is ``kv_transfer_params["tenant"]``, else its ``cache_salt``
(what a gateway sets from the authenticated key), else the configured default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache.integrations.vllm.worker import LoadSpec, SaveSpec

__all__ = ["SchedulerState", "StepPlan", "tenant_of"]

Lookup = Callable[[Sequence[int], str], int]


def tenant_of(request: Any, default: str) -> str:
    params = getattr(request, "kv_transfer_params", None) or {}
    tenant = params.get("tenant") if isinstance(params, dict) else None
    if isinstance(tenant, str) and tenant:
        return tenant
    salt = getattr(request, "cache_salt", None)
    return salt if isinstance(salt, str) and salt else default


@dataclass
class _Tracked:
    tenant: str
    prompt: tuple[int, ...]
    block_ids: list[int]
    saved: int  # prompt tokens already sent to be saved (or loaded from the cache)


@dataclass
class StepPlan:
    """What the worker does this step (vLLM's connector metadata)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class SchedulerState:
    def __init__(self, block_size: int, lookup: Lookup, default_tenant: str) -> None:
        self.block_size = block_size
        self._lookup = lookup
        self.default_tenant = default_tenant
        self._asked: dict[str, tuple[int, int]] = {}  # req_id -> (vLLM's own hit, ours beyond it)
        self._pending: dict[str, tuple[int, int]] = {}  # req_id -> (vLLM's own hit, tokens to load)
        self._tracked: dict[str, _Tracked] = {}
        self._tenants: dict[str, str] = {}  # vLLM's NewRequestData carries no salt: remembered by ``seen``

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        prompt = request.prompt_token_ids
        if not prompt:
            return 0
        n = self.block_size
        limit = (len(prompt) - 1) // n * n
        if limit <= num_computed_tokens or num_computed_tokens % n:
            return 0
        cached = self._lookup(list(prompt[:limit]), tenant_of(request, self.default_tenant))
        extra = max(0, min(cached, limit) - num_computed_tokens)  # whole blocks: both ends are
        self._asked[request.request_id] = (num_computed_tokens, extra)
        return extra

    def allocated(self, request: Any, num_external_tokens: int) -> None:
        local, _ = self._asked.pop(request.request_id, (request.num_computed_tokens, 0))
        if num_external_tokens > 0:
            self._pending[request.request_id] = (local, num_external_tokens)

    def step(self, output: Any) -> StepPlan:
        plan = StepPlan()
        for new in output.scheduled_new_reqs:
            if not new.prompt_token_ids:
                continue
            tenant = self._tenants.pop(new.req_id, self.default_tenant)
            tracked = _Tracked(tenant, tuple(new.prompt_token_ids), list(new.block_ids[0]), 0)
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
            self._tracked.pop(req_id, None)
            self._tenants.pop(req_id, None)
        return plan

    def _load(self, plan: StepPlan, req_id: str, tracked: _Tracked) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        local, external = pending
        n = self.block_size
        first, end = local // n, (local + external) // n
        blocks = tuple(tracked.block_ids[first:end])
        plan.loads.append(LoadSpec(req_id, tracked.tenant, tracked.prompt[: end * n], first, blocks))
        tracked.saved = end * n

    def _save(self, plan: StepPlan, req_id: str, tracked: _Tracked, computed: int) -> None:
        n = self.block_size
        end = min(computed, len(tracked.prompt)) // n * n
        end = min(end, len(tracked.block_ids) * n)
        if end > tracked.saved:
            plan.saves.append(
                SaveSpec(req_id, tracked.tenant, tracked.prompt[:end], tuple(tracked.block_ids[: end // n]))
            )
            tracked.saved = end

    def seen(self, request: Any) -> None:
        self._tenants[request.request_id] = tenant_of(request, self.default_tenant)

    def finished(self, request: Any) -> None:
        self._tracked.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        self._tenants.pop(request.request_id, None)
