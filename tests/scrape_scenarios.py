"""The saved scrapes of tests/data/scrapes/: one pair per situation ``prefixcache diagnose`` knows.

Each scenario drives a real ``PrefixCache`` with requests (match, record the request
in a real ``ServingMetrics``, insert), scrapes a registry that also holds a real
``CacheCollector``, drives more requests, and scrapes again: ``NAME.1.prom`` and
``NAME.2.prom``, taken "10 seconds" apart (the test passes ``--interval 10``). Where a
situation needs storage tiers (pressure, a dead or slow L2), the entries of
``stats().tiers`` are written out as the tiered cache reports them (``TierStats``),
beside the real cache's own counters. ``_created`` samples (wall-clock times) are left out so
that the files are reproducible byte for byte.

Regenerate: ``.venv/bin/python tests/scrape_scenarios.py`` (the test checks that the
committed files equal what this writes).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from prefixcache import CacheConfig, CacheContext, PrefixCache
from prefixcache.cache.stats import CacheStats, Histogram, TierStats
from prefixcache.ops.collector import CacheCollector
from prefixcache.ops.metrics import RequestRecord, ServingMetrics

OUT = Path(__file__).parent / "data" / "scrapes"
INTERVAL = 10  # nominal seconds between the two scrapes
SECONDS_PER_TOKEN = 2e-4
GiB = 1 << 30


class Server:
    """A cache, its metrics and a registry, driven the way the engine will drive them."""

    def __init__(self, config: CacheConfig, tiers: list[TierStats] | None = None) -> None:
        self.cache = PrefixCache(config)
        self.tiers = tiers
        self.registry = CollectorRegistry()
        self.metrics = ServingMetrics(self.registry, top_tenants=20)
        self.metrics.set_prefill_seconds_per_token(SECONDS_PER_TOKEN)
        self.registry.register(CacheCollector(self))

    def stats(self) -> CacheStats:
        stats = self.cache.stats()
        return replace(stats, tiers=tuple(self.tiers)) if self.tiers is not None else stats

    def request(self, tenant: str, prompt: list[int], model: str = "smollm2") -> None:
        ctx = CacheContext(tenant=tenant, model=model)
        with self.cache.match(prompt, ctx) as m:
            cached = m.cached_tokens
        computed = len(prompt) - cached
        self.metrics.record_request(
            RequestRecord(
                tenant,
                model,
                "chat",
                len(prompt),
                cached,
                {"L0": cached} if cached else {},
                0.002,
                0.01 + computed * SECONDS_PER_TOKEN,
                0.5 + computed * SECONDS_PER_TOKEN,
            )
        )
        self.cache.insert(prompt, ctx)

    def scrape(self) -> str:
        text = generate_latest(self.registry).decode()
        return "".join(line + "\n" for line in text.splitlines() if "_created" not in line)


def tier(name: str, kind: str, capacity: int, used: int, **counters: Any) -> TierStats:
    entry = TierStats(
        name=name,
        kind=kind,
        level={"device": "L0", "memory": "L1"}.get(kind, "L2"),
        write="back",
        capacity_bytes=capacity,
        used_bytes=used,
        frame_bytes=256 * 1024,
        blocks=used // (256 * 1024),
        hits=0,
        misses=0,
        bytes_read=0,
        bytes_written=0,
        promotions=0,
        demotions=0,
        evictions=0,
        removals={},
        errors={},
        load_seconds=Histogram(((0.001, 0), (0.01, 0), (0.1, 0), (1.0, 0), (float("inf"), 0)), 0.0, 0),
        writes_pending=0,
        writes_dropped=0,
        writes_failed=0,
    )
    return replace(entry, **counters)


def load_seconds(fast: int, slow: int) -> Histogram:
    """A load-latency histogram: ``fast`` loads under 1 ms, ``slow`` ones of 50-100 ms."""
    n = fast + slow
    return Histogram(
        ((0.001, fast), (0.01, fast), (0.1, n), (1.0, n), (float("inf"), n)), 0.0005 * fast + 0.08 * slow, n
    )


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(49_152) for _ in range(n)]


def chat_traffic(
    server: Server, rng: random.Random, tenants: list[str], requests: int, systems: dict[str, list[int]]
) -> None:
    """Tenants re-sending their system prompt with a short question: mostly hits."""
    for _ in range(requests):
        tenant = rng.choice(tenants)
        server.request(tenant, systems[tenant] + tokens(rng, rng.randrange(16, 64)))


def two_tier(l0_used: float, l1_used: float, **over: dict[str, Any]) -> list[TierStats]:
    return [
        tier("hbm", "device", 8 * GiB, int(l0_used * 8 * GiB), **over.get("hbm", {})),
        tier("ram", "memory", 64 * GiB, int(l1_used * 64 * GiB), **over.get("ram", {})),
    ]


def _base(
    tiers: list[TierStats] | None = None, capacity: int = 1_000_000, policy: str = "s3fifo"
) -> tuple[Server, random.Random, dict[str, list[int]]]:
    rng = random.Random(7)
    systems = {t: tokens(rng, 512) for t in ("acme", "globex", "initech")}
    return Server(CacheConfig(block_size=16, capacity_tokens=capacity, policy=policy), tiers), rng, systems


def healthy() -> tuple[str, str]:
    server, rng, systems = _base(two_tier(0.6, 0.3))
    chat_traffic(server, rng, list(systems), 60, systems)
    before = server.scrape()
    chat_traffic(server, rng, list(systems), 60, systems)
    return before, server.scrape()


def pressure(level: str) -> tuple[str, str]:
    tiers = two_tier(0.6, 0.3, hbm={"hits": 5000, "misses": 1000, "evictions": 20_000})
    server, rng, systems = _base(tiers)
    chat_traffic(server, rng, list(systems), 60, systems)
    before = server.scrape()
    chat_traffic(server, rng, list(systems), 60, systems)
    if level == "L0":  # 97% full, 70,000 more evictions in 10 s: 7,000/s
        tiers[0] = replace(
            tiers[0], **{"used_bytes": int(0.97 * 8 * GiB), "hits": 90_000, "misses": 40_000, "evictions": 90_000}
        )
    else:  # host RAM 99% full, 2,000 more evictions in 10 s: 200/s
        tiers[1] = replace(
            tiers[1], **{"used_bytes": int(0.99 * 64 * GiB), "hits": 4000, "misses": 3000, "evictions": 2_000}
        )
    return before, server.scrape()


def low_hit_rate() -> tuple[str, str]:
    """Each prompt starts with a per-request token (a timestamp rendered into the
    template), so no two prompts share a first block: a large cache, nothing reused."""
    server, rng, systems = _base(two_tier(0.2, 0.1))
    for phase in range(2):
        for i in range(60):
            tenant = rng.choice(list(systems))
            server.request(tenant, [1000 + phase * 100 + i, *systems[tenant], *tokens(rng, 40)])
        if phase == 0:
            before = server.scrape()
    return before, server.scrape()


def invalidation_storm() -> tuple[str, str]:
    server, rng, systems = _base()
    chat_traffic(server, rng, list(systems), 60, systems)
    before = server.scrape()
    for _ in range(12):  # 12 bumps in 10 s, each followed by a few requests
        server.cache.bump_epoch("smollm2")
        chat_traffic(server, rng, list(systems), 5, systems)
    return before, server.scrape()


def l2(broken: str) -> tuple[str, str]:
    tiers = [
        *two_tier(0.6, 0.3),
        tier("shared", "redis", 512 * GiB, 100 * GiB, hits=3000, misses=200, load_seconds=load_seconds(3200, 0)),
    ]
    server, rng, systems = _base(tiers)
    chat_traffic(server, rng, list(systems), 60, systems)
    before = server.scrape()
    chat_traffic(server, rng, list(systems), 60, systems)
    if broken == "dead":  # every call refused or skipped by the breaker for 10 s
        tiers[2] = replace(tiers[2], misses=1200, errors={"connection": 40, "breaker_open": 960})
    else:  # reachable, but most loads take 50-100 ms
        tiers[2] = replace(tiers[2], hits=4000, misses=300, load_seconds=load_seconds(3400, 900))
    return before, server.scrape()


def writes_lost() -> tuple[str, str]:
    """Host RAM written through to a disk that cannot keep up: the write queue fills and
    drops writes (a restart would miss those blocks)."""
    tiers = [*two_tier(0.6, 0.3), tier("disk", "disk", 512 * GiB, 40 * GiB, write="back")]
    tiers[1] = replace(tiers[1], write="through")
    server, rng, systems = _base(tiers)
    chat_traffic(server, rng, list(systems), 60, systems)
    before = server.scrape()
    chat_traffic(server, rng, list(systems), 60, systems)
    tiers[2] = replace(tiers[2], writes_dropped=450, writes_pending=2048)
    return before, server.scrape()


def crowding() -> tuple[str, str]:
    """A small cache shared by three chat tenants; then one batch tenant floods it with
    long one-off documents and evicts everyone's system prompts (LRU: S3-FIFO would
    have kept the one-off documents in its small queue)."""
    server, rng, systems = _base(capacity=4096, policy="lru")
    chat_traffic(server, rng, list(systems), 60, systems)
    before = server.scrape()
    for _ in range(20):
        server.request("batchco", tokens(rng, 3000))
        chat_traffic(server, rng, list(systems), 2, systems)
    return before, server.scrape()


SCENARIOS: dict[str, Callable[[], tuple[str, str]]] = {
    "healthy": healthy,
    "l0_pressure": lambda: pressure("L0"),
    "l1_pressure": lambda: pressure("L1"),
    "low_hit_rate": low_hit_rate,
    "invalidation_storm": invalidation_storm,
    "l2_dead": lambda: l2("dead"),
    "l2_slow": lambda: l2("slow"),
    "crowding": crowding,
    "writes_lost": writes_lost,
}


def write(out: Path = OUT) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in SCENARIOS.items():
        for i, text in enumerate(build(), start=1):
            path = out / f"{name}.{i}.prom"
            path.write_text(text)
            written.append(path)
    return written


if __name__ == "__main__":
    for path in write():
        print(path)
