"""A trace held in memory (sim/held.py) yields exactly the requests its file does, pass
after pass; one it cannot hold is streamed; the planner and the curves answer the same
either way."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.config import CacheConfig
from prefixcache.sim.costmodel import CostModel, get_gpu, get_model
from prefixcache.sim.curves import curve
from prefixcache.sim.held import HeldTrace, hold
from prefixcache.sim.plan import PlanInputs, make_plan
from prefixcache.sim.plan_inputs import kv_layout
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.summary import TraceSource
from prefixcache.sim.tracefile import TraceError
from prefixcache.sim.traces import Request, read_trace
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import write_jsonl
from support import CONVERSATION, source_of

ints = st.none() | st.lists(st.integers(0, 2**64 - 1), max_size=6).map(tuple)
names = st.sampled_from(["", "acme", "globex", "tenant-03/chat-07", "é"])
requests = st.builds(
    Request,
    timestamp=st.floats(-1e12, 1e12, allow_nan=False),
    tenant=names,
    model=names,
    endpoint=names,
    input_length=st.integers(0, 2**40),
    output_length=st.integers(0, 2**40),
    tokens=ints,
    hash_ids=ints,
    block_size=st.none() | st.integers(1, 4096),
    output_tokens=ints,
    session=st.none() | names,
)


def of(items: list[Request]) -> TraceSource:
    def source() -> Iterable[Request]:
        return iter(items)

    return source


@settings(max_examples=200, deadline=None)
@given(st.lists(requests, max_size=8))
def test_held_requests_are_the_requests_on_every_pass(items: list[Request]) -> None:
    held = hold(of(items))
    assert isinstance(held, HeldTrace) and len(held) == len(items)
    assert list(held()) == items
    assert list(held()) == items  # a second pass: nothing consumed


@pytest.mark.parametrize("emit", ["hash_ids", "tokens"])
def test_a_trace_file_held_is_the_file(tmp_path: Path, emit: str) -> None:
    path = tmp_path / "w.jsonl"
    write_jsonl(WorkloadSpec(requests=300, tenants=3, seed=5, emit=emit, max_turns=4), path)
    for trace in (path, CONVERSATION):
        streamed = source_of(trace)
        held = hold(streamed)
        assert isinstance(held, HeldTrace)
        assert list(held()) == list(streamed())


def test_a_trace_over_the_budget_is_streamed_and_its_file_closed(tmp_path: Path) -> None:
    streamed = source_of(CONVERSATION)
    whole = hold(streamed)
    assert isinstance(whole, HeldTrace)
    opened: list[Iterator[Request]] = []

    def watched() -> Iterable[Request]:
        opened.append(read_trace(CONVERSATION))
        return opened[-1]

    assert hold(watched, budget=whole.nbytes - 1) is watched
    with pytest.raises(StopIteration):
        next(opened[0])  # left early, and closed
    assert hold(watched, budget=whole.nbytes) is not watched
    assert hold(streamed, budget=0) is streamed
    assert hold(whole) is whole


def test_ids_beyond_64_bits_are_streamed() -> None:
    items = [Request(0.0, "a", "m", "", 32, 0, hash_ids=(1, 2**64), block_size=16)]
    source = of(items)
    assert hold(source) is source


def test_a_malformed_line_is_named_when_held(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(good | {"hash_ids": [-1]}) + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2.*hash_ids"):
        hold(source_of(path))


def test_the_plan_and_the_curve_are_the_same_held_or_streamed(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    write_jsonl(WorkloadSpec(requests=800, tenants=4, seed=2, duration_s=900.0), path)
    model = get_model("llama-3-8b")
    inputs = PlanInputs(0.4, CostModel(model, get_gpu("h100")), kv_layout(model))
    held = make_plan(source_of(path), inputs, jobs=2)
    assert len(held.curve) > 3
    assert make_plan(source_of(path), inputs, jobs=2, hold_bytes=0) == held
    config = ReplayConfig(CacheConfig(policy="sieve", capacity_tokens=1 << 20))
    got = curve(source_of(path), config, warmup=0.5, rate=0.5, jobs=2)
    streamed = curve(source_of(path), config, warmup=0.5, rate=0.5, jobs=2, hold_bytes=0)
    assert replace(streamed, seconds=0.0) == replace(got, seconds=0.0)
