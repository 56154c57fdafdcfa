"""Isolation between tenants: shared, namespace and partitioned modes, per-tenant pools
and quotas, k-anonymous hot-prefix publication and operator-declared public prefixes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache import CacheConfig, CacheContext, PrefixCache, PrefixPublished, PublishConfig
from prefixcache.cache.stats import PoolStats
from prefixcache.tenancy import Tenancy


def seq(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def ctx(tenant: str, model: str = "m") -> CacheContext:
    return CacheContext(tenant=tenant, model=model)


def hit(cache: PrefixCache, tokens: list[int], tenant: str, model: str = "m") -> int:
    with cache.match(tokens, ctx(tenant, model)) as m:
        return m.cached_tokens


def make(**kwargs: Any) -> PrefixCache:
    settings: dict[str, Any] = {"block_size": 4, "capacity_tokens": 10_000}
    settings.update(kwargs)
    return PrefixCache(CacheConfig(**settings))


def promoted(cache: PrefixCache) -> list[PrefixPublished]:
    return [e for e in cache.take_events() if isinstance(e, PrefixPublished)]


# ====================================================================== isolation modes


@pytest.mark.parametrize("partial_blocks", [False, True])
def test_shared_mode_reuses_across_tenants(partial_blocks: bool) -> None:
    cache = make(isolation="shared", partial_blocks=partial_blocks)
    cache.insert(seq(0, 16), ctx("a"))
    assert hit(cache, seq(0, 16), "b") == 16
    assert hit(cache, seq(0, 12) + seq(900, 4), "b") == 12
    assert cache.insert(seq(0, 20), ctx("b")) == 4  # builds on a's blocks
    assert cache.stats().used_tokens == 20
    assert hit(cache, seq(0, 16), "b", model="other") == 0  # models never share


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
@pytest.mark.parametrize("partial_blocks", [False, True])
def test_isolated_modes_never_share_between_tenants(isolation: str, partial_blocks: bool) -> None:
    cache = make(isolation=isolation, partial_blocks=partial_blocks)
    a_prompt, b_prompt = seq(0, 18), seq(0, 8) + seq(500, 10)
    assert cache.insert(a_prompt, ctx("a")) == (18 if partial_blocks else 16)
    assert hit(cache, a_prompt, "b") == 0
    assert hit(cache, a_prompt[:6], "b") == 0
    assert hit(cache, b_prompt, "b") == 0
    # b caches the same tokens separately, and hits its own
    assert cache.insert(b_prompt, ctx("b")) == (18 if partial_blocks else 16)
    assert hit(cache, b_prompt, "b") == (18 if partial_blocks else 16)
    assert hit(cache, a_prompt, "b") == 8
    assert hit(cache, a_prompt, "a") == (18 if partial_blocks else 16)
    stats = cache.stats()
    assert stats.tenants["a"].hit_tokens == (18 if partial_blocks else 16)
    assert stats.tenants["b"].hit_requests == 2


def test_tenant_names_that_concatenate_alike_do_not_share() -> None:
    cache = make(isolation="namespace")
    cache.insert(seq(0, 8), CacheContext(tenant="org_1", model="m", extra=("2345",)))
    with cache.match(seq(0, 8), CacheContext(tenant="org_12345", model="m", extra=("",))) as m:
        assert m.cached_tokens == 0


# ====================================================================== partitioned pools


def test_a_tenant_burst_never_evicts_another_tenants_blocks() -> None:
    cache = make(isolation="partitioned", capacity_tokens=64, quotas={"a": 32, "b": 32})
    b_prompts = [seq(50_000 + 100 * i, 8) for i in range(2)]
    for p in b_prompts:
        cache.insert(p, ctx("b"))
    for i in range(30):
        cache.insert(seq(100 * i, 8), ctx("a"))
        pools = cache.stats().pools
        assert pools["a"].used_tokens <= 32, i
        assert pools["b"].used_tokens == 16, i
        assert all(hit(cache, p, "b") == 8 for p in b_prompts), i
    pools = cache.stats().pools
    assert pools["a"] == PoolStats(32, 32, 8, 26 * 2)
    assert pools["b"] == PoolStats(32, 16, 4, 0)
    assert sum(hit(cache, seq(100 * i, 8), "a") == 8 for i in range(30)) == 4
    assert cache.stats().tenants["a"].used_tokens == 32


def test_a_prompt_above_its_quota_is_cut_at_the_quota() -> None:
    cache = make(isolation="partitioned", capacity_tokens=64, quotas={"a": 16, "b": 48})
    assert cache.insert(seq(0, 40), ctx("a")) == 16
    assert hit(cache, seq(0, 40), "a") == 16
    assert cache.stats().pools["a"].used_tokens == 16
    assert cache.stats().declined_tokens == 24


def test_default_equal_shares_shrink_and_over_share_tenants_give_back() -> None:
    cache = make(isolation="partitioned", capacity_tokens=96)
    assert cache.stats().pools == {}
    for i in range(12):
        cache.insert(seq(100 * i, 8), ctx("a"))
    pools = cache.stats().pools
    assert pools == {"a": PoolStats(96, 96, 24, 0)}

    cache.insert(seq(50_000, 8), ctx("b"))  # a newcomer: shares are 48 each, a is over
    pools = cache.stats().pools
    assert (pools["a"].quota_tokens, pools["b"].quota_tokens) == (48, 48)
    assert (pools["a"].used_tokens, pools["b"].used_tokens) == (88, 8)
    assert pools["a"].evictions == 2 and pools["b"].evictions == 0
    for i in range(1, 12):
        cache.insert(seq(50_000 + 100 * i, 8), ctx("b"))
        pools = cache.stats().pools
        assert pools["a"].used_tokens >= 48  # never below its share
        assert cache.stats().used_tokens <= 96
    assert (pools["a"].used_tokens, pools["b"].used_tokens) == (48, 48)
    assert pools["b"].evictions > 0  # b, at its share, now evicts its own

    cache.insert(seq(90_000, 8), ctx("c"))
    pools = cache.stats().pools
    assert [pools[t].quota_tokens for t in "abc"] == [32, 32, 32]
    for i in range(1, 4):
        cache.insert(seq(90_000 + 100 * i, 8), ctx("c"))
    pools = cache.stats().pools
    assert [pools[t].used_tokens for t in "abc"] == [32, 32, 32]
    assert sum(p.used_tokens for p in pools.values()) == cache.stats().used_tokens


def test_fixed_quotas_and_equal_shares_of_the_rest() -> None:
    cache = make(isolation="partitioned", capacity_tokens=100, quotas={"a": 40})
    for tenant in ("a", "b", "c"):
        cache.insert(seq(0, 8), ctx(tenant))
    pools = cache.stats().pools
    assert [pools[t].quota_tokens for t in "abc"] == [40, 30, 30]
    per_tenant = cache.stats().tenants
    assert [per_tenant[t].used_tokens for t in "abc"] == [8, 8, 8]


def test_quotas_in_bytes() -> None:
    cache = make(
        isolation="partitioned",
        capacity_tokens=None,
        capacity_bytes=640,
        bytes_per_token=10,
        quotas={"a": 320, "b": 320},
    )
    for i in range(10):
        cache.insert(seq(100 * i, 8), ctx("a"))
    pools = cache.stats().pools
    assert pools["a"].quota_tokens == 32
    assert pools["a"].used_tokens == 32


# ====================================================================== publication

BS = 16
SYSTEM = seq(100_000, 64)


def suffix(i: int, n: int = 20) -> list[int]:
    return seq(1000 * i, n)


def promo_cache(isolation: str, partial_blocks: bool = False, **kwargs: Any) -> PrefixCache:
    return make(
        block_size=BS,
        isolation=isolation,
        partial_blocks=partial_blocks,
        publish=PublishConfig(min_tenants=3, min_tokens=32),
        **kwargs,
    )


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
@pytest.mark.parametrize("partial_blocks", [False, True])
def test_a_prefix_sent_by_three_tenants_becomes_public(isolation: str, partial_blocks: bool) -> None:
    cache = promo_cache(isolation, partial_blocks)
    own = 84 if partial_blocks else 80  # a tenant's own full prompt: system + 20 suffix tokens
    for i in (1, 2):
        cache.insert(SYSTEM + suffix(i), ctx(f"t{i}"))
    assert hit(cache, SYSTEM, "t4") == 0
    assert hit(cache, SYSTEM + suffix(1), "t4") == 0
    assert promoted(cache) == []

    cache.insert(SYSTEM + suffix(3), ctx("t3"))
    events = promoted(cache)
    assert len(events) == 1
    assert (events[0].tenants, events[0].num_tokens, len(events[0].keys), events[0].model) == (3, 64, 4, "m")
    assert cache.stats().published_blocks == 4

    assert hit(cache, SYSTEM + suffix(4), "t4") == 64
    for i in (1, 2, 3):
        # the system prompt, and not one token of another tenant's suffix
        assert hit(cache, SYSTEM + suffix(i), "t4") == 64
        assert hit(cache, SYSTEM + suffix(i, 3), "t4") == 64
        assert hit(cache, SYSTEM + suffix(i), f"t{i}") == own
    assert hit(cache, SYSTEM, "t4", model="other") == 0
    if isolation == "partitioned":
        pools = cache.stats().pools
        assert pools[""].used_tokens == 64
        assert pools[""].blocks == 4
        assert pools["t3"].used_tokens == own - 64  # t3's suffix, stored under the public blocks


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
def test_one_tenant_never_promotes_alone(isolation: str) -> None:
    cache = promo_cache(isolation)
    for i in range(100):
        cache.insert(SYSTEM + suffix(i), ctx("t1"))
    assert hit(cache, SYSTEM, "t2") == 0
    for i in range(50):
        cache.insert(SYSTEM + suffix(i), ctx("t2"))
    assert hit(cache, SYSTEM, "t3") == 0
    assert promoted(cache) == []
    assert cache.stats().published_blocks == 0


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
def test_a_prefix_shorter_than_min_tokens_is_never_promoted(isolation: str) -> None:
    cache = promo_cache(isolation)
    short = SYSTEM[:16]  # one block, min_tokens is 32
    for i in range(1, 6):
        cache.insert(short + suffix(i), ctx(f"t{i}"))
    unaligned = SYSTEM[:28]  # 1 full block shared, then every tenant differs
    for i in range(1, 6):
        cache.insert(unaligned + suffix(i + 10), ctx(f"t{i}"))
    assert hit(cache, short, "t9") == 0
    assert hit(cache, unaligned, "t9") == 0
    assert promoted(cache) == []


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
def test_suffixes_shared_by_fewer_tenants_stay_private(isolation: str) -> None:
    cache = promo_cache(isolation)
    doc = seq(7000, 32)
    for tenant in ("t1", "t2", "t3"):
        cache.insert(SYSTEM + suffix(int(tenant[1])), ctx(tenant))
    cache.insert(SYSTEM + doc, ctx("t1"))
    cache.insert(SYSTEM + doc, ctx("t2"))  # two tenants only
    assert hit(cache, SYSTEM + doc, "t5") == 64
    cache.insert(SYSTEM + doc, ctx("t3"))  # now three
    assert hit(cache, SYSTEM + doc, "t5") == 96


def test_promoted_blocks_live_in_the_public_pool() -> None:
    cache = promo_cache("partitioned", capacity_tokens=1200)
    assert "" in cache.stats().pools
    for i in range(1, 4):
        cache.insert(SYSTEM + suffix(i), ctx(f"t{i}"))
    pools = cache.stats().pools
    assert set(pools) == {"", "t1", "t2", "t3"}
    assert all(p.quota_tokens == 300 for p in pools.values())
    assert pools[""].used_tokens == 64
    assert pools["t1"].used_tokens == 80
    assert pools["t2"].used_tokens == 80
    assert pools["t3"].used_tokens == 16


# ====================================================================== declare_public


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
def test_a_declared_prefix_is_shared_from_the_next_request(isolation: str) -> None:
    cache = make(block_size=BS, isolation=isolation)
    a_prompt = SYSTEM + suffix(1)
    cache.insert(a_prompt, ctx("a"))
    cache.declare_public(SYSTEM, ctx("a"))
    assert hit(cache, SYSTEM, "b") == 0  # nobody has sent it since the declaration
    cache.insert(a_prompt, ctx("a"))
    assert hit(cache, SYSTEM + suffix(2), "b") == 64
    assert hit(cache, a_prompt, "b") == 64  # a's suffix stays private
    assert hit(cache, a_prompt, "a") == 80
    assert hit(cache, SYSTEM, "b", model="other") == 0
    events = promoted(cache)
    assert len(events) == 1 and events[0].tenants == 0 and events[0].num_tokens == 64


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
def test_a_declared_prefix_sent_first_by_a_new_tenant(isolation: str) -> None:
    cache = make(block_size=BS, isolation=isolation)
    cache.declare_public(SYSTEM, ctx("ops"))
    cache.insert(SYSTEM + suffix(1), ctx("a"))  # NOTE: returns 16, the private part only
    assert hit(cache, SYSTEM + suffix(1), "b") == 64
    assert hit(cache, SYSTEM + suffix(1), "a") == 80
    stats = cache.stats()
    assert stats.used_tokens == 80  # stored once: 64 public, 16 private
    assert (stats.inserted_tokens, stats.published_blocks) == (80, 4)
    if isolation == "partitioned":
        assert stats.pools[""].used_tokens == 64
        assert stats.pools["a"].used_tokens == 16


def test_declare_public_in_shared_mode_is_an_error() -> None:
    cache = make(isolation="shared")
    with pytest.raises(ValueError, match="declare_public"):
        cache.declare_public(SYSTEM, ctx("a"))


def test_private_blocks_under_a_promoted_prefix_survive_their_root_being_emptied() -> None:
    """Found by the state machine: promoting a prefix evicted tenant b's only private
    block, emptying b's root while b's next block was being stored (under the public
    prefix). A second identical insert must find that block: no re-store, no collision."""
    config = CacheConfig(
        block_size=4,
        capacity_tokens=12,
        policy="lru",
        isolation="namespace",
        publish=PublishConfig(min_tenants=2, min_tokens=8),
    )
    cache = PrefixCache(config)
    a, b = CacheContext(tenant="a", model="m1"), CacheContext(tenant="b", model="m1")
    prompt = [10, 11, 12, 13, 20, 21, 22, 23, 24, 0, 1, 2]
    cache.insert(prompt[:9], a)
    cache.insert([0, 1, 2, 0, 1, 2], b)
    assert cache.insert(prompt, b) == 12  # 8 promoted + 4 private under them
    assert cache.insert(prompt, b) == 0
    assert cache.stats().collisions == 0
    with cache.match(prompt, b) as m:
        assert m.cached_tokens == 12


@given(
    declared=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), max_size=6),
    query=st.lists(st.integers(0, 3), min_size=0, max_size=14),
    block=st.sampled_from([1, 2, 4]),
)
def test_declared_depth_is_the_longest_common_whole_block_prefix(
    declared: list[list[int]], query: list[int], block: int
) -> None:
    """How much of a request is declared public: the most whole blocks it shares with any
    declaration of its context (what a linear scan over the declarations says), kept as
    block digests so that it costs the request's length only."""
    from prefixcache.cache.publish import Publisher
    from prefixcache.cache.tree import common_tokens
    from prefixcache.hashing import token_bytes

    config = CacheConfig(block_size=block, isolation="namespace")
    publisher = Publisher(config, Tenancy(config))
    ctx, other = CacheContext(tenant="a", model="m"), CacheContext(tenant="a", model="other")
    for tokens in declared:
        publisher.declare(token_bytes(tokens), ctx)
    publisher.declare(token_bytes(query), other)  # another model's declaration counts for nothing
    data = token_bytes(query)
    want = max((common_tokens(token_bytes(t), data) // block for t in declared), default=0)
    assert publisher._declared_depth(data, ctx) == want
