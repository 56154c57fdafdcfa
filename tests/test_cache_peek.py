"""``PrefixCache.peek``: a scheduler's question, asked again and again, that must change
nothing.

The twin tests run one sequence of operations on two caches, one of them peeked at
between the steps, and require them to stay the same cache: stats, events, which
blocks survive in which tier, what every later match and load returns."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guard_store import guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache.cache import Peek, PrefixCache
from prefixcache.cache.stats import CacheStats
from prefixcache.config import CacheConfig, PublishConfig
from prefixcache.hashing import CacheContext
from redis_server import RedisServer
from support import Clock
from test_cache_tiers import check_tiers, disk, mem, rds
from test_index import LengthHash
from tier_worker import BLOCK, CTX, SEED, cache_with, kv_for, prompt, store
from tier_worker import layout as tiny_layout

BS = BLOCK
PIECES = [list(range(10 * i + 1, 10 * i + 1 + n)) for i, n in enumerate((3, 4, 5, 8, 9, 2))]
prompts = st.lists(st.sampled_from(range(len(PIECES))), min_size=0, max_size=5).map(
    lambda idx: [tok for i in idx for tok in PIECES[i]]
)
TENANTS = ("a", "b", "c")
MODELS = ("m1", "m2")
peeks = st.lists(st.tuples(prompts, st.sampled_from(TENANTS), st.integers(1, 5)), max_size=3)
ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "match", "match", "tick", "bump"]),
        prompts,
        st.sampled_from(TENANTS),
        st.sampled_from(MODELS),
        peeks,
    ),
    max_size=25,
)


def comparable(stats: CacheStats) -> CacheStats:
    """A snapshot without the tiers' load timings (two caches never take the same time)."""
    return replace(stats, tiers=tuple(replace(t, load_seconds=None) for t in stats.tiers))  # type: ignore[arg-type]


def residency(cache: PrefixCache) -> dict[bytes, tuple[int, int]]:
    """Every cached block, with the tiers holding it (0s for a metadata-only cache)."""
    return {
        key: (b.res.held, b.res.pending) if b.res is not None else (0, 0) for key, b in cache._ledger.tree.nodes.items()
    }


def run_twins(make: Any, steps: list[Any], kv: bool) -> None:
    """``steps`` on two caches; the first is peeked before each step (and before each
    match, at the prompt it matches, which must agree with the match)."""
    clocks = Clock(), Clock()
    peeked, twin = make(clocks[0]), make(clocks[1])
    try:
        for kind, tokens, tenant, model, asked in steps:
            ctx = CacheContext(tenant=tenant, model=model)
            stats, roots, held = comparable(peeked.stats()), len(peeked._ledger.contexts), residency(peeked)
            for p_tokens, p_tenant, times in asked:
                p_ctx = CacheContext(tenant=p_tenant, model=model)
                answers = {peeked.peek(p_tokens, p_ctx) for _ in range(times)}
                assert len(answers) == 1  # asking again gives the same answer: nothing moved
            assert comparable(peeked.stats()) == stats
            assert peeked.take_events() == []
            assert len(peeked._ledger.contexts) == roots and residency(peeked) == held
            if kind == "insert":
                kwargs = {"kv": kv_for(tokens)} if kv and tokens else {}
                if kv and not tokens:
                    continue
                assert peeked.insert(tokens, ctx, **kwargs) == twin.insert(tokens, ctx, **kwargs)
            elif kind == "match":
                ahead = peeked.peek(tokens, ctx)
                with peeked.match(tokens, ctx) as m, twin.match(tokens, ctx) as t:
                    assert (ahead.num_blocks, ahead.cached_tokens) == (m.num_blocks, m.cached_tokens)
                    assert ahead.partial_tokens == m.partial_tokens and ahead.probed_blocks == 0
                    assert (m.cached_tokens, m.block_keys) == (t.cached_tokens, t.block_keys)
                    if kv:
                        got, want = peeked.load(m), twin.load(t)
                        assert got.tokens == want.tokens and np.array_equal(got.kv, want.kv)
            elif kind == "tick":
                for clock in clocks:
                    clock.now += 3.0
            else:
                assert peeked.bump_epoch(model) == twin.bump_epoch(model)
            assert comparable(peeked.stats()) == comparable(twin.stats())
            assert peeked.take_events() == twin.take_events()
            assert residency(peeked) == residency(twin)
            assert len(peeked._ledger.contexts) == len(twin._ledger.contexts)
        for tokens in ([t for p in PIECES for t in p], *PIECES):  # what survived answers alike
            for model in MODELS:
                ctx = CacheContext(tenant="a", model=model)
                with peeked.match(tokens, ctx) as m, twin.match(tokens, ctx) as t:
                    assert m.block_keys == t.block_keys
        for i in range(12):  # a flood of new prompts: both evict the same blocks, in the same order
            flood, ctx = [1000 + 100 * i + j for j in range(4 * BS)], CacheContext(tenant="a", model="m1")
            kwargs = {"kv": kv_for(flood)} if kv else {}
            assert peeked.insert(flood, ctx, **kwargs) == twin.insert(flood, ctx, **kwargs)
            assert residency(peeked) == residency(twin)
            assert peeked.take_events() == twin.take_events()
    finally:
        peeked.close()
        twin.close()


# ============================================================================ peek changes nothing


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=ops,
    isolation=st.sampled_from(["shared", "namespace", "partitioned"]),
    policy=st.sampled_from(["lru", "s3fifo", "lfuda", "sieve"]),
    partial=st.booleans(),
    capacity_blocks=st.sampled_from([3, 8, 40]),
    ttl=st.sampled_from([None, 5.0]),
    publish=st.booleans(),
)
def test_peeks_leave_a_metadata_cache_as_its_twin(
    steps: list[Any], isolation: str, policy: str, partial: bool, capacity_blocks: int, ttl: float | None, publish: bool
) -> None:
    config = CacheConfig(
        block_size=BS,
        capacity_tokens=capacity_blocks * BS,
        policy=policy,
        isolation=isolation,
        partial_blocks=partial,
        ttl_seconds=ttl,
        publish=PublishConfig(min_tenants=2, min_tokens=2 * BS) if publish and isolation != "shared" else None,
    )
    run_twins(lambda clock: PrefixCache(config, clock=clock), steps, kv=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=ops,
    frames=st.sampled_from([(3,), (2, 5)]),
    partial=st.booleans(),
    ttl=st.sampled_from([None, 5.0]),
    policy=st.sampled_from(["lru", "s3fifo"]),
)
def test_peeks_leave_a_tiered_cache_as_its_twin(
    steps: list[Any], frames: tuple[int, ...], partial: bool, ttl: float | None, policy: str
) -> None:
    tiers = tuple(mem(n, name=f"mem{i}") for i, n in enumerate(frames))
    config = CacheConfig(
        block_size=BS,
        seed=SEED,
        kv_layout=tiny_layout(),
        tiers=tiers,
        writer="inline",
        partial_blocks=partial,
        ttl_seconds=ttl,
        policy=policy,
    )
    run_twins(lambda clock: PrefixCache(config, clock=clock), steps, kv=True)


# ============================================================================ peek == match


def test_peek_agrees_with_match_through_ttl_and_epoch_bumps() -> None:
    rng = np.random.default_rng(7)
    clock = Clock()
    cache = PrefixCache(CacheConfig(block_size=BS, ttl_seconds=10.0, partial_blocks=True), clock=clock)
    ctx = CacheContext(tenant="t", model="m")
    stored = [list(rng.integers(1, 4, size=int(rng.integers(1, 30)))) for _ in range(60)]

    def asked() -> list[list[int]]:
        picks = [stored[int(i)] for i in rng.integers(0, len(stored), 80)]
        return picks + [list(rng.integers(1, 4, size=int(rng.integers(0, 30)))) for _ in range(80)]

    def agree(expect_hits: bool) -> None:
        hits = 0
        for tokens in asked():
            ahead = cache.peek(tokens, ctx)
            with cache.match(tokens, ctx) as m:
                assert (ahead.num_blocks, ahead.partial_tokens, ahead.cached_tokens) == (
                    m.num_blocks,
                    m.partial_tokens,
                    m.cached_tokens,
                )
                hits += m.cached_tokens > 0
        assert (hits > 0) == expect_hits

    for i, tokens in enumerate(stored):
        clock.now = i * 0.25  # a spread of ages: some expire before others
        cache.insert(tokens, ctx)
    clock.now = 20.0  # the older half has expired
    agree(True)
    clock.now = 100.0  # everything has expired, and is not matched
    agree(False)
    for tokens in stored:
        cache.insert(tokens, ctx)
    agree(True)
    cache.bump_epoch("m")
    agree(False)  # stale: matched by neither
    for tokens in stored[:20]:
        cache.insert(tokens, ctx)
    agree(True)


def test_a_collision_peek_catches_is_not_counted() -> None:
    cache = PrefixCache(CacheConfig(block_size=BS, seed="weak"), hash_factory=LengthHash)
    p, q = [1, 2, 3, 4, 5, 5, 5, 5, 6, 6, 6, 6], [1, 2, 3, 4, 7, 7, 7, 7, 8, 8, 8, 8]
    cache.insert(p, CTX)
    for _ in range(3):
        assert cache.peek(q, CTX) == Peek(1, BS)  # P's keys collide with Q's: caught, Q gets the shared block
    assert cache.stats().collisions == 0
    with cache.match(q, CTX) as m:
        assert m.cached_tokens == BS
    assert cache.stats().collisions == 1


def test_peek_of_an_unseen_context_leaves_no_root() -> None:
    cache = PrefixCache(CacheConfig(block_size=BS))
    cache.insert([1, 2, 3, 4], CTX)
    roots = len(cache._ledger.contexts)
    assert cache.peek([1, 2, 3, 4], CacheContext(tenant="nobody", model="m")) == Peek(0, 0)
    assert cache.peek([1, 2, 3, 4], CacheContext(tenant="acme", model="other")) == Peek(0, 0)
    assert len(cache._ledger.contexts) == roots


# ============================================================================ peek and a probing tier


def test_peek_counts_blocks_on_a_reopened_disk_without_adopting_them(tmp_path: Path) -> None:
    with cache_with(mem(64, write="through"), disk(tmp_path)) as first:
        for i in range(3):
            store(first, prompt(i))
    with cache_with(mem(64), disk(tmp_path)) as cache:
        books = cache._ledger.books
        assert books is not None
        orphans = set(books.tiers[1].orphans)
        stats, events = comparable(cache.stats()), cache.drain(residency=True)
        for _ in range(3):
            assert cache.peek(prompt(1), CTX) == Peek(6, 6 * BS, 0, 6)
            assert cache.peek(prompt(1)[:10], CTX) == Peek(2, 2 * BS, 0, 2)
            assert cache.peek(prompt(9), CTX) == Peek(1, BS, 0, 1)  # the shared first block
        assert len(cache) == 0 and books.tiers[1].orphans == orphans
        assert comparable(cache.stats()) == stats
        assert cache.drain(residency=True) == replace(events, events=[])
        with cache.match(prompt(1), CTX) as m:  # the match still adopts them
            assert m.num_blocks == 6 and m.tier_tokens == {"memory": 0, "disk": 6 * BS}
        assert len(cache) == 6 and len(books.tiers[1].orphans) == len(orphans) - 6
        assert cache.peek(prompt(2), CTX) == Peek(6, 6 * BS, 0, 5)  # one in the tree, five on disk
        with cache.match(prompt(2), CTX) as m:
            assert m.num_blocks == 6
            assert cache.load(m).tokens == 6 * BS
        cache.bump_epoch("m")
        assert cache.peek(prompt(0), CTX) == Peek(0, 0)  # another epoch: other keys, found nowhere
        check_tiers(cache)


def test_peek_counts_what_another_server_put_in_redis_without_adopting_it(redis_server: RedisServer) -> None:
    with (
        cache_with(mem(64, write="through"), rds(redis_server.url)) as writer,
        cache_with(mem(64), rds(redis_server.url)) as cache,
    ):
        store(writer, prompt(1))
        assert writer.flush(timeout=30)
        stats = comparable(cache.stats())
        assert cache.peek(prompt(1), CTX) == Peek(6, 6 * BS, 0, 6)
        assert len(cache) == 0 and comparable(cache.stats()) == stats and cache.take_events() == []
        with cache.match(prompt(1), CTX) as m:
            assert m.num_blocks == 6 and cache.load(m).tokens == 6 * BS


def test_an_epoch_bump_during_a_peek_probe_is_not_served(tmp_path: Path) -> None:
    with cache_with(mem(64, write="through"), disk(tmp_path)) as first:
        store(first, prompt(1))
    with cache_with(mem(64), disk(tmp_path)) as cache:
        io = cache._io
        assert io is not None
        run_probe = io.run_probe

        def bumped(probe: Any) -> tuple[int, int]:
            found = run_probe(probe)
            cache.bump_epoch("m")
            return found

        io.run_probe = bumped  # type: ignore[method-assign]
        assert cache.peek(prompt(1), CTX) == Peek(0, 0)
        io.run_probe = run_probe  # type: ignore[method-assign]
        with cache.match(prompt(1), CTX) as m:
            assert m.cached_tokens == 0
