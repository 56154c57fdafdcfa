"""The replay: exact answers on generated traces, the Belady optimum as an upper bound,
calibration against the published Mooncake figures, flat mode against libCacheSim, and
the bookkeeping (configurations, warm-up, timelines, tenants, errors) around them.

Measured here (tree mode, whole trace, no warm-up): Mooncake synthetic LRU @ 1e7 tokens
0.5955, FIFO @ 1e7 0.5879, ceiling 0.6512; conversation ceiling 0.3736. The traces'
README has naive block-level LRU .577 / FIFO .535 for synthetic @ 1e7; likely because the tree
evicts leaves first and so keeps prompts' heads, the tree lands a little higher (not verified).

Tests that take seconds are marked ``slow`` (register the marker in pyproject.toml).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixcache.config import CacheConfig, PublishConfig
from prefixcache.sim.accounting import TIMELINE_WINDOWS
from prefixcache.sim.peers import libcachesim_run
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig, ReplayResult, cache_capacity
from prefixcache.sim.summary import summarize
from prefixcache.sim.tracefile import TraceError
from prefixcache.sim.traces import Request, read_trace
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import repeated_prefix, write_jsonl
from support import CONVERSATION, SYNTHETIC, tok

POLICIES = ("lru", "fifo", "s3fifo", "sieve", "lfuda")
INF = math.inf

slow = pytest.mark.slow


# ---------------------------------------------------------------------------- helpers


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prefix_trace(
    tmp_path: Path, prefix: int, suffix: int, n: int, tenants: int = 1, block_size: int = 16
) -> list[Request]:
    """``repeated_prefix`` written as our JSONL and read back through the reader."""
    path = write_records(
        tmp_path / f"rp-{prefix}-{suffix}-{n}-{tenants}-{block_size}.jsonl",
        repeated_prefix(prefix, suffix, n, tenants=tenants, block_size=block_size),
    )
    return list(read_trace(path))


def sim_config(
    policy: str = "lru",
    capacity_tokens: float = INF,
    block_size: int = 16,
    isolation: str = "shared",
    *,
    mode: str = "tree",
    **cache: Any,
) -> ReplayConfig:
    """A replay configuration; unless told otherwise, the command line's defaults (lru,
    unlimited, blocks of 16, shared). ``cache`` holds further ``CacheConfig`` fields."""
    config = CacheConfig(
        policy=policy,
        capacity_tokens=cache_capacity(capacity_tokens),
        block_size=block_size,
        isolation=isolation,
        **cache,
    )
    return ReplayConfig(config, mode)


def run(requests: Sequence[Request], *configs: ReplayConfig, **kwargs: Any) -> list[ReplayResult]:
    return replay(lambda: requests, list(configs), **kwargs)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> list[Request]:
    """A small multi-tenant workload (chat, RAG, agents, scans), pre-hashed at 64 tokens."""
    spec = WorkloadSpec(
        requests=1500,
        tenants=4,
        seed=7,
        duration_s=600.0,
        document_tokens=(500, 2000),
        tool_prompt_tokens=3000,
        block_size=64,
    )
    path = tmp_path_factory.mktemp("generated") / "generated.jsonl"
    assert write_jsonl(spec, path) == 1500
    return list(read_trace(path))


# ---------------------------------------------------------------------------- known answers


@pytest.mark.parametrize("mode", ["tree", "flat"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("prefix", [300, 256])
def test_repeated_prefix_shared_and_namespace_exact(tmp_path: Path, mode: str, block_size: int, prefix: int) -> None:
    n, tenants, suffix = 14, 3, 40
    requests = prefix_trace(tmp_path, prefix, suffix, n, tenants, block_size)
    length = prefix + suffix
    hit = prefix // block_size * block_size
    configs = [sim_config(p, INF, block_size, iso, mode=mode) for iso in ("shared", "namespace") for p in POLICIES]
    results = run(requests, *configs)
    assert [r.config for r in results] == configs
    per_tenant = [len(range(t, n, tenants)) for t in range(tenants)]
    for r in results:
        first_misses = 1 if r.config.isolation == "shared" else tenants
        assert r.requests == n
        assert r.lookup_tokens == n * length
        assert r.hit_tokens == (n - first_misses) * hit
        assert r.hit_requests == n - first_misses
        assert r.request_hit_rate == (n - first_misses) / n
        assert r.token_hit_rate == (n - first_misses) * hit / (n * length)
        assert r.optimal_hit_tokens == r.hit_tokens  # unlimited: the optimum is the ceiling
        assert r.evictions == 0
        for t, name in enumerate(sorted(r.tenants)):
            misses = 1 if (r.config.isolation != "shared" or t == 0) else 0
            assert r.tenants[name].requests == per_tenant[t]
            assert r.tenants[name].hit_tokens == (per_tenant[t] - misses) * hit
    # every policy is the same at unlimited capacity
    for iso in ("shared", "namespace"):
        assert len({(r.hit_tokens, r.hit_requests) for r in results if r.config.isolation == iso}) == 1


@pytest.mark.parametrize("block_size", [16, 64])
def test_partitioned_at_unlimited_capacity_is_namespace(tmp_path: Path, block_size: int) -> None:
    requests = prefix_trace(tmp_path, 300, 40, 12, 4, block_size)
    ns, part = run(requests, *(sim_config("lru", INF, block_size, iso) for iso in ("namespace", "partitioned")))
    assert part.hit_tokens == ns.hit_tokens == (12 - 4) * (300 // block_size * block_size)
    assert part.hit_requests == ns.hit_requests == 8


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("prefix", [300, 100, 10])
def test_partial_blocks_hit_the_exact_prefix(tmp_path: Path, block_size: int, prefix: int) -> None:
    n = 9
    requests = prefix_trace(tmp_path, prefix, 50, n, 1, block_size)
    results = run(requests, *(sim_config(p, INF, block_size, partial_blocks=True) for p in POLICIES), optimal=False)
    for r in results:
        assert r.hit_tokens == (n - 1) * prefix
        assert r.hit_requests == n - 1


def test_capacity_zero_hits_nothing(tmp_path: Path) -> None:
    requests = prefix_trace(tmp_path, 256, 64, 10)
    configs = [sim_config(p, 0, 16, mode=m) for m in ("tree", "flat") for p in POLICIES]
    for r in run(requests, *configs):
        assert (r.hit_tokens, r.hit_requests, r.optimal_hit_tokens) == (0, 0, 0), r.config.label


@pytest.mark.parametrize("capacity", [16, 100, 255])
def test_capacity_smaller_than_one_prompt(tmp_path: Path, capacity: int) -> None:
    """Flat LRU/FIFO cycle the prompt's blocks through a cache too small for it, so its
    first block is always gone: no prefix hit. The tree stops storing a prompt when only
    the path being stored is left to evict, so it keeps the prompt's head and every later
    request hits exactly the blocks that fit."""
    n, bs = 10, 16
    requests = prefix_trace(tmp_path, 256, 64, n, 1, bs)  # 320-token prompts, 256 shared
    flat = run(requests, *(sim_config(p, capacity, bs, mode="flat") for p in ("lru", "fifo")), optimal=False)
    assert [r.hit_tokens for r in flat] == [0, 0]
    tree = run(requests, *(sim_config(p, capacity, bs) for p in POLICIES))
    for r in tree:
        assert r.hit_tokens == (n - 1) * (capacity // bs * bs), r.config.label
        assert r.optimal_hit_tokens == r.hit_tokens


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_publication_shares_the_prefix_after_k_tenants(tmp_path: Path, isolation: str, k: int) -> None:
    """Four tenants send the same 300-token prefix in turn: once k distinct tenants have
    sent it, it is published, so only the first min(k, 4) requests miss."""
    n, tenants, hit = 12, 4, 300 // 16 * 16
    requests = prefix_trace(tmp_path, 300, 40, n, tenants, 16)
    configs = [
        sim_config("lru", INF, 16, "shared"),
        sim_config("lru", INF, 16, isolation),
        sim_config("lru", INF, 16, isolation, publish=PublishConfig(k)),
        sim_config("lru", INF, 16, isolation, publish=PublishConfig(k, 512)),  # prefix too short
    ]
    shared, isolated, published, too_short = run(requests, *configs)
    misses = min(k, tenants)
    assert published.hit_requests == n - misses
    assert published.hit_tokens == (n - misses) * hit
    assert isolated.hit_tokens <= published.hit_tokens <= shared.hit_tokens
    assert too_short.hit_tokens == isolated.hit_tokens == (n - tenants) * hit
    # publication can share no more than shared mode: its optimum is shared mode's
    assert published.optimal_hit_tokens == shared.optimal_hit_tokens == shared.hit_tokens
    assert isolated.optimal_hit_tokens == isolated.hit_tokens


@pytest.mark.parametrize("warmup", [0.0, 0.25, 0.35, 0.5, 0.9])
def test_warmup_counts_only_the_requests_after_it(tmp_path: Path, warmup: float) -> None:
    n, tenants, prefix, suffix, bs = 20, 4, 200, 30, 16
    requests = prefix_trace(tmp_path, prefix, suffix, n, tenants, bs)
    skip = int(n * warmup)
    counted = n - skip
    hit = prefix // bs * bs
    (r,) = run(requests, sim_config("lru", INF, bs, "namespace"), warmup=warmup)
    # Under namespace isolation requests 0..3 (one per tenant) are the only misses.
    hits = sum(1 for i in range(skip, n) if i >= tenants)
    assert r.warmup_requests == skip
    assert r.requests == counted
    assert r.lookup_tokens == counted * (prefix + suffix)
    assert r.hit_tokens == hits * hit
    assert r.hit_requests == hits
    assert r.request_hit_rate == hits / counted
    assert r.token_hit_rate == hits * hit / (counted * (prefix + suffix))
    assert r.optimal_hit_tokens == r.hit_tokens
    assert sum(t.requests for t in r.tenants.values()) == counted
    assert sum(p.requests for p in r.timeline) == counted


@pytest.mark.parametrize("warmup", [1.0, -0.1, 1.5])
def test_warmup_outside_unit_interval_is_an_error(tmp_path: Path, warmup: float) -> None:
    requests = prefix_trace(tmp_path, 32, 8, 3)
    with pytest.raises(ValueError, match="warm-up"):
        run(requests, sim_config(), warmup=warmup)


def chat_turns() -> list[Request]:
    """Turn 2 sends turn 1's prompt and answer back, then new user tokens."""
    p1, o1 = list(range(1000, 1100)), list(range(2000, 2040))  # 100 + 40 = 140 tokens
    p2, o2 = [*p1, *o1, *range(3000, 3030)], list(range(4000, 4005))
    return [tok(0.0, p1, output=o1), tok(1.0, p2, output=o2)]


@pytest.mark.parametrize(
    ("include_output", "partial", "hit"),
    [
        (False, False, 96),  # the 6 full blocks of turn 1's prompt
        (True, False, 128),  # the 8 full blocks of turn 1's prompt + answer (140 tokens)
        (False, True, 100),  # turn 1's prompt exactly
        (True, True, 140),  # turn 1's prompt + answer exactly
    ],
)
def test_include_output_lets_the_next_turn_hit_the_answer(include_output: bool, partial: bool, hit: int) -> None:
    requests = chat_turns()
    results = run(
        requests,
        *(sim_config(p, INF, 16, partial_blocks=partial) for p in POLICIES),
        include_output=include_output,
        optimal=False,
    )
    for r in results:
        assert r.hit_tokens == hit, r.config.label
        assert r.lookup_tokens == 100 + 170
        assert r.hit_requests == 1


def test_include_output_is_ignored_for_pre_hashed_traces() -> None:
    requests = [
        Request(float(i), "t", "m", "", 40, 7, hash_ids=(1, 2, 3), block_size=16, output_tokens=(5,) * 7)
        for i in range(3)
    ]
    a, b = (run(requests, sim_config(), include_output=flag)[0] for flag in (False, True))
    assert a.hit_tokens == b.hit_tokens == 2 * 40


@pytest.mark.parametrize(("ttl", "hits"), [(None, True), (200.0, True), (50.0, False), (99.0, False)])
def test_ttl_runs_on_trace_time(tmp_path: Path, ttl: float | None, hits: bool) -> None:
    prompt = list(range(64))
    path = write_records(
        tmp_path / "ttl.jsonl",
        [{"timestamp": t, "tenant": "a", "model": "m", "tokens": prompt} for t in (0.0, 100.0)],
    )
    (r,) = replay(lambda: read_trace(path), [sim_config("lru", INF, 16, ttl_seconds=ttl)], optimal=False)
    assert r.hit_tokens == (64 if hits else 0)


def test_ttl_is_refreshed_by_each_hit() -> None:
    prompt = list(range(64))
    requests = [tok(t, prompt) for t in (0.0, 80.0, 160.0, 240.0, 400.0)]
    (r,) = run(requests, sim_config("lru", INF, 16, ttl_seconds=100.0), optimal=False)
    # 80, 160 and 240 each come within 100 s of the last use; 400 does not.
    assert r.hit_requests == 3
    assert r.hit_tokens == 3 * 64


def test_ttl_on_mooncake_timestamps_in_milliseconds(tmp_path: Path) -> None:
    rows = [{"timestamp": ms, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]} for ms in (0, 30_000)]
    path = write_records(tmp_path / "mc.jsonl", rows)
    for ttl, hit in ((31.0, 600), (29.0, 0)):
        (r,) = replay(lambda: read_trace(path, "mooncake"), [sim_config(ttl_seconds=ttl)], optimal=False)
        assert r.hit_tokens == hit


# ---------------------------------------------------------------------------- the optimum


# NOTE: the optimum is Belady with bypass on the *flat* block sequence: it maximizes block
# hits, not prefix-contiguous hits, so in principle a policy could beat it by a hair on
# the token hit rate (a block hit that is not on a cached prefix earns no tokens). The
# margins measured here are large (e.g. 0.38 vs 0.15 on Mooncake synthetic @ 1e6), so the
# slack only keeps such an artefact from being mistaken for a bug.
SLACK = 0.005


def check_optimum_bounds(results: list[ReplayResult]) -> None:
    by_capacity: dict[tuple[float, str], set[int | None]] = {}
    for r in results:
        assert r.optimal_token_hit_rate is not None
        assert r.optimal_token_hit_rate + SLACK >= r.token_hit_rate, r.config.label
        iso = "shared" if r.config.isolation == "shared" else "per-tenant"
        by_capacity.setdefault((r.config.capacity_tokens, iso), set()).add(r.optimal_hit_tokens)
    for key, optima in by_capacity.items():
        assert len(optima) == 1, f"optimum differs between policies at {key}: {optima}"


@slow
def test_optimum_bounds_every_policy_on_a_generated_workload(generated: list[Request]) -> None:
    configs = [sim_config(p, c, 64) for c in (50_000, 200_000) for p in POLICIES]
    configs += [sim_config(p, 50_000, 64, "namespace") for p in ("lru", "s3fifo")]
    configs += [sim_config(p, 50_000, 64, mode="flat") for p in ("lru", "fifo", "s3fifo")]
    results = run(generated, *configs)
    check_optimum_bounds(results)
    # the optimum grows with capacity and is not trivially reached at these sizes
    small = next(r for r in results if r.config.capacity_tokens == 50_000)
    large = next(r for r in results if r.config.capacity_tokens == 200_000)
    assert small.optimal_token_hit_rate is not None and large.optimal_token_hit_rate is not None
    assert small.optimal_token_hit_rate < large.optimal_token_hit_rate
    assert max(r.token_hit_rate for r in results if r.config.capacity_tokens == 50_000) < small.optimal_token_hit_rate


@slow
def test_optimum_bounds_every_policy_on_mooncake_synthetic(synthetic: list[Request]) -> None:
    configs = [sim_config(p, 1e6) for p in POLICIES]
    configs += [sim_config(p, 1e6, mode="flat") for p in ("lru", "fifo", "s3fifo")]
    results = run(synthetic, *configs)
    check_optimum_bounds(results)
    assert results[0].optimal_token_hit_rate == pytest.approx(0.383, abs=0.002)


def test_optimum_at_unlimited_capacity_is_the_ceiling(generated: list[Request]) -> None:
    sample = generated[:400]
    results = run(sample, *(sim_config(p, INF, 64, mode=m) for m in ("tree", "flat") for p in ("lru", "s3fifo")))
    assert len({r.hit_tokens for r in results}) == 1
    assert all(r.optimal_hit_tokens == r.hit_tokens for r in results)


# BUG (src/prefixcache/sim/replay.py, replay() and belady()): the optimum is computed on
# the prompts' full-block sequence whatever the configuration, so with partial_blocks
# (matching inside a block) or include_output (answers inserted for the next turn) the
# policy reuses tokens the "optimum" never sees, and the reported optimum falls below
# what the policy achieved -- at unlimited capacity, where both must be the ceiling.
@pytest.mark.parametrize("case", ["partial_blocks", "include_output"])
def test_optimum_is_never_below_the_policy_at_unlimited_capacity(tmp_path: Path, case: str) -> None:
    if case == "partial_blocks":
        requests = prefix_trace(tmp_path, 100, 50, 10)
        (r,) = run(requests, sim_config("lru", INF, 16, partial_blocks=True))
    else:
        (r,) = run(chat_turns(), sim_config("lru", INF, 16), include_output=True)
    # Either fix passes: an optimum that sees the same reuse, or none reported for such configurations.
    if r.optimal_hit_tokens is not None:
        assert r.optimal_hit_tokens >= r.hit_tokens, f"optimum {r.optimal_hit_tokens} < achieved {r.hit_tokens}"


# BUG (src/prefixcache/sim/replay.py, request_blocks): block ids are salted by the tenant
# but never by the model, so flat mode and the optimum reuse one model's KV for another
# model's identical prompt; the tree (the real cache, keyed by CacheContext(tenant,
# model)) rightly does not. The optimum then exceeds the unlimited-capacity ceiling.
@pytest.mark.parametrize("hashed", [False, True])
def test_blocks_of_different_models_are_never_shared(hashed: bool) -> None:
    def req(ts: float, model: str) -> Request:
        if hashed:
            return Request(ts, "t", model, "", 64, 0, hash_ids=(1, 2, 3, 4), block_size=16)
        return tok(ts, range(64), model=model)

    requests = [req(0.0, "model-a"), req(1.0, "model-b")]
    tree, flat = run(requests, *(sim_config("lru", INF, 16, mode=m) for m in ("tree", "flat")))
    assert tree.hit_tokens == 0
    assert flat.hit_tokens == 0
    assert tree.optimal_hit_tokens == 0


@pytest.mark.parametrize(("ids", "hit"), [([7, 8], 600), ([7], 512)])
@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_partial_tail_without_an_id_is_never_a_hit(tmp_path: Path, ids: list[int], hit: int, engine: str) -> None:
    """600 tokens in blocks of 512: Mooncake's two ids, or one for the full block only,
    whose 88-token tail then never counts as a hit, in any mode nor in the optimum."""
    rows = [{"timestamp": t, "input_length": 600, "output_length": 1, "hash_ids": ids} for t in (0, 1)]
    path = write_records(tmp_path / "t.jsonl", rows)
    configs = [sim_config("lru", c, mode=m) for m in ("tree", "flat") for c in (INF, 1024)]
    for r in replay(lambda: read_trace(path, "mooncake"), configs, engine=engine):
        assert (r.lookup_tokens, r.hit_tokens, r.optimal_hit_tokens) == (1200, hit, hit), r.config.label


# ---------------------------------------------------------------------------- calibration


@slow
def test_calibration_mooncake_synthetic() -> None:
    configs = [sim_config("lru", 1e7), sim_config("fifo", 1e7), sim_config("lru", INF)]
    lru, fifo, ceiling = replay(lambda: read_trace(SYNTHETIC), configs, trace_name=SYNTHETIC.name)
    assert lru.config.block_size == 512  # the trace's own block size
    assert lru.requests == 3993
    assert 0.56 <= lru.token_hit_rate <= 0.60  # README: naive .577; paper Fig. 9 ~.59
    assert fifo.token_hit_rate < lru.token_hit_rate  # README: .535 vs .577
    assert ceiling.token_hit_rate == pytest.approx(0.651, abs=0.001)
    assert ceiling.optimal_token_hit_rate == ceiling.token_hit_rate
    for r in (lru, fifo):
        assert r.optimal_token_hit_rate is not None and r.optimal_token_hit_rate >= r.token_hit_rate


@slow
def test_calibration_mooncake_conversation_ceiling() -> None:
    (r,) = replay(lambda: read_trace(CONVERSATION), [sim_config("lru", INF)], trace_name=CONVERSATION.name)
    assert r.requests == 12031
    assert r.blocks_looked_up == 288_500  # README: total blocks
    assert r.token_hit_rate == pytest.approx(0.374, abs=0.001)
    assert r.optimal_token_hit_rate == r.token_hit_rate
    assert r.evictions == 0


# ---------------------------------------------------------------------------- flat mode vs libCacheSim


def libcachesim_miss_ratio(keys: np.ndarray, policy: str, capacity: int) -> float:
    """libCacheSim's miss ratio on ``keys`` (objects of size 1), run by its C loop."""
    pytest.importorskip("libcachesim")
    return libcachesim_run(keys, policy, capacity)[0]


def flat_miss_ratios(requests: list[Request], capacity_blocks: Sequence[int], block_size: int) -> dict[Any, float]:
    configs = [
        sim_config(p, c * block_size, block_size, mode="flat")
        for c in capacity_blocks
        for p in ("lru", "fifo", "s3fifo")
    ]
    out = {}
    for r in run(requests, *configs, optimal=False):
        assert r.block_hit_rate is not None and r.blocks_looked_up == sum(len(q.hash_ids or ()) for q in requests)
        out[(r.config.policy, int(r.config.capacity_tokens) // block_size)] = 1 - r.block_hit_rate
    return out


@slow
def test_flat_mode_matches_libcachesim_on_zipf() -> None:
    rng = np.random.default_rng(42)
    objects = 10_000
    weights = 1.0 / np.arange(1, objects + 1)
    keys = rng.choice(objects, size=100_000, p=weights / weights.sum())
    requests = [Request(float(i), "t", "m", "", 1, 0, hash_ids=(int(k),), block_size=1) for i, k in enumerate(keys)]
    ours = flat_miss_ratios(requests, (200, 2000), 1)
    for (policy, capacity), miss in ours.items():
        peer = libcachesim_miss_ratio(keys, policy, capacity)
        assert abs(miss - peer) <= 0.002, f"{policy} @ {capacity}: ours {miss:.4f}, libcachesim {peer:.4f}"
    assert ours[("s3fifo", 200)] < ours[("lru", 200)] < ours[("fifo", 200)]  # the usual order on Zipf


@slow
def test_flat_mode_matches_libcachesim_on_mooncake_blocks(conversation: list[Request]) -> None:
    keys = np.fromiter((b for r in conversation for b in r.hash_ids or ()), dtype=np.uint64)
    assert len(keys) == 288_500
    ours = flat_miss_ratios(conversation, (2_000, 20_000), 512)
    for (policy, capacity), miss in ours.items():
        peer = libcachesim_miss_ratio(keys, policy, capacity)
        assert abs(miss - peer) <= 0.002, f"{policy} @ {capacity}: ours {miss:.4f}, libcachesim {peer:.4f}"


# ---------------------------------------------------------------------------- configurations and bookkeeping


def test_one_result_per_configuration_in_order(tmp_path: Path) -> None:
    requests = prefix_trace(tmp_path, 100, 30, 8, 2, 16)
    configs = [
        sim_config(p, c, bs, iso, mode=m)
        for m in ("tree", "flat")
        for iso in ("shared", "namespace", "partitioned")
        for bs in (16, 64)
        for p in ("lru", "s3fifo")
        for c in (1000.0, INF)
    ]
    results = run(requests, *configs, *configs[:3])  # repeats are replayed once
    assert [r.config for r in results] == configs
    assert all(r.trace == "trace" and r.requests == 8 for r in results)


def test_pre_hashed_trace_merges_block_sizes(synthetic: list[Request]) -> None:
    sample = synthetic[:200]
    configs = [sim_config("lru", 1e6, bs, partial_blocks=pb) for bs in (16, 64, 512) for pb in (False, True)]
    configs.append(sim_config("fifo", 1e6, 16))
    results = run(sample, *configs)
    assert [r.config for r in results] == [sim_config("lru", 1e6, 512), sim_config("fifo", 1e6, 512)]
    assert summarize(lambda: sample).native_block_size == 512


def test_mixed_native_block_sizes_are_an_error() -> None:
    requests = [
        Request(0.0, "t", "m", "", 16, 0, hash_ids=(1,), block_size=16),
        Request(1.0, "t", "m", "", 64, 0, hash_ids=(2,), block_size=64),
    ]
    with pytest.raises(ValueError, match="block size"):
        run(requests, sim_config())


@pytest.mark.parametrize("warmup", [0.0, 0.3])
def test_timeline_and_tenants_add_up_to_the_totals(generated: list[Request], warmup: float) -> None:
    sample = generated[:600]
    configs = [sim_config("lru", 30_000, 64, iso, mode=m) for m in ("tree", "flat") for iso in ("shared", "namespace")]
    for r in run(sample, *configs, warmup=warmup, optimal=False):
        assert r.requests == 600 - int(600 * warmup)
        assert 1 < len(r.timeline) <= TIMELINE_WINDOWS
        assert sum(p.requests for p in r.timeline) == r.requests
        assert sum(p.lookup_tokens for p in r.timeline) == r.lookup_tokens
        assert sum(p.hit_tokens for p in r.timeline) == r.hit_tokens
        assert all(p.evictions >= 0 for p in r.timeline)
        starts = [p.t_start for p in r.timeline]
        assert starts == sorted(starts) and len(set(starts)) == len(starts)
        assert r.timeline[-1].t_end == pytest.approx(sample[-1].timestamp)
        assert len(r.tenants) == 4
        for name in ("requests", "lookup_tokens", "hit_tokens", "hit_requests"):
            assert sum(getattr(t, name) for t in r.tenants.values()) == getattr(r, name), name
        assert r.evictions > 0


def test_timeline_windows_hold_their_requests() -> None:
    """Requests at 0..99 s: 48 windows of (99 - 0) / 48 s, each holding the requests
    whose timestamps fall in it, the last closed at the end."""
    requests = [tok(float(i), [i, i + 1, i + 2]) for i in range(100)]
    (r,) = run(requests, sim_config("lru", INF, 16), optimal=False)
    width = 99 / TIMELINE_WINDOWS
    assert len(r.timeline) == TIMELINE_WINDOWS
    for k, p in enumerate(r.timeline):
        assert p.t_start == pytest.approx(k * width)
        inside = [i for i in range(100) if min(int(i / width), TIMELINE_WINDOWS - 1) == k]
        assert p.requests == len(inside)


# BUG (src/prefixcache/sim/replay.py, _replay_tree / _replay_flat -> _Counter.add ->
# _Counter._timeline): a window's eviction baseline is the count *after* its first
# request, so that request's evictions go to the window before it -- and the first
# counted request's evictions to no window at all: after a warm-up the timeline misses
# them. Fix: pass the eviction count from before the request as the baseline.
@pytest.mark.parametrize("mode", ["tree", "flat"])
def test_timeline_evictions_are_the_evictions_after_the_warmup(mode: str) -> None:
    rng = np.random.default_rng(0)
    requests = [tok(float(i), rng.integers(0, 1000, 160).tolist()) for i in range(100)]
    cfg = sim_config("lru", 320, 16, mode=mode)
    (whole,) = run(requests, cfg, warmup=0.3, optimal=False)
    (warm,) = run(requests[:30], cfg, optimal=False)
    assert warm.evictions > 0 and whole.evictions > warm.evictions
    assert sum(p.evictions for p in whole.timeline) == whole.evictions - warm.evictions


@pytest.mark.parametrize("mode", ["tree", "flat"])
def test_no_evictions_at_unlimited_capacity(generated: list[Request], mode: str) -> None:
    for r in run(generated[:500], *(sim_config(p, INF, 64, mode=mode) for p in POLICIES), optimal=False):
        assert r.evictions == 0
        assert all(p.evictions == 0 for p in r.timeline)


def test_flat_mode_block_hits_and_tree_mode_has_none(generated: list[Request]) -> None:
    tree, flat = run(generated[:300], *(sim_config("lru", 20_000, 64, mode=m) for m in ("tree", "flat")))
    assert tree.block_hits is None and tree.block_hit_rate is None
    assert flat.block_hits is not None and 0 < flat.block_hits <= flat.blocks_looked_up
    assert tree.blocks_looked_up == flat.blocks_looked_up == sum(len(r.hash_ids or ()) for r in generated[:300])


def test_unknown_mode_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode"):
        run(prefix_trace(tmp_path, 16, 8, 2), sim_config(mode="btree"))


def test_progress_is_entered_once_per_pass(tmp_path: Path) -> None:
    """The kernel's and the flat configurations share one pass over the trace; each
    configuration on the PrefixCache has its own."""
    requests = prefix_trace(tmp_path, 64, 16, 7)
    calls: list[tuple[int, str, int]] = []

    class Bar:
        def __init__(self) -> None:
            self.n = 0

        def advance(self, n: int = 1) -> None:
            self.n += n

    @contextmanager
    def progress(total: int, label: str) -> Iterator[Bar]:
        bar = Bar()
        yield bar
        calls.append((total, label, bar.n))

    reads = 0

    def source() -> Iterator[Request]:
        nonlocal reads
        reads += 1
        yield from requests

    configs = [
        sim_config("lru", INF, 16),
        sim_config("fifo", 100.0, 16, mode="flat"),
        sim_config("lru", 64.0, 16, partial_blocks=True),  # the kernel does not model it: python
        sim_config("s3fifo", 64.0, 16),
    ]
    results = replay(source, configs, progress=progress, optimal=False)
    assert [r.engine for r in results] == ["native", "python", "python", "native"]
    assert calls == [(7, "3 configurations", 7), (7, configs[2].label, 7)]
    assert reads == 1 + 2  # the summary, then two passes
    assert all(r.requests == 7 and r.seconds > 0 for r in results)


def test_results_are_json_safe(tmp_path: Path) -> None:
    requests = prefix_trace(tmp_path, 64, 16, 5, 2)
    for r in run(requests, sim_config("lru", INF, 16), sim_config("lru", 100.0, 16, mode="flat")):
        data = json.loads(json.dumps(r.to_json(), allow_nan=False))
        for key in ("policy", "capacity_tokens", "block_size", "isolation", "token_hit_rate", "request_hit_rate"):
            assert key in data
        assert data["optimal_token_hit_rate"] == r.optimal_token_hit_rate
        assert (data["capacity_tokens"], data["unlimited"]) == (
            (None, True) if r.config.mode == "tree" else (100, False)
        )


def test_empty_trace_gives_empty_results(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    (r,) = replay(lambda: read_trace(path), [sim_config()], warmup=0.5)
    assert (r.requests, r.hit_tokens, r.token_hit_rate, r.optimal_token_hit_rate, r.timeline) == (0, 0, 0.0, 0.0, [])


# BUG (src/prefixcache/sim/replay.py, _replay_tree): a pre-hashed trace's ids become the
# tree's pseudo-tokens, which the cache packs as uint32, but the reader accepts any id
# >= 0 (our JSONL spec; 64-bit content hashes are common), so tree mode -- the default --
# fails on a valid trace with "token id ... out of range" naming no file or line, while
# flat mode replays it. Fix: map ids to dense small ints per replay (as belady() does).
def test_tree_mode_replays_large_hash_ids(tmp_path: Path) -> None:
    base = 2**40
    rows = [
        {
            "timestamp": float(i),
            "tenant": "a",
            "model": "m",
            "hash_ids": [base + 1, base + 2 + i % 2],
            "block_size": 16,
            "input_length": 30,
        }
        for i in range(6)
    ]
    path = write_records(tmp_path / "big.jsonl", rows)
    tree, flat = replay(lambda: read_trace(path), [sim_config(mode="tree"), sim_config(mode="flat")])
    assert tree.hit_tokens == flat.hit_tokens == 16 + 4 * 30


# ---------------------------------------------------------------------------- malformed traces


GOOD = {"timestamp": 0.0, "tenant": "a", "model": "m", "tokens": [1, 2, 3]}


@pytest.mark.parametrize(
    ("line", "fmt", "message"),
    [
        ('{"timestamp": 1.0, "tenant": "a", "model": "m", "tokens": [1, 2', "auto", "invalid JSON"),
        ({"timestamp": 1.0, "model": "m", "tokens": [1]}, "auto", "field 'tenant': missing"),
        ({"timestamp": 1.0, "tenant": "a", "model": "m", "tokens": [-1]}, "auto", "field 'tokens'"),
        ({"timestamp": -5.0, "tenant": "a", "model": "m", "tokens": [1]}, "auto", "field 'timestamp'"),
        ({"timestamp": 1.0, "tenant": "a", "model": "m", "tokens": [1], "endpont": "x"}, "auto", "'endpont'"),
        ({"timestamp": 9, "input_length": 600, "output_length": 1, "hash_ids": [0]}, "mooncake", "'hash_ids'"),
    ],
)
def test_malformed_line_is_a_trace_error_naming_file_and_line(
    tmp_path: Path, line: Any, fmt: str, message: str
) -> None:
    first = GOOD if fmt == "auto" else {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps(first)
        + "\n"
        + json.dumps(first)
        + "\n"
        + (line if isinstance(line, str) else json.dumps(line))
        + "\n"
    )
    source: Callable[[], Iterable[Request]] = lambda: read_trace(path, fmt)  # noqa: E731
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:3: .*{re.escape(message)}") as info:
        replay(source, [sim_config()])
    assert isinstance(info.value, ValueError)


def test_timestamp_going_back_is_a_trace_error(tmp_path: Path) -> None:
    path = write_records(tmp_path / "back.jsonl", [{**GOOD, "timestamp": 5.0}, {**GOOD, "timestamp": 4.0}])
    with pytest.raises(TraceError, match=f"{re.escape(str(path))}:2: field 'timestamp'"):
        replay(lambda: read_trace(path), [sim_config()])


def test_a_trace_mixing_hash_ids_and_tokens_is_refused(tmp_path: Path) -> None:
    """Hit tokens of a pre-hashed request are counted in native blocks, of a token
    request in tokens: one replay cannot do both, so it says so instead of mixing."""
    path = tmp_path / "mixed.jsonl"
    lines = [
        {"timestamp": 0, "tenant": "a", "model": "m", "tokens": [1, 2, 3]},
        {"timestamp": 1, "tenant": "a", "model": "m", "hash_ids": [7], "block_size": 16, "input_length": 10},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match="mixes hash_ids and token prompts"):
        replay(lambda: read_trace(path), [sim_config()])
