"""PrefixCache: the public API, capacity and eviction, pins, invalidation, purge, TTL,
events, stats and input validation."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import xxhash

from prefixcache import (
    BlocksRemoved,
    BlocksStored,
    CacheConfig,
    CacheContext,
    EpochBumped,
    Match,
    PrefixCache,
    RemovalReason,
)
from prefixcache.cache.stats import PoolStats, TenantStats
from prefixcache.hashing import token_bytes
from prefixcache.policies import POLICIES
from support import Clock, lcp

POLICY_NAMES = sorted(POLICIES)
ACME = CacheContext(tenant="acme", model="smollm2")


def seq(base: int, n: int) -> list[int]:
    """``n`` consecutive token ids from ``base``: prompts with distinct bases share nothing."""
    return list(range(base, base + n))


def make(**kwargs: Any) -> PrefixCache:
    settings: dict[str, Any] = {"block_size": 4, "capacity_tokens": 10_000}
    settings.update(kwargs)
    clock = settings.pop("clock", None)
    config = CacheConfig(**settings)
    return PrefixCache(config) if clock is None else PrefixCache(config, clock=clock)


def hit(cache: PrefixCache, tokens: list[int], ctx: CacheContext = ACME) -> int:
    """Cached tokens of ``tokens``, without keeping the pin."""
    with cache.match(tokens, ctx) as m:
        return m.cached_tokens


def removed(events: list[Any], reason: RemovalReason) -> list[BlocksRemoved]:
    return [e for e in events if isinstance(e, BlocksRemoved) and e.reason is reason]


# ====================================================================== public API


def test_public_api_with_a_repeated_shared_prefix() -> None:
    cache = PrefixCache(
        CacheConfig(block_size=16, capacity_tokens=100_000, policy="s3fifo", isolation="namespace", partial_blocks=True)
    )
    ctx = CacheContext(tenant="acme", model="smollm2")
    system = seq(1000, 32)
    first = system + seq(5000, 10)  # 2 full blocks + a tail of 10
    second = [*system, *first[32:35], *seq(9000, 17)]  # shares 35 tokens with the first

    m = cache.match(first, ctx)
    assert isinstance(m, Match)
    assert m.cached_tokens == 0
    m.release()
    assert cache.insert(first, ctx) == 42

    with cache.match(second, ctx) as m:
        assert m.cached_tokens == 35
        assert (m.num_blocks, m.partial_tokens) == (2, 3)
        assert not m.released
    assert m.released
    m.release()  # twice is harmless

    assert hit(cache, first, ctx) == 42
    assert hit(cache, system, ctx) == 32
    assert hit(cache, system[:20], ctx) == 20  # token-granular inside the second block
    assert hit(cache, [*system[:20], 7], ctx) == 20
    assert hit(cache, seq(1, 40), ctx) == 0

    assert cache.insert(second, ctx) == 20  # only what follows the cached 32
    assert hit(cache, second, ctx) == 52
    assert hit(cache, first, ctx) == 42

    stats = cache.stats()
    assert stats.lookups == 9
    assert stats.hit_tokens == 35 + 42 + 32 + 20 + 20 + 52 + 42
    assert stats.hit_requests == 7
    assert stats.used_tokens == 42 + 20
    assert stats.tenants["acme"].inserted_tokens == 62
    assert stats.evictions == 0 and stats.collisions == 0


def test_full_blocks_only_without_partial_blocks() -> None:
    cache = make(block_size=16)
    tokens = seq(0, 42)
    assert cache.insert(tokens, ACME) == 32  # the tail of 10 is not cached
    assert hit(cache, tokens) == 32
    assert hit(cache, tokens[:40]) == 32
    assert hit(cache, tokens[:31]) == 16
    assert cache.stats().used_tokens == 32


def test_block_keys_are_root_most_first_and_unreadable_after_release() -> None:
    cache = make()
    cache.insert(seq(0, 12), ACME)
    m = cache.match(seq(0, 12), ACME)
    keys = m.block_keys
    assert len(keys) == 3 and len(set(keys)) == 3
    with cache.match(seq(0, 8), ACME) as shorter:
        assert shorter.block_keys == keys[:2]
    m.release()
    with pytest.raises(RuntimeError):
        _ = m.block_keys
    assert cache.match(seq(100, 8), ACME).block_keys == ()


def test_reinserting_a_cached_prompt_stores_nothing_and_is_no_collision() -> None:
    cache = make(partial_blocks=True)
    tokens = seq(0, 10)  # two full blocks and a tail of 2
    assert cache.insert(tokens, ACME) == 10
    assert cache.insert(tokens, ACME) == 0
    assert cache.insert(tokens[:8], ACME) == 0
    stats = cache.stats()
    assert stats.collisions == 0
    assert stats.used_tokens == 10
    assert stats.blocks == 3
    assert hit(cache, tokens) == 10


def test_a_longer_tail_replaces_a_shorter_one() -> None:
    cache = make(partial_blocks=True)
    cache.insert(seq(0, 6), ACME)  # block + tail of 2
    assert cache.insert(seq(0, 11), ACME) == 7  # block + tail of 3 ... replaces the tail of 2
    stats = cache.stats()
    assert stats.removed(RemovalReason.REPLACED) == 1
    assert stats.used_tokens == 11
    assert hit(cache, seq(0, 6)) == 6
    assert hit(cache, seq(0, 11)) == 11


def test_a_weak_hash_never_gives_a_wrong_answer() -> None:
    """Invariant 3: with one-byte keys, collisions are everywhere; they are counted
    misses, and a match never claims a token that no inserted prompt had."""

    class OneByte:
        def __init__(self, inner: Any = None) -> None:
            self.inner = inner if inner is not None else xxhash.xxh3_64()

        def update(self, data: Any) -> None:
            self.inner.update(data)

        def copy(self) -> OneByte:
            return OneByte(self.inner.copy())

        def digest(self) -> bytes:
            return self.inner.digest()[:1]

    cache = PrefixCache(CacheConfig(block_size=4, capacity_tokens=100_000), hash_factory=OneByte)
    rng = random.Random(3)
    inserted: list[list[int]] = []
    for _ in range(120):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(4, 24))]
        with cache.match(tokens, ACME) as m:
            best = max((lcp(tokens, p) for p in inserted), default=0)
            assert m.cached_tokens <= best
            assert m.cached_tokens % 4 == 0
        cache.insert(tokens, ACME)
        inserted.append(tokens)
    assert cache.stats().collisions > 0


# ====================================================================== capacity


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_capacity_is_never_exceeded(policy: str) -> None:
    cache = make(capacity_tokens=120, policy=policy, partial_blocks=True)
    rng = random.Random(7)
    systems = [seq(10_000 * (i + 1), 4 * rng.randrange(1, 6)) for i in range(5)]
    for step in range(300):
        tokens = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        cache.insert(tokens, ACME)
        stats = cache.stats()
        assert stats.used_tokens <= 120, step
        assert stats.used_tokens == stats.pools["*"].used_tokens
        # nothing is pinned, and the prompt fits: it is all there after its insert
        assert hit(cache, tokens) == len(tokens), step
    stats = cache.stats()
    assert stats.evictions > 0
    assert stats.evictions == stats.pools["*"].evictions
    evicted = removed(cache.take_events(), RemovalReason.EVICTED)
    assert len(evicted) == stats.evictions
    assert sum(e.num_tokens for e in evicted) == stats.evicted_tokens


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_block_after_capacity_evicts(policy: str) -> None:
    n = 5
    cache = make(capacity_tokens=4 * n, policy=policy)
    for i in range(n):
        assert cache.insert(seq(100 * i, 4), ACME) == 4
    stats = cache.stats()
    assert (stats.used_tokens, stats.evictions) == (4 * n, 0)
    assert all(hit(cache, seq(100 * i, 4)) == 4 for i in range(n))

    assert cache.insert(seq(100 * n, 4), ACME) == 4
    stats = cache.stats()
    assert (stats.used_tokens, stats.evictions, stats.evicted_tokens) == (4 * n, 1, 4)
    assert sum(hit(cache, seq(100 * i, 4)) == 4 for i in range(n + 1)) == n
    assert hit(cache, seq(100 * n, 4)) == 4


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_eviction_is_leaf_first(policy: str) -> None:
    """A shared prefix of 2 blocks with many one-block children: children leave, the
    prefix that they hang under never does."""
    cache = make(capacity_tokens=4 * 7, policy=policy)
    prefix = seq(0, 8)
    for i in range(1, 25):
        cache.insert(prefix + seq(1000 * i, 4), ACME)
        assert hit(cache, prefix) == 8, i
        assert cache.stats().used_tokens <= 28
    children = sum(hit(cache, prefix + seq(1000 * i, 4)) == 12 for i in range(1, 25))
    assert children == 5  # 7 blocks: the prefix's 2 and 5 children
    assert cache.stats().evictions == 24 - 5


# ====================================================================== pins


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_pinned_blocks_are_never_evicted(policy: str) -> None:
    cache = make(capacity_tokens=32, policy=policy)
    held = seq(0, 8)
    cache.insert(held, ACME)
    m = cache.match(held, ACME)
    assert m.cached_tokens == 8
    for i in range(1, 30):
        cache.insert(seq(1000 * i, 8), ACME)
        assert cache.stats().used_tokens <= 32
    assert cache.stats().evictions > 0
    assert hit(cache, held) == 8
    m.release()
    if policy == "lru":  # once released it may go (SIEVE and LFU rightly keep a hit block longer)
        for i in range(30, 40):
            cache.insert(seq(1000 * i, 8), ACME)
        assert hit(cache, held) == 0


def test_insert_declines_when_everything_is_pinned() -> None:
    cache = make(capacity_tokens=16)
    prompts = [seq(100 * i, 4) for i in range(4)]
    for p in prompts:
        cache.insert(p, ACME)
    held = [cache.match(p, ACME) for p in prompts]
    assert [m.cached_tokens for m in held] == [4, 4, 4, 4]

    assert cache.insert(seq(900, 4), ACME) == 0
    stats = cache.stats()
    assert (stats.used_tokens, stats.evictions, stats.declined_tokens) == (16, 0, 4)
    assert hit(cache, seq(900, 4)) == 0
    assert all(hit(cache, p) == 4 for p in prompts)

    held[0].release()
    assert cache.insert(seq(900, 4), ACME) == 4
    assert cache.stats().evictions == 1
    assert hit(cache, prompts[0]) == 0
    for m in held[1:]:
        m.release()


def test_insert_stores_what_fits_around_pins() -> None:
    cache = make(capacity_tokens=16)
    for i in range(4):
        cache.insert(seq(100 * i, 4), ACME)
    held = [cache.match(seq(100 * i, 4), ACME) for i in range(2)]
    assert cache.insert(seq(900, 12), ACME) == 8  # room for 2 of its 3 blocks
    assert hit(cache, seq(900, 12)) == 8
    stats = cache.stats()
    assert (stats.used_tokens, stats.declined_tokens) == (16, 4)
    for m in held:
        m.release()


# ====================================================================== invalidation


def test_bump_epoch_invalidates_one_model_only() -> None:
    cache = make()
    other = CacheContext(tenant="acme", model="llama")
    cache.insert(seq(0, 12), ACME)
    cache.insert(seq(0, 12), other)
    assert cache.bump_epoch("smollm2") == 1
    assert hit(cache, seq(0, 12)) == 0
    assert hit(cache, seq(0, 12), other) == 12
    # the new epoch caches afresh
    assert cache.insert(seq(0, 12), ACME) == 12
    assert hit(cache, seq(0, 12)) == 12


def test_bump_epoch_returns_increasing_epochs() -> None:
    cache = make()
    assert [cache.bump_epoch("m") for _ in range(3)] == [1, 2, 3]
    adapter = [cache.bump_epoch("m", "lora") for _ in range(3)]
    assert adapter == sorted(set(adapter))
    assert cache.stats().epoch_bumps == 6


def test_adapter_bump_invalidates_that_adapter_and_model_bump_all() -> None:
    cache = make()
    base = CacheContext(tenant="acme", model="m")
    a1 = CacheContext(tenant="acme", model="m", adapter="a1")
    a2 = CacheContext(tenant="acme", model="m", adapter="a2")
    tokens = seq(0, 12)
    for ctx in (base, a1, a2):
        cache.insert(tokens, ctx)
    assert cache.stats().blocks == 9  # each context keys its own blocks

    cache.bump_epoch("m", "a1")
    assert [hit(cache, tokens, c) for c in (base, a1, a2)] == [12, 0, 12]
    cache.insert(tokens, a1)
    assert hit(cache, tokens, a1) == 12

    cache.bump_epoch("m")
    assert [hit(cache, tokens, c) for c in (base, a1, a2)] == [0, 0, 0]
    for ctx in (base, a1, a2):
        assert cache.insert(tokens, ctx) == 12
        assert hit(cache, tokens, ctx) == 12


def test_stale_blocks_are_reclaimed_before_any_live_block_is_evicted() -> None:
    cache = make(capacity_tokens=64)
    live = CacheContext(tenant="acme", model="live")
    old = CacheContext(tenant="acme", model="old")
    live_prompts = [seq(100 * i, 8) for i in range(2)]
    for p in live_prompts:
        cache.insert(p, live)
    for i in range(6):
        cache.insert(seq(5000 + 100 * i, 8), old)
    assert cache.stats().used_tokens == 64

    cache.bump_epoch("old")
    for i in range(6):
        cache.insert(seq(9000 + 100 * i, 8), old)
        stats = cache.stats()
        assert stats.evictions == 0, i
        assert stats.removed(RemovalReason.STALE) == 2 * (i + 1)
        assert stats.used_tokens == 64
    assert all(hit(cache, p, live) == 8 for p in live_prompts)
    assert all(hit(cache, seq(9000 + 100 * i, 8), old) == 8 for i in range(6))
    # no stale block left: the next insert has to evict a live one
    cache.insert(seq(20_000, 8), old)
    assert cache.stats().evictions > 0


def test_reclaim_frees_every_stale_block_at_once() -> None:
    cache = make()
    for i in range(5):
        cache.insert(seq(100 * i, 12), ACME)
    cache.insert(seq(0, 12), CacheContext(tenant="acme", model="other"))
    cache.bump_epoch("smollm2")
    assert cache.stats().used_tokens == 72  # nothing freed by the bump itself
    assert cache.reclaim() == 15
    stats = cache.stats()
    assert stats.used_tokens == 12
    assert stats.blocks == 3
    assert stats.removed(RemovalReason.STALE) == 15
    assert stats.evictions == 0
    assert stats.stale_roots_pending == 0
    assert cache.reclaim() == 0


def test_reclaim_can_be_bounded() -> None:
    cache = make()
    cache.insert(seq(0, 40), ACME)
    cache.bump_epoch("smollm2")
    assert cache.reclaim(max_blocks=4) == 4
    assert cache.stats().used_tokens == 24
    assert cache.reclaim() == 6


def test_a_stale_pinned_block_is_freed_on_release() -> None:
    cache = make()
    cache.insert(seq(0, 12), ACME)
    cache.insert(seq(500, 8), ACME)
    m = cache.match(seq(0, 12), ACME)
    cache.bump_epoch("smollm2")
    assert hit(cache, seq(0, 12)) == 0
    assert cache.reclaim() == 2  # the unpinned prompt; the pinned one waits
    assert cache.stats().used_tokens == 12
    m.release()
    stats = cache.stats()
    assert stats.used_tokens == 0
    assert stats.blocks == 0
    assert stats.removed(RemovalReason.STALE) == 5


# ====================================================================== purge


def test_purge_tenant_removes_only_its_blocks() -> None:
    cache = make()
    a, b = CacheContext(tenant="a"), CacheContext(tenant="b")
    cache.insert(seq(0, 12), a)
    cache.insert(seq(1000, 8), a)
    cache.insert(seq(0, 12), b)
    assert cache.stats().used_tokens == 32
    assert cache.purge("a") == 20
    assert hit(cache, seq(0, 12), a) == 0
    assert hit(cache, seq(1000, 8), a) == 0
    assert hit(cache, seq(0, 12), b) == 12
    stats = cache.stats()
    assert (stats.used_tokens, stats.removed(RemovalReason.PURGED)) == (12, 5)
    assert cache.purge("a") == 0
    assert cache.purge("nobody") == 0
    cache.purge_prefix(seq(0, 4), b)
    assert cache.stats().purges == 4  # operator calls, whatever they removed


def test_purge_needs_a_tenant_name() -> None:
    cache = make()
    with pytest.raises(ValueError):
        cache.purge("")


@pytest.mark.parametrize("partial_blocks", [False, True])
def test_purge_of_a_pinned_block_is_unmatchable_now_and_freed_on_release(partial_blocks: bool) -> None:
    cache = make(partial_blocks=partial_blocks)
    a, b = CacheContext(tenant="a"), CacheContext(tenant="b")
    tokens = seq(0, 12)
    cache.insert(tokens, a)
    cache.insert(tokens, b)
    m = cache.match(tokens, a)
    assert m.cached_tokens == 12
    assert cache.purge("a") == 12
    assert hit(cache, tokens, a) == 0  # unmatchable at once (also token by token)
    assert hit(cache, tokens[:6], a) == 0
    assert hit(cache, tokens, b) == 12
    assert cache.stats().used_tokens == 24  # still in use by the holder
    m.release()
    assert cache.stats().used_tokens == 12
    assert cache.stats().blocks == 3
    # and a's prompt can be cached again
    assert cache.insert(tokens, a) == 12
    assert hit(cache, tokens, a) == 12


@pytest.mark.parametrize("partial_blocks", [False, True])
def test_purge_prefix_of_a_pinned_sequence(partial_blocks: bool) -> None:
    cache = make(partial_blocks=partial_blocks)
    tokens = seq(0, 16)
    cache.insert(tokens, ACME)
    m = cache.match(tokens, ACME)
    assert cache.purge_prefix(tokens[:8], ACME) == 12  # the block holding its end, and below
    assert hit(cache, tokens) == 4  # the first block stays
    assert hit(cache, tokens[:10]) == 4
    assert cache.stats().used_tokens == 16
    m.release()
    assert cache.stats().used_tokens == 4
    assert cache.insert(tokens, ACME) == 12
    assert hit(cache, tokens) == 16


def _purge_tree(partial_blocks: bool) -> tuple[PrefixCache, list[int]]:
    cache = make(partial_blocks=partial_blocks)
    base = seq(0, 8)
    cache.insert(base + seq(100, 8), ACME)  # A
    cache.insert(base + seq(200, 8), ACME)  # B: a sibling of A under base
    cache.insert(base[:4] + seq(300, 8), ACME)  # C: a sibling of base's 2nd block
    return cache, base


def test_purge_prefix_at_a_block_boundary() -> None:
    cache, base = _purge_tree(False)
    assert cache.purge_prefix(base + seq(100, 4), ACME) == 8
    assert hit(cache, base + seq(100, 8)) == 8
    assert hit(cache, base + seq(200, 8)) == 16
    assert hit(cache, base[:4] + seq(300, 8)) == 12

    assert cache.purge_prefix(base, ACME) == 12  # base's 2nd block and B below it
    assert hit(cache, base + seq(200, 8)) == 4
    assert hit(cache, base[:4] + seq(300, 8)) == 12
    assert cache.stats().used_tokens == 12
    assert cache.purge_prefix(seq(7777, 8), ACME) == 0


def test_purge_prefix_with_a_tail() -> None:
    cache, base = _purge_tree(True)
    # A's block [100..103] already holds this tail, so it is not stored again.
    assert cache.insert([*base, 100, 101, 102], ACME) == 0
    cache.insert([*base, 100, 105, 106, 107], ACME)  # shares 100 but not 101: stays
    cache.insert([*base, 100, 101, 109], ACME)  # a tail that starts with the prefix
    before = cache.stats().used_tokens
    assert cache.purge_prefix([*base, 100, 101], ACME) == 8 + 3
    assert cache.stats().used_tokens == before - 11
    assert hit(cache, base + seq(100, 8)) == 9  # base + the 100 that [100, 105, ...] shares
    assert hit(cache, [*base, 100, 101, 102]) == 9
    assert hit(cache, [*base, 100, 105, 106, 107]) == 12
    assert hit(cache, base + seq(200, 8)) == 16
    assert hit(cache, base[:4] + seq(300, 8)) == 12


def test_purge_prefix_needs_a_non_empty_prefix() -> None:
    cache, _ = _purge_tree(False)
    with pytest.raises(ValueError):
        cache.purge_prefix([], ACME)
    assert hit(cache, seq(0, 8) + seq(100, 8)) == 16


def test_purge_prefix_of_another_tenant_is_a_no_op() -> None:
    cache, base = _purge_tree(False)
    assert cache.purge_prefix(base, CacheContext(tenant="other", model="smollm2")) == 0
    assert hit(cache, base + seq(200, 8)) == 16


# ====================================================================== TTL


def test_a_block_unused_for_ttl_seconds_is_a_miss() -> None:
    clock = Clock()
    cache = make(ttl_seconds=10, clock=clock, partial_blocks=True)
    cache.insert(seq(0, 10), ACME)
    clock.now = 9.5
    assert hit(cache, seq(0, 10)) == 10
    clock.now = 20.0
    assert hit(cache, seq(0, 10)) == 0
    assert hit(cache, seq(0, 4)) == 0


def test_a_hit_refreshes_the_ttl() -> None:
    clock = Clock()
    cache = make(ttl_seconds=10, clock=clock)
    cache.insert(seq(0, 12), ACME)
    cache.insert(seq(500, 12), ACME)
    clock.now = 8.0
    assert hit(cache, seq(0, 8)) == 8  # refreshes the first 2 blocks only
    clock.now = 15.0
    assert hit(cache, seq(0, 12)) == 8
    assert hit(cache, seq(500, 12)) == 0
    clock.now = 24.0
    assert hit(cache, seq(0, 12)) == 8  # refreshed again at 15
    clock.now = 40.0
    assert hit(cache, seq(0, 12)) == 0


def test_expired_blocks_are_reclaimed_before_live_ones_are_evicted() -> None:
    clock = Clock()
    cache = make(capacity_tokens=32, ttl_seconds=10, clock=clock)
    cache.insert(seq(0, 16), ACME)  # expires at 10
    clock.now = 8.0
    cache.insert(seq(500, 16), ACME)  # expires at 18
    clock.now = 12.0
    assert cache.insert(seq(900, 16), ACME) == 16
    stats = cache.stats()
    assert (stats.removed(RemovalReason.EXPIRED), stats.evictions, stats.used_tokens) == (4, 0, 32)
    assert hit(cache, seq(500, 16)) == 16
    assert hit(cache, seq(900, 16)) == 16


def test_reclaim_frees_expired_blocks() -> None:
    clock = Clock()
    cache = make(ttl_seconds=10, clock=clock)
    cache.insert(seq(0, 12), ACME)
    clock.now = 5.0
    cache.insert(seq(500, 8), ACME)
    clock.now = 11.0
    assert cache.reclaim() == 3
    assert cache.stats().used_tokens == 8
    assert cache.stats().removed(RemovalReason.EXPIRED) == 3
    assert hit(cache, seq(500, 8)) == 8


@pytest.mark.parametrize("length", [12, 10])
def test_insert_of_an_expired_prompt_revives_it(length: int) -> None:
    clock = Clock()
    cache = make(ttl_seconds=10, clock=clock, partial_blocks=True)
    tokens = seq(0, length)
    cache.insert(tokens, ACME)
    clock.now = 30.0
    assert hit(cache, tokens) == 0
    cache.insert(tokens, ACME)
    assert hit(cache, tokens) == length
    stats = cache.stats()
    assert stats.collisions == 0
    assert stats.used_tokens == length  # revived in place, not duplicated


def test_insert_extending_an_expired_prefix_revives_the_prefix() -> None:
    clock = Clock()
    cache = make(ttl_seconds=10, clock=clock)
    cache.insert(seq(0, 8), ACME)
    clock.now = 30.0
    assert cache.insert(seq(0, 16), ACME) == 8
    assert hit(cache, seq(0, 16)) == 16
    assert hit(cache, seq(0, 8)) == 8
    assert cache.stats().collisions == 0


def test_a_purged_pinned_prompt_cached_again_still_expires() -> None:
    """Releasing the purged (doomed) copy must not drop the TTL entry of the new copy
    that took its key."""
    clock = Clock()
    cache = make(ttl_seconds=10, clock=clock)
    tokens = seq(0, 8)
    cache.insert(tokens, ACME)
    m = cache.match(tokens, ACME)
    cache.purge("acme")
    assert cache.insert(tokens, ACME) == 8
    m.release()
    assert cache.stats().used_tokens == 8
    clock.now = 100.0
    assert cache.reclaim() == 2
    assert cache.stats().used_tokens == 0


# ====================================================================== events


def test_events_of_storing_and_replacing() -> None:
    cache = make(partial_blocks=True)
    cache.insert(seq(0, 10), ACME)
    with cache.match(seq(0, 10), ACME) as m:
        keys = m.block_keys
    events = cache.take_events()
    assert events == [BlocksStored(keys, None, 10, "acme", "smollm2", "*", False, token_bytes(seq(0, 10)))]
    assert isinstance(events[0], BlocksStored) and events[0].token_ids == seq(0, 10)
    assert cache.take_events() == []

    cache.insert(seq(0, 16), ACME)
    with cache.match(seq(0, 16), ACME) as m:
        longer = m.block_keys
    assert longer[:2] == keys[:2]
    events = cache.take_events()
    assert len(events) == 2
    assert BlocksStored(longer[2:], keys[1], 8, "acme", "smollm2", "*", False, token_bytes(seq(8, 8))) in events
    assert BlocksRemoved((keys[2],), 2, RemovalReason.REPLACED, "*") in events


def test_events_of_eviction_stale_purge_and_expiry() -> None:
    clock = Clock()
    cache = make(capacity_tokens=16, ttl_seconds=100, clock=clock)
    cache.insert(seq(0, 16), ACME)
    cache.insert(seq(500, 4), ACME)
    evicted = removed(cache.take_events(), RemovalReason.EVICTED)
    assert len(evicted) == 1 and evicted[0].num_tokens == 4 and evicted[0].pool == "*"

    cache.bump_epoch("smollm2")
    cache.reclaim()
    events = cache.take_events()
    assert events[0] == EpochBumped("smollm2", None, 1)
    assert len(removed(events, RemovalReason.STALE)) == 4
    assert cache.stats().used_tokens == 0

    cache.insert(seq(0, 8), ACME)
    with cache.match(seq(0, 8), ACME) as m:
        keys = m.block_keys
    cache.purge("acme")
    purged = removed(cache.take_events(), RemovalReason.PURGED)
    assert [e.keys for e in purged] == [(keys[1],), (keys[0],)]  # children first

    cache.insert(seq(0, 8), ACME)
    clock.now = 500.0
    cache.reclaim()
    assert len(removed(cache.take_events(), RemovalReason.EXPIRED)) == 2


def test_adapter_bump_event() -> None:
    cache = make()
    cache.bump_epoch("m", "lora")
    assert cache.take_events() == [EpochBumped("m", "lora", 1)]


def test_event_buffer_is_bounded_and_counts_drops() -> None:
    cache = make(events_capacity=3)
    for i in range(5):
        cache.insert(seq(100 * i, 4), ACME)
    events = cache.take_events()
    assert len(events) == 3
    assert [e.num_tokens for e in events if isinstance(e, BlocksStored)] == [4, 4, 4]
    assert cache.stats().events_dropped == 2
    with cache.match(seq(400, 4), ACME) as m:
        assert events[-1] == BlocksStored(
            m.block_keys, None, 4, "acme", "smollm2", "*", False, token_bytes(seq(400, 4))
        )


def test_events_capacity_zero_records_nothing() -> None:
    cache = make(events_capacity=0, capacity_tokens=8)
    for i in range(5):
        cache.insert(seq(100 * i, 4), ACME)
    cache.bump_epoch("smollm2")
    cache.reclaim()
    assert cache.take_events() == []
    assert cache.stats().evictions == 3


# ====================================================================== stats


def test_stats_of_a_scripted_sequence() -> None:
    cache = make()
    a, b = CacheContext(tenant="a"), CacheContext(tenant="b")
    prompt = seq(0, 12)
    assert hit(cache, prompt, a) == 0
    cache.insert(prompt, a)
    assert hit(cache, prompt, a) == 12
    assert hit(cache, prompt, b) == 0
    assert hit(cache, [*prompt[:6], 999, 998, 997, 996], a) == 4

    stats = cache.stats()
    assert (stats.lookups, stats.lookup_tokens, stats.hit_tokens, stats.hit_requests) == (4, 46, 16, 2)
    assert stats.tenants == {
        "a": TenantStats(lookups=3, lookup_tokens=34, hit_tokens=16, hit_requests=2, inserted_tokens=12),
        "b": TenantStats(lookups=1, lookup_tokens=12, hit_tokens=0, hit_requests=0, inserted_tokens=0),
    }
    assert (stats.inserted_tokens, stats.inserted_blocks) == (12, 3)
    assert (stats.used_tokens, stats.blocks, len(cache), cache.used_tokens) == (12, 3, 3, 12)
    assert (stats.evictions, stats.collisions, stats.removed(RemovalReason.STALE)) == (0, 0, 0)
    assert stats.pools == {"*": PoolStats(quota_tokens=10_000, used_tokens=12, blocks=3, evictions=0)}


def test_partial_hits_are_counted() -> None:
    cache = make(partial_blocks=True)
    cache.insert(seq(0, 8), ACME)
    assert hit(cache, seq(0, 6)) == 6
    stats = cache.stats()
    assert (stats.hit_tokens, stats.partial_hit_tokens) == (6, 2)


# ====================================================================== bad input


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, -3],
        [1, 2.5, 3],
        [1, "2", 3],
        [1, None],
        [2**32],
        np.array([1.0, 2.0]),
        np.array([[1, 2], [3, 4]]),
        np.array([1, -2]),
        "abc",
    ],
    ids=lambda t: repr(t)[:20],
)
def test_bad_token_ids_are_value_errors_and_leave_the_cache_usable(tokens: Any) -> None:
    cache = make()
    cache.insert(seq(0, 8), ACME)
    before = cache.stats()
    with pytest.raises(ValueError, match="token"):
        cache.match(tokens, ACME)
    with pytest.raises(ValueError, match="token"):
        cache.insert(tokens, ACME)
    with pytest.raises(ValueError, match="token"):
        cache.purge_prefix(tokens, ACME)
    assert cache.stats() == before  # nothing counted, nothing stored
    assert hit(cache, seq(0, 8)) == 8
    assert cache.insert(seq(100, 8), ACME) == 8


def test_bool_token_ids_are_python_ints_but_bool_arrays_are_rejected() -> None:
    """A Python bool is an int (documented in ``token_bytes``): ``[True, False]`` is the
    prompt ``[1, 0]``. A numpy bool array has no integer dtype and is refused."""
    cache = make()
    assert cache.insert([True, False, True, True], ACME) == 4
    assert hit(cache, [1, 0, 1, 1]) == 4
    with pytest.raises(ValueError, match="dtype"):
        cache.match(np.array([True, False, True, True]), ACME)


def test_token_ids_above_the_vocabulary() -> None:
    cache = make(vocab_size=100)
    with pytest.raises(ValueError, match="position 2"):
        cache.insert([1, 2, 100, 3], ACME)
    with pytest.raises(ValueError, match="100"):
        cache.match(np.array([5, 6, 7, 100]), ACME)
    assert cache.insert([96, 97, 98, 99], ACME) == 4
    assert hit(cache, [96, 97, 98, 99]) == 4
    assert cache.stats().used_tokens == 4


def test_numpy_tokens_match_like_lists() -> None:
    cache = make()
    cache.insert(np.arange(12, dtype=np.int64), ACME)
    assert hit(cache, seq(0, 12)) == 12
    with cache.match(np.arange(12, dtype=np.uint32), ACME) as m:
        assert m.cached_tokens == 12


@pytest.mark.parametrize("ctx", ["acme", None, {"tenant": "acme"}, ("acme", "smollm2")])
def test_a_context_that_is_not_a_cache_context_is_a_type_error(ctx: Any) -> None:
    cache = make()
    cache.insert(seq(0, 8), ACME)
    with pytest.raises(TypeError, match="CacheContext"):
        cache.match(seq(0, 8), ctx)
    with pytest.raises(TypeError, match="CacheContext"):
        cache.insert(seq(0, 8), ctx)
    assert cache.stats().lookups == 0
    assert hit(cache, seq(0, 8)) == 8


def test_empty_prompts() -> None:
    cache = make()
    assert cache.insert([], ACME) == 0
    with cache.match([], ACME) as m:
        assert m.cached_tokens == 0
    assert cache.stats().used_tokens == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"tenant": ""}, {"tenant": "a", "model": ""}, {"tenant": "a", "adapter": 3}, {"tenant": "a", "extra": [1]}],
)
def test_bad_contexts(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        CacheContext(**kwargs)


def test_context_roots_are_forgotten_when_empty_but_not_while_storing_under_them() -> None:
    """A root with nothing under it is dropped (contexts seen once do not pile up), but
    never while an insert is evicting its last child to make room under it."""
    cache = make(capacity_tokens=4)
    for i in range(50):
        cache.match(seq(1000 * i, 4), CacheContext(tenant=f"visitor-{i}", model="smollm2")).release()
    assert len(cache._ledger.contexts) == 0
    cache.insert(seq(0, 4), ACME)
    assert cache.insert(seq(100, 4), ACME) == 4  # evicts the root's only child, stores under it
    assert hit(cache, seq(100, 4)) == 4
    assert cache.stats().collisions == 0
    assert len(cache._ledger.contexts) == 1
    cache.purge("acme")
    assert len(cache._ledger.contexts) == 0
