"""Retention on /metrics (issue 41): a tenant retaining to its cap shows its retained
tokens and bytes at the cap, per tier, in the unit of the tier's own byte gauge; its
expiries by reason, cap hits and refusals are counted; tenant labels are bounded as the
serving metrics' are, and no counter goes down when the labelled tenants change."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from prefixcache import CacheConfig, CacheContext, PrefixCache
from prefixcache.config import RetentionConfig, TierConfig
from prefixcache.ops.collector import CacheCollector
from prefixcache.ops.metrics import OTHER, RETENTION_METRICS, metric_names
from prefixcache.ops.retention import RetentionMetrics
from prefixcache.ops.scrape import Scrape
from support import Clock
from tier_worker import BLOCK, SEED, frame_bytes, kv_for, layout

FRAMES = 16  # the memory tier, in frames of a full block
TIER = {"tier": "memory", "kind": "memory", "level": "L1"}


def ctx(tenant: str) -> CacheContext:
    return CacheContext(tenant=tenant, model="m")


def prompt(i: int, blocks: int = 3) -> list[int]:
    return [1000 * (i + 1) + j for j in range(blocks * BLOCK)]


def tiered(clock: Clock, **shares: float) -> PrefixCache:
    """One memory tier of 16 frames (the last tier: the cap binds there); acme may keep
    half of it, globex nothing, the others share the default half."""
    config = CacheConfig(
        block_size=BLOCK,
        seed=SEED,
        kv_layout=layout(),
        writer="inline",
        tiers=(TierConfig(kind="memory", capacity_bytes=FRAMES * frame_bytes()),),
        retention=RetentionConfig(share=0.5, tenants={"acme": 0.5, "globex": 0.0, **shares}),
    )
    return PrefixCache(config, clock=clock)


def store_and_retain(cache: PrefixCache, tenant: str, tokens: list[int], seconds: float = 600.0) -> None:
    cache.insert(tokens, ctx(tenant), kv=kv_for(tokens))
    cache.retain(tokens, ctx(tenant), seconds)


def scrape(registry: CollectorRegistry) -> Scrape:
    return Scrape.parse(generate_latest(registry).decode())


def value(s: Scrape, name: str, **labels: str) -> float:
    series = s.series(name, **labels)
    assert len(series) == 1, (name, labels, series)
    return next(iter(series.values()))


def test_a_tenant_retaining_to_its_cap_shows_it_on_metrics() -> None:
    clock = Clock()
    cache = tiered(clock)
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    for i in range(3):  # 9 blocks against a cap of 8 frames: the first span's deepest block gives way
        clock.now += 1
        store_and_retain(cache, "acme", prompt(i))
    s = scrape(registry)
    slot = frame_bytes()  # a memory slot, as the tier's byte gauge counts it
    (memory,) = cache.stats().tiers
    assert memory.frame_bytes == slot and memory.used_bytes == 9 * slot  # the cache's unit is the gauge's
    assert value(s, "prefixcache_retained_bytes", tenant="acme", **TIER) == 8 * slot
    assert value(s, "prefixcache_retention_cap_bytes", tenant="acme", **TIER) == 8 * slot
    assert value(s, "prefixcache_retained_tokens", tenant="acme") == 8 * BLOCK
    assert value(s, "prefixcache_retention_cap_tokens", tenant="acme") == cache.retain_caps("acme")[0]
    # one unit with the tier's own gauge: the tier holds the 9 blocks, 8 of them retained
    assert value(s, "prefixcache_tier_used_bytes", **TIER) == 9 * slot
    assert value(s, "prefixcache_retention_cap_hits_total", tenant="acme") == 1
    assert value(s, "prefixcache_retention_expired_tokens_total", tenant="acme", reason="cap") == BLOCK
    assert value(s, "prefixcache_retention_expired_tokens_total", tenant="acme", reason="deadline") == 0


def test_deadlines_and_refusals_are_counted_per_tenant() -> None:
    clock = Clock()
    cache = tiered(clock)
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    store_and_retain(cache, "initech", prompt(5, 2), seconds=10.0)
    store_and_retain(cache, "globex", prompt(6, 2))  # a zero share: refused, served without
    store_and_retain(cache, "globex", prompt(7, 2))
    assert value(scrape(registry), "prefixcache_retained_tokens", tenant="initech") == 2 * BLOCK
    clock.now = 11.0
    s = scrape(registry)
    assert value(s, "prefixcache_retention_expired_tokens_total", tenant="initech", reason="deadline") == 2 * BLOCK
    assert value(s, "prefixcache_retained_tokens", tenant="initech") == 0
    assert value(s, "prefixcache_retention_refused_total", tenant="globex") == 2
    assert value(s, "prefixcache_retained_tokens", tenant="globex") == 0
    assert value(s, "prefixcache_retention_cap_tokens", tenant="globex") == 0


def test_a_cache_without_tiers_counts_tokens_only() -> None:
    cache = PrefixCache(CacheConfig(block_size=BLOCK, capacity_tokens=100, retention=RetentionConfig(share=0.2)))
    cache.access(prompt(1), ctx("acme"))
    cache.retain(prompt(1), ctx("acme"), 60.0)
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    s = scrape(registry)
    assert value(s, "prefixcache_retained_tokens", tenant="acme") == 3 * BLOCK
    assert value(s, "prefixcache_retention_cap_tokens", tenant="acme") == 20
    assert not s.series("prefixcache_retained_bytes")


def test_every_retention_family_is_a_known_metric_name() -> None:
    clock = Clock()
    cache = tiered(clock)
    store_and_retain(cache, "acme", prompt(1))
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    s = scrape(registry)
    exported = {name for name in s.samples if "retain" in name or "retention" in name}
    assert exported == set(RETENTION_METRICS)
    assert set(RETENTION_METRICS) <= metric_names()


def test_tenant_labels_are_bounded_and_no_counter_goes_down() -> None:
    """Two labels at most (top 1 and ``other``, then a frozen one): a tenant that climbs
    past the labelled one takes the label from then on; every series only grows."""
    clock = Clock()
    cache = PrefixCache(
        CacheConfig(block_size=BLOCK, capacity_tokens=400, retention=RetentionConfig(share=0.1)), clock=clock
    )
    metrics = RetentionMetrics(top_tenants=1, max_label_values=2)
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def take() -> Scrape:
        registry = CollectorRegistry()
        registry.register(_Families(metrics, cache))
        s = scrape(registry)
        for name in ("prefixcache_retention_cap_hits_total", "prefixcache_retention_expired_tokens_total"):
            for labels, v in s.series(name).items():
                assert v >= seen.get((name, labels), 0.0), (name, labels)
                seen[(name, labels)] = v
        tenants = {dict(labels)["tenant"] for labels in s.series("prefixcache_retention_cap_hits_total")}
        assert len(tenants) <= 3 and tenants <= {"acme", "globex", "initech", OTHER}
        return s

    def traffic(tenant: str, n: int, base: int) -> None:
        for i in range(n):
            clock.now += 1
            tokens = prompt(base + i)
            cache.access(tokens, ctx(tenant))
            cache.retain(tokens, ctx(tenant), 600.0)

    traffic("acme", 6, 0)
    s = take()
    assert value(s, "prefixcache_retention_cap_hits_total", tenant="acme") > 0
    traffic("globex", 3, 100)
    traffic("initech", 3, 200)
    s = take()
    folded = value(s, "prefixcache_retention_cap_hits_total", tenant=OTHER)
    assert folded > 0  # globex's and initech's, under one label
    traffic("globex", 12, 300)  # globex now looks up more than acme: it takes the label
    s = take()
    assert value(s, "prefixcache_retention_cap_hits_total", tenant="globex") > 0
    assert value(s, "prefixcache_retention_cap_hits_total", tenant=OTHER) >= folded
    assert value(s, "prefixcache_retained_tokens", tenant="globex") > 0
    take()


class _Families:
    """A collector over one ``RetentionMetrics`` (kept between scrapes, as the cache
    collector keeps its own)."""

    def __init__(self, metrics: RetentionMetrics, cache: PrefixCache) -> None:
        self.metrics, self.cache = metrics, cache

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        return self.metrics.families(self.cache.stats())
