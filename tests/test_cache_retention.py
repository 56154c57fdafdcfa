"""Retention (issue 41): a block a client asked to keep is no eviction's victim until its
deadline (each hit extends it); under pressure it goes down a tier, never out; each
tenant is held to its cap, and past it loses its own oldest retention first; epochs,
purges and TTLs still win. The hypothesis machines (``test_invariants.py``,
``test_writer_machine.py``) check the same with random steps."""

from __future__ import annotations

import pytest

from prefixcache import CacheConfig, CacheContext, PrefixCache
from prefixcache.cache.retention import MAX_RETAIN_S, RetainOutcome, RetainSpan
from prefixcache.config import RetentionConfig, TierConfig
from support import Clock
from tier_worker import BLOCK, SEED, frame_bytes, kv_for, layout

BS = 4


def cache(capacity_blocks: int = 8, share: float = 0.5, ttl: float | None = None, **tenants: float) -> PrefixCache:
    config = CacheConfig(
        block_size=BS,
        capacity_tokens=capacity_blocks * BS,
        ttl_seconds=ttl,
        retention=RetentionConfig(share=share, tenants=tenants),
    )
    return PrefixCache(config, clock=CLOCK)


CLOCK = Clock()


@pytest.fixture(autouse=True)
def _clock() -> None:
    CLOCK.now = 0.0


def ctx(tenant: str) -> CacheContext:
    return CacheContext(tenant=tenant, model="m")


def prompt(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


def flood(c: PrefixCache, tenant: str, n_prompts: int, start: int = 10_000) -> None:
    """Other prompts, enough to evict everything unretained."""
    for i in range(n_prompts):
        c.access(prompt(2 * BS, start + 100 * i), ctx(tenant))


def cached(c: PrefixCache, tokens: list[int], tenant: str) -> int:
    return c.peek(tokens, ctx(tenant)).cached_tokens


def test_a_retained_prefix_survives_a_flood_that_evicts_an_unretained_one() -> None:
    c = cache()
    kept, lost = prompt(2 * BS), prompt(2 * BS, 500)
    c.access(kept, ctx("a"))
    c.access(lost, ctx("a"))
    assert c.retain(kept, ctx("a"), 60.0).outcome is RetainOutcome.RETAINED
    flood(c, "b", 20)
    assert cached(c, kept, "a") == 2 * BS
    assert cached(c, lost, "a") == 0


def test_retention_ends_at_its_deadline_and_each_hit_extends_it() -> None:
    c = cache()
    tokens = prompt(2 * BS)
    c.access(tokens, ctx("a"))
    c.retain(tokens, ctx("a"), 60.0)
    CLOCK.now = 50.0
    c.access(tokens, ctx("a"))  # a hit: retained until 110 now
    CLOCK.now = 100.0
    flood(c, "b", 20)
    assert cached(c, tokens, "a") == 2 * BS
    CLOCK.now = 111.0
    flood(c, "b", 20, start=50_000)
    assert cached(c, tokens, "a") == 0
    assert c.stats().retention[0].expired_tokens == 2 * BS


def test_the_default_share_is_split_among_the_tenants_that_retain() -> None:
    c = cache(capacity_blocks=8, share=0.5)  # 16 tokens to share
    assert c.retain_caps("a") == (16,)
    c.access(prompt(4 * BS), ctx("a"))
    assert c.retain(prompt(4 * BS), ctx("a"), 60.0).tokens == 16
    c.access(prompt(2 * BS, 900), ctx("b"))
    assert c.retain(prompt(2 * BS, 900), ctx("b"), 60.0).tokens == 8
    # b joined: each has 8 now; a's oldest retention (the deepest blocks first) ended
    assert c.retain_caps("a") == c.retain_caps("b") == (8,)
    by_tenant = {t.tenant: t for t in c.stats().retention}
    assert by_tenant["a"].held == (8,) and by_tenant["b"].held == (8,)
    assert by_tenant["a"].capped_tokens == 8 and by_tenant["b"].capped_tokens == 0
    flood(c, "c", 20)
    assert cached(c, prompt(4 * BS), "a") == 8  # its start stays retained
    assert cached(c, prompt(2 * BS, 900), "b") == 8


def test_past_its_cap_a_tenant_loses_its_own_oldest_retention_never_anothers() -> None:
    c = cache(capacity_blocks=16, share=0.5, a=0.25, b=0.25)  # 16 tokens each
    first, second = prompt(4 * BS, 100), prompt(4 * BS, 200)
    others = prompt(4 * BS, 300)
    for tenant, tokens in (("a", first), ("b", others), ("a", second)):
        c.access(tokens, ctx(tenant))
        CLOCK.now += 1
        got = c.retain(tokens, ctx(tenant), 600.0)
        assert got.outcome is RetainOutcome.RETAINED and got.tokens == 16
    flood(c, "c", 40)
    assert cached(c, second, "a") == 16
    assert cached(c, others, "b") == 16
    assert cached(c, first, "a") == 0  # a's own older retention gave way
    a = next(t for t in c.stats().retention if t.tenant == "a")
    assert a.cap_hits >= 1 and a.capped_tokens == 16


def test_a_span_larger_than_the_cap_keeps_its_start_and_says_capped() -> None:
    c = cache(capacity_blocks=8, share=0.25)  # 8 tokens
    tokens = prompt(4 * BS)
    c.access(tokens, ctx("a"))
    got = c.retain(tokens, ctx("a"), 60.0)
    assert (got.tokens, got.outcome) == (8, RetainOutcome.CAPPED)
    flood(c, "b", 20)
    assert cached(c, tokens, "a") == 8


def test_a_tenant_with_a_zero_share_is_refused_and_nothing_is_retained() -> None:
    c = cache(a=0.0)
    tokens = prompt(2 * BS)
    c.access(tokens, ctx("a"))
    assert not c.may_retain("a") and c.may_retain("b")
    assert c.retain(tokens, ctx("a"), 60.0) == type(c.retain(tokens, ctx("a"), 60.0))(0, RetainOutcome.REFUSED)
    flood(c, "b", 20)
    assert cached(c, tokens, "a") == 0
    assert next(t for t in c.stats().retention if t.tenant == "a").refused == 2


@pytest.mark.parametrize("how", ["bump", "purge", "purge_prefix", "ttl"])
def test_epochs_purges_and_ttls_win_over_retention(how: str) -> None:
    c = cache(ttl=30.0)
    tokens = prompt(2 * BS)
    c.access(tokens, ctx("a"))
    c.retain(tokens, ctx("a"), 3600.0)
    if how == "bump":
        c.bump_epoch("m")
    elif how == "purge":
        c.purge("a")
    elif how == "purge_prefix":
        c.purge_prefix(tokens[:1], ctx("a"))  # from the first block on
    else:
        CLOCK.now = 31.0
    c.reclaim()
    assert cached(c, tokens, "a") == 0
    assert c.stats().retention[0].held == (0,)


def test_a_hit_never_lengthens_another_tenants_retention_past_what_was_asked() -> None:
    """A public or shared block retained by one tenant and hit by another: the hit
    extends it by the retention asked, charged to who asked."""
    config = CacheConfig(block_size=BS, capacity_tokens=64, isolation="shared", retention=RetentionConfig(share=0.5))
    c = PrefixCache(config, clock=CLOCK)
    tokens = prompt(2 * BS)
    c.access(tokens, ctx("a"))
    c.retain(tokens, ctx("a"), 10.0)
    CLOCK.now = 5.0
    c.access(tokens, ctx("b"))
    by_tenant = {t.tenant: t for t in c.stats().retention}
    assert by_tenant["a"].held == (8,) and "b" not in by_tenant
    CLOCK.now = 15.1
    c.access(prompt(BS, 777), ctx("b"))
    assert c.stats().retention[0].held == (0,)


@pytest.mark.parametrize(
    ("share", "tenants"), [(1.5, {}), (-0.1, {}), (0.5, {"a": 0.6}), (0.25, {"a": 2.0}), (True, {}), (0.5, {"a": "x"})]
)
def test_shares_out_of_range_or_adding_up_past_the_cache_are_refused(share: object, tenants: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="retention"):
        RetentionConfig(share=share, tenants=tenants)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tokens", "seconds"), [(-1, 1.0), (1, 0.0), (1, -5.0), (1, float("nan")), (1, MAX_RETAIN_S + 1)]
)
def test_a_span_out_of_range_is_a_clear_error(tokens: int, seconds: float) -> None:
    with pytest.raises(ValueError, match="retained span"):
        RetainSpan(tokens, seconds)
    c = cache()
    if tokens >= 0:
        with pytest.raises(ValueError, match="retained span"):
            c.retain(prompt(tokens), ctx("a"), seconds)


def tiered(top_blocks: int, disk_blocks: int, tmp: str, write: str = "back") -> PrefixCache:
    fb = frame_bytes()
    config = CacheConfig(
        block_size=BLOCK,
        seed=SEED,
        kv_layout=layout(),
        tiers=(
            TierConfig(kind="memory", capacity_bytes=top_blocks * fb, write=write, write_after_hits=5),
            TierConfig(kind="disk", capacity_bytes=disk_blocks * fb, path=tmp, fsync="none"),
        ),
        writer="inline",
        retention=RetentionConfig(share=0.5),
    )
    return PrefixCache(config, clock=CLOCK)


@pytest.mark.parametrize("write", ["back", "selective"])
def test_under_pressure_a_retained_block_goes_down_a_tier_and_stays_in_the_last(tmp_path: object, write: str) -> None:
    """Memory holds 4 frames, the disk 8: a retained prompt is pushed from memory to the
    disk (even with the selective policy, which drops blocks hit too rarely) and stays
    there while other prompts come and go; its KV loads exactly."""
    with tiered(4, 8, str(tmp_path), write) as c:
        kept = prompt(2 * BLOCK, 7)
        c.insert(kept, ctx("a"), kv=kv_for(kept))
        assert c.retain(kept, ctx("a"), 60.0).tokens == 2 * BLOCK
        for i in range(12):
            other = prompt(2 * BLOCK, 1000 + 100 * i)
            c.insert(other, ctx("b"), kv=kv_for(other))
        with c.match(kept, ctx("a")) as m:
            assert m.cached_tokens == 2 * BLOCK
            loaded = c.load(m)
            assert loaded.tokens == 2 * BLOCK
            assert loaded.tier_tokens["disk"] == 2 * BLOCK or loaded.tier_tokens["memory"] == 2 * BLOCK
            assert (loaded.kv == kv_for(kept)).all()
        caps = c.retain_caps("a")
        assert caps[2] == 4  # half the disk's 8 frames: the last tier, where the cap binds


def test_hits_extend_a_retention_without_growing_its_books() -> None:
    """A hot retained prompt is hit again and again: one deadline entry per block, moved
    up when it comes due early; it expires once, at the last hit plus its retention."""
    c = cache()
    tokens = prompt(2 * BS)
    c.access(tokens, ctx("a"))
    c.retain(tokens, ctx("a"), 10.0)
    keeper = c._ledger.keeper
    for step in range(1, 1001):
        CLOCK.now = step * 0.5
        c.access(tokens, ctx("a"))
    assert len(keeper.deadlines) <= 2
    CLOCK.now = 500.0 + 9.9
    assert keeper.sweep() == 0 and c.stats().retention[0].held == (8,)
    CLOCK.now = 500.0 + 10.0
    assert keeper.sweep() == 2 and c.stats().retention[0].expired_tokens == 8


def test_a_tenant_at_its_cap_never_ends_anothers_retention_of_a_shared_block() -> None:
    config = CacheConfig(
        block_size=BS, capacity_tokens=64, isolation="shared", retention=RetentionConfig(share=0.5, tenants={"b": 0.05})
    )
    c = PrefixCache(config, clock=CLOCK)
    tokens = prompt(2 * BS)
    c.access(tokens, ctx("a"))
    assert c.retain(tokens, ctx("a"), 60.0).tokens == 8
    assert c.retain(tokens, ctx("b"), 60.0).outcome is RetainOutcome.CAPPED  # b's cap (3 tokens) holds no block
    held = {t.tenant: t.held[0] for t in c.stats().retention}
    assert held == {"a": 8, "b": 0}
