"""The epoch and generation books' tests share these: a cache over a memory tier and
the tiers under test, writes inline, the shared tiers read at open and when a test calls
``sync_epochs`` (or every ``sync_s``), and one 100-token prompt to store and match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.hashing import CacheContext
from tier_worker import BLOCK, CTX, SEED, kv_for, layout, prompt

BIG = 1 << 30
TOKENS = prompt(1, 25)  # 100 tokens


def cache_of(*tiers: TierConfig, sync_s: float | None = None, **config: Any) -> PrefixCache:
    memory = TierConfig(kind="memory", capacity_bytes=BIG, write="through")
    built = CacheConfig(
        block_size=BLOCK, seed=SEED, kv_layout=layout(), tiers=(memory, *tiers), writer="inline", **config
    )
    return PrefixCache(built, epoch_sync_s=sync_s)


def disk(path: Path) -> TierConfig:
    return TierConfig(kind="disk", capacity_bytes=BIG, path=str(path))


def on_redis(url: str, **kwargs: Any) -> TierConfig:
    return TierConfig(kind="redis", capacity_bytes=BIG, url=url, **kwargs)


def store(cache: PrefixCache, ctx: CacheContext = CTX, tokens: list[int] = TOKENS) -> int:
    return cache.insert(tokens, ctx, kv=kv_for(tokens))


def matched(cache: PrefixCache, ctx: CacheContext = CTX, tokens: list[int] = TOKENS) -> int:
    with cache.match(tokens, ctx) as m:
        return m.cached_tokens


def loaded(cache: PrefixCache, ctx: CacheContext = CTX, tokens: list[int] = TOKENS) -> int:
    with cache.match(tokens, ctx) as m:
        return cache.load(m).tokens
