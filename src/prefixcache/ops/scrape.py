"""Scrapes of /metrics as ``prefixcache diagnose`` reads them: the samples of one scrape,
what changed between two (a ``Window``), and the figures of each tier in it."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Labels", "Scrape", "Tier", "Window", "tiers", "token_counts"]

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """The samples of one scrape: name -> labels -> value."""

    samples: dict[str, dict[Labels, float]]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples: dict[str, dict[Labels, float]] = defaultdict(dict)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[s.name][tuple(sorted(s.labels.items()))] = s.value
        return cls(dict(samples))

    def series(self, name: str, **match: str) -> dict[Labels, float]:
        return {k: v for k, v in self.samples.get(name, {}).items() if _matches(k, match)}

    def has(self, name: str) -> bool:
        return name in self.samples


def _matches(labels: Labels, match: dict[str, str]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in match.items())


@dataclass(frozen=True)
class Window:
    """What changed between two scrapes ``seconds`` apart, or, with one scrape, since start."""

    after: Scrape
    before: Scrape | None = None
    seconds: float | None = None

    def delta(self, name: str, **match: str) -> float:
        return sum(self.delta_series(name, **match).values())

    def delta_series(self, name: str, **match: str) -> dict[Labels, float]:
        now = self.after.series(name, **match)
        if self.before is None:
            return now
        then = self.before.samples.get(name, {})
        # A counter that went down was reset (a restart): its whole value is new.
        return {k: v - then.get(k, 0.0) if v >= then.get(k, 0.0) else v for k, v in now.items()}

    def delta_by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for labels, value in self.delta_series(name, **match).items():
            out[dict(labels).get(label, "")] += value
        return dict(out)

    def gauge(self, name: str, **match: str) -> float:
        return sum(self.after.series(name, **match).values())

    def rate(self, amount: float) -> float | None:
        return amount / self.seconds if self.seconds else None

    def span(self) -> str:
        return f"in the last {self.seconds:g} s" if self.seconds else "since start"


@dataclass(frozen=True)
class Tier:
    labels: dict[str, str]
    used: float
    capacity: float
    evictions: float
    asked: float  # blocks asked of it (hits + misses) in the window

    @property
    def name(self) -> str:
        return f"{self.labels.get('level', '?')} tier {self.labels.get('tier', '?')} ({self.labels.get('kind', '?')})"

    @property
    def occupancy(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


def tiers(w: Window) -> list[Tier]:
    out = []
    for labels in sorted(w.after.series("prefixcache_tier_capacity_bytes")):
        match = dict(labels)
        out.append(
            Tier(
                match,
                w.gauge("prefixcache_tier_used_bytes", **match),
                w.gauge("prefixcache_tier_capacity_bytes", **match),
                w.delta("prefixcache_tier_evictions_total", reason="capacity", **match),
                w.delta("prefixcache_tier_hits_total", **match) + w.delta("prefixcache_tier_misses_total", **match),
            )
        )
    if not out and w.after.has("prefixcache_capacity_tokens"):
        # NOTE: a cache without storage tiers is one pool; judge it as its L0, in tokens.
        out.append(
            Tier(
                {"level": "L0", "tier": "cache", "kind": "pool"},
                w.gauge("prefixcache_used_tokens"),
                w.gauge("prefixcache_capacity_tokens"),
                w.delta("prefixcache_evictions_total", reason="capacity"),
                w.delta("prefixcache_cache_lookup_tokens_total") / max(_block_tokens(w), 1.0),
            )
        )
    return out


def _block_tokens(w: Window) -> float:
    blocks = w.gauge("prefixcache_blocks")
    return w.gauge("prefixcache_used_tokens") / blocks if blocks else 1.0


def token_counts(w: Window) -> tuple[float, float]:
    """Lookup and hit tokens in the window: the cache's own counters, else the server's."""
    if w.after.has("prefixcache_cache_lookup_tokens_total"):
        return w.delta("prefixcache_cache_lookup_tokens_total"), w.delta("prefixcache_cache_hit_tokens_total")
    return w.delta("prefixcache_prompt_tokens_total"), w.delta("prefixcache_hit_tokens_total")
