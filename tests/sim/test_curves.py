"""Hit-rate curves (sim/curves.py, sim/native/_curves.c) against full replays.

The stack engine against a reference LRU tree written here (leaf-only eviction, blocked
entries to the tail, as policies/base.py) in both orders of a request's steps: linking
the missing blocks after touching the cached prefix (the cache's order, which the
kernel must match) or before (the order in which LRU is a stack algorithm, which the
stack must match exactly). The sampled method against full replays: exact at rate 1,
within ``ERROR_BOUND`` at its default sample; the refusals.

Tests that take seconds are marked ``slow``.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.config import CacheConfig
from prefixcache.sim.curves import DEFAULT_SAMPLE, ERROR_BOUND, Curve, curve, unsupported
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.traces import Request
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import generate

_curves = pytest.importorskip("prefixcache.sim.native._curves", reason="the compiled curve engine is not built")
pytest.importorskip("prefixcache.sim.native._kernel", reason="the compiled replay kernel is not built")


def _cfg(policy: str = "lru", isolation: str = "shared", **kw: object) -> ReplayConfig:
    return ReplayConfig(CacheConfig(policy=policy, isolation=isolation, capacity_tokens=1 << 20, **kw))  # type: ignore[arg-type]


def _req(ids: Sequence[int], tenant: str = "t", bs: int = 4, length: int | None = None) -> Request:
    n = len(ids) * bs if length is None else length
    return Request(0.0, tenant, "m", "", n, 0, hash_ids=tuple(ids), block_size=bs)


class _TreeLRU:
    """The ledger's LRU on a tree, in blocks: match, pin, make room (leaves only, blocked
    entries to the tail), link; ``touch_first``: touch the cached prefix before linking
    (the cache) or after (a stack algorithm)."""

    def __init__(self, capacity: int, touch_first: bool) -> None:
        self.capacity, self.touch_first = capacity, touch_first
        self.queue: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.kids: dict[tuple[int, ...], int] = {}

    def access(self, ids: Sequence[int]) -> int:
        path = [tuple(ids[: i + 1]) for i in range(len(ids))]
        hit = 0
        while hit < len(path) and path[hit] in self.queue:
            hit += 1
        if self.touch_first:
            self._touch(path[:hit])
        room = self._make_room(min(len(path) - hit, self.capacity), pinned=path[hit - 1] if hit else None)
        for key in path[hit : hit + room]:
            self.kids[key] = 0
            if len(key) > 1:
                self.kids[key[:-1]] += 1
        for key in reversed(path[hit : hit + room]):  # deepest first
            self.queue[key] = None
        if not self.touch_first:
            self._touch(path[:hit])
        return hit

    def _touch(self, path: list[tuple[int, ...]]) -> None:
        for key in reversed(path):
            self.queue.move_to_end(key)

    def _make_room(self, need: int, pinned: tuple[int, ...] | None) -> int:
        while self.capacity - len(self.queue) < need:
            for _ in range(len(self.queue)):
                key = next(iter(self.queue))
                if self.kids[key] == 0 and key != pinned:
                    del self.queue[key], self.kids[key]
                    if len(key) > 1:
                        self.kids[key[:-1]] -= 1
                    break
                self.queue.move_to_end(key)
            else:
                break
        return max(0, min(need, self.capacity - len(self.queue)))


def _stack_hits(requests: list[Request], capacities: list[int]) -> list[int]:
    stack = _curves.Stack()
    for r in requests:
        assert r.hash_ids is not None
        stack.access(1, r.hash_ids, 1, len(r.hash_ids), True)
    return list(stack.hits(capacities))


_chains = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(_chains, st.integers(1, 12))
def test_the_stack_is_lru_that_touches_after_linking(chains: list[list[int]], capacity: int) -> None:
    requests = [_req(c, bs=1) for c in chains]
    lru = _TreeLRU(capacity, touch_first=False)
    assert sum(lru.access(c) for c in chains) == _stack_hits(requests, [capacity])[0]


@settings(max_examples=60, deadline=None)
@given(_chains, st.integers(1, 12))
def test_the_reference_tree_is_the_caches_lru(chains: list[list[int]], capacity: int) -> None:
    from prefixcache.sim.native import _kernel

    tree = _kernel.Tree("lru", capacity, 1, False, None)
    root = tree.root(1)
    lru = _TreeLRU(capacity, touch_first=True)
    for c in chains:
        assert lru.access(c) == tree.access(root, 0, c, -1, 0.0)


def test_the_caches_lru_is_no_stack_algorithm() -> None:
    """[a] then [a b] leave a older than its new child b; [c] fills 3 blocks; [d e]
    needs 2: LRU skips a (it has a child), moving it to the tail, and evicts b, then c.
    The stack evicts b, then a: so [a] hits in the cache and misses in the stack."""
    chains = [[1], [1, 2], [3], [4, 5], [1]]
    lru = _TreeLRU(3, touch_first=True)
    assert [lru.access(c) for c in chains] == [0, 1, 0, 0, 1]
    assert _stack_hits([_req(c, bs=1) for c in chains], [3]) == [1]  # the second request's [a] only


def test_stack_weighs_tokens_and_counts_after_the_warm_up() -> None:
    stack = _curves.Stack()
    stack.access(7, [1, 2, 3], 4, 10, False)  # blocks of 4 tokens, the last one 2
    assert stack.access(7, [1, 2, 3], 4, 10, True) == 3
    assert stack.hits([0, 1, 2, 3, None]) == [0, 4, 8, 10, 10]
    assert stack.blocks == 3 and stack.lookups == 6 and stack.cold == 0


def test_stack_curve_matches_a_replay_where_nothing_is_both_hit_and_linked() -> None:
    """One-block requests: no parent ever gets a new child, so stack and cache agree."""
    rng = random.Random(3)
    requests = [_req([rng.randrange(60)], tenant=f"t{rng.randrange(3)}") for _ in range(2000)]
    caps = [4.0, 40.0, 100.0, 200.0, math.inf]
    for isolation in ("shared", "namespace"):
        cfg = _cfg(isolation=isolation)
        ref = curve(lambda: iter(requests), cfg, caps, method="replay", warmup=0.3)
        got = curve(lambda: iter(requests), cfg, caps, method="stack", warmup=0.3)
        assert got.token_hit_rates == pytest.approx(ref.token_hit_rates, abs=1e-12)
        assert (got.requests, got.lookup_tokens) == (ref.requests, ref.lookup_tokens)


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "fifo", "sieve", "lfuda", "gittins"])
def test_sampled_at_rate_one_is_the_replay(synthetic: list[Request], policy: str) -> None:
    caps = [1e5, 1e6, 1e7, math.inf]
    ref = curve(lambda: iter(synthetic), _cfg(policy), caps, method="replay", warmup=0.5)
    got = curve(lambda: iter(synthetic), _cfg(policy), caps, method="sampled", rate=1.0, warmup=0.5)
    assert got.token_hit_rates == pytest.approx(ref.token_hit_rates, abs=1e-9)
    assert (got.sampling_rate, got.error_bound, got.method) == (1.0, 0.0, "sampled")


def _max_error(requests: list[Request], policy: str, isolation: str, **kw: object) -> tuple[float, Curve]:
    cfg = _cfg(policy, isolation)
    ref = curve(lambda: iter(requests), cfg, None, method="replay")
    got = curve(lambda: iter(requests), cfg, ref.capacities, **kw)  # type: ignore[arg-type]
    return max(abs(a - b) for a, b in zip(ref.token_hit_rates, got.token_hit_rates, strict=True)), got


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_default_curves_of_the_mooncake_traces(
    synthetic: list[Request], conversation: list[Request], policy: str
) -> None:
    for requests in (synthetic, conversation):
        error, got = _max_error(requests, policy, "shared")
        assert got.sampling_rate == 1.0 and got.error_bound == 0.0 and error <= ERROR_BOUND


def _workload(requests: int) -> list[Request]:
    spec = WorkloadSpec(requests=requests, tenants=16, seed=1, max_turns=12, sessions_per_tenant=50)
    return [
        Request(
            r["timestamp"],
            r["tenant"],
            r["model"],
            r.get("endpoint", ""),
            r["input_length"],
            r.get("output_length", 0),
            hash_ids=tuple(r["hash_ids"]),
            block_size=r["block_size"],
        )
        for r in generate(spec)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["s3fifo", "sieve"])
def test_sampled_error_on_a_generated_workload(policy: str) -> None:
    """A 20,000-request workload (5 M block lookups) at a rate of 0.6: 3 M lookups kept,
    fewer than the default sample (``DEFAULT_SAMPLE``) keeps. SIEVE: the policy whose
    miniatures err most (docs/simulator.md)."""
    requests = _workload(20_000)
    assert 0.6 * sum(len(r.hash_ids or ()) for r in requests) < DEFAULT_SAMPLE
    error, got = _max_error(requests, policy, "namespace", rate=0.6)
    assert got.sampling_rate == 0.6 and error <= ERROR_BOUND


@pytest.mark.parametrize("policy", ["lru", "sieve", "gittins"])
def test_the_unlimited_point_is_exact_at_any_rate(policy: str) -> None:
    """Below the heads the kept requests' hits are scaled by what an unlimited cache hits
    there over all requests against over the kept ones (``miniatures.Tally``); at
    unlimited capacity a miniature hits below the head exactly that, and in the head
    what the cache does, so the point is exact whatever the draw."""
    requests = _workload(600)
    cfg = _cfg(policy, "namespace")
    caps = [2_000.0 * 16, math.inf]
    ref = curve(lambda: iter(requests), cfg, caps, method="replay")
    for seed in (0, 1):
        got = curve(lambda: iter(requests), cfg, caps, method="sampled", rate=0.3, seed=seed)
        assert got.token_hit_rates[-1] == pytest.approx(ref.token_hit_rates[-1], abs=1e-12)


def test_a_tally_counts_heads_over_all_requests_and_scales_what_lies_below() -> None:
    from prefixcache.sim.miniatures import Tally

    tally = Tally(2, 4, True)
    tally.kept([3, 1], 2, 16)  # 2 head blocks, then 2 more: hits of 3 and 1 blocks
    tally.seen(4, 2, 16, kept=True)  # an unlimited cache: 2 blocks below the head
    tally.dropped([3, 2], 2, 12)  # the head and unit only: 2 head blocks at most
    tally.seen(3, 2, 12, kept=False)  # 1 below
    assert (tally.head, tally.below) == ([16, 12], [4, 0])
    assert (tally.seen_all, tally.seen_kept) == (12, 8)
    assert tally.rates(28) == pytest.approx([(16 + 4 * 12 / 8) / 28, 12 / 28])
    assert Tally(1, 4, True).rates(0) == [0.0]


def test_auto_draws_every_policy_by_its_miniatures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack is textbook LRU, not the cache's: ``auto`` never takes it."""
    import prefixcache.sim.curves as curves

    requests = [_req([i % 7, i]) for i in range(50)]
    monkeypatch.setattr(curves, "DEFAULT_SAMPLE", 10)
    for policy in ("lru", "fifo"):
        got = curve(lambda: iter(requests), _cfg(policy), [8.0])
        assert got.method == "sampled" and got.sampling_rate is not None and got.sampling_rate < 1


def test_curve_reads_and_inverts() -> None:
    c = Curve("lru", 16, "shared", (100.0, 200.0, math.inf), (0.2, 0.4, 0.5), "stack")
    assert c.hit_rate_at(50) == pytest.approx(0.1) and c.hit_rate_at(150) == pytest.approx(0.3)
    assert c.hit_rate_at(1e9) == 0.5
    assert c.capacity_for(0.3) == pytest.approx(150.0) and c.capacity_for(0.45) == math.inf
    assert c.capacity_for(0.6) is None and c.capacity_for(0.0) == 0.0
    assert c.to_json()["capacities"] == [100.0, 200.0, None]


def test_refusals() -> None:
    assert "partitioned" in unsupported(_cfg(isolation="partitioned"))
    assert "LRU only" in unsupported(_cfg("s3fifo"), "stack")
    assert "TTL" in unsupported(_cfg(ttl_seconds=60.0), "stack")
    assert "tree mode" in unsupported(ReplayConfig(_cfg().cache, mode="flat"))
    assert "unknown curve method" in unsupported(_cfg(), "magic")
    assert unsupported(_cfg(ttl_seconds=60.0)) == ""
    source = lambda: iter([_req([1])])  # noqa: E731
    with pytest.raises(ValueError, match="partitioned"):
        curve(source, _cfg(isolation="partitioned"))
    with pytest.raises(ValueError, match="applies to method 'sampled'"):
        curve(source, _cfg(), method="stack", rate=0.5)
    with pytest.raises(ValueError, match="rate must be in"):
        curve(source, _cfg(), rate=0.0)
    with pytest.raises(ValueError, match="capacities"):
        curve(source, _cfg(), [-1.0])


def test_a_miniatures_head_blocks_cost_their_own_unit() -> None:
    """``head_unit``: a request's first ``head`` new blocks cost it, the rest ``unit``;
    eviction gives back what each block cost."""
    from prefixcache.sim.native import _kernel

    tree = _kernel.Tree("lru", 12, 4, False, None, 1)
    root = tree.root(1)
    assert tree.access(root, 0, [1, 2, 3], -1, 0.0, 2) == 0
    assert (tree.used, len(tree)) == (1 + 1 + 4, 3)
    assert tree.access(root, 0, [1, 2, 4], -1, 0.0, 2) == 2  # a sibling leaf: 4 more
    assert (tree.used, len(tree)) == (10, 4)
    assert tree.access(root, 0, [5], -1, 0.0, 0) == 0  # 4 more: the oldest leaf (3) leaves
    assert (tree.used, len(tree), tree.evictions) == (10, 4, 1)
    with pytest.raises(ValueError, match="head must be >= 0"):
        tree.access(root, 0, [1], -1, 0.0, -1)
    with pytest.raises(ValueError, match="head_unit"):
        _kernel.Tree("lru", 12, 4, False, None, -1)


def test_capacities_too_small_for_a_miniature_are_replayed_whole() -> None:
    """A miniature that would hold fewer than ``MIN_INSERTS`` requests' new blocks is
    replayed at rate 1: those points equal the replay's, the others are sampled."""
    from prefixcache.sim.miniatures import MIN_INSERTS

    requests = _workload(1_500)
    new = len({(r.tenant, r.hash_ids[: i + 1]) for r in requests for i in range(len(r.hash_ids or ()))})
    inserts = new / len(requests)
    bs = requests[0].block_size
    assert bs is not None
    rate = 0.5
    small = [c * bs for c in (inserts, 10 * inserts, 0.9 * MIN_INSERTS * inserts / rate)]
    caps = [*small, 4 * MIN_INSERTS * inserts / rate * bs]
    ref = curve(lambda: iter(requests), _cfg("s3fifo", "namespace"), caps, method="replay")
    got = curve(lambda: iter(requests), _cfg("s3fifo", "namespace"), caps, method="sampled", rate=rate)
    assert got.token_hit_rates[:3] == pytest.approx(ref.token_hit_rates[:3], abs=1e-12)
    assert got.token_hit_rates[3] != ref.token_hit_rates[3]  # sampled: near, not equal
    assert got.sampling_rate == rate and got.error_bound is None


@pytest.mark.parametrize("policy", ["lru", "gittins"])
def test_the_curve_is_the_same_in_any_number_of_processes(policy: str) -> None:
    """The trees are split into parts, each replayed in its own process (forks.py):
    the whole capacities, the miniatures and the unlimited tree land in different
    parts, and the curve does not change by a bit."""
    from prefixcache.sim.miniatures import MIN_INSERTS, split

    requests = _workload(1_500)
    new = len({(r.tenant, r.hash_ids[: i + 1]) for r in requests for i in range(len(r.hash_ids or ()))})
    inserts, bs, rate = new / len(requests), requests[0].block_size or 1, 0.5
    caps = [c * inserts * bs for c in (1, 10, 0.9 * MIN_INSERTS / rate, 4 * MIN_INSERTS / rate, 8 * MIN_INSERTS / rate)]
    caps.append(math.inf)
    parts = split(3, 3, True, rate, 3)
    assert len(parts) == 3 and sum(len(p.small) + len(p.large) + p.seen for p in parts) == 7
    got = [
        curve(lambda: iter(requests), _cfg(policy, "namespace"), caps, method="sampled", rate=rate, jobs=jobs)
        for jobs in (1, 2, 3, 16)
    ]
    assert all(g.token_hit_rates == got[0].token_hit_rates for g in got[1:])
    assert all((g.requests, g.lookup_tokens) == (got[0].requests, got[0].lookup_tokens) for g in got[1:])
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        curve(lambda: iter(requests), _cfg(policy), caps, jobs=0)
    with pytest.raises(ValueError, match="jobs apply to method 'sampled', not 'replay'"):
        curve(lambda: iter(requests), _cfg(policy), caps, method="replay", jobs=2)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6), st.integers(0, 25), st.booleans(), st.floats(0.01, 1.0), st.integers(1, 40))
def test_a_split_holds_every_tree_once_in_at_most_jobs_parts(
    small: int, large: int, seen: bool, rate: float, jobs: int
) -> None:
    from prefixcache.sim.miniatures import split

    parts = split(small, large, seen, rate, jobs)
    assert 1 <= len(parts) <= max(1, jobs)
    assert sorted(i for p in parts for i in p.small) == list(range(small))
    assert sorted(i for p in parts for i in p.large) == list(range(large))
    assert sum(p.seen for p in parts) == seen
    trees = small + large + seen
    assert trees == 0 or all(p.small or p.large or p.seen for p in parts)
    weights = [len(p.small) + p.seen + rate * len(p.large) for p in parts]
    assert max(weights) - min(weights) <= 1.0 + 1e-9  # no part waits on another by more than one tree
