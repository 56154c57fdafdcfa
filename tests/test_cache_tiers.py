"""The tiered cache: KV bytes through memory, disk and Redis tiers, demotion and promotion,
invariant 4 across tiers, and every failure a shorter (or no) match, counted, never wrong
bytes (invariant 6). Redis is a real ``redis-server``; disk tiers live in ``tmp_path``."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from fault_stores import Faulty, faulty
from guard_store import guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache.cache import PrefixCache
from prefixcache.cache.stats import Histogram, LatencyHistogram
from prefixcache.config import CacheConfig, KVLayout, PublishConfig, TierConfig
from prefixcache.events import RemovalReason
from prefixcache.hashing import CacheContext
from prefixcache.storage import disk as disk_module
from redis_server import REDIS_SERVER, RedisServer, StallingProxy, free_port
from support import random_kv
from tier_worker import BLOCK, CTX, cache_with, frame_bytes, kv_for, prompt, store
from tier_worker import layout as tiny_layout

HERE = Path(__file__).resolve().parent
BIG = 1 << 30


def needs_redis(test: Callable[..., None]) -> Callable[..., None]:
    skip = pytest.mark.skipif(not Path(REDIS_SERVER).exists(), reason="redis-server is not installed")
    return pytest.mark.redis(skip(test))


def mem(blocks: int, **kwargs: object) -> TierConfig:
    return TierConfig(kind="memory", capacity_bytes=blocks * frame_bytes(), **kwargs)  # type: ignore[arg-type]


def disk(path: Path, blocks: int = 1 << 20, **kwargs: object) -> TierConfig:
    """A disk tier without fsync (what these tests check does not depend on it; the
    kill -9 test's writer syncs)."""
    kwargs.setdefault("fsync", "none")
    return TierConfig(kind="disk", capacity_bytes=blocks * frame_bytes(), path=str(path), **kwargs)  # type: ignore[arg-type]


def rds(url: str, **kwargs: object) -> TierConfig:
    return TierConfig(kind="redis", capacity_bytes=BIG, url=url, **kwargs)  # type: ignore[arg-type]


def fetch(cache: PrefixCache, tokens: list[int], dtype: str = "float16") -> tuple[int, int, dict[str, int]]:
    """match + load + release; asserts that what was loaded is the exact KV of the prefix.
    Returns (tokens the match claimed, tokens loaded, tokens per tier)."""
    with cache.match(tokens, CTX) as m:
        loaded = cache.load(m)
        assert loaded.tokens <= m.cached_tokens == loaded.requested
        assert loaded.kv.flags.c_contiguous
        want = kv_for(tokens, dtype)[:, :, :, : loaded.tokens, :]
        assert loaded.kv.shape == want.shape
        assert np.array_equal(loaded.kv.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))
        assert sum(loaded.tier_tokens.values()) == loaded.tokens
        return m.cached_tokens, loaded.tokens, loaded.tier_tokens


def check_tiers(cache: PrefixCache, reachable: bool = True) -> None:
    """Invariant 4 across tiers (over what each block can be loaded from: held or queued),
    residency == store contents once the writes are done, capacities, counters."""
    assert cache.flush(timeout=30)
    books = cache._ledger.books
    assert books is not None
    n = len(books.tiers)
    blocks = list(cache._ledger.tree.nodes.values())
    for block in blocks:
        res = block.res
        assert res is not None and res.held | res.pending, f"{block} is cached but held by no tier"
        assert not res.pending, f"{block} still has a write queued after a flush"
        parent = block.parent
        for k in range(n):
            upto = (1 << (k + 1)) - 1
            if res.held & upto and not parent.is_root:
                assert parent.res is not None and parent.res.held & upto, (
                    f"tiers 0..{k} hold {block} but not its parent"
                )
        kids = [0] * n
        for child in block.children.values():
            if child.res is not None and child.res.held:
                kids[(child.res.held & -child.res.held).bit_length() - 1] += 1
        assert kids == (res.kids or [0] * n)
    for tier in books.tiers:
        held = {b.key for b in blocks if b.res is not None and b.res.held & tier.bit}
        if tier.config.kind != "redis":
            assert len(tier.store) == len(held) + len(tier.orphans)
        assert not reachable or all(key in tier.store for key in held)
        assert tier.store.used_bytes <= tier.store.capacity_bytes
        assert len(tier.policy) == len(held) + len(tier.orphans)
        assert tier.used == len(held) + len(tier.orphans)


# ============================================================================ round trips


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["device", "memory", "disk", pytest.param("redis", marks=pytest.mark.redis)])
def test_round_trip_through_every_tier_and_dtype_is_bit_exact(tmp_path: Path, kind: str, dtype: str) -> None:
    srv = None
    if kind in ("memory", "device"):
        tier = TierConfig(kind=kind, capacity_bytes=BIG >> 6)
    elif kind == "disk":
        tier = TierConfig(kind="disk", capacity_bytes=BIG, path=str(tmp_path / "d"))
    else:
        if not Path(REDIS_SERVER).exists():
            pytest.skip("redis-server is not installed")
        srv = RedisServer(tmp_path).start()
        tier = rds(srv.url)
    try:
        with cache_with(tier, dtype=dtype, partial_blocks=True) as cache:
            tokens = [*prompt(1, 5), 7, 8]  # 5 full blocks and a 2-token tail
            assert store(cache, tokens, dtype) == len(tokens)
            cached, loaded, per_tier = fetch(cache, tokens, dtype)
            assert cached == loaded == len(tokens) and per_tier[kind] == len(tokens)
            # random bytes as KV (NaN payloads, -0.0, subnormals): equal bit for bit
            other = prompt(2, 3)
            kv = random_kv(dtype, 7, tiny_layout(dtype).shape(len(other)))
            assert cache.insert(other, CTX, kv=kv) == len(other) - BLOCK  # the first block is shared
            with cache.match(other, CTX) as m:
                got = cache.load(m)
            assert got.tokens == len(other)
            assert got.kv[:, :, :, BLOCK:].tobytes() == np.ascontiguousarray(kv[:, :, :, BLOCK:]).tobytes()
            check_tiers(cache)
    finally:
        if srv is not None:
            srv.stop()


def test_partial_block_hit_loads_only_the_shared_tokens() -> None:
    with cache_with(mem(64), partial_blocks=True) as cache:
        store(cache, prompt(1, 3))
        other = [*prompt(1, 3)[:10], 55, 56, 57]  # shares 2 blocks and 2 tokens of the third
        cached, loaded, _ = fetch(cache, other)
        assert cached == loaded == 10


def test_prefetch_gives_what_load_gives() -> None:
    with cache_with(mem(64)) as cache:
        store(cache, prompt(2))
        with cache.match(prompt(2), CTX) as m:
            loaded = cache.prefetch(m).result(timeout=10)
            assert loaded.tokens == m.cached_tokens == len(prompt(2))
            assert np.array_equal(loaded.kv, kv_for(prompt(2)))


# ============================================================================ moving between tiers


def test_eviction_demotes_to_disk_and_a_hit_there_promotes_back(tmp_path: Path) -> None:
    with cache_with(mem(6), disk(tmp_path)) as cache:
        a, b = prompt(1), prompt(2)  # 6 blocks each, sharing the first
        store(cache, a)
        store(cache, b)  # memory holds 6 blocks: a's own 5 go down to disk
        memory, dsk = cache.stats().tiers
        assert memory.demotions == 0 and dsk.demotions == 5 and memory.evictions == 5
        with cache.match(a, CTX) as m:
            assert m.tier_tokens == {"memory": 4, "disk": 20}
        check_tiers(cache)
        assert fetch(cache, a)[1:] == (24, {"memory": 4, "disk": 20})
        assert cache.stats().tiers[0].promotions == 5  # a is back in memory, b went down
        assert fetch(cache, a)[1:] == (24, {"memory": 24, "disk": 0})
        assert fetch(cache, b)[2] == {"memory": 4, "disk": 20}
        check_tiers(cache)


def test_write_through_copies_below_at_once_so_eviction_writes_nothing(tmp_path: Path) -> None:
    with cache_with(mem(6, write="through"), disk(tmp_path)) as cache:
        store(cache, prompt(1))
        memory, dsk = cache.stats().tiers
        assert dsk.blocks == 6 and dsk.bytes_written > 0
        written = dsk.bytes_written
        store(cache, prompt(2))
        memory, dsk = cache.stats().tiers
        assert memory.evictions == 5 and dsk.demotions == 0
        assert dsk.bytes_written == written + 5 * (written // 6)  # b's own blocks, nothing demoted
        assert fetch(cache, prompt(1))[1] == 24
        check_tiers(cache)


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_a_tiers_frame_bytes_is_what_its_store_counts_for_one_full_block(tmp_path: Path, codec: str) -> None:
    """``TierStats.frame_bytes`` (what retention's bytes are frames times) is what the
    tier's ``used_bytes`` grows by when it takes one full block: a whole slot in memory,
    the frame's own length on disk. An odd head size in int8 makes a frame that is no
    whole slot, so the two units differ there."""
    odd = KVLayout(layers=1, kv_heads=1, head_dim=3, dtype="float16")
    tiers = (
        TierConfig(kind="memory", capacity_bytes=1 << 16, write="through", codec=codec),
        TierConfig(kind="disk", capacity_bytes=1 << 16, path=str(tmp_path), fsync="none", codec=codec),
    )
    config = CacheConfig(block_size=BLOCK, kv_layout=odd, tiers=tiers, writer="inline")
    kv = (np.arange(2 * BLOCK * 3, dtype=np.float16) / 8).reshape(1, 2, 1, BLOCK, 3)
    with PrefixCache(config) as cache:
        before = cache.stats().tiers
        assert cache.insert(list(range(BLOCK)), CTX, kv=kv) == BLOCK
        after = cache.stats().tiers
    for was, now in zip(before, after, strict=True):
        assert (was.blocks, now.blocks) == (0, 1), now.name
        assert now.frame_bytes == was.frame_bytes == now.used_bytes - was.used_bytes > 0, now.name
    memory, dsk = after
    assert (memory.frame_bytes != dsk.frame_bytes) == (codec == "int8")


def test_a_block_leaves_the_last_tier_only_as_a_leaf_and_then_leaves_the_tree(tmp_path: Path) -> None:
    with cache_with(mem(2), disk(tmp_path, 6)) as cache:
        for i in range(5):
            store(cache, prompt(i))
            check_tiers(cache)
        assert len(cache) <= 8
        assert cache.stats().evictions > 0
        for i in range(5):
            fetch(cache, prompt(i))  # whatever is left loads exactly
        check_tiers(cache)


def test_stale_blocks_are_reclaimed_before_live_ones_are_evicted() -> None:
    with cache_with(mem(6)) as cache:
        store(cache, prompt(1))
        store(cache, prompt(2, 1))  # the shared block only: already there
        cache.bump_epoch("m")
        store(cache, prompt(3))
        stats = cache.stats()
        assert stats.removed(RemovalReason.STALE) == 6 and stats.evictions == 0
        assert stats.tiers[0].evictions == 0
        assert fetch(cache, prompt(3))[1] == 24 and fetch(cache, prompt(1))[1] == 4


def test_pinned_blocks_stay_in_their_tier() -> None:
    with cache_with(mem(6)) as cache:
        store(cache, prompt(1))
        with cache.match(prompt(1), CTX) as m:
            assert store(cache, prompt(2)) == 0  # no room: every block is pinned or an ancestor of one
            assert cache.load(m).tokens == 24
        assert store(cache, prompt(2)) == 20


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "fetch", "fetch_insert", "bump", "purge_prefix", "purge"]),
        st.integers(0, 7),
        st.integers(1, 9),
        st.sampled_from(["a", "b", "c"]),
    ),
    max_size=40,
)


@settings(deadline=None)  # a step may wait on disk I/O of a busy machine
@given(
    ops=ops,
    writes=st.tuples(st.booleans(), st.booleans()),
    isolation=st.sampled_from(["shared", "namespace", "partitioned", "publish"]),
    partial=st.booleans(),
    sizes=st.tuples(st.integers(1, 6), st.integers(1, 8), st.integers(1, 12)),
    policy=st.sampled_from(["lru", "s3fifo", "sieve"]),
)
def test_invariant_4_holds_across_tiers_under_any_sequence(
    tmp_path_factory: pytest.TempPathFactory,
    ops: list[tuple[str, int, int, str]],
    writes: tuple[bool, bool],
    isolation: str,
    partial: bool,
    sizes: tuple[int, int, int],
    policy: str,
) -> None:
    """Random traffic over three tiers of random sizes and write modes: after every step,
    invariant 4, residency == store contents, capacities, and every load bit-exact."""
    path = tmp_path_factory.mktemp("disk")
    modes = ["through" if w else "back" for w in writes]
    tiers = (
        mem(sizes[0], write=modes[0], policy=policy),
        mem(sizes[1], name="ram2", write=modes[1]),
        disk(path, sizes[2]),
    )
    options: dict[str, object] = {"isolation": isolation}
    if isolation == "publish":
        options = {"isolation": "namespace", "publish": PublishConfig(min_tenants=2, min_tokens=BLOCK)}
    with cache_with(*tiers, partial_blocks=partial, **options) as cache:
        for op, i, n, tenant in ops:
            ctx = CacheContext(tenant=tenant, model="m")
            tokens = prompt(i, n)[: BLOCK * n - (i % 3)]
            if op == "insert":
                cache.insert(tokens, ctx, kv=kv_for(tokens))
            elif op in ("fetch", "fetch_insert"):
                with cache.match(tokens, ctx) as m:
                    if op == "fetch_insert":  # room is made while this match pins its blocks
                        other = prompt(i + 1, n)
                        cache.insert(other, ctx, kv=kv_for(other))
                    loaded = cache.load(m)
                    assert loaded.tokens == m.cached_tokens  # nothing here damages bytes
                    assert np.array_equal(loaded.kv, kv_for(tokens)[:, :, :, : loaded.tokens])
            elif op == "bump":
                cache.bump_epoch("m")
            elif op == "purge_prefix":
                cache.purge_prefix(tokens[:BLOCK], ctx)
            else:
                cache.purge(tenant)
            check_tiers(cache)


# ============================================================================ disk faults


def damage(cache: PrefixCache, tokens: list[int], block: int, how: str) -> None:
    """Damage the disk file of the ``block``-th block of ``tokens``."""
    with cache.match(tokens, CTX) as m:
        key = m.block_keys[block]
    books = cache._ledger.books
    assert books is not None
    store_ = books.tiers[-1].store
    path = store_._path(key)  # type: ignore[attr-defined]
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:-7])
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_damaged_disk_block_shortens_the_match_and_is_counted(tmp_path: Path, how: str) -> None:
    with cache_with(mem(1), disk(tmp_path)) as cache:
        a = prompt(1)
        store(cache, a)
        store(cache, [*prompt(2, 1), 9, 9, 9, 9])  # push a's blocks out of memory onto disk
        damage(cache, a, 3, how)
        cached, loaded, _ = fetch(cache, a)
        assert cached == 24 and loaded == 12  # blocks 0-2 good, block 3 bad: the true length
        errors = cache.stats().tiers[1].errors
        assert sum(errors.values()) >= 1
        assert cache.stats().removed(RemovalReason.LOST) >= 1
        assert fetch(cache, a)[:2] == (12, 12)  # the bad block and its children are gone
        store(cache, a)
        assert fetch(cache, a)[:2] == (24, 24)
        check_tiers(cache)


@pytest.mark.parametrize("impl", ["native", "python"])
@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_placed_disk_load_stops_at_a_damaged_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, impl: str
) -> None:
    """A disk tier alone: its blocks are read straight into place (storage/placed.py),
    checked after; a bad one ends the load there, is counted and lost, as in any tier."""
    from prefixcache.storage import placed

    if impl == "python":
        monkeypatch.setattr(placed, "_placed", None)
    elif not placed.NATIVE:
        pytest.skip("the compiled _placed helper is not built")
    with cache_with(disk(tmp_path)) as cache:
        a = prompt(1)
        store(cache, a)
        assert cache.flush(timeout=30)
        assert fetch(cache, a)[:2] == (24, 24)
        damage(cache, a, 3, how)
        cached, loaded, _ = fetch(cache, a)
        assert cached == 24 and loaded == 12
        errors = cache.stats().tiers[0].errors
        assert errors[{"flip": "CorruptFrame", "truncate": "TruncatedFrame", "delete": "missing"}[how]] >= 1
        assert cache.stats().removed(RemovalReason.LOST) >= 1
        assert fetch(cache, a)[:2] == (12, 12)
        store(cache, a)
        assert fetch(cache, a)[:2] == (24, 24)
        check_tiers(cache)


def test_a_full_disk_declines_blocks_and_never_serves_wrong_bytes(tmp_path: Path) -> None:
    with cache_with(mem(2), disk(tmp_path, 4)) as cache:
        for i in range(6):
            store(cache, prompt(i))
        for i in range(6):
            fetch(cache, prompt(i))
        tiers = cache.stats().tiers
        assert tiers[1].used_bytes <= tiers[1].capacity_bytes
        check_tiers(cache)


def test_one_failed_disk_write_is_one_error_under_one_label(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def enospc(fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with cache_with(mem(64, write="through"), disk(tmp_path)) as cache:
        monkeypatch.setattr(disk_module.os, "write", enospc)
        store(cache, prompt(0, n_blocks=1))  # one block, written through to the failing disk
        assert cache.flush(timeout=30)
        monkeypatch.undo()
        tier = cache.stats().tiers[1]
        assert (tier.writes_failed, dict(tier.errors)) == (1, {"io": 1})  # the store's cause, once
        assert fetch(cache, prompt(0, n_blocks=1))[:2] == (4, 4)  # still served from memory
        check_tiers(cache)


@pytest.mark.parametrize("kind", ["memory", "disk"])  # a write by the deciding thread, and a queued one
def test_a_write_refused_by_a_faulty_store_is_counted_once(tmp_path: Path, kind: str) -> None:
    opened: list[Faulty] = []
    factory = faulty((kind,), opened=opened)
    with cache_with(mem(64, write="through"), disk(tmp_path), store_factory=factory) as cache:
        opened[0].fail = 1
        store(cache, prompt(0, n_blocks=2))  # the first write fails; the second block hangs below it
        tier = cache.stats().tiers[0 if kind == "memory" else 1]
        assert (tier.writes_failed, dict(tier.errors)) == (1, {"injected": 1})
        check_tiers(cache)


def test_warm_restart_in_a_new_process_still_hits(tmp_path: Path) -> None:
    worker = [sys.executable, str(HERE / "tier_worker.py"), "disk", str(tmp_path), "3"]
    subprocess.run(worker, check=True, timeout=60, cwd=HERE)
    with cache_with(mem(64), disk(tmp_path)) as cache:
        assert len(cache) == 0
        for i in range(3):
            cached, loaded, per_tier = fetch(cache, prompt(i))
            assert cached == loaded == 24
        assert per_tier == {"memory": 4, "disk": 20}  # the shared block was promoted by prompt 0
        assert fetch(cache, prompt(7))[:2] == (4, 4)  # the shared first block only
        check_tiers(cache)


def test_kill_9_while_writing_then_restart_serves_only_whole_verified_blocks(tmp_path: Path) -> None:
    worker = [sys.executable, str(HERE / "tier_worker.py"), "disk-forever", str(tmp_path)]
    child = subprocess.Popen(worker, stdout=subprocess.PIPE, text=True, cwd=HERE)
    assert child.stdout is not None
    done = -1
    while done < 20:
        line = child.stdout.readline()
        assert line, "the writer died early"
        done = int(line)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    with cache_with(mem(256), disk(tmp_path)) as cache:
        full = 0
        for i in range(done + 5):
            _, loaded, _ = fetch(cache, prompt(i))
            full += loaded == 24
        assert full >= done + 1  # every prompt stored before the kill is whole
        check_tiers(cache)


# ============================================================================ redis


def redis_cache(url: str, mem_blocks: int = 2, **kwargs: object) -> PrefixCache:
    return cache_with(mem(mem_blocks, write="through"), rds(url, **kwargs))


@needs_redis
def test_two_processes_share_one_redis_with_no_shared_index(redis_server: RedisServer) -> None:
    worker = [sys.executable, str(HERE / "tier_worker.py"), "redis", redis_server.url, "3"]
    subprocess.run(worker, check=True, timeout=60, cwd=HERE)
    with redis_cache(redis_server.url, 64) as cache:
        assert len(cache) == 0
        cached, loaded, per_tier = fetch(cache, prompt(2))
        assert cached == loaded == 24 and per_tier == {"memory": 0, "redis": 24}
        assert fetch(cache, prompt(2))[2] == {"memory": 24, "redis": 0}  # promoted
        assert fetch(cache, prompt(9))[:2] == (4, 4)
        check_tiers(cache)


@needs_redis
def test_redis_killed_mid_run_is_a_shorter_match_and_counted(redis_server: RedisServer) -> None:
    with redis_cache(redis_server.url) as cache:
        store(cache, prompt(1))
        store(cache, prompt(2))  # prompt 1's blocks now live in redis only
        redis_server.kill()
        cached, loaded, _ = fetch(cache, prompt(1))
        assert cached == 24 and loaded < 24
        assert sum(cache.stats().tiers[1].errors.values()) >= 1
        assert fetch(cache, prompt(2))[1] >= 4  # memory still serves what it holds
        store(cache, prompt(3))  # the write-through fails, counted; the insert still works
        assert fetch(cache, prompt(3))[1] >= 4
        check_tiers(cache, reachable=False)


@needs_redis
def test_redis_unreachable_at_start_still_serves_from_memory() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with cache_with(mem(64, write="through"), rds(url)) as cache:
        store(cache, prompt(1))
        assert fetch(cache, prompt(1))[:2] == (24, 24)
        assert sum(cache.stats().tiers[1].errors.values()) >= 1


@needs_redis
def test_a_stalled_redis_read_is_abandoned_at_its_deadline(redis_server: RedisServer) -> None:
    proxy = StallingProxy(redis_server.port)
    try:
        with redis_cache(proxy.url, read_timeout=0.2) as cache:
            store(cache, prompt(1))
            store(cache, prompt(2))
            proxy.stall()
            cached, loaded, _ = fetch(cache, prompt(1))
            assert cached == 24 and loaded == 4
            # abandoned at its deadline: each command the stalled Redis swallowed was a timeout
            timeouts = cache.stats().tiers[1].errors.get("timeout", 0)
            assert timeouts >= 1 and timeouts == proxy.swallowed, (timeouts, proxy.swallowed)
    finally:
        proxy.stop()


@needs_redis
def test_flushall_mid_run_is_misses_never_wrong_bytes(redis_server: RedisServer) -> None:
    with redis_cache(redis_server.url) as cache:
        store(cache, prompt(1))
        store(cache, prompt(2))
        redis.Redis.from_url(redis_server.url).flushall()
        cached, loaded, _ = fetch(cache, prompt(1))
        assert cached == 24 and loaded == 4
        assert cache.stats().tiers[1].errors["missing"] >= 1
        check_tiers(cache, reachable=False)  # redis lost keys behind the tree's back: found out on load


@needs_redis
def test_redis_evicting_under_maxmemory_serves_only_right_bytes(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path, extra=("--maxmemory-policy", "allkeys-lru")).start()
    try:
        client = redis.Redis.from_url(srv.url)
        baseline = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", baseline + 600_000)  # room for about half of the 2,400 frames
        with redis_cache(srv.url) as cache:
            prompts = [[50_000 + 64 * i + j for j in range(32)] for i in range(300)]  # no shared block
            for tokens in prompts:
                store(cache, tokens)
            loaded = [fetch(cache, tokens)[1] for tokens in prompts]  # each checked bit-exact
            # NOTE: redis's LRU is sampled, so which blocks of a prompt survive is close to
            # random: a prompt may keep a prefix of its blocks, and none need keep all 8.
            assert sum(loaded) > 0 and sum(n < 32 for n in loaded) > 0  # redis kept some, dropped some
            assert cache.stats().tiers[1].errors["missing"] > 0
    finally:
        srv.stop()


# ============================================================================ interface


def test_bad_calls_are_clear_errors() -> None:
    with cache_with(mem(8)) as cache:
        with pytest.raises(ValueError, match="needs kv"):
            cache.insert(prompt(1), CTX)
        with pytest.raises(ValueError, match="shape"):
            cache.insert(prompt(1), CTX, kv=np.zeros((2, 2, 2, 3, 4), np.float16))
        with pytest.raises(ValueError, match="dtype"):
            cache.insert(prompt(1), CTX, kv=kv_for(prompt(1), "float32"))
        with pytest.raises(ValueError, match="metadata-only"):
            cache.access(prompt(1), CTX)
        store(cache, prompt(1))
        m = cache.match(prompt(1), CTX)
        m.release()
        with pytest.raises(RuntimeError, match="released"):
            cache.load(m)
    plain = PrefixCache(CacheConfig())
    with pytest.raises(RuntimeError, match="metadata-only"):
        plain.load(plain.match([1, 2, 3], CTX))
    with pytest.raises(ValueError, match="no tiers"):
        plain.insert([1, 2, 3], CTX, kv=np.zeros(3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tiers": (TierConfig(kind="memory", capacity_bytes=1),)}, "kv_layout"),
        ({"tiers": (TierConfig(kind="memory", capacity_bytes=1),) * 2, "kv_layout": KVLayout(1, 1, 1)}, "unique"),
    ],
)
def test_bad_tier_configs_are_refused(kwargs: dict[str, object], message: str) -> None:
    """Tiers without a KV layout are a valid configuration (a server fills the layout in
    from its model) but not a cache that can be opened."""
    with pytest.raises(ValueError, match=message):
        PrefixCache(CacheConfig(**kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "tape", "capacity_bytes": 1}, "unknown tier kind"),
        ({"kind": "disk", "capacity_bytes": 1}, "path"),
        ({"kind": "redis", "capacity_bytes": 1}, "url"),
        ({"kind": "memory", "capacity_bytes": -1}, "capacity_bytes"),
        ({"kind": "memory", "capacity_bytes": 1, "write": "around"}, "write mode"),
        ({"kind": "memory", "capacity_bytes": 1, "policy": "mru"}, "policy"),
        ({"kind": "redis", "capacity_bytes": 1, "url": "redis://x", "read_timeout": 0}, "read_timeout"),
    ],
)
def test_bad_tier_fields_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TierConfig(**kwargs)  # type: ignore[arg-type]


def test_a_device_tier_on_cpu_over_memory_and_disk(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    with cache_with(TierConfig(kind="device", capacity_bytes=7 * frame_bytes()), mem(4), disk(tmp_path)) as cache:
        for i in range(4):
            store(cache, prompt(i))
        for i in range(4):
            assert fetch(cache, prompt(i))[1] == 24
        assert fetch(cache, prompt(3))[2]["device"] == 24
        check_tiers(cache)


def test_a_device_tier_on_a_missing_device_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA"):
        cache_with(TierConfig(kind="device", capacity_bytes=BIG >> 10, device="cuda:0"))
    with pytest.raises(ValueError, match="bad device"):
        cache_with(TierConfig(kind="device", capacity_bytes=BIG >> 10, device="warp-drive"))


def test_stats_report_each_tier_with_a_latency_histogram(tmp_path: Path) -> None:
    with cache_with(mem(6), disk(tmp_path)) as cache:
        store(cache, prompt(1))
        store(cache, prompt(2))
        fetch(cache, prompt(1))
        memory, dsk = cache.stats().tiers
        assert (memory.name, memory.kind, dsk.kind) == ("memory", "memory", "disk")
        assert dsk.hits == 5 and memory.hits == 1
        hist = dsk.load_seconds
        assert hist.count == 1 and hist.buckets[-1] == (float("inf"), 1) and hist.sum > 0


def test_latency_histogram_uses_le_buckets() -> None:
    hist = LatencyHistogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 2.0):
        hist.observe(seconds)
    assert hist.snapshot() == Histogram(((0.1, 2), (1.0, 3), (float("inf"), 4)), 2.65, 4)


def test_torch_tensors_are_accepted_as_kv() -> None:
    torch = pytest.importorskip("torch")
    with cache_with(mem(64), dtype="bfloat16") as cache:
        kv = torch.from_numpy(kv_for(prompt(1), "bfloat16").view(np.int16)).view(torch.bfloat16)
        assert cache.insert(prompt(1), CTX, kv=kv) == 24
        assert fetch(cache, prompt(1), "bfloat16")[1] == 24


def test_a_match_that_probes_a_tier_searches_the_tree_once(tmp_path: Path) -> None:
    """A reopened disk makes every match probe it; the tree search before the probe is
    the match's own, so a hash collision it catches is counted once."""
    from test_index import LengthHash  # every two prefixes of equal length collide

    def weak(write: str) -> PrefixCache:
        config = CacheConfig(
            block_size=BLOCK, seed="weak", kv_layout=tiny_layout(), tiers=(mem(64, write=write), disk(tmp_path))
        )
        return PrefixCache(config, hash_factory=LengthHash)

    p, q = [1, 2, 3, 4, 5, 5, 5, 5, 6, 6, 6, 6], [1, 2, 3, 4, 7, 7, 7, 7, 8, 8, 8, 8]
    with weak("through") as first:
        other = CacheContext(tenant="someone-else", model="m")  # a root of another length: no key shared
        first.insert([9, 9, 9, 9], other, kv=kv_for([9, 9, 9, 9]))  # one block, left on disk
    with weak("back") as cache:  # P stays in memory: the probe finds nothing
        assert cache._ledger.books is not None and any(t.probes for t in cache._ledger.books.tiers)
        cache.insert(p, CTX, kv=kv_for(p))
        assert any(t.probes for t in cache._ledger.books.tiers)  # the orphan is still there to probe for
        with cache.match(q, CTX) as m:  # P's keys collide with Q's: caught, Q gets the shared block
            assert m.cached_tokens == BLOCK
        assert cache.stats().collisions == 1


# ============================================================================ public blocks in probing tiers


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
def test_published_blocks_are_found_after_a_restart_and_private_ones_stay_private(
    tmp_path: Path, isolation: str
) -> None:
    """A declared public prefix written to disk is found by another tenant after a
    restart (the public chain is probed when the tenant's own finds nothing); a private
    prompt's blocks on the same disk are found by their tenant only."""
    extra: dict[str, object] = {"isolation": isolation}
    if isolation == "partitioned":
        extra["shared_quota"] = 1 << 12
    tiers = (mem(64, write="through"), disk(tmp_path))
    bob = CacheContext(tenant="bob", model="m")
    public, private = prompt(7), prompt(8)
    with cache_with(*tiers, **extra) as one:
        one.declare_public(public, CTX)
        store(one, public)
        store(one, private)
        assert one.flush(timeout=30)
    with cache_with(*tiers, **extra) as two:  # a new process: the tree is empty, the disk holds both
        with two.match(public, bob) as m:
            assert m.cached_tokens == len(public)
            loaded = two.load(m)
            assert loaded.tokens == len(public) and np.array_equal(loaded.kv, kv_for(public))
        with two.match(private, bob) as m:
            assert m.cached_tokens <= BLOCK  # at most the first block, which prompt(7) made public
        assert fetch(two, private)[:2] == (len(private), len(private))  # its own tenant still finds all of it
        check_tiers(two)


def test_a_shared_mode_cache_probes_no_public_chain(tmp_path: Path) -> None:
    with cache_with(mem(64, write="through"), disk(tmp_path)) as cache:
        lookup = cache._ledger.lookup(prompt(1), CTX, None, probing=True)
        assert len(lookup.roots) == 1


@needs_redis
def test_a_prefix_one_server_published_is_found_by_another_through_redis(redis_server: RedisServer) -> None:
    """Two servers of a fleet on one Redis: what one published, another tenant of the
    other finds (peek says so first, adopting nothing); a private prompt stays its own."""
    tiers = (mem(64, write="through"), rds(redis_server.url))
    bob = CacheContext(tenant="bob", model="m")
    public, private = prompt(11), prompt(12)
    with cache_with(*tiers, isolation="namespace") as one, cache_with(*tiers, isolation="namespace") as two:
        one.declare_public(public, CTX)
        store(one, public)
        store(one, private)
        assert one.flush(timeout=30)
        ahead = two.peek(public, bob)
        assert (ahead.num_blocks, ahead.probed_blocks) == (6, 6) and not two._ledger.tree.nodes
        with two.match(public, bob) as m:
            assert m.cached_tokens == len(public) and two.load(m).tokens == len(public)
        with two.match(private, bob) as m:
            assert m.cached_tokens == BLOCK  # the public first block only
        assert fetch(two, private)[:2] == (len(private), len(private))
