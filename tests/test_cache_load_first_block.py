"""``PrefixCache.load(match, first_block=n)``: a caller that holds the first ``n`` blocks
(vLLM's own prefix cache) reads, verifies and promotes only the rest: its bytes read,
its honest length when a block after ``n`` is bad, and invariant 4 kept by a promotion
that cannot rise above an unread ancestor."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from guard_store import guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache.cache import PrefixCache
from prefixcache.events import RemovalReason
from test_cache_tiers import check_tiers, damage, disk, mem
from tier_worker import BLOCK, CTX, cache_with, kv_for, prompt, store
from tier_worker import layout as tiny_layout

BS = BLOCK


def disk_reads(cache: PrefixCache) -> int:
    return sum(t.bytes_read for t in cache.stats().tiers if t.kind == "disk")


def test_load_from_a_first_block_reads_only_the_blocks_after_it(tmp_path: Path) -> None:
    a = prompt(1, 8)
    with cache_with(disk(tmp_path)) as cache:
        store(cache, a)
        assert cache.flush(timeout=30)
        with cache.match(a, CTX) as m:
            before = disk_reads(cache)
            whole = cache.load(m)
            full_bytes = disk_reads(cache) - before
            assert (whole.tokens, whole.start, whole.requested) == (32, 0, 32)
            before = disk_reads(cache)
            half = cache.load(m, first_block=4)
            assert disk_reads(cache) - before == full_bytes // 2
        assert (half.tokens, half.start, half.requested, half.lost_tokens) == (32, 16, 32, 0)
        assert half.kv.shape[3] == half.tokens - half.start and half.kv.flags.c_contiguous
        assert np.array_equal(half.kv, whole.kv[:, :, :, 16:, :])
        assert half.tier_tokens == {"disk": 16}
        check_tiers(cache)


def test_load_from_a_first_block_skips_a_bad_block_before_it_and_stops_at_one_after(tmp_path: Path) -> None:
    a = prompt(1, 8)
    with cache_with(disk(tmp_path)) as cache:
        store(cache, a)
        assert cache.flush(timeout=30)
        damage(cache, a, 2, "flip")  # the caller's own copy of block 2 is all it needs
        with cache.match(a, CTX) as m:
            got = cache.load(m, first_block=4)
        assert (got.tokens, got.start) == (32, 16)
        assert cache.stats().removed(RemovalReason.LOST) == 0
        damage(cache, a, 6, "flip")
        with cache.match(a, CTX) as m:
            got = cache.load(m, first_block=4)
        assert (got.tokens, got.start, got.lost_tokens) == (24, 16, 8)  # blocks 4 and 5: the honest end
        assert np.array_equal(got.kv, kv_for(a)[:, :, :, 16:24, :])
        assert got.tier_tokens == {"disk": 8}
        assert cache.stats().removed(RemovalReason.LOST) >= 1
        with cache.match(a, CTX) as m:
            assert m.cached_tokens == 24  # block 6 and what hangs below it are gone


def test_load_from_a_first_block_promotes_only_under_a_parent_in_memory(tmp_path: Path) -> None:
    a, b = prompt(1, 8), prompt(2, 8)
    with cache_with(mem(8), disk(tmp_path)) as cache:
        store(cache, a)
        store(cache, [*b[:16], 7, 7, 7, 7])  # five blocks, a's last four leave memory for disk
        with cache.match(a, CTX) as m:
            assert m.tier_tokens == {"memory": 16, "disk": 16}
            got = cache.load(m, first_block=4)
        assert (got.tokens, got.start, got.tier_tokens) == (32, 16, {"memory": 0, "disk": 16})
        assert np.array_equal(got.kv, kv_for(a)[:, :, :, 16:, :])
        assert cache.stats().tiers[0].promotions == 4  # their parent is in memory: up they go
        check_tiers(cache)
    with cache_with(mem(8), disk(tmp_path / "again")) as cache:
        c = [5000 + j for j in range(8 * BS)]  # no block shared with the others
        store(cache, c)
        for i in range(3, 6):
            store(cache, prompt(i, 8))  # all of c leaves memory for disk
        evictions = cache.stats().tiers[0].evictions
        with cache.match(c, CTX) as m:
            assert m.tier_tokens == {"memory": 0, "disk": 32}
            got = cache.load(m, first_block=4)
        assert got.tokens == 32 and np.array_equal(got.kv, kv_for(c)[:, :, :, 16:, :])
        memory = cache.stats().tiers[0]
        assert memory.promotions == 0  # blocks 0-3 are not in memory: nothing may go above them,
        assert memory.evictions == evictions  # nor is room made for it
        check_tiers(cache)


def test_load_from_first_block_zero_is_the_whole_load_and_past_the_end_is_empty(tmp_path: Path) -> None:
    a = [*prompt(1, 3), 9, 9]  # three blocks and a two-token tail
    with cache_with(mem(64), disk(tmp_path), partial_blocks=True) as cache:
        store(cache, a)
        with cache.match(a, CTX) as m:
            whole, zero = cache.load(m), cache.load(m, first_block=0)
            assert (whole.tokens, whole.start) == (zero.tokens, zero.start) == (14, 0)
            assert np.array_equal(whole.kv, zero.kv)
            tail = cache.load(m, first_block=3)  # only the partial block
            assert (tail.tokens, tail.start) == (14, 12) and np.array_equal(tail.kv, whole.kv[:, :, :, 12:, :])
            out = np.empty(2 * tiny_layout().bytes_per_token, dtype=np.uint8)  # room for what is read only
            assert np.array_equal(cache.load(m, out, first_block=3).kv, tail.kv)
            assert np.array_equal(cache.prefetch(m, first_block=1).result().kv, whole.kv[:, :, :, 4:, :])
            reads = sum(t.bytes_read for t in cache.stats().tiers)
            for first in (4, 100):
                none = cache.load(m, first_block=first)
                assert (none.tokens, none.start, none.requested, none.lost_tokens) == (14, 14, 14, 0)
                assert none.kv.shape[3] == 0 and none.tier_tokens == {"memory": 0, "disk": 0}
            assert sum(t.bytes_read for t in cache.stats().tiers) == reads
            with pytest.raises(ValueError, match="first_block"):
                cache.load(m, first_block=-1)
        with cache.match([5, 5, 5, 5], CTX) as miss:
            nothing = cache.load(miss, first_block=2)
            assert (nothing.tokens, nothing.start, nothing.kv.shape[3]) == (0, 0, 0)


def test_loads_from_first_blocks_keep_the_tiers_consistent() -> None:
    """Random first blocks over a small memory tier above a disk: every load is the exact
    slice of the prompt's KV from its start, and invariant 4 holds after each."""
    rng = np.random.default_rng(3)
    with tempfile.TemporaryDirectory() as where, cache_with(mem(6), disk(Path(where))) as cache:
        for step in range(60):
            p = prompt(int(rng.integers(0, 5)), int(rng.integers(1, 9)))
            if rng.random() < 0.4:
                store(cache, p)
                continue
            with cache.match(p, CTX) as m:
                first = int(rng.integers(0, m.num_blocks + 2))
                got = cache.load(m, first_block=first)
                assert got.start == min(first * BS, m.cached_tokens) and got.kv.shape[3] == got.tokens - got.start
                assert np.array_equal(got.kv, kv_for(p)[:, :, :, got.start : got.tokens, :]), step
            check_tiers(cache)
