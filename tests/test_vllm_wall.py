"""The wall around the connector's hooks (``wall.py``, design invariant 17): whatever a
hook meets, vLLM gets an answer, never an exception, and the request it failed for
bypasses the cache for the rest of its life; a load promised to vLLM is made or
reported failed (vLLM recomputes it), never dropped. The vLLM-free halves are driven
here with stand-ins for vLLM's ``Request`` and scheduler output (read by field name);
``tests_vllm/test_wall.py`` checks the connector class itself forwards every hook to
them inside the wall."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.integrations.vllm.groups import Found
from prefixcache.integrations.vllm.scheduler import HOOK_FAILED, SchedulerState, StepPlan
from prefixcache.integrations.vllm.scope import Scope
from prefixcache.integrations.vllm.wall import Wall
from prefixcache.integrations.vllm.worker import LoadSpec, SaveSpec, Tally, VoidLoad
from prefixcache.integrations.vllm.worker_hooks import WorkerHooks
from test_vllm_parts import N, cpu_caches, output, request, scoper, worker


class Boom(RuntimeError):
    pass


def boom(*args: Any, **kwargs: Any) -> Any:
    raise Boom("injected")


class Unreadable:
    """A field of vLLM's that cannot be read (iterating or indexing it raises)."""

    def __iter__(self) -> Iterator[int]:
        raise Boom("unreadable")

    def __getitem__(self, i: Any) -> Any:
        raise Boom("unreadable")

    def __len__(self) -> int:
        raise Boom("unreadable")


def new_req(req_id: str, prompt: Any, blocks: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=(blocks,), num_computed_tokens=computed)


# ---------------------------------------------------------------------------- the wall


def test_the_wall_swallows_counts_and_logs_each_kind_once(caplog: pytest.LogCaptureFixture) -> None:
    wall = Wall()
    caplog.set_level(logging.DEBUG, "prefixcache.vllm")
    for _ in range(3):
        with wall.hold("matched") as held:
            raise Boom("x")
        assert held.failed
    with wall.hold("matched"):
        raise KeyError("y")
    with wall.hold("matched") as held:
        pass
    assert not held.failed
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage().split(";")[0] for r in errors] == [
        "prefixcache: matched raised Boom",
        "prefixcache: matched raised KeyError",
    ]
    assert all(r.exc_info for r in errors)  # with its traceback, the first time
    assert wall.take() == {("matched", "Boom"): 3, ("matched", "KeyError"): 1} and wall.take() == {}
    assert wall.total == 4


def test_the_wall_lets_vllms_shutdown_through() -> None:
    with pytest.raises(KeyboardInterrupt), Wall().hold("step"):
        raise KeyboardInterrupt


# ---------------------------------------------------------------------------- the scheduler's half


def test_a_scope_that_raises_bypasses_the_request_and_is_counted() -> None:
    asked: list[int] = []
    state = SchedulerState(N, lambda tokens, scope: asked.append(1) or Found(8), boom)
    r = request("r", list(range(13)), "acme")
    state.seen(r)
    assert state.matched(r, 0) == 0 and asked == []
    state.allocated(r, 0)
    assert state.step(output([new_req("r", list(range(13)), [1, 2, 3, 4])], scheduled={"r": 13})) == StepPlan()
    assert state.bypassed == {HOOK_FAILED: 1}
    tally = state.take_tally()
    assert tally is not None and tally.hook_failures == {("on_new_request", "Boom"): 1}
    assert tally.bypassed == {HOOK_FAILED: 1} and state.take_tally() is None


def test_a_lookup_that_raises_is_a_miss_and_that_request_is_never_cached() -> None:
    """A token id past 32 bits makes the socket's client raise (``LookupClient``)."""

    def lookup(tokens: list[int], scope: Scope) -> Found:
        if max(tokens) >= 1 << 32:
            raise ValueError("token ids must fit in 32 bits")
        return Found(8)

    state = SchedulerState(N, lookup, scoper())
    bad, good = request("bad", [1 << 40, *range(12)], "s"), request("good", list(range(13)), "s")
    for r in (bad, good):
        state.seen(r)
    assert state.matched(bad, 0) == 0 and state.matched(good, 0) == 8
    state.allocated(bad, 0)
    state.allocated(good, 8)
    plan = state.step(
        output(
            [
                new_req("bad", bad.prompt_token_ids, [1, 2, 3, 4]),
                new_req("good", good.prompt_token_ids, [5, 6, 7, 8], 8),
            ],
            scheduled={"bad": 13, "good": 5},
        )
    )
    assert [s.req_id for s in plan.loads] == ["good"] and {s.req_id for s in plan.saves} == {"good"}
    assert state.bypassed == {HOOK_FAILED: 1}


def test_a_sync_load_promised_then_unplannable_is_reported_failed_not_dropped() -> None:
    """vLLM counts the 8 promised tokens as computed: if no load fills their blocks, they
    must come back as load errors (vLLM recomputes them), never be served unfilled."""
    state = SchedulerState(N, lambda tokens, scope: Found(8), scoper())
    r, other = request("r", list(range(13)), "s"), request("o", list(range(13)), "t")
    for x in (r, other):
        state.seen(x)
        assert state.matched(x, 0) == 8
        state.allocated(x, 8)
    scheduled = output(
        [new_req("r", Unreadable(), [1, 2, 3, 4]), new_req("o", list(range(13)), [5, 6, 7, 8])],
        scheduled={"r": 5, "o": 5},
    )
    plan = state.step(scheduled)
    assert plan.voids == [VoidLoad("r", (1, 2))]
    assert [s.req_id for s in plan.loads] == ["o"]  # the other request's step is its own
    cached = SimpleNamespace(req_ids=["r"], new_block_ids=[([9],)], num_computed_tokens=[13], resumed_req_ids=set())
    assert state.step(output(cached=cached, scheduled={"r": 1})) == StepPlan()  # never tracked again
    assert state.bypassed == {HOOK_FAILED: 1}


def test_an_async_load_whose_blocks_cannot_be_read_fails_as_a_whole() -> None:
    """vLLM parks the request until the worker reports it: a load that cannot be planned
    goes out as a void, which the worker reports as a failed receive."""
    state = SchedulerState(N, lambda tokens, scope: Found(8), scoper(), async_load=True)
    r = request("r", list(range(13)), "s")
    state.seen(r)
    assert state.matched(r, 0) == 8
    blocks = SimpleNamespace(get_block_ids=boom)  # vLLM's KVCacheBlocks
    state.allocated(r, 8, blocks)
    plan = state.step(output())
    assert plan == StepPlan(voids=[VoidLoad("r", whole=True)])
    assert state.step(output([new_req("r", list(range(13)), [1, 2, 3, 4])], scheduled={"r": 13})) == StepPlan()


def test_a_step_that_raises_trusts_none_of_its_books_and_voids_its_promises() -> None:
    state = SchedulerState(N, lambda tokens, scope: Found(8), scoper())
    r, done = request("r", list(range(13)), "s"), request("d", list(range(13)), "s")
    state.seen(done)
    state.allocated(done, 0)
    state.step(output([new_req("d", list(range(13)), [5, 6, 7, 8])], scheduled={"d": 13}))
    state.seen(r)
    assert state.matched(r, 0) == 8
    state.allocated(r, 8)
    broken = SimpleNamespace(
        scheduled_new_reqs=[new_req("r", list(range(13)), [1, 2, 3, 4])], num_scheduled_tokens={}, finished_req_ids=()
    )  # no scheduled_cached_reqs
    plan = state.step(broken)
    assert plan == StepPlan(voids=[VoidLoad("r", (1, 2))])
    cached = SimpleNamespace(
        req_ids=["d", "r"], new_block_ids=[([9],), None], num_computed_tokens=[13, 13], resumed_req_ids=set()
    )
    assert state.step(output(cached=cached, scheduled={"d": 1, "r": 1})) == StepPlan()
    assert state.bypassed == {HOOK_FAILED: 2}


def test_a_cut_that_raises_bypasses_that_request_and_cuts_the_others() -> None:
    state = SchedulerState(N, lambda tokens, scope: Found(8), scoper())
    for req_id, blocks in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        r = request(req_id, list(range(13)), "s")
        r.prefill_stats = SimpleNamespace(
            num_prompt_tokens=13, num_local_cached_tokens=0, num_external_cached_tokens=8, set=boom
        )
        state.seen(r)
        state.matched(r, 0)
        state.allocated(r, 8)
        state.step(output([new_req(req_id, list(range(13)), blocks)], scheduled={req_id: 5}))
    state.load_failed({2, 6})
    assert state.bypassed == {HOOK_FAILED: 2}
    tally = state.take_tally()
    assert tally is not None and tally.hook_failures == {("update_connector_output", "Boom"): 2}


# A simplified vLLM driving the scheduler's half: requests arrive, are offered, allocated,
# scheduled (sync loads: in their first step) and finish, with a fault injected in any
# one of the places vLLM's objects are read. Whatever fails, every promised load is
# answered exactly once (a LoadSpec or a VoidLoad), and a request planned nothing after
# its hook failed.
FAULTS = ("none", "scope", "lookup", "blocks", "prompt", "step")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(FAULTS), min_size=1, max_size=6), st.booleans(), st.integers(0, 3))
def test_whatever_fails_every_promised_load_is_answered_once(faults: list[str], async_load: bool, hit: int) -> None:
    def scope_or_fail(r: Any) -> Any:
        return boom() if faults[int(r.request_id)] == "scope" else scoper()(r)

    def lookup(tokens: list[int], scope: Scope) -> Found:
        return boom() if tokens[0] == 1000 else Found(hit * N)

    state = SchedulerState(N, lookup, scope_or_fail, async_load=async_load)
    promised: dict[str, int] = {}
    plans: list[StepPlan] = []
    for i, fault in enumerate(faults):
        req_id, prompt, ids = str(i), [1000 if fault == "lookup" else i, *range(12)], [10 * i + b for b in range(4)]
        r = request(req_id, prompt, f"t{i % 2}")
        state.seen(r)
        promised[req_id] = state.matched(r, 0)
        state.allocated(
            r, promised[req_id], SimpleNamespace(get_block_ids=boom if fault == "blocks" else lambda ids=ids: (ids,))
        )
        step = output([new_req(req_id, Unreadable() if fault == "prompt" else prompt, ids)], scheduled={req_id: 1})
        if fault == "step":
            del step.scheduled_cached_reqs
        plans.append(state.step(step))
    plans.append(state.step(output()))
    answered = [s.req_id for p in plans for s in p.loads] + [v.req_id for p in plans for v in p.voids]
    assert sorted(answered) == sorted(req_id for req_id, n in promised.items() if n > 0)
    # NOTE: vLLM's blocks are read only for a promised async load: with nothing promised
    # ("blocks" beside a miss) there is nothing to fail, and nothing counted
    failing = {"scope", "lookup", "prompt", "step"} | ({"blocks"} if async_load else set())
    for i, fault in enumerate(faults):
        if fault in failing and not (fault == "blocks" and promised[str(i)] == 0):
            assert not any(s.req_id == str(i) for p in plans for s in p.saves), (i, fault)
            assert state.bypassed[HOOK_FAILED] > 0


# ---------------------------------------------------------------------------- the worker's half


def test_voided_loads_come_back_as_errors_or_failed_receives(tmp_path: Path) -> None:
    hooks = WorkerHooks(worker(tmp_path, cpu_caches(1)), async_load=True)
    hooks.start_loads([], [VoidLoad("sync", (3, 4)), VoidLoad("async", whole=True)])
    assert hooks.transfers() == ({"async"}, {"async"}) and hooks.load_errors() == {3, 4}
    assert hooks.transfers() == (set(), set()) and hooks.load_errors() == set()
    hooks.close(5)


def test_a_load_that_cannot_start_reports_its_request_done_and_its_blocks_failed(tmp_path: Path) -> None:
    """A load that arrives after the I/O threads stopped: ``submit`` raises."""
    hooks = WorkerHooks(worker(tmp_path, cpu_caches(2)), async_load=True)
    hooks.start_loads([LoadSpec("a", Scope("t"), tuple(range(2 * N)), 0, ((5, 6),))])
    while hooks._loading:
        hooks.transfers()
    hooks.load_errors()
    hooks.close(5)
    hooks.start_loads([LoadSpec("b", Scope("t"), tuple(range(2 * N)), 0, ((7, 8),))])
    assert hooks.transfers() == ({"b"}, set()) and hooks.load_errors() == {7, 8}
    tally = hooks.take_tally()
    assert tally is not None and tally.hook_failures == {("start_load_kv", "RuntimeError"): 1}


def test_a_commit_that_raises_still_reports_the_request_and_every_block(tmp_path: Path) -> None:
    hooks = WorkerHooks(worker(tmp_path, cpu_caches(3)), async_load=True)
    hooks.start_loads([LoadSpec("a", None, (1, 2, 3, 4), 0, ((5,),))])  # type: ignore[arg-type]
    done: set[str] = set()
    while not done:
        done, _ = hooks.transfers()
    assert done == {"a"} and hooks.load_errors() == {5}
    tally = hooks.take_tally()
    assert tally is not None and tally.hook_failures == {("get_finished", "AttributeError"): 1}
    hooks.close(5)


def test_a_sync_load_and_a_save_that_raise_cost_their_own_blocks_only(tmp_path: Path) -> None:
    w = worker(tmp_path, cpu_caches(4))
    hooks = WorkerHooks(w, async_load=False)
    tokens = tuple(range(2 * N))
    hooks.save([SaveSpec("x", None, tokens, ((1, 2),)), SaveSpec("y", Scope("t"), tokens, ((1, 2),))])  # type: ignore[arg-type]
    hooks.start_loads([LoadSpec("a", None, tokens, 0, ((5, 6),)), LoadSpec("b", Scope("t"), tokens, 0, ((7, 8),))])  # type: ignore[arg-type]
    assert hooks.load_errors() == {5, 6}  # b loaded what y saved
    tally = hooks.take_tally()
    assert tally is not None and tally.errors == {"save": 1, "load": 1} and tally.saved_tokens == {"t": 2 * N}
    hooks.close(5)


def test_a_tally_carries_hook_failures_and_bypasses_between_processes() -> None:
    import json

    t = Tally(hook_failures={("start_load_kv", "Boom"): 2}, bypassed={HOOK_FAILED: 1})  # type: ignore[arg-type]
    back = Tally.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.merge(back).hook_failures == {("start_load_kv", "Boom"): 4} and back.bypassed == {HOOK_FAILED: 1}
    assert not back.is_empty() and Tally().is_empty()
