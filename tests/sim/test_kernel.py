"""The compiled replay kernel (sim/native/_kernel.c) against the reference engine.

``KernelStepper`` must give every request the same cached prefix, and leave the same
eviction count, as ``CacheStepper`` (the real ``PrefixCache``) for every configuration
the kernel accepts. Checked here: a property test on random multi-tenant traces at
capacities small enough that most requests evict, compared after every request; whole
replays of the Mooncake traces and of a generated workload, field for field; engine
selection; the kernel's own argument checks.

NOTE: without the built extension (``pip install -e .`` compiles it) this module is
skipped, so CI must build it or none of this runs.

Tests that take seconds are marked ``slow``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixcache.config import CacheConfig, PublishConfig
from prefixcache.policies import POLICIES as CACHE_POLICIES
from prefixcache.sim.engines import CacheStepper, KernelStepper, make_stepper, native_unsupported
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig, ReplayResult, cache_capacity
from prefixcache.sim.summary import effective_configs, summarize
from prefixcache.sim.traces import Request, read_trace
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import write_jsonl
from support import tok

_kernel = pytest.importorskip("prefixcache.sim.native._kernel", reason="the compiled replay kernel is not built")


def sim_config(
    policy: str = "lru",
    capacity_tokens: float = math.inf,
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


ISOLATIONS = ("shared", "namespace", "partitioned")
KERNEL_POLICIES: tuple[str, ...] = tuple(_kernel.POLICIES)
KERNEL_TTL = native_unsupported(sim_config(ttl_seconds=60.0)) == ""  # NOTE: the kernel models TTLs
TENANTS = ("acme", "bolt", "cyan", "dune")
MODELS = ("m1", "m2")
MAX_TOKEN = 2**32 - 1
LENGTHS = st.one_of(st.integers(1, 30), st.integers(10, 30))  # requests per drawn trace
INF = math.inf

slow = pytest.mark.slow


# ---------------------------------------------------------------------------- helpers


def hashed(
    ts: float, ids: Sequence[int], block_size: int, input_length: int, tenant: str = "acme", model: str = "m1"
) -> Request:
    return Request(
        timestamp=ts,
        tenant=tenant,
        model=model,
        endpoint="",
        input_length=input_length,
        output_length=0,
        hash_ids=tuple(ids),
        block_size=block_size,
    )


def _show(req: Request) -> str:
    """A request as the helper call that rebuilds it (failures print a reproduction)."""
    who = f"tenant={req.tenant!r}, model={req.model!r}"
    if req.hash_ids is not None:
        return f"hashed({req.timestamp}, {list(req.hash_ids)}, {req.block_size}, {req.input_length}, {who})"
    out = f", output={list(req.output_tokens)}" if req.output_tokens else ""
    return f"tok({req.timestamp}, {list(req.tokens or ())}, {who}{out})"


@dataclass(frozen=True)
class Case:
    """One drawn scenario: a configuration and the requests both engines replay."""

    config: ReplayConfig
    include_output: bool
    requests: tuple[Request, ...]

    def __repr__(self) -> str:
        reqs = "".join(f"\n    {_show(r)}," for r in self.requests)
        return f"Case(\n  {self.config!r},\n  include_output={self.include_output},\n  requests=[{reqs}\n  ],\n)"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis prints a failing case with this
        printer.text(repr(self))


def step_both(case: Case) -> tuple[CacheStepper, KernelStepper]:
    """Replay ``case`` through both engines, comparing after every request; the first
    difference fails with the request's index and both engines' answers."""
    summary = summarize(lambda: case.requests)
    (cfg,) = effective_configs([case.config], summary)
    ref = CacheStepper(cfg, summary, case.include_output)
    ker = KernelStepper(cfg, summary, case.include_output)
    for i, req in enumerate(case.requests):
        want = ref.step(req)
        got = ker.step(req)
        where = f"request {i} ({_show(req)}) under {cfg.label}"
        assert got == want, f"{where}: kernel cached {got}, cache {want}"
        assert ker.evictions == ref.evictions, f"{where}: kernel evictions {ker.evictions}, cache {ref.evictions}"
        assert ker.counters() == ref.counters(), f"{where}: kernel {ker.counters()}, cache {ref.counters()}"
    return ref, ker


# ---------------------------------------------------------------------------- strategies


# Steps of trace time, and TTLs: sums of tenths are inexact in binary, so a kernel that
# tests expiry another way than the cache (``last >= now - ttl``) differs on some.
TIME_STEPS = st.sampled_from([0.0, 0.1, 0.2, 0.3, 1.0, 2.5])
TTLS = st.one_of(st.none(), st.sampled_from([0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 10.0, INF])) if KERNEL_TTL else st.none()


@st.composite
def replay_configs(draw: st.DrawFn, block_size: int) -> ReplayConfig:
    """A configuration the kernel models, at a capacity of 0..40 blocks (sometimes not a
    whole number of blocks) or unlimited, with a TTL when the kernel has them."""
    few = st.one_of(st.integers(1, 10), st.integers(0, 40))
    blocks = few.map(lambda b: b * block_size)
    ragged = st.one_of(st.integers(1, 10 * block_size), st.integers(0, 40 * block_size))
    kind = draw(st.sampled_from(["blocks", "ragged", "blocks", "ragged", "unlimited"]))
    capacity = draw({"blocks": blocks, "ragged": ragged, "unlimited": st.just(INF)}[kind])
    return sim_config(
        policy=draw(st.sampled_from(KERNEL_POLICIES)),
        capacity_tokens=capacity,
        block_size=block_size,
        isolation=draw(st.sampled_from(ISOLATIONS)),
        ttl_seconds=draw(TTLS),
    )


def _who(draw: st.DrawFn, tenants: int, models: int) -> tuple[str, str]:
    return draw(st.sampled_from(TENANTS[:tenants])), draw(st.sampled_from(MODELS[:models]))


@st.composite
def token_cases(draw: st.DrawFn) -> Case:
    """Token prompts built from a few shared heads, earlier prompts (with their outputs,
    as a chat's next turn sends them) and random tails, of any length: empty, shorter
    than a block, not a multiple of it. A tiny vocabulary makes equal blocks under
    different parents common; the largest uint32 id is drawn too."""
    bs = draw(st.sampled_from([1, 2, 3, 4, 8]))
    vocab = st.one_of(st.integers(0, 3), st.just(MAX_TOKEN))
    tokens = st.lists(vocab, max_size=3 * bs + 1)
    heads = draw(st.lists(tokens, min_size=1, max_size=4))
    include_output = draw(st.booleans())
    earlier: list[list[int]] = []
    requests = []
    tenants, models = draw(st.integers(1, len(TENANTS))), draw(st.integers(1, len(MODELS)))
    now = 0.0
    for _ in range(draw(LENGTHS)):
        now += draw(TIME_STEPS)
        prompt = draw(st.sampled_from(heads + earlier)) + draw(tokens)
        output = draw(st.lists(vocab, max_size=2 * bs + 1)) if draw(st.booleans()) else []
        tenant, model = _who(draw, tenants, models)
        requests.append(tok(now, prompt, tenant, model, output))
        earlier.append(prompt + (output if include_output else []))
    return Case(draw(replay_configs(bs)), include_output, tuple(requests))


@st.composite
def hashed_cases(draw: st.DrawFn) -> Case:
    """Pre-hashed prompts: block contents from a tiny alphabet, named either by prefix
    ids (Mooncake: an id per distinct prefix, in order of first appearance, sometimes
    beyond 32 or 64 bits) or by the raw content (one id under many parents, repeated within a
    prompt). The last block may be partial (``input_length``)."""
    bs = draw(st.sampled_from([1, 4, 16, 512]))
    prefix_ids = draw(st.booleans())
    scale = draw(st.sampled_from([1, 2**40 + 1, 2**64 + 1]))
    content = st.lists(st.integers(0, 3), max_size=5)
    heads = draw(st.lists(content, min_size=1, max_size=4))
    ids: dict[tuple[int, ...], int] = {}
    earlier: list[list[int]] = []
    requests = []
    tenants, models = draw(st.integers(1, len(TENANTS))), draw(st.integers(1, len(MODELS)))
    now = 0.0
    for _ in range(draw(LENGTHS)):
        now += draw(TIME_STEPS)
        blocks = draw(st.sampled_from(heads + earlier)) + draw(content)
        if prefix_ids:
            hash_ids = [ids.setdefault(tuple(blocks[: j + 1]), len(ids)) * scale for j in range(len(blocks))]
        else:
            hash_ids = [b * scale for b in blocks]
        n = len(hash_ids)
        length = draw(st.integers((n - 1) * bs + 1, n * bs)) if n else 0
        tenant, model = _who(draw, tenants, models)
        requests.append(hashed(now, hash_ids, bs, length, tenant, model))
        earlier.append(blocks)
    return Case(draw(replay_configs(bs)), draw(st.booleans()), tuple(requests))


# ---------------------------------------------------------------------------- step for step


def _lru(capacity: float, isolation: str = "shared", block_size: int = 2) -> ReplayConfig:
    return sim_config(policy="lru", capacity_tokens=capacity, block_size=block_size, isolation=isolation)


@settings(max_examples=300, deadline=None)
@given(st.one_of(token_cases(), hashed_cases()))
# A prompt longer than the whole cache: its head is stored, its tail declined.
@example(Case(_lru(4), False, (tok(0.0, [1, 2, 3, 4, 5, 6, 7]), tok(1.0, [1, 2, 3, 4, 5, 6, 7]))))
# FIFO's oldest block is the one the answer extends: it stays, the next oldest goes.
@example(
    Case(
        sim_config(policy="fifo", capacity_tokens=4, block_size=2),
        True,
        (tok(0.0, [1, 1]), tok(1.0, [2, 2]), tok(2.0, [1, 1], output=[4, 4]), tok(3.0, [2, 2]), tok(4.0, [1, 1])),
    )
)
# Partitioned quotas shrink as tenants appear; the newcomer evicts from those over theirs.
@example(
    Case(
        _lru(8, "partitioned"),
        False,
        (tok(0.0, [1] * 8, "acme"), tok(1.0, [2] * 4, "bolt"), tok(2.0, [1] * 8, "acme"), tok(3.0, [3] * 4, "cyan")),
    )
)
# Capacity zero: nothing is ever stored, nothing evicted.
@example(Case(_lru(0), False, (hashed(0.0, [0, 1], 4, 5), hashed(1.0, [0, 1], 4, 8))))
def test_kernel_steps_like_the_cache(case: Case) -> None:
    step_both(case)


LONG_TTLS = [None, 2.0] if KERNEL_TTL else [None]  # 2 s: four requests


@pytest.mark.parametrize("ttl", LONG_TTLS)
@pytest.mark.parametrize("policy", KERNEL_POLICIES)
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_kernel_steps_like_the_cache_on_a_long_random_trace(policy: str, isolation: str, ttl: float | None) -> None:
    """Hundreds of requests through one pair of engines: state that only drifts apart
    after many evictions (a policy's ghost queue, frequency counters, a hand) shows."""
    rng = random.Random(f"{policy}-{isolation}-{ttl}")
    heads = [[rng.randrange(6) for _ in range(rng.randrange(0, 13))] for _ in range(6)]
    requests = []
    earlier: list[list[int]] = []
    for i in range(500):
        base = rng.choice(heads + earlier[-20:])
        prompt = base + [rng.randrange(6) for _ in range(rng.randrange(0, 9))]
        output = [rng.randrange(6) for _ in range(rng.randrange(0, 5))]
        requests.append(tok(i * 0.5, prompt, rng.choice(TENANTS[:3]), rng.choice(MODELS), output))
        earlier.append(prompt + output)
    cfg = sim_config(policy=policy, capacity_tokens=60, block_size=3, isolation=isolation, ttl_seconds=ttl)
    ref, _ = step_both(Case(cfg, True, tuple(requests)))
    assert ref.evictions > 50  # the comparison ran through many evictions
    assert ttl is None or ref.counters().expired > 50  # and expiries


# ---------------------------------------------------------------------------- whole replays


def comparable(result: ReplayResult) -> dict[str, Any]:
    """Everything a replay measured, less its wall time and the engine's name."""
    out = result.to_json()
    del out["seconds"]
    out.pop("engine", None)
    return out


def assert_same_replays(requests: Sequence[Request], configs: Iterable[ReplayConfig], **kwargs: Any) -> None:
    configs = list(configs)
    native = replay(lambda: requests, configs, engine="native", optimal=False, **kwargs)
    python = replay(lambda: requests, configs, engine="python", optimal=False, **kwargs)
    assert [r.engine for r in native] == ["native"] * len(native)
    assert [r.engine for r in python] == ["python"] * len(python)
    for n, p in zip(native, python, strict=True):
        assert comparable(n) == comparable(p), n.config.label
    assert any(r.evictions for r in python), "no configuration evicted: the comparison is too easy"


MOONCAKE_CONFIGS = [
    sim_config(policy=policy, capacity_tokens=capacity, block_size=512)
    for policy in ("lru", "s3fifo")
    for capacity in (1e6, 1e7)
]


@slow
def test_same_replay_of_mooncake_synthetic(synthetic: list[Request]) -> None:
    assert_same_replays(synthetic, MOONCAKE_CONFIGS, warmup=0.1)


@slow
def test_same_replay_of_mooncake_conversation(conversation: list[Request]) -> None:
    assert_same_replays(conversation, MOONCAKE_CONFIGS, warmup=0.1)


def test_same_replay_of_the_mooncake_conversation_head(conversation: list[Request]) -> None:
    """The first 1000 requests, every kernel policy, at a capacity that evicts often (one
    tenant: partitioned is one pool with all the capacity, through the pool code)."""
    configs = [
        sim_config(policy=p, capacity_tokens=2e5, block_size=512, isolation=i)
        for p in KERNEL_POLICIES
        for i in ("shared", "partitioned")
    ]
    if KERNEL_TTL:  # the head spans 330 s
        configs += [
            sim_config(policy=p, capacity_tokens=1e6, block_size=512, ttl_seconds=30.0) for p in ("lru", "s3fifo")
        ]
    assert_same_replays(conversation[:1000], configs)


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Request]]:
    """A small multi-tenant, multi-model workload (chat, RAG, agents, scans), as token
    prompts with outputs and as prefix ids at 16 tokens."""
    out = {}
    for emit in ("tokens", "hash_ids"):
        spec = WorkloadSpec(
            requests=400,
            tenants=4,
            seed=11,
            duration_s=600.0,
            shared_system_prompt_tokens=200,
            system_prompt_tokens=100,
            turn_tokens=(10, 80),
            output_tokens=(5, 60),
            sessions_per_tenant=4,
            documents=30,
            document_tokens=(100, 400),
            tool_prompt_tokens=300,
            scan_tokens=(50, 300),
            models=("model-a", "model-b"),
            emit=emit,
            block_size=16,
        )
        path = tmp_path_factory.mktemp("workload") / f"{emit}.jsonl"
        write_jsonl(spec, path)
        out[emit] = list(read_trace(path))
    return out


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("emit", ["tokens", "hash_ids"])
def test_same_replay_of_a_generated_workload(workloads: dict[str, list[Request]], isolation: str, emit: str) -> None:
    configs = [
        sim_config(policy=p, capacity_tokens=c, block_size=16, isolation=isolation)
        for p in KERNEL_POLICIES
        for c in (3000, INF)
    ]
    if KERNEL_TTL:
        configs += [
            sim_config(policy=p, capacity_tokens=c, block_size=16, isolation=isolation, ttl_seconds=30.0)
            for p in ("lru", "s3fifo")
            for c in (3000, INF)
        ]
    assert_same_replays(workloads[emit], configs, warmup=0.2, include_output=True)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_generated_workload_step_for_step(workloads: dict[str, list[Request]], isolation: str) -> None:
    """The same workload compared after every request (a difference names the request)."""
    for policy in KERNEL_POLICIES:
        cfg = sim_config(policy=policy, capacity_tokens=2000, block_size=8, isolation=isolation)
        step_both(Case(cfg, True, tuple(workloads["tokens"])))


# ---------------------------------------------------------------------------- gittins and lfuda


def _gittins_of(stepper: CacheStepper) -> Any:
    (pool,) = stepper.cache._ledger.tenancy.pools.values()
    return pool.policy


def test_gittins_steps_like_the_cache_on_a_generated_workload(tmp_path: Any) -> None:
    """Gittins' whole life in the kernel, compared after every request: learned tables
    recomputed many times, ghosts readmitted, leaves told apart (its float ranks break
    ties exactly as the Python policy's, or a victim would differ here)."""
    spec = WorkloadSpec(requests=800, tenants=6, seed=5, duration_s=600.0, emit="hash_ids", block_size=16)
    path = tmp_path / "w.jsonl"
    write_jsonl(spec, path)
    requests = tuple(read_trace(path))
    cfg = sim_config(policy="gittins", capacity_tokens=10_000, block_size=16)
    ref, _ = step_both(Case(cfg, False, requests))
    policy = _gittins_of(ref)
    assert policy._index is not None and policy._tick > 40 * policy._table_every()  # tables, many times
    assert ref.evictions > 5_000 and len(policy._ghost) > 100  # a ghost that readmits
    assert policy._interior  # and the ledger's leaf news


@slow
@pytest.mark.parametrize("policy", ["gittins", "lfuda"])
def test_same_replay_of_mooncake_conversation_for_the_new_policies(conversation: list[Request], policy: str) -> None:
    """Hit tokens, evictions and every other figure, the whole trace at 1M tokens."""
    assert_same_replays(conversation, [sim_config(policy=policy, capacity_tokens=1e6, block_size=512)], warmup=0.5)


# ---------------------------------------------------------------------------- engine selection


CHAT = [
    tok(0.0, [1, 2, 3, 4, 5], "acme", output=[6, 7]),
    tok(1.0, [1, 2, 3, 4, 5, 6, 7, 8], "bolt"),
    tok(2.0, [1, 2, 3, 4, 5, 6, 7, 8, 9], "acme"),
]


def _run(cfg: ReplayConfig, engine: str = "auto", **kwargs: Any) -> ReplayResult:
    (result,) = replay(lambda: CHAT, [cfg], optimal=False, engine=engine, **kwargs)
    return result


@pytest.mark.parametrize("policy", KERNEL_POLICIES)
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_auto_runs_the_kernel_where_it_can(policy: str, isolation: str) -> None:
    cfg = sim_config(policy=policy, capacity_tokens=64, block_size=2, isolation=isolation)
    assert native_unsupported(cfg) == ""
    assert _run(cfg).engine == "native"
    assert isinstance(make_stepper(cfg, summarize(lambda: CHAT), False), KernelStepper)
    assert isinstance(make_stepper(cfg, summarize(lambda: CHAT), False, "python"), CacheStepper)


UNSUPPORTED = {
    "publication": (sim_config(block_size=2, isolation="namespace", publish=PublishConfig(2)), "publication"),
    "partial": (sim_config(block_size=2, partial_blocks=True), "partial blocks"),
}
if not KERNEL_TTL:
    UNSUPPORTED["ttl"] = (sim_config(block_size=2, ttl_seconds=60.0), "TTL")


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_auto_falls_back_to_python_and_native_refuses(case: str) -> None:
    cfg, reason = UNSUPPORTED[case]
    assert reason in native_unsupported(cfg)
    assert _run(cfg).engine == "python"
    with pytest.raises(ValueError, match=reason) as err:
        _run(cfg, "native")
    assert cfg.label in str(err.value)
    with pytest.raises(ValueError, match=reason):
        KernelStepper(cfg, summarize(lambda: CHAT), False)


def test_an_unlimited_ttl_replays_on_auto_as_on_python() -> None:
    """The cache takes ``ttl_seconds=inf`` (nothing expires); ``auto`` must not pick an
    engine that then refuses it."""
    cfg = sim_config(block_size=2, capacity_tokens=8, ttl_seconds=INF)
    assert comparable(_run(cfg)) == comparable(_run(cfg, "python"))


def test_metrics_run_on_python_and_native_refuses() -> None:
    cfg = sim_config(block_size=2)
    seen: list[bytes] = []
    assert _run(cfg, metrics=lambda _cfg, text: seen.append(text)).engine == "python"
    assert seen and b"prefixcache" in seen[0]
    with pytest.raises(ValueError, match="metrics"):
        _run(cfg, "native", metrics=lambda _cfg, text: None)


def test_pre_hashed_trace_with_partial_blocks_runs_native() -> None:
    """A pre-hashed trace has no tokens inside a block: partial blocks are turned off
    for it (``effective_configs``), so nothing stops the kernel."""
    trace = [hashed(0.0, [0, 1], 16, 20), hashed(1.0, [0, 1], 16, 32)]
    (result,) = replay(lambda: trace, [sim_config(partial_blocks=True)], optimal=False)
    assert result.engine == "native"
    assert result.hit_tokens == 32


@pytest.mark.parametrize("engine", ["gpu", "", "Native"])
def test_unknown_engine_is_an_error_listing_the_valid_ones(engine: str) -> None:
    with pytest.raises(ValueError, match="auto, native, python"):
        _run(sim_config(block_size=2), engine)


# ---------------------------------------------------------------------------- kernel guards


def test_kernel_policies_are_the_caches() -> None:
    assert {"lru", "fifo", "s3fifo", "sieve"} <= set(KERNEL_POLICIES) <= set(CACHE_POLICIES)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("nope", 10, 1, False), "nope"),
        (("lru", -1, 1, False), "capacity"),
        (("lru", 10, 0, False), "unit"),
        (("lru", 10, -3, False), "unit"),
    ],
)
def test_tree_refuses_bad_arguments(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _kernel.Tree(*args)


def test_tree_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        _kernel.Tree("nope", 10, 1, False)
    assert all(p in str(err.value) for p in KERNEL_POLICIES)


@pytest.fixture
def tree() -> Any:
    return _kernel.Tree("lru", 100, 1, False)


@pytest.mark.parametrize("root", [1, 3, 4, 7, -1, 2**40])
def test_access_with_a_bad_root_is_an_error(tree: Any, root: int) -> None:
    """Slots 1..3 hold blocks, not roots; the rest hold nothing."""
    tree.access(tree.root(12345), 0, [1, 2, 3])
    with pytest.raises((IndexError, ValueError, OverflowError)):
        tree.access(root, 0, [1, 2, 3])
    assert (len(tree), tree.used) == (3, 3)


@pytest.mark.parametrize("ids", [["a"], [1.5], [1, None], "abc", None, 5, [-1], [-(2**70)]])
def test_access_with_bad_ids_is_an_error(tree: Any, ids: Any) -> None:
    root = tree.root(12345)
    with pytest.raises((TypeError, ValueError, OverflowError)):
        tree.access(root, 0, ids)


def test_ids_of_any_size_are_distinct_blocks(tree: Any) -> None:
    """The trace format allows ids of any size; from 2**64 up the kernel digests them."""
    root = tree.root(12345)
    big = [2**64, 2**64 + 1, 2**200]
    assert tree.access(root, 0, big) == 0
    assert tree.access(root, 0, big) == 3
    assert tree.access(root, 0, [2**64, 2**64 + 2]) == 1
    assert tree.access(root, 0, [0]) == 0
    assert tree.access(root, 0, [2**64 - 1, 2**64]) == 0


def test_a_refused_access_changes_nothing(tree: Any) -> None:
    """Every id is checked before anything is stored: an error part way through the ids
    leaves the tree as it was."""
    root = tree.root(12345)
    assert tree.access(root, 0, [1, 2, 3]) == 0
    with pytest.raises(TypeError):
        tree.access(root, 0, [4, 5, "x"])
    assert (len(tree), tree.used, tree.evictions) == (3, 3, 0)
    assert tree.access(root, 0, [4, 5]) == 0
    assert tree.access(root, 0, [1, 2, 3]) == 3


def test_an_uninitialized_tree_is_an_error_not_a_crash() -> None:
    tree = _kernel.Tree.__new__(_kernel.Tree)
    with pytest.raises(RuntimeError):
        tree.access(0, 0, [1])
    with pytest.raises(RuntimeError):
        tree.root(1)
    ready = _kernel.Tree("lru", 10, 1)
    with pytest.raises(RuntimeError):
        ready.__init__("fifo", 10, 1)


@pytest.mark.parametrize("keys", [(0, 1), (0, 0), (-1, 2**64 - 1)])
def test_roots_are_distinct_whatever_their_keys(tree: Any, keys: tuple[int, int]) -> None:
    """Each root is its own context: keys that mask or mix to one value do not merge them."""
    a, b = (tree.root(k) for k in keys)
    assert tree.access(a, 0, [1, 2]) == 0
    assert tree.access(b, 0, [1, 2]) == 0  # not a's blocks
    assert (tree.access(a, 0, [1, 2]), tree.access(b, 0, [1, 2])) == (2, 2)
    assert (len(tree), tree.collisions) == (4, 0)


@pytest.mark.parametrize("match_blocks", [-2, -(2**40)])
def test_a_negative_match_length_other_than_all_is_an_error(tree: Any, match_blocks: int) -> None:
    root = tree.root(1)
    with pytest.raises(ValueError, match="match_blocks"):
        tree.access(root, 0, [1, 2], match_blocks)
    assert len(tree) == 0


def test_int_subclasses_run_no_python_code(tree: Any) -> None:
    """A huge id of an int subclass is digested with int's own operations: its overrides
    (which could change the tree under the call) never run."""

    class Loud(int):
        def __rshift__(self, other: object) -> int:
            raise AssertionError("ran __rshift__")

        def __bool__(self) -> bool:
            raise AssertionError("ran __bool__")

        def __lt__(self, other: object) -> bool:
            raise AssertionError("ran __lt__")

    root = tree.root(1)
    assert tree.access(root, 0, [Loud(2**70), 5]) == 0
    assert tree.access(root, 0, [2**70, 5]) == 2


@pytest.mark.parametrize("policy", KERNEL_POLICIES)
def test_access_all_is_each_trees_access(policy: str) -> None:
    """``access_all`` (the miniatures' one call per request) gives each tree what its own
    ``access`` gives a twin, decision for decision: the same hits and counters after
    every request, heads and limits included (prefetching changes no decision)."""
    rng = random.Random(7)
    shape = [(c, h) for c in (6, 20, 60, 1 << 40) for h in (0, 3)]
    trees = [_kernel.Tree(policy, c, 4, False, None, h) for c, h in shape]
    twins = [_kernel.Tree(policy, c, 4, False, None, h) for c, h in shape]
    roots: dict[int, tuple[list[int], list[int]]] = {}
    for step in range(600):
        key = rng.randrange(3)
        if key not in roots:
            roots[key] = ([t.root(key) for t in trees], [t.root(key) for t in twins])
        ids = [rng.randrange(4) for _ in range(2)] + [rng.randrange(40) for _ in range(rng.randrange(6))]
        head, limit = rng.choice([(0, -1), (2, -1), (3, 3), (1, 2)])
        got = _kernel.access_all(trees, roots[key][0], ids, float(step), head, limit)
        part = ids if limit < 0 else ids[:limit]
        want = [t.access(r, 0, part, -1, float(step), head) for t, r in zip(twins, roots[key][1], strict=True)]
        assert got == want
        for a, b in zip(trees, twins, strict=True):
            assert (a.used, len(a), a.evictions, a.collisions) == (b.used, len(b), b.evictions, b.collisions)


def test_access_all_refuses_bad_arguments(tree: Any) -> None:
    root = tree.root(1)
    with pytest.raises(ValueError, match="1 trees but 2 roots"):
        _kernel.access_all([tree], [root, root], [1], 0.0, 0)
    with pytest.raises(TypeError, match="not a Tree"):
        _kernel.access_all([object()], [root], [1], 0.0, 0)
    with pytest.raises(IndexError, match="not a root"):
        _kernel.access_all([tree], [root + 5], [1], 0.0, 0)
    with pytest.raises(ValueError, match="head must be >= 0"):
        _kernel.access_all([tree], [root], [1], 0.0, -1)
    with pytest.raises(TypeError, match="block id 1 must be an int"):
        _kernel.access_all([tree], [root], [1, "x"], 0.0, 0)
    assert len(tree) == 0  # a refused call changes nothing
    assert _kernel.access_all([tree], [root], [1, 2, 3], 0.0, 0, 2) == [0]
    assert _kernel.access_all([], [], [1], 0.0, 0) == []
    assert len(tree) == 2
