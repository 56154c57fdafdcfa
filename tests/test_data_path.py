"""The data path under real load and real faults: nothing slow runs under the cache's
lock, writes go through the queue (policies through, back, selective), the queue never
blocks a request, a flush or a graceful close writes what is queued, and a kill -9
loses at most what was queued, never a partial block."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fault_stores import Faulty, faulty
from guard_store import Guarded, IOUnderLock, LockGuard, guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache.cache import PrefixCache
from prefixcache.config import TierConfig
from prefixcache.ops.collector import CacheCollector
from prefixcache.settings import SERVER_CACHE
from prefixcache.storage.queue import Job
from prefixcache.storage.transfer import Outcome
from redis_server import RedisServer
from support import wait_for
from test_cache_tiers import check_tiers, disk, fetch, mem, rds
from tier_worker import BLOCK, CTX, cache_with, frame_bytes, kv_for, layout, prompt, store

HERE = Path(__file__).resolve().parent


def hit(cache: PrefixCache, tokens: list[int]) -> None:
    """A memory hit, as a request takes it before its prefill: match, load, release."""
    with cache.match(tokens, CTX) as m:
        loaded = cache.load(m)
    assert loaded.tokens == len(tokens)


def finishes(work: Callable[[], object], guard_s: float = 120.0) -> None:
    """Run ``work`` in a thread: it must end (a hang guard: on any machine it takes a
    fraction of that), and what it raised is raised here."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(guard_s)
    assert not thread.is_alive(), f"{work} waited on a store that does not answer"
    if errors:
        raise errors[0]


# ============================================================================ nothing slow under the lock


def test_a_disk_saturated_by_demotions_leaves_memory_hits_and_metrics_alone(tmp_path: Path) -> None:
    """A small host-RAM tier over a disk whose writes hang (until the end), write-back:
    every insert demotes, and the writer waits inside the first disk write. Between
    inserts, a hot prefix is hit in memory and the cache's metrics are scraped: that
    they all finish shows that none waited for a disk write (and the lock guard, that
    none was made under the cache's lock)."""
    opened: list[Faulty] = []
    cache = cache_with(
        mem(12, write="back", policy="lru"),
        disk(tmp_path),
        writer="background",
        store_factory=faulty(("disk",), opened=opened),
    )
    (slow,) = opened
    slow.hang("put")
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    hot = prompt(0, 3)
    store(cache, hot)

    def traffic() -> None:
        for i in range(1, 60):
            store(cache, prompt(i, 4))  # 3 new blocks: 3 demotions once memory is full
            hit(cache, hot)
            generate_latest(registry)

    try:
        finishes(traffic)
        stats = cache.stats()
        assert stats.writer is not None and stats.writer.queued_jobs > 20  # the disk was saturated meanwhile
        assert stats.tiers[1].demotions > 100 and slow.puts == 0 and slow.parked == 1
    finally:
        slow.release()
        cache.close(timeout=0)  # NOTE: no need to wait for the queued writes


def test_a_stalled_redis_never_holds_the_cache_lock(redis_server: RedisServer) -> None:
    """Redis stops answering: first a Redis whose calls hang inside the store until the
    test lets them go (the writer's write-through and a request's probe wait there, and
    meanwhile the cache answers its stats and another request's memory hit: a lock held
    through the call would block them until it returned); then SIGSTOP, where Redis
    keeps its sockets and answers nothing, and requests that need it wait for their own
    timeouts (outside the lock) while everything else goes on."""
    opened: list[Faulty] = []
    cache = cache_with(
        mem(256, write="through"),
        rds(redis_server.url, read_timeout=0.3),
        writer="background",
        store_factory=faulty(("redis",), opened=opened),
    )
    (stalled,) = opened
    for i in range(4):
        store(cache, prompt(i))
    assert cache.flush(timeout=10)
    stalled.hang("put", "get_many", "contains_prefix")
    try:
        store(cache, prompt(4))  # written through: the writer waits inside Redis, not this thread
        prober = threading.Thread(target=fetch, args=(cache, prompt(104)), daemon=True)  # unknown here: probed
        prober.start()
        wait_for(lambda: stalled.parked == 2)
        finishes(cache.stats)
        finishes(lambda: fetch(cache, prompt(1)))  # memory still serves
    finally:
        stalled.release()
    prober.join(60)
    assert not prober.is_alive()

    redis_server.pause()
    errors: list[BaseException] = []

    def traffic() -> None:
        try:
            for i in range(5, 24):
                store(cache, prompt(i))  # written through to Redis: the writer waits, not this thread
                fetch(cache, prompt(i))
                fetch(cache, prompt(100 + i))  # unknown here: probed in Redis (a timeout, or the breaker)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        while worker.is_alive():
            finishes(cache.stats)  # takes the lock
            time.sleep(0.005)
    finally:
        worker.join(60)
        redis_server.resume()
    assert not errors, errors
    assert cache.stats().tiers[1].errors.get("timeout", 0) >= 1
    assert fetch(cache, prompt(20))[1] == 24  # memory still serves
    cache.close(timeout=10)


# ============================================================================ write policies


def test_selective_writes_only_blocks_hit_often_enough(tmp_path: Path) -> None:
    with cache_with(mem(6, write="selective", write_after_hits=2), disk(tmp_path)) as cache:
        cold, warm = prompt(1), prompt(2)
        store(cache, cold)
        store(cache, warm)
        fetch(cache, warm)
        fetch(cache, warm)  # hit twice: copied down now
        assert cache.stats().tiers[1].blocks == 6  # warm's blocks; cold's never written
        for i in range(3, 6):
            store(cache, prompt(i))  # memory churns: cold is dropped, warm already has a copy
        assert fetch(cache, cold)[1] <= BLOCK  # gone (its shared first block may be elsewhere)
        assert fetch(cache, warm)[1] == 24
        check_tiers(cache)


def test_write_through_reaches_every_tier_and_back_only_the_next(tmp_path: Path) -> None:
    tiers = (mem(64, write="through"), mem(64, name="ram2", write="through"), disk(tmp_path))
    with cache_with(*tiers) as cache:
        store(cache, prompt(1))
        assert [t.blocks for t in cache.stats().tiers] == [6, 6, 6]
    tiers = (mem(64, write="back"), mem(64, name="ram2", write="through"), disk(tmp_path / "b"))
    with cache_with(*tiers) as cache:
        store(cache, prompt(1))
        assert [t.blocks for t in cache.stats().tiers] == [6, 0, 0]


# ============================================================================ the queue


def test_a_full_queue_drops_writes_counts_them_and_blocks_nobody(tmp_path: Path) -> None:
    tiers = (mem(64, write="through"), disk(tmp_path))
    with cache_with(*tiers, writer="deferred", write_queue_bytes=2 * frame_bytes()) as cache:
        stored: list[int] = []
        finishes(lambda: stored.append(store(cache, prompt(1))))  # the full queue blocks nobody ...
        assert stored == [24]  # ... all 6 blocks in memory: the request is not refused
        stats = cache.stats()
        assert stats.tiers[1].writes_pending == 2 and stats.tiers[1].writes_dropped == 4
        assert stats.writer is not None and stats.writer.dropped == 4
        assert cache.flush()
        assert cache.stats().tiers[1].blocks == 2 and fetch(cache, prompt(1))[1] == 24
        check_tiers(cache)


def test_a_block_whose_only_copy_is_queued_is_served_from_the_queue(tmp_path: Path) -> None:
    with cache_with(mem(2), disk(tmp_path), writer="deferred") as cache:
        store(cache, prompt(1))  # 6 blocks into 2 slots: 4 demoted, their writes queued
        assert cache.stats().tiers[1].writes_pending == 4
        assert fetch(cache, prompt(1))[1:] == (24, {"memory": 8, "disk": 16})  # read from the queue, exact
        assert cache.flush()
        check_tiers(cache)


def test_close_flushes_or_gives_up_at_its_timeout(tmp_path: Path) -> None:
    opened: list[Faulty] = []
    cache = cache_with(
        mem(64, write="through"), disk(tmp_path), writer="background", store_factory=faulty(("disk",), 0, opened)
    )
    opened[0].hang("put")  # the disk takes no write until the end
    store(cache, prompt(1))
    closed: list[bool] = []
    finishes(lambda: closed.append(cache.close(timeout=0.3)))  # it gives up at its timeout, never waits on
    assert closed == [False]  # 6 writes queued, none of them done
    stats = cache.stats()
    assert stats.writer is not None and stats.writer.abandoned >= 3
    try:
        again = cache_with(mem(64, write="through"), disk(tmp_path), writer="background")
        with again:
            store(again, prompt(2))
            assert again.close(timeout=30) is True
        assert len(opened) == 1 and opened[0].puts == 0
    finally:
        opened[0].release()


def test_two_threads_on_a_background_writer_see_exact_bytes(tmp_path: Path) -> None:
    cache = cache_with(mem(8, write="through"), mem(16, name="ram2"), disk(tmp_path, 40), writer="background")
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                i, n = int(rng.integers(0, 12)), int(rng.integers(1, 7))
                tokens = prompt(i, n)
                if rng.random() < 0.5:
                    store(cache, tokens)
                else:
                    fetch(cache, tokens)  # asserts the bytes
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    check_tiers(cache)
    cache.close()


# ============================================================================ crashes and restarts


def test_kill_9_with_writes_queued_loses_at_most_the_queued_blocks(tmp_path: Path) -> None:
    n = 12
    worker = [sys.executable, str(HERE / "tier_worker.py"), "slow-disk", str(tmp_path), str(n)]
    child = subprocess.Popen(worker, stdout=subprocess.PIPE, text=True, cwd=HERE)
    assert child.stdout is not None
    line = child.stdout.readline().split()
    assert line and line[0] == "stop", line
    written, queued = int(line[1]), int(line[2])
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert queued > 0  # killed with writes still queued
    blocks = 1 + 5 * n  # prompts share their first block
    with cache_with(mem(256), disk(tmp_path)) as cache:
        found = len(cache._ledger.books.tiers[1].orphans)  # type: ignore[union-attr]
        assert written <= found and blocks - found <= queued
        for i in range(n):
            fetch(cache, prompt(i))  # whatever loads is whole and exact (fetch checks every byte)
        check_tiers(cache)


def test_two_servers_on_one_redis_reuse_what_either_computed(tmp_path: Path, redis_server: RedisServer) -> None:
    """The server's default tiers, with the same Redis added below them, in two processes'
    worth of caches: what one computes the other loads."""
    small = frame_bytes() * 64

    def server(name: str) -> PrefixCache:
        tiers = [dataclasses.replace(t, capacity_bytes=small, write="through") for t in SERVER_CACHE.tiers]
        tiers[1] = dataclasses.replace(tiers[1], path=str(tmp_path / name))
        tiers.append(TierConfig(kind="redis", capacity_bytes=small, url=redis_server.url))
        config = dataclasses.replace(
            SERVER_CACHE, block_size=BLOCK, seed="fleet", kv_layout=layout(), tiers=tuple(tiers)
        )
        return PrefixCache(config)

    a, b = server("a"), server("b")
    try:
        store(a, prompt(1))
        store(b, prompt(2))
        assert a.flush(10) and b.flush(10)
        assert fetch(b, prompt(1))[1:] == (24, {"memory": 4, "disk": 0, "redis": 20})  # first block: b's own
        assert fetch(a, prompt(2))[1:] == (24, {"memory": 4, "disk": 0, "redis": 20})
    finally:
        a.close(10)
        b.close(10)


def test_the_kv_read_from_an_insert_is_the_new_range_only() -> None:
    """insert reads from a KV source only what it stores: a conversation's turns copy their
    new tokens, not the history again."""
    reads: list[tuple[int, int]] = []

    class Source:
        def __init__(self, tokens: list[int]) -> None:
            self.kv = kv_for(tokens)

        def read(self, begin: int, end: int) -> np.ndarray:
            reads.append((begin, end))
            return self.kv[:, :, :, begin:end]

    with cache_with(mem(256)) as cache:
        history: list[int] = []
        per_token = layout().bytes_per_token
        for turn in range(5):
            history = [*history, *range(100 * turn, 100 * turn + 13)]  # 13 new tokens a turn
            before = cache.stats().kv_bytes_in
            cache.insert(history, CTX, kv=Source(history))
            new = cache.stats().kv_bytes_in - before
            begin, end = reads[-1]
            assert end == len(history) // BLOCK * BLOCK and begin == (len(history) - 13) // BLOCK * BLOCK
            assert new == (end - begin) * per_token <= (13 + BLOCK) * per_token
        assert fetch(cache, history)[1] == len(history) // BLOCK * BLOCK


def test_a_tier_announces_a_block_when_its_bytes_land_not_when_queued(tmp_path: Path) -> None:
    """Another server may read a shared tier the moment it hears of a block: a queued
    write is announced (``TierEntered``) when it lands, and a residency snapshot taken
    meanwhile leaves it out."""
    from prefixcache.events import TierEntered

    def entered(events: object) -> list[str]:
        return [e.kind for e in events if isinstance(e, TierEntered)]  # type: ignore[attr-defined]

    with cache_with(mem(64, write="through"), disk(tmp_path), writer="deferred") as cache:
        tokens = prompt(1)
        store(cache, tokens)
        blocks = len(tokens) // BLOCK
        drained = cache.drain(residency=True)
        assert cache.stats().tiers[1].writes_pending == blocks
        assert entered(drained.events) == ["memory"] * blocks
        assert drained.resident is not None and entered(drained.resident) == ["memory"] * blocks
        assert cache.flush()
        assert entered(cache.drain().events) == ["disk"] * blocks
        assert entered(cache.drain(residency=True).resident or []) == ["memory", "disk"] * blocks


def test_the_lock_owner_knows_which_thread_holds_its_lock() -> None:
    """``held`` is per thread: what the guard asks at every store call."""
    owner = PrefixCache()._owner
    seen: list[bool] = []
    assert not owner.held()
    with owner._lock:
        assert owner.held()
        other = threading.Thread(target=lambda: seen.append(owner.held()))
        other.start()
        other.join()
        with owner._lock:  # reentrant: a section may call another
            assert owner.held()
        assert owner.held()
    assert seen == [False] and not owner.held()


def test_the_guard_fails_a_store_called_under_the_cache_lock(tmp_path: Path, lock_guard: LockGuard) -> None:
    """The guard every cache here is built with (``guard_store.py``) does catch I/O under
    the lock: a read from a disk or a write into a memory slab, called by a thread that
    holds it, fails there; outside the lock the same calls pass. A memory slab's slot
    bookkeeping (``delete``) is what the books do under the lock, and passes."""
    cache = cache_with(mem(8), disk(tmp_path))
    assert cache._io is not None
    memory, disk_store = cache._io.transfer.stores
    assert isinstance(memory, Guarded) and isinstance(disk_store, Guarded)
    key = bytes(16)
    with cache._owner._lock:  # deliberately: what no cache step may do
        with pytest.raises(IOUnderLock):
            disk_store.get_many([key])
        with pytest.raises(IOUnderLock):
            memory.put(key, b"x")
        assert memory.delete(key) is False
    assert lock_guard.violations == [
        "disk.get_many called under the cache's lock",
        "memory.put called under the cache's lock",
    ]
    lock_guard.violations.clear()
    assert disk_store.get_many([key]) == [None]
    cache.close()


def test_the_guard_sees_a_writer_that_writes_under_the_lock(
    tmp_path: Path, lock_guard: LockGuard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shape this cache had before one owner held its lock: the writer thread running
    a job while it holds the lock. The writer logs the failure and goes on; the guard
    records it all the same, so the test that built the cache fails."""
    cache = cache_with(mem(64, write="through"), disk(tmp_path), writer="background")
    assert cache._io is not None
    transfer, owner = cache._io.transfer, cache._owner
    run = transfer.run

    def run_under_the_lock(job: Job) -> Outcome:
        with owner._lock:
            return run(job)

    monkeypatch.setattr(transfer, "run", run_under_the_lock)
    store(cache, prompt(0))
    assert cache.flush(timeout=10)
    assert lock_guard.violations and set(lock_guard.violations) == {"disk.put called under the cache's lock"}
    lock_guard.violations.clear()
    cache.close()
