"""The engine's cache I/O workers with a real ``PrefixCache`` and real jobs (no model):
one tenant's lookup stalled in its shared tier holds neither another tenant's memory hit
nor its own tenant's unrelated work beyond its share of workers; a conversation's next
turn is staged after its store; a request that follows a prompt in flight and whose
deadline passes or whose client leaves is handed back at once, never staged; ``close``
runs what is queued and stops the threads.

The shared tier is a stand-in that the cache takes for Redis (it probes it for blocks no
tree knows), whose probes block on a ``threading.Event``: every wait is on an event or a
count, never on a time."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.engine.cacheio import CacheIO
from prefixcache.engine.job import Job, Runtime
from prefixcache.engine.modes import EXACT
from prefixcache.engine.requests import EngineStats, Handle, Request
from prefixcache.engine.sampling import SamplingParams
from prefixcache.hashing import CacheContext
from prefixcache.storage.base import Frame, TierStore
from prefixcache.storage.memory import MemoryStore
from support import Clock, wait_for

LAYOUT = KVLayout(layers=2, kv_heads=1, head_dim=4, dtype="float32")
BLOCK = 16
GUARD_S = 30.0  # a bound on a wait for what must happen, so that a bug fails rather than hangs


class GatedShared(TierStore):
    """A shared tier (the cache probes it, as it does Redis) held in memory, whose probes
    wait for ``open`` while it is cleared; ``probing`` counts the probes waiting."""

    kind = "redis"

    def __init__(self, capacity_bytes: int, slot: int) -> None:
        super().__init__(capacity_bytes)
        self.inner = MemoryStore(capacity_bytes, slot)
        self.open = threading.Event()
        self.open.set()
        self.probes = 0
        self.probing = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def footprint(self, frame_bytes: int) -> int:
        return self.inner.footprint(frame_bytes)  # NOTE: slots, as its memory counts them

    def put(self, key: bytes, frame: Frame) -> None:
        self.inner.put(key, bytes(frame))

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        return self.inner.get_many(keys)

    def delete(self, key: bytes) -> bool:
        return self.inner.delete(key)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            self.probes += 1
            self.probing += 1
        try:
            assert self.open.wait(GUARD_S), "the test never opened the shared tier"
            return self.inner.contains_prefix(keys)
        finally:
            with self._lock:
                self.probing -= 1

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)


class World:
    """A cache (memory over the gated shared tier), its jobs' runtime, and the workers."""

    def __init__(self, workers: int = 8, per_tenant: int = 2) -> None:
        self.shared: GatedShared | None = None
        tiers = (
            TierConfig(kind="memory", capacity_bytes=64 << 20),
            TierConfig(kind="redis", capacity_bytes=64 << 20, url="redis://127.0.0.1:1/0"),
        )
        config = CacheConfig(block_size=BLOCK, kv_layout=LAYOUT, tiers=tiers, seed="test-cacheio")
        self.cache = PrefixCache(config, store_factory=self._open)
        self.clock = Clock()
        self.runtime = Runtime(
            None,  # type: ignore[arg-type]  # NOTE: lookups and stores never touch the model
            self.cache,
            EXACT,
            lambda tenant: CacheContext(tenant=tenant, model="m", tokenizer="m"),
            EngineStats(),
            self.clock,
            random.Random(0),
            BLOCK,
        )
        self.staged = threading.Semaphore(0)  # released by every poke (a job staged)
        self.io = CacheIO(self.staged.release, workers=workers, per_tenant=per_tenant)
        self.ids = 0

    def _open(self, config: TierConfig, frame_bytes: int, seed: str) -> TierStore:
        slot = MemoryStore.slot_for(frame_bytes)
        if config.kind == "memory":
            return MemoryStore(config.capacity_bytes, slot)
        self.shared = GatedShared(config.capacity_bytes, slot)
        return self.shared

    @property
    def gate(self) -> GatedShared:
        assert self.shared is not None
        return self.shared

    def job(self, tenant: str, prompt: list[int], timeout_s: float = 1000.0) -> Job:
        self.ids += 1
        request = Request(prompt, tenant, SamplingParams(max_tokens=1, temperature=0.0))
        job = Job(self.runtime, Handle(self.ids, request, lambda event: None, self.clock() + timeout_s, timeout_s))
        job._turn = EXACT.open(request, job.context)  # NOTE: what its first prefill step sets
        return job

    def insert(self, tenant: str, tokens: list[int]) -> None:
        self.cache.insert(tokens, self.runtime.context(tenant), kv=kv(len(tokens)))
        self.cache.flush()

    def wait_staged(self, *jobs: Job) -> None:
        for job in jobs:
            wait_for(lambda job=job: job.staged is not None, GUARD_S)

    def close(self) -> None:
        self.gate.open.set()
        self.io.close(GUARD_S)
        self.cache.close()


def kv(tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(LAYOUT.shape(tokens)).astype(np.float32)


def prompt(seed: int, tokens: int = 4 * BLOCK) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 30_000) for _ in range(tokens)]


@pytest.fixture
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


def test_a_tenants_stalled_shared_tier_never_holds_another_tenants_memory_hit(world: World) -> None:
    hot = prompt(1)
    world.insert("globex", hot)  # globex's prompt, whole in memory: its match probes nothing
    world.gate.open.clear()
    misses = [world.job("acme", prompt(10 + i)) for i in range(3)]  # acme's: probed in the shared tier
    for job in misses:
        world.io.stage(job)
    wait_for(lambda: world.gate.probing == 2, GUARD_S)  # acme holds its two workers, stalled
    hit = world.job("globex", hot)
    world.io.stage(hit)
    world.wait_staged(hit)
    assert hit.staged is not None and hit.staged.cached == len(hot) - 1  # all but the last token
    assert hit.staged.tiers["memory"] == len(hot) - 1
    assert world.gate.probes == 2  # the hit probed nothing; acme's third waits for its own share
    assert all(job.staged is None for job in misses)
    world.gate.open.set()
    world.wait_staged(*misses)
    assert [job.staged.cached for job in misses if job.staged is not None] == [0, 0, 0]


def test_one_worker_serves_the_tenants_one_after_another() -> None:
    """The engine before (one FIFO thread): the memory hit waits for the stalled probe."""
    world = World(workers=1, per_tenant=1)
    try:
        hot = prompt(1)
        world.insert("globex", hot)
        world.gate.open.clear()
        miss, hit = world.job("acme", prompt(2)), world.job("globex", hot)
        world.io.stage(miss)
        wait_for(lambda: world.gate.probing == 1, GUARD_S)
        world.io.stage(hit)
        assert world.io.workers == 1 and hit.staged is None  # its one worker is in the stalled probe
        world.gate.open.set()
        world.wait_staged(miss, hit)
    finally:
        world.close()


def test_a_tenant_holds_per_tenant_workers_and_its_unrelated_work_waits_for_its_own_share() -> None:
    world = World(workers=3, per_tenant=2)
    try:
        hot = prompt(1)
        world.insert("acme", hot)
        world.gate.open.clear()
        misses = [world.job("acme", prompt(10 + i)) for i in range(2)]
        for job in misses:
            world.io.stage(job)
        wait_for(lambda: world.gate.probing == 2, GUARD_S)
        hit, other = world.job("acme", hot), world.job("globex", prompt(3, 2 * BLOCK))
        world.io.stage(hit)
        world.io.stage(other)  # a miss of globex probes too (not stalled for long: see below)
        wait_for(lambda: world.gate.probing == 3, GUARD_S)  # globex got the third worker
        assert hit.staged is None  # acme's hit waits behind acme's own stalled probes only
        world.gate.open.set()
        world.wait_staged(hit, other, *misses)
        assert hit.staged is not None and hit.staged.cached == len(hot) - 1
    finally:
        world.close()


def held(job: Job, gate: threading.Event, entered: threading.Event) -> None:
    """Make ``job``'s end store wait for ``gate`` before it inserts (a slow store)."""
    store = job.store

    def slow(kv: Any, length: int) -> None:
        entered.set()
        assert gate.wait(GUARD_S)
        store(kv, length)

    job.store = slow  # type: ignore[method-assign]


def test_a_conversations_next_turn_is_staged_after_its_store_and_nothing_else_waits(world: World) -> None:
    first = prompt(1, 3 * BLOCK)
    answer = prompt(2, 2 * BLOCK)
    turn = world.job("acme", first)
    turn._out[:] = answer  # NOTE: what its decode steps would have sampled
    gate, entered = threading.Event(), threading.Event()
    held(turn, gate, entered)
    history = [*first, *answer]
    world.io.store(turn, kv(len(history)), len(history), lambda: None)  # queued before its end event
    assert entered.wait(GUARD_S)
    again = world.job("acme", [*history, *prompt(3, BLOCK)])  # the next turn: the history, a new message
    unrelated, other = world.job("acme", prompt(4)), world.job("globex", [*history, 7])
    for job in (again, unrelated, other):
        world.io.stage(job)
    world.wait_staged(unrelated, other)  # neither waits for the store held back
    assert again.staged is None  # ... the next turn does
    gate.set()
    world.wait_staged(again)
    assert again.staged is not None and again.staged.cached == len(history)  # a hit on the stored turn
    assert other.staged is not None and other.staged.cached == 0  # globex never sees acme's


def test_a_follower_past_its_deadline_or_gone_is_handed_back_at_once_and_never_staged(world: World) -> None:
    system = prompt(1, 6 * BLOCK)
    lead = world.job("acme", [*system, 1, 2, 3])
    world.io.stage(lead)
    world.wait_staged(lead)  # a miss: it will prefill the system prompt
    late = world.job("acme", [*system, 4, 5], timeout_s=1.0)
    left = world.job("acme", [*system, 6, 7])
    world.io.stage(late)
    world.io.stage(left)
    wait_for(lambda: world.io.following == 2, GUARD_S)  # both wait for the lead's prompt
    assert world.io.overdue(lambda job: job.handle.cancelled or job.expired()) == []
    world.clock.now += 2.0  # late's deadline passes
    left.handle.cancel()
    gone = world.io.overdue(lambda job: job.handle.cancelled or job.expired())
    assert gone == [late, left] and world.io.following == 0  # ended by the caller now, not at the lead's end
    done = threading.Event()
    world.io.store_prompt(lead, kv(len(lead.prompt)), len(lead.prompt), done.set)
    assert done.wait(GUARD_S)
    world.io.close(GUARD_S)  # drained: had they been staged again, it would be done now
    assert late.staged is None and left.staged is None


def test_a_follower_is_staged_again_once_its_lead_is_stored_even_with_one_worker() -> None:
    """The lead's store stages its followers again from the worker that ran it, with
    the lock held: with one worker, that stage runs once the store is done."""
    world = World(workers=1, per_tenant=1)
    try:
        system = prompt(1, 6 * BLOCK)
        lead, follower = world.job("acme", system), world.job("acme", [*system, 9])
        world.io.stage(lead)
        world.wait_staged(lead)
        world.io.stage(follower)
        wait_for(lambda: world.io.following == 1, GUARD_S)
        world.io.store_prompt(lead, kv(len(system)), len(system), lambda: None)
        world.wait_staged(follower)
        assert follower.staged is not None and follower.staged.cached == len(system)
        assert world.io.following == 0
    finally:
        world.close()


def test_an_expired_or_cancelled_job_never_follows(world: World) -> None:
    system = prompt(1, 6 * BLOCK)
    lead = world.job("acme", [*system, 1])
    world.io.stage(lead)
    world.wait_staged(lead)
    late = world.job("acme", [*system, 2], timeout_s=-1.0)  # past its deadline already
    left = world.job("acme", [*system, 3])
    left.handle.cancel()
    world.io.stage(late)
    world.io.stage(left)
    world.wait_staged(late, left)  # staged (empty) at once: their first step ends them
    assert world.io.following == 0
    later = world.job("acme", [*system, 4])
    world.io.stage(later)
    wait_for(lambda: world.io.following == 1, GUARD_S)  # it follows the lead, never the two that end now
    assert world.io._inflight is not None and world.io._inflight.leads == 1


def test_close_runs_what_is_queued_then_stops_the_threads_and_a_later_task_starts_them_again(
    world: World,
) -> None:
    ended: list[int] = []
    jobs = [world.job(tenant, prompt(i, 2 * BLOCK)) for i, tenant in enumerate(("acme", "globex") * 3)]
    for job in jobs:
        world.io.stage(job)
        world.io.store(job, kv(len(job.prompt)), len(job.prompt), lambda job=job: ended.append(job.handle.id))
    threads = list(world.io._threads)
    assert len(threads) == world.io.workers
    world.io.close(GUARD_S)
    assert sorted(ended) == [job.handle.id for job in jobs] and all(job.staged is not None for job in jobs)
    assert world.io.idle and not any(thread.is_alive() for thread in threads)
    again = world.job("acme", jobs[0].prompt)
    world.io.stage(again)
    world.wait_staged(again)
    assert again.staged is not None and again.staged.cached == len(again.prompt) - 1


def test_a_task_that_raises_does_not_stop_the_workers(world: World, caplog: pytest.LogCaptureFixture) -> None:
    job = world.job("acme", prompt(1))
    calls: list[str] = []

    def broken(kv: Any, length: int) -> None:
        raise RuntimeError("a bug")

    job.store = broken  # type: ignore[method-assign]
    world.io.store(job, None, 0, lambda: calls.append("after"))
    world.io.stage(job)  # after its store, in order
    world.wait_staged(job)
    assert calls == ["after"] and "a prefix cache task failed" in caplog.text
