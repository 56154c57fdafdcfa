"""A purge or an epoch bump is final: a store decided before it never brings back what it
removed (issue 39, finding 9), in any tier.

Two windows: a request that matched before the invalidation and stores after it (the
engine's ``insert`` when a request ends: its ``stamp``), and an insert whose blocks were
planned under the lock before it and committed after (the bytes move outside the lock:
a ``KVSource`` whose ``read`` runs the invalidation puts it exactly there). And what a
store had already queued for a slower tier when the purge came never lands for good.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guard_store import guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.hashing import CacheContext
from tier_worker import BLOCK, CTX, cache_with, kv_for, prompt

BIG = 1 << 30
GLOBEX = CacheContext(tenant="globex", model="m")
TOKENS = prompt(1, 100)  # 400 tokens: the finding's request


def memory_disk(path: Path, **kwargs: Any) -> PrefixCache:
    memory = TierConfig(kind="memory", capacity_bytes=BIG, write="through")
    return cache_with(memory, TierConfig(kind="disk", capacity_bytes=BIG, path=str(path)), **kwargs)


def matched(cache: PrefixCache, tokens: list[int], ctx: CacheContext = CTX) -> int:
    with cache.match(tokens, ctx) as m:
        return m.cached_tokens


Invalidate = Callable[[PrefixCache], object]

INVALIDATIONS: dict[str, Invalidate] = {
    "purge": lambda cache: cache.purge("acme"),
    "purge_prefix": lambda cache: cache.purge_prefix(TOKENS[:2], CTX),
    "bump_epoch": lambda cache: cache.bump_epoch("m"),
    "bump_adapter": lambda cache: cache.bump_epoch("m", "lora"),
}
LORA = CacheContext(tenant="acme", model="m", adapter="lora")


# ============================================================================ a request in flight


@pytest.mark.parametrize("how", ["purge", "purge_prefix", "bump_epoch"])
def test_a_request_in_flight_does_not_store_back_what_was_invalidated(tmp_path: Path, how: str) -> None:
    with memory_disk(tmp_path) as cache:
        cache.insert(TOKENS, CTX, kv=kv_for(TOKENS))
        stamp = cache.stamp()  # the request's match
        assert matched(cache, TOKENS) == 400
        INVALIDATIONS[how](cache)
        assert matched(cache, TOKENS) == 0
        assert cache.insert(TOKENS, CTX, kv=kv_for(TOKENS), since=stamp) == 0  # the request ends
        assert matched(cache, TOKENS) == 0
        assert cache.stats().voided_tokens == 400
        assert cache.insert(TOKENS, CTX, kv=kv_for(TOKENS), since=cache.stamp()) == 400  # a later request


@pytest.mark.parametrize("how", ["purge", "purge_prefix", "bump_epoch"])
def test_a_purged_prefix_stored_back_by_a_request_in_flight_is_not_on_disk(tmp_path: Path, how: str) -> None:
    with memory_disk(tmp_path) as cache:
        cache.insert(TOKENS, CTX, kv=kv_for(TOKENS))
        stamp = cache.stamp()
        INVALIDATIONS[how](cache)
        assert cache.insert(TOKENS, CTX, kv=kv_for(TOKENS), since=stamp) == 0
    with memory_disk(tmp_path) as restarted:
        assert matched(restarted, TOKENS) == 0


def test_a_stamped_store_of_a_metadata_only_cache_is_voided_too() -> None:
    cache = PrefixCache(CacheConfig(block_size=BLOCK, capacity_tokens=10_000))
    stamp = cache.stamp()
    cache.purge("acme")
    assert cache.insert(TOKENS, CTX, since=stamp) == 0 and matched(cache, TOKENS) == 0
    assert cache.insert(TOKENS, GLOBEX, since=stamp) == 400  # another tenant's store is not covered


def test_an_invalidation_voids_only_the_stores_it_covers(tmp_path: Path) -> None:
    other = [7, 7, 7, 7, *TOKENS[4:40]]
    with memory_disk(tmp_path) as cache:
        stamp = cache.stamp()
        cache.purge("acme")
        assert cache.insert(TOKENS, GLOBEX, kv=kv_for(TOKENS), since=stamp) == 400
        stamp = cache.stamp()
        cache.purge_prefix(TOKENS[:10], CTX)
        assert cache.insert(other, CTX, kv=kv_for(other), since=stamp) == 40  # another prefix
        assert cache.insert(TOKENS[:8], CTX, kv=kv_for(TOKENS[:8]), since=stamp) == 8  # shorter than the purged one
        stamp = cache.stamp()
        cache.bump_epoch("m", "lora")
        assert cache.insert(TOKENS, CTX, kv=kv_for(TOKENS), since=stamp) == 392  # the base model's: not the adapter's
        assert cache.insert(TOKENS, LORA, kv=kv_for(TOKENS), since=stamp) == 0
        assert cache.stats().voided_tokens == 400


def test_a_stamp_older_than_every_invalidation_remembered_is_voided() -> None:
    # NOTE: a memory tier only: on a disk, each purge would also write its generation's record
    with cache_with(TierConfig(kind="memory", capacity_bytes=BIG, write="through")) as cache:
        stamp = cache.stamp()
        for i in range(4097):  # more than the log keeps, none of them acme's
            cache.purge(f"tenant-{i}")
        assert cache.insert(TOKENS, CTX, kv=kv_for(TOKENS), since=stamp) == 0  # the worst is assumed
        assert cache.insert(TOKENS, CTX, kv=kv_for(TOKENS), since=cache.stamp()) == 400


# ============================================================================ between plan and commit


class Interrupting:
    """A KV source that runs ``then`` when the insert reads it: after the blocks were
    planned under the lock, before their commit."""

    def __init__(self, cache: PrefixCache, tokens: list[int], then: Invalidate) -> None:
        self.cache, self.kv, self.then = cache, kv_for(tokens), then
        self.ran = 0

    def read(self, begin: int, end: int) -> np.ndarray:
        if not self.ran:
            self.then(self.cache)
        self.ran += 1
        return self.kv[:, :, :, begin:end, :]


@pytest.mark.parametrize("how", ["purge", "purge_prefix", "bump_epoch"])
def test_an_invalidation_between_an_inserts_plan_and_its_commit_wins(tmp_path: Path, how: str) -> None:
    with memory_disk(tmp_path, writer="deferred") as cache:
        source = Interrupting(cache, TOKENS, INVALIDATIONS[how])
        assert cache.insert(TOKENS, CTX, kv=source) == 0 and source.ran == 1
        assert matched(cache, TOKENS) == 0
        assert cache.flush() and cache.stats().tiers[1].blocks == 0  # nothing was queued for the disk
        assert len(cache.stats().tiers) == 2 and cache.stats().tiers[0].blocks == 0  # the memory slots went back
    with memory_disk(tmp_path) as restarted:
        assert matched(restarted, TOKENS) == 0


def test_another_tenants_insert_commits_across_a_purge(tmp_path: Path) -> None:
    with memory_disk(tmp_path) as cache:
        source = Interrupting(cache, TOKENS, INVALIDATIONS["purge"])
        assert cache.insert(TOKENS, GLOBEX, kv=source) == 400
        assert matched(cache, TOKENS, GLOBEX) == 400


# ============================================================================ what the writer holds


@pytest.mark.parametrize("how", ["purge", "purge_prefix"])
def test_writes_queued_before_a_purge_never_land_for_good(tmp_path: Path, how: str) -> None:
    with memory_disk(tmp_path, writer="deferred") as cache:
        assert cache.insert(TOKENS, CTX, kv=kv_for(TOKENS)) == 400  # its disk copies queued, not written
        INVALIDATIONS[how](cache)
        assert cache.flush()
        assert matched(cache, TOKENS) == 0 and cache.stats().tiers[1].blocks == 0
    with memory_disk(tmp_path) as restarted:
        assert matched(restarted, TOKENS) == 0
