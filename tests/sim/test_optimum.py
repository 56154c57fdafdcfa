"""The compiled offline optimum (sim/native/_optimum.c) against its Python reference.

``optima(..., engine="native")`` must give, at every capacity, exactly the hit tokens
and block hits of ``belady`` (the reference, sim/optimum.py). Checked here: a property
test on random multi-tenant traces (pre-hashed with ids of every size, and token
traces), at capacities from 0 to unlimited, with warm-up, across chunk boundaries;
both Mooncake traces at several capacities; the passes shared by a capacity sweep;
the fallback without the extension; bad input.

NOTE: without the built extension (``pip install -e .`` compiles it) the comparisons
are skipped, so CI must build it or they never run.

Tests that take seconds are marked ``slow``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixcache.config import CacheConfig
from prefixcache.sim import optimum
from prefixcache.sim.optimum import Optimum, OptimumSweep, belady, optima
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig, cache_capacity
from prefixcache.sim.traces import Request, read_trace
from support import CONVERSATION, SYNTHETIC

native = pytest.mark.skipif(not optimum.native_available(), reason="the compiled optimum is not built")
slow = pytest.mark.slow
INF = math.inf
ISOLATIONS = ("shared", "namespace", "partitioned")


def hashed(ids: Sequence[int], input_length: int, tenant: str = "a", model: str = "m", block_size: int = 4) -> Request:
    return Request(0.0, tenant, model, "", input_length, 0, hash_ids=tuple(ids), block_size=block_size)


def sim_config(capacity: float, isolation: str) -> ReplayConfig:
    cache = CacheConfig(policy="lru", capacity_tokens=cache_capacity(capacity), block_size=4, isolation=isolation)
    return ReplayConfig(cache)


def reference(
    requests: Sequence[Request], capacities: Iterable[float], block_size: int, isolation: str, warmup: int
) -> list[Optimum]:
    return [belady(lambda: requests, c, block_size, isolation, warmup) for c in capacities]


# ---------------------------------------------------------------------------- random traces

# ids: mostly a small pool (reuse), sometimes one of every width the engine keys apart
# (64-bit, 128-bit, 192-bit, beyond and negative: the reference takes any int)
WIDE_IDS = (2**63, 2**64 + 5, 2**128 + 2**64 + 5, 2**130 - 1, 2**191, 2**192, 2**200 + 1, -1, -3)
IDS = st.one_of(st.integers(0, 12), st.integers(0, 12), st.sampled_from(WIDE_IDS))
CAPACITY = st.one_of(st.sampled_from([0, 0.5, 1, 2, 3, 5, 8, 13, 40, INF]), st.floats(0, 30, allow_nan=False))


@st.composite
def hashed_traces(draw: st.DrawFn) -> list[Request]:
    n = draw(st.integers(0, 25))
    block_size = draw(st.sampled_from([1, 4, 16]))
    out = []
    for _ in range(n):
        ids = draw(st.lists(IDS, max_size=9))
        length = max(0, len(ids) * block_size - draw(st.integers(0, block_size - 1)))
        who = {"tenant": draw(st.sampled_from("abc")), "model": draw(st.sampled_from(("m1", "m2")))}
        out.append(hashed(ids, length, block_size=block_size, **who))
    return out


@st.composite
def token_traces(draw: st.DrawFn) -> list[Request]:
    out = []
    for _ in range(draw(st.integers(0, 15))):
        tokens = tuple(draw(st.lists(st.integers(0, 3), max_size=14)))
        who = {"tenant": draw(st.sampled_from("ab")), "model": "m"}
        out.append(Request(0.0, **who, endpoint="", input_length=len(tokens), output_length=0, tokens=tokens))
    return out


@native
@settings(max_examples=300, deadline=None)
@given(
    requests=hashed_traces(),
    capacities=st.lists(CAPACITY, min_size=1, max_size=4),
    isolation=st.sampled_from(ISOLATIONS),
    warmup=st.integers(0, 8),
    chunk=st.sampled_from([1, 2, 3, 7, None]),
)
@example(requests=[hashed([1, 2], 8), hashed([1, 2], 8)], capacities=[0, 1, INF], isolation="shared", warmup=0,
         chunk=1)  # fmt: skip
def test_native_equals_the_reference_on_random_hashed_traces(
    requests: list[Request], capacities: list[float], isolation: str, warmup: int, chunk: int | None
) -> None:
    block_size = requests[0].block_size if requests else 4
    assert block_size is not None
    got = optima(lambda: requests, capacities, block_size, isolation, warmup, engine="native", chunk=chunk)
    assert got == reference(requests, capacities, block_size, isolation, warmup)


@native
@settings(max_examples=100, deadline=None)
@given(
    requests=token_traces(),
    capacities=st.lists(CAPACITY, min_size=1, max_size=3),
    block_size=st.sampled_from([1, 2, 3, 64]),  # NOTE: at 64 the tail ids pass 2**128
    isolation=st.sampled_from(ISOLATIONS),
    warmup=st.integers(0, 4),
)
def test_native_equals_the_reference_on_random_token_traces(
    requests: list[Request], capacities: list[float], block_size: int, isolation: str, warmup: int
) -> None:
    got = optima(lambda: requests, capacities, block_size, isolation, warmup, engine="native", chunk=2)
    assert got == reference(requests, capacities, block_size, isolation, warmup)


@native
def test_many_distinct_ids_of_every_width() -> None:
    """Enough distinct ids, of every width, to grow the id map many times (a tiny chunk
    starts it small), in a sweep that crosses many chunk boundaries."""
    rng = random.Random(5)
    widths = (0, 2**64, 2**130, 2**200, -(2**70))
    requests = [
        hashed([w + rng.randrange(400) for w in rng.choices(widths, k=rng.randrange(8))], 16, rng.choice("ab"))
        for _ in range(2_000)
    ]
    capacities = [0, 10, 100, 300, INF]
    got = optima(lambda: requests, capacities, 4, "namespace", 500, engine="native", chunk=3)
    assert got == reference(requests, capacities, 4, "namespace", 500)


# ---------------------------------------------------------------------------- known answers


@pytest.mark.parametrize("engine", ["native", "python"])
def test_known_answers(engine: str) -> None:
    if engine == "native" and not optimum.native_available():
        pytest.skip("the compiled optimum is not built")
    # a b c a b c, one block of 4 tokens each, requests of 3 tokens (a partial block)
    requests = [hashed([i], 3) for i in (1, 2, 3, 1, 2, 3)]
    got = optima(lambda: requests, [0, 1, 2, INF], 4, "shared", 0, engine=engine)
    # cap 1: keep a (next used at 3) and bypass b and c: 1 hit; cap 2: a and b; unlimited: 3
    assert got == [Optimum(0, 0), Optimum(3, 1), Optimum(6, 2), Optimum(9, 3)]
    # warm-up: the first four requests are not counted (a's hit is the 4th)
    assert optima(lambda: requests, [1, INF], 4, "shared", 4, engine=engine) == [Optimum(0, 0), Optimum(6, 2)]


@native
def test_a_prefix_hit_stops_at_the_first_miss() -> None:
    requests = [hashed([1, 2, 3], 12), hashed([1, 9, 3], 12)]  # 3 hits but is not on the prefix
    (got,) = optima(lambda: requests, [INF], 4, "shared", 1, engine="native")
    assert got == Optimum(4, 2) == belady(lambda: requests, INF, 4, "shared", 1)


@native
def test_tenants_share_blocks_only_in_shared_mode() -> None:
    requests = [hashed([1], 4, tenant="a"), hashed([1], 4, tenant="b"), hashed([1], 4, tenant="b", model="m2")]
    found = [optima(lambda: requests, [INF], 4, iso, 0, engine="native")[0].block_hits for iso in ISOLATIONS]
    assert found == [1, 0, 0]


def test_empty_trace() -> None:
    assert optima(list, [0, 3, INF], 16, "shared", 0) == [Optimum(0, 0)] * 3
    assert optima(list, [], 16, "shared", 0) == []


# ---------------------------------------------------------------------------- the Mooncake traces


@native
@slow
@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC], ids=lambda p: p.stem)
@pytest.mark.parametrize(("isolation", "warmup"), [("shared", 0.0), ("namespace", 0.5)])
def test_native_equals_the_reference_on_the_mooncake_traces(path: Path, isolation: str, warmup: float) -> None:
    requests = list(read_trace(path, "mooncake"))
    skip = int(len(requests) * warmup)
    capacities = [0, 1, 100, 2_000, 10_000_000 / 512, INF]
    got = optima(lambda: requests, capacities, 512, isolation, skip, engine="native")
    assert got == reference(requests, capacities, 512, isolation, skip)
    assert got[0] == Optimum(0, 0) and got[1].hit_tokens > 0
    assert [o.hit_tokens for o in got] == sorted(o.hit_tokens for o in got)


# ---------------------------------------------------------------------------- shared passes


def counting(requests: list[Request]) -> tuple[list[int], Any]:
    reads = [0]

    def source() -> list[Request]:
        reads[0] += 1
        return requests

    return reads, source


@native
def test_a_capacity_sweep_reads_the_trace_once() -> None:
    requests = [hashed([i % 7, i % 5], 8) for i in range(40)]
    reads, source = counting(requests)
    capacities = [0, 1, 2, 3, 4, INF]
    assert optima(source, capacities, 4, "shared", 3, engine="native") == reference(
        requests, capacities, 4, "shared", 3
    )
    assert reads == [1]


@native
def test_a_sweep_is_fed_once_for_every_block_size_and_isolation() -> None:
    requests = [hashed([i % 7, i % 5], 8, tenant="ab"[i % 2]) for i in range(40)]
    keys = [(c, 4, iso) for iso in ("shared", "namespace") for c in (4.0, 8.0, INF)] + [(8.0, 4, "shared")]
    sweep = OptimumSweep(keys, 3)
    try:
        assert sweep.feed is not None
        for req in requests:
            sweep.feed(req)
        found = sweep.solve(lambda: pytest.fail("the compiled engine needs no read of its own"))
    finally:
        sweep.close()
    assert set(found) == set(keys)
    for capacity, block_size, isolation in keys:
        assert found[(capacity, block_size, isolation)] == belady(
            lambda: requests, capacity / block_size, block_size, isolation, 3
        )


def test_a_sweep_on_the_reference_reads_the_trace_itself() -> None:
    requests = [hashed([i % 3], 4) for i in range(10)]
    reads, source = counting(requests)
    sweep = OptimumSweep([(4.0, 4, "shared"), (INF, 4, "shared")], 0, engine="python")
    assert sweep.feed is None
    # 0 1 2 0 1 2 ...: one block keeps 0 (3 hits), unlimited hits every repeat (7)
    assert sweep.solve(source) == {(4.0, 4, "shared"): Optimum(12, 3), (INF, 4, "shared"): Optimum(28, 7)}
    assert reads == [2]
    assert OptimumSweep([], 0).feed is None


@native
def test_the_replay_builds_the_optimum_in_its_first_pass() -> None:
    requests = [hashed([i % 7, i % 5], 8, tenant="ab"[i % 2], block_size=4) for i in range(40)]
    reads, source = counting(requests)
    configs = [sim_config(capacity=c, isolation=iso) for c in (16, 32, INF) for iso in ("shared", "namespace")]
    results = replay(source, configs, warmup=0.25)
    assert reads == [1 + 1]  # the summary, then one pass for the kernel's runs and the optimum
    for r in results:
        expected = belady(lambda: requests, r.config.capacity_tokens / 4, 4, r.config.isolation, 10)
        assert r.optimal_hit_tokens == expected.hit_tokens, r.config.label


@native
def test_solve_again_reuses_the_sequence(tmp_path: Path) -> None:
    seq = optimum._optimum.Sequence(tmp_path, 3)  # type: ignore[union-attr]
    try:
        for ids in ([1, 2], [1, 2, 3], [], [3, 1]):
            seq.add(0, ids, 4 * len(ids))
        assert (seq.requests, seq.accesses, seq.blocks) == (4, 7, 3)
        first = seq.solve([1, None], 4, 0)
        assert seq.solve([None, 1, 0], 4, 0) == [first[1], first[0], (0, 0)]
        with pytest.raises(RuntimeError, match="add\\(\\) after solve\\(\\)"):
            seq.add(0, [1], 4)
    finally:
        seq.close()
    assert seq.closed
    with pytest.raises(ValueError, match="closed"):
        seq.solve([1], 4, 0)
    seq.close()  # twice is fine


@native
def test_temporary_files_leave_nothing_behind(tmp_path: Path) -> None:
    seq = optimum._optimum.Sequence(tmp_path)  # type: ignore[union-attr]
    seq.add(0, [1, 2, 3], 12)
    assert list(tmp_path.iterdir()) == []  # unlinked from the start
    assert seq.solve([1], 4, 0) == [(0, 0)]
    seq.close()


def test_without_the_extension_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimum, "_optimum", None)
    requests = [hashed([1], 4), hashed([1], 4)]
    assert not optimum.native_available()
    assert optima(lambda: requests, [1, INF], 4, "shared", 0) == [Optimum(4, 1)] * 2
    with pytest.raises(ValueError, match="not built"):
        optima(lambda: requests, [1], 4, "shared", 0, engine="native")


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("capacity", "block_size", "isolation", "warmup", "error", "message"),
    [
        (-1, 16, "shared", 0, ValueError, "capacity must be >= 0 blocks"),
        (math.nan, 16, "shared", 0, ValueError, "capacity must be >= 0 blocks"),
        ("10", 16, "shared", 0, TypeError, "capacity must be a number of blocks"),
        (True, 16, "shared", 0, TypeError, "capacity must be a number of blocks"),
        (10, 0, "shared", 0, ValueError, "block_size must be an integer >= 1"),
        (10, 16.0, "shared", 0, ValueError, "block_size must be an integer >= 1"),
        (10, 16, "tenant", 0, ValueError, "unknown isolation 'tenant'; valid: shared, namespace, partitioned"),
        (10, 16, "shared", -1, ValueError, "warmup must be a number of requests >= 0"),
    ],
)
@pytest.mark.parametrize("engine", ["auto", "python"])
def test_bad_arguments_are_clear_errors(
    capacity: Any, block_size: Any, isolation: str, warmup: int, error: type[Exception], message: str, engine: str
) -> None:
    with pytest.raises(error, match=message):
        optima(list, [capacity], block_size, isolation, warmup, engine=engine)
    with pytest.raises(error, match=message):
        belady(list, capacity, block_size, isolation, warmup)


def test_arguments_are_checked_without_capacities_too() -> None:
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        optima(list, [], 0, "shared", 0)


def test_unknown_engine_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown optimum engine 'c'; valid: auto, native, python"):
        optima(list, [1], 16, "shared", 0, engine="c")


@native
@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda s: s.add(0, [1, "2"], 8), TypeError, r"ids\[1\] must be an int, got str"),
        (lambda s: s.add(0, [1, 2.0], 8), TypeError, r"ids\[1\] must be an int, got float"),
        (lambda s: s.add(0, 5, 8), TypeError, "ids must be a sequence of ints"),
        (lambda s: s.add(-1, [1], 4), ValueError, r"context must be in \[0, 2\*\*30\)"),
        (lambda s: s.add(2**30, [1], 4), ValueError, r"context must be in \[0, 2\*\*30\)"),
        (lambda s: s.add(0, [1], -4), ValueError, "input_length must be >= 0"),
        (lambda s: s.add(0, [1]), TypeError, "takes 3 arguments"),
        (lambda s: s.solve([-1], 4, 0), ValueError, r"capacities\[0\] must be >= 0 blocks"),
        (lambda s: s.solve([-(2**70)], 4, 0), ValueError, r"capacities\[0\] must be >= 0 blocks"),
        (lambda s: s.solve([1.5], 4, 0), TypeError, r"capacities\[0\] must be an int or None, got float"),
        (lambda s: s.solve(3, 4, 0), TypeError, "capacities must be a sequence"),
        (lambda s: s.solve([1], 0, 0), ValueError, "block_size must be >= 1"),
        (lambda s: s.solve([1], 4, -1), ValueError, "warmup must be >= 0 requests"),
    ],
)
def test_native_bad_input_is_a_clear_error_that_changes_nothing(
    tmp_path: Path, call: Any, error: type[Exception], message: str
) -> None:
    seq = optimum._optimum.Sequence(tmp_path, 2)  # type: ignore[union-attr]
    try:
        seq.add(0, [1, 2, 3], 12)
        seq.add(0, [1, 2, 3], 12)
        with pytest.raises(error, match=message):
            call(seq)
        assert (seq.requests, seq.accesses, seq.blocks) == (2, 6, 3)  # a refused request added nothing
        assert seq.solve([None], 4, 0) == [(12, 3)]
    finally:
        seq.close()


@native
def test_native_bad_construction(tmp_path: Path) -> None:
    Sequence = optimum._optimum.Sequence  # type: ignore[union-attr]
    with pytest.raises(FileNotFoundError):
        Sequence(tmp_path / "missing")
    with pytest.raises(ValueError, match="chunk must be in"):
        Sequence(tmp_path, 0)
    with pytest.raises(TypeError):
        Sequence(3.5)
