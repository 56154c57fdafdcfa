"""metrics.py: serving counters, the tenant cardinality guard, and the cache collector."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prefixcache import CacheConfig, CacheContext, PrefixCache, RemovalReason
from prefixcache.cache.retention import Level, TenantRetention
from prefixcache.ops.collector import CacheCollector
from prefixcache.ops.metrics import OTHER, RequestRecord, ServingMetrics, TenantLabels, metric_names
from support import WRITER, StatsSource, tier_stats


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, as the text exposition a Prometheus server reads."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def record(m: ServingMetrics, tenant: str, prompt: int, cached: int = 0, model: str = "m") -> str:
    return m.record_request(RequestRecord(tenant, model, "chat", prompt, cached, {"L0": cached}, 0.01, 0.2, 1.5))


def prompt_tokens(registry: CollectorRegistry, tenant: str) -> float | None:
    labels = {"tenant": tenant, "model": "m", "endpoint": "chat"}
    return registry.get_sample_value("prefixcache_prompt_tokens_total", labels)


# ============================================================================ serving


def test_record_request_counts_tokens_seconds_and_latency() -> None:
    registry = CollectorRegistry()
    m = ServingMetrics(registry)
    m.set_prefill_seconds_per_token(0.001)
    m.record_request(RequestRecord("acme", "smollm2", "chat", 1000, 640, {"L0": 512, "L2": 128}, 0.02, 0.3, 2.0))
    m.record_request(RequestRecord("acme", "smollm2", "chat", 200, 0, {}, 0.001, 0.05, 0.5, prefill_seconds=0.25))
    labels = {"tenant": "acme", "model": "smollm2", "endpoint": "chat"}
    get = registry.get_sample_value
    assert get("prefixcache_lookups_total", labels) == 2
    assert get("prefixcache_prompt_tokens_total", labels) == 1200
    assert get("prefixcache_hit_tokens_total", labels) == 640
    assert get("prefixcache_tier_hit_tokens_total", {"tenant": "acme", "model": "smollm2", "tier": "L0"}) == 512
    assert get("prefixcache_tier_hit_tokens_total", {"tenant": "acme", "model": "smollm2", "tier": "L2"}) == 128
    assert get("prefixcache_prefill_seconds_saved_total", labels) == pytest.approx(0.64)
    # the first request's 360 computed tokens at the measured speed, the second's own timing
    assert get("prefixcache_prefill_seconds_total", labels) == pytest.approx(0.36 + 0.25)
    assert get("prefixcache_prefill_seconds_per_token") == 0.001
    hist = {"model": "smollm2", "endpoint": "chat"}
    assert get("prefixcache_time_to_first_token_seconds_count", hist) == 2
    assert get("prefixcache_time_to_first_token_seconds_bucket", {**hist, "le": "0.1"}) == 1
    assert get("prefixcache_request_queue_seconds_sum", hist) == pytest.approx(0.021)
    assert get("prefixcache_request_duration_seconds_bucket", {**hist, "le": "+Inf"}) == 2
    totals = m.snapshot()[("acme", "smollm2", "chat")]
    assert (totals.lookups, totals.prompt_tokens, totals.hit_tokens) == (2, 1200, 640)


def test_nothing_is_saved_on_paper_before_the_prefill_speed_is_measured() -> None:
    registry = CollectorRegistry()
    m = ServingMetrics(registry)
    record(m, "acme", 100, 64)
    labels = {"tenant": "acme", "model": "m", "endpoint": "chat"}
    assert registry.get_sample_value("prefixcache_prefill_seconds_saved_total", labels) == 0
    assert registry.get_sample_value("prefixcache_prefill_seconds_per_token") == 0
    m.set_prefill_seconds_per_token(0.5)
    record(m, "acme", 100, 64)
    assert registry.get_sample_value("prefixcache_prefill_seconds_saved_total", labels) == 32


@pytest.mark.parametrize(
    ("prompt", "cached", "tiers"),
    [(10, 11, {"L0": 11}), (10, -1, {}), (10, 8, {"L0": 4}), (10, 4, {"L0": 6, "L1": -2})],
)
def test_inconsistent_requests_are_refused(prompt: int, cached: int, tiers: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        RequestRecord("a", "m", "chat", prompt, cached, tiers)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_prefill_speed_must_be_a_positive_measurement(bad: float) -> None:
    with pytest.raises(ValueError):
        ServingMetrics(CollectorRegistry()).set_prefill_seconds_per_token(bad)


def test_two_registries_share_nothing() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    record(ServingMetrics(a), "acme", 10)
    ServingMetrics(b)
    assert a.get_sample_value("prefixcache_lookups_total", {"tenant": "acme", "model": "m", "endpoint": "chat"}) == 1
    assert b.get_sample_value("prefixcache_lookups_total", {"tenant": "acme", "model": "m", "endpoint": "chat"}) is None


# ============================================================================ the tenant guard


def test_tenants_beyond_the_top_n_are_folded_into_other() -> None:
    registry = CollectorRegistry()
    m = ServingMetrics(registry, top_tenants=2)
    assert [record(m, t, n) for t, n in [("a", 100), ("b", 50), ("c", 10), ("d", 10)]] == ["a", "b", OTHER, OTHER]
    assert prompt_tokens(registry, OTHER) == 20


def test_a_folded_tenant_that_overtakes_gets_its_label_from_then_on() -> None:
    registry = CollectorRegistry()
    m = ServingMetrics(registry, top_tenants=2)
    record(m, "a", 100)
    record(m, "b", 50)
    assert record(m, "c", 40) == OTHER  # 40 < 50
    assert record(m, "c", 20) == "c"  # 60 > 50: c replaces b
    assert record(m, "b", 5) == OTHER  # b is folded now; its old series stays, frozen
    prompt = {t: prompt_tokens(registry, t) for t in ("a", "b", "c", OTHER)}
    # c's first 40 tokens stay in other: nothing moves between series
    assert prompt == {"a": 100, "b": 50, "c": 20, OTHER: 45}
    assert registry.get_sample_value("prefixcache_tenant_label_changes_total") == 1
    assert record(m, "b", 100) == "b"  # b is back on top (155 > 60): it resumes its own series
    assert prompt_tokens(registry, "b") == 150


def test_label_values_ever_exported_are_capped() -> None:
    labels = TenantLabels(top_n=1, max_label_values=2)
    assert labels.observe("a", 10) == "a"
    assert labels.observe("b", 20) == "b"  # the second label value ever
    assert labels.observe("c", 30) == OTHER  # would be a third: the set is frozen now
    assert labels.exported == {"a", "b"}
    assert labels.observe("a", 100) == "a"  # a already has a series: it may come back


def test_a_tenant_named_other_is_always_folded() -> None:
    assert TenantLabels(top_n=5).observe(OTHER, 10) == OTHER


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 4),
    st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 500), st.sampled_from(["m1", "m2"])), max_size=60),
)
def test_every_counter_stays_monotonic_and_sums_to_the_traffic(top: int, requests: list[tuple[str, int, str]]) -> None:
    """Whatever the order of tenants, no exported counter ever decreases or disappears,
    at most ``2 * top`` tenant label values (plus other) exist, and the series of a
    counter sum to exactly what was recorded."""
    registry = CollectorRegistry()
    m = ServingMetrics(registry, top_tenants=top)
    before: dict[Any, float] = {}
    for tenant, prompt, model in requests:
        record(m, tenant, prompt, prompt // 2, model)
        now = samples(registry)
        for key, value in before.items():
            if key[0].endswith("_total") or key[0].endswith(("_count", "_bucket", "_sum")):
                assert now[key] >= value, key
        before = now
    tenants = {dict(labels)["tenant"] for name, labels in before if name == "prefixcache_prompt_tokens_total"}
    assert len(tenants - {OTHER}) <= 2 * top
    total = sum(v for (name, _), v in before.items() if name == "prefixcache_prompt_tokens_total")
    assert total == sum(prompt for _, prompt, _ in requests)
    hits = sum(v for (name, _), v in before.items() if name == "prefixcache_hit_tokens_total")
    assert hits == sum(prompt // 2 for _, prompt, _ in requests)


# ============================================================================ the cache collector


def cache_scrape(cache: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    return samples(registry)


def test_collector_exports_what_a_real_cache_counts() -> None:
    cache = PrefixCache(CacheConfig(block_size=4, capacity_tokens=64, policy="lru", isolation="namespace"))
    ctx = CacheContext(tenant="acme", model="m")
    for start in range(0, 200, 20):  # 10 prompts of 20 tokens into 64 tokens: capacity evictions
        tokens = list(range(start, start + 20))
        cache.insert(tokens, ctx)
        cache.match(tokens, ctx).release()
    cache.bump_epoch("m")
    cache.reclaim()
    cache.insert(list(range(1000, 1016)), ctx)
    cache.purge("acme")
    stats = cache.stats()
    got = cache_scrape(cache)

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert value("prefixcache_cache_lookups_total") == stats.lookups == 10
    assert value("prefixcache_cache_hit_tokens_total") == stats.hit_tokens == 200
    assert value("prefixcache_cache_lookup_tokens_total") == 200
    assert value("prefixcache_evictions_total", reason="capacity") == stats.evictions > 0
    assert value("prefixcache_evictions_total", reason="stale") == stats.removed(RemovalReason.STALE) == 16
    assert value("prefixcache_evictions_total", reason="purge") == stats.removed(RemovalReason.PURGED) == 4
    assert value("prefixcache_evictions_total", reason="ttl") == 0
    assert value("prefixcache_epoch_bumps_total") == 1
    assert value("prefixcache_capacity_tokens") == 64
    assert value("prefixcache_used_tokens") == stats.used_tokens == 0
    assert value("prefixcache_hash_collisions_total") == 0
    assert value("prefixcache_published_blocks_total") == 0
    assert not any(name.startswith("prefixcache_tier_") for name, _ in got)  # no tiers, no tier series


def test_collector_reads_the_cache_at_scrape_time() -> None:
    cache = PrefixCache(CacheConfig(block_size=4, capacity_tokens=64))
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    assert registry.get_sample_value("prefixcache_blocks") == 0
    cache.insert(list(range(12)), CacheContext(tenant="t", model="m"))
    assert registry.get_sample_value("prefixcache_blocks") == 3
    assert registry.get_sample_value("prefixcache_used_tokens") == 12


def test_collector_exports_every_tier_with_its_level() -> None:
    tiers = [
        tier_stats("hbm", "device"),
        tier_stats("ram", "memory"),
        tier_stats("shared", "redis", errors={"timeout": 3, "connection": 1}),
    ]
    registry = CollectorRegistry()
    registry.register(CacheCollector(StatsSource(tiers=tuple(tiers))))
    get = registry.get_sample_value
    l2 = {"tier": "shared", "kind": "redis", "level": "L2"}
    assert get("prefixcache_tier_used_bytes", {"tier": "hbm", "kind": "device", "level": "L0"}) == 1 << 29
    assert get("prefixcache_tier_capacity_bytes", {"tier": "ram", "kind": "memory", "level": "L1"}) == 1 << 30
    assert get("prefixcache_tier_hits_total", l2) == 10
    assert get("prefixcache_tier_misses_total", l2) == 2
    assert get("prefixcache_tier_read_bytes_total", l2) == 4096
    assert get("prefixcache_tier_written_bytes_total", l2) == 8192
    assert get("prefixcache_tier_promotions_total", l2) == 1
    assert get("prefixcache_tier_demotions_total", l2) == 3
    assert get("prefixcache_tier_evictions_total", {**l2, "reason": "capacity"}) == 5
    assert get("prefixcache_tier_evictions_total", {**l2, "reason": "stale"}) == 0
    assert get("prefixcache_tier_blocks", l2) == 100
    assert get("prefixcache_tier_errors_total", {**l2, "error": "timeout"}) == 3
    assert get("prefixcache_tier_errors_total", {**l2, "error": "connection"}) == 1
    assert get("prefixcache_tier_load_seconds_bucket", {**l2, "le": "0.001"}) == 4
    assert get("prefixcache_tier_load_seconds_bucket", {**l2, "le": "+Inf"}) == 10
    assert get("prefixcache_tier_load_seconds_count", l2) == 10
    assert get("prefixcache_tier_load_seconds_sum", l2) == 0.05


def test_metric_names_lists_exactly_what_is_exported() -> None:
    """The list the dashboard and alert tests check against cannot drift from the code."""
    registry = CollectorRegistry()
    m = ServingMetrics(registry)
    m.set_prefill_seconds_per_token(1e-4)
    record(m, "a", 10, 5)
    retention = (TenantRetention("a", (32, 2), (64, 4), 16, 16, 1, 1),)  # a tenant that retains (ops/retention.py)
    levels = (Level("cache", 256, True), Level("x", 16, False))
    full = StatsSource(
        purges=1,
        tiers=(tier_stats("x", "memory", errors={"io": 1}),),
        writer=WRITER,
        retention=retention,
        retention_levels=levels,
    )
    registry.register(CacheCollector(full))
    exported = {name for name, _ in samples(registry)}
    assert exported == metric_names()


def test_collector_exports_a_real_tier() -> None:
    """A real memory tier holding KV: what it stored and served is on the scrape."""
    import numpy as np

    from prefixcache.config import KVLayout, TierConfig

    layout = KVLayout(layers=2, kv_heads=1, head_dim=8)
    config = CacheConfig(
        block_size=4, capacity_tokens=64, kv_layout=layout, tiers=(TierConfig(kind="memory", capacity_bytes=1 << 20),)
    )
    cache = PrefixCache(config)
    ctx = CacheContext(tenant="acme", model="m")
    prompt = list(range(16))
    cache.insert(prompt, ctx, kv=np.zeros((2, 2, 1, 16, 8), dtype=np.float16))
    with cache.match(prompt, ctx) as m:
        assert cache.load(m) is not None
    (tier,) = cache.stats().tiers
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    labels = {"tier": tier.name, "kind": "memory", "level": "L1"}
    assert registry.get_sample_value("prefixcache_tier_hits_total", labels) == tier.hits == 4
    assert registry.get_sample_value("prefixcache_tier_used_bytes", labels) == tier.used_bytes > 0
    assert registry.get_sample_value("prefixcache_tier_written_bytes_total", labels) == tier.bytes_written > 0
    assert registry.get_sample_value("prefixcache_tier_load_seconds_count", labels) == 1
    cache.bump_epoch("m")
    cache.reclaim()  # the stale blocks leave the tier: counted per tier with their reason
    stale = registry.get_sample_value("prefixcache_tier_evictions_total", {**labels, "reason": "stale"})
    assert stale == 4 and registry.get_sample_value("prefixcache_tier_blocks", labels) == 0
    assert registry.get_sample_value("prefixcache_tier_evictions_total", {**labels, "reason": "capacity"}) == 0
    assert registry.get_sample_value("prefixcache_tier_load_seconds_bucket", {**labels, "le": "+Inf"}) == 1


def test_prefill_rate_skips_warm_up_and_short_prompts_and_smooths() -> None:
    from prefixcache.ops.metrics import PrefillRate

    rate = PrefillRate(min_tokens=100, alpha=0.5)
    assert rate.observe(9.0, 1000) is None  # the first one warms the model up
    assert rate.observe(0.5, 50) is None  # too short: fixed costs would dominate
    assert rate.observe(2.0, 1000) == 0.002
    assert rate.observe(4.0, 1000) == 0.003  # halfway to 0.004
    assert rate.observe(float("nan"), 1000) == 0.003
