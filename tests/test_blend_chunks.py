"""Chunks are blocks (blend/chunks.py, blend/known.py): a chunk is a block chain of the
one ``PrefixCache`` under a chunk root, so the cache's rules hold for chunks with no
second book: keys never equal a prompt's, tenants are isolated and public chunks are
the cache's, epochs, purges and TTL apply, a bad frame is a miss, a restarted disk and
a shared Redis find chunks, writes to slow tiers never run on the caller's thread; a
hit is a whole chunk; and the embedding fallback's book follows what the cache removes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache import CacheConfig, CacheContext
from prefixcache.blend.ann import AnnConfig, ChunkIndex
from prefixcache.blend.chunks import Chunks, chunk_context
from prefixcache.blend.known import KnownChunks
from prefixcache.cache import PrefixCache
from prefixcache.config import KVLayout, PublishConfig, TierConfig
from prefixcache.hashing import root_encoding
from prefixcache.storage import codec
from prefixcache.storage.base import TierStore
from prefixcache.storage.memory import MemoryStore
from prefixcache.storage.open import open_store
from prefixcache.tenancy import PUBLIC
from support import Clock

LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=2, dtype="float32")
BS = 4
SLOT = MemoryStore.slot_for(codec.encoded_size(LAYOUT.shape(BS), LAYOUT.dtype, 16))
DOC = list(range(100, 110))  # 10 tokens: two whole blocks and a tail of 2
OTHER = list(range(200, 212))  # 12 tokens: three whole blocks


def kv_of(tokens: list[int], tag: float) -> np.ndarray:
    """A chunk's KV that names the put it came from (``tag``) and each token's position."""
    kv = np.full(LAYOUT.shape(len(tokens)), tag, dtype=np.float32)
    kv[..., 1] = np.arange(len(tokens), dtype=np.float32)
    return kv


def tag_of(kv: np.ndarray) -> float:
    return float(kv.reshape(-1)[0])


def memory(slots: int = 64, write: str = "back") -> TierConfig:
    return TierConfig(kind="memory", capacity_bytes=slots * SLOT, write=write)


def disk(tmp: Path, **kw: Any) -> TierConfig:
    return TierConfig(kind="disk", capacity_bytes=1 << 20, path=str(tmp / "disk"), fsync="none", **kw)


def open_chunks(*tiers: TierConfig, clock: Clock | None = None, **kw: Any) -> Chunks:
    config = CacheConfig(block_size=BS, kv_layout=LAYOUT, tiers=tiers or (memory(),), **kw)
    cache = PrefixCache(config, clock=clock) if clock is not None else PrefixCache(config)
    return Chunks(cache, max_chunk_tokens=64)


# ---------------------------------------------------------------------------- keys and the whole-chunk rule


def test_a_chunk_root_is_another_context_than_the_prompt() -> None:
    ctx = CacheContext("a", "m", extra=(b"img",))
    chunk = chunk_context(ctx)
    assert (chunk.tenant, chunk.model, chunk.adapter, chunk.tokenizer) == (ctx.tenant, ctx.model, None, "")
    assert chunk.extra[:1] == ctx.extra and chunk != ctx
    assert root_encoding("s", chunk, "a", 0, 0) != root_encoding("s", ctx, "a", 0, 0)
    chunks = open_chunks()
    cache = chunks.cache
    chunks.put(ctx, OTHER, kv_of(OTHER, 1.0))
    assert cache.peek(OTHER, ctx).cached_tokens == 0  # the same tokens as a prompt: never the chunk's KV
    cache.insert(DOC, ctx, kv=kv_of(DOC, 2.0))
    assert not chunks.contains(ctx, DOC) and chunks.get(ctx, DOC) is None
    assert chunks.contains(ctx, OTHER)
    cache.close()


def test_a_hit_is_the_whole_line_or_its_whole_block_prefix() -> None:
    chunks = open_chunks()
    ctx = CacheContext("a", "m")
    assert chunks.reusable(len(DOC)) == 8  # no partial blocks: the tail of 2 is not kept
    assert chunks.put(ctx, DOC, kv_of(DOC, 3.0)) == 8
    got = chunks.get(ctx, DOC)
    assert got is not None and got.tokens == 8
    assert np.array_equal(got.kv, kv_of(DOC, 3.0)[:, :, :, :8])
    assert chunks.get(ctx, DOC[:5]) is not None  # its whole block prefix is a chunk too (KV from 0)
    assert chunks.get(ctx, DOC[:3]) is None  # not one whole block
    assert chunks.put(ctx, DOC[:3], kv_of(DOC[:3], 1.0)) == 0
    chunks.cache.close()

    partial = open_chunks(partial_blocks=True)
    assert partial.put(ctx, DOC, kv_of(DOC, 4.0)) == 10
    got = partial.get(ctx, DOC)
    assert got is not None and got.tokens == 10 and np.array_equal(got.kv, kv_of(DOC, 4.0))
    cut = partial.get(ctx, [*DOC[:9], 7])  # shares 9 tokens, cut inside the tail: its whole blocks only
    assert cut is not None and cut.tokens == 8
    partial.cache.close()


def test_bad_arguments_are_errors() -> None:
    chunks = open_chunks()
    ctx = CacheContext("a", "m")
    with pytest.raises(ValueError, match="kv has shape"):
        chunks.put(ctx, DOC, kv_of(DOC[:4], 1.0))
    with pytest.raises(ValueError, match="max_chunk_tokens"):
        chunks.get(ctx, list(range(65)))
    with pytest.raises(ValueError, match="at least one token"):
        chunks.get(ctx, [])
    with pytest.raises(ValueError, match="tiers"):
        Chunks(PrefixCache(CacheConfig()))
    chunks.cache.close()


# ---------------------------------------------------------------------------- isolation


def test_tenants_never_see_each_others_chunks() -> None:
    chunks = open_chunks(isolation="namespace")
    a, b = CacheContext("a", "m"), CacheContext("b", "m")
    chunks.put(a, OTHER, kv_of(OTHER, 1.0))
    assert chunks.get(b, OTHER) is None and not chunks.contains(b, OTHER)
    chunks.put(b, OTHER, kv_of(OTHER, 2.0))
    got_a, got_b = chunks.get(a, OTHER), chunks.get(b, OTHER)
    assert got_a is not None and got_b is not None and (tag_of(got_a.kv), tag_of(got_b.kv)) == (1.0, 2.0)
    chunks.cache.close()

    shared = open_chunks(isolation="shared")
    shared.put(a, OTHER, kv_of(OTHER, 3.0))
    got = shared.get(b, OTHER)
    assert got is not None and tag_of(got.kv) == 3.0  # shared mode: one namespace, as for prompts
    shared.cache.close()


def test_partitioned_tenants_do_not_evict_each_others_chunks() -> None:
    chunks = open_chunks(memory(12), isolation="partitioned", quotas={"a": 24})
    b = CacheContext("b", "m")
    chunks.put(b, OTHER, kv_of(OTHER, 9.0))
    for i in range(6):
        chunks.put(CacheContext("a", "m"), [i * 50 + t for t in range(8)], kv_of(list(range(8)), float(i)))
    assert chunks.get(b, OTHER) is not None  # a's puts stayed within a's quota
    chunks.cache.close()


def test_public_chunks_are_declared_or_published_by_enough_tenants() -> None:
    chunks = open_chunks(publish=PublishConfig(min_tenants=2, min_tokens=1))
    a, b, c = (CacheContext(t, "m") for t in "abc")
    chunks.put(a, OTHER, kv_of(OTHER, 1.0))
    chunks.put(a, OTHER, kv_of(OTHER, 1.0))
    assert chunks.get(c, OTHER) is None  # one tenant alone never publishes
    chunks.put(b, OTHER, kv_of(OTHER, 2.0))  # a second tenant: published
    got = chunks.get(c, OTHER)
    assert got is not None and got.tokens == 12
    chunks.cache.close()

    declared = open_chunks(isolation="namespace", partial_blocks=True)
    declared.declare_public(a, DOC)
    declared.put(a, DOC, kv_of(DOC, 3.0))
    got = declared.get(b, DOC)
    assert got is not None and got.tokens == 8 and tag_of(got.kv) == 3.0  # the public copy: whole blocks only
    got = declared.get(a, DOC)
    assert got is not None and got.tokens == 10  # a's own copy is whole
    declared.cache.close()


# ---------------------------------------------------------------------------- epochs, purge, ttl, pins


def test_an_epoch_bump_invalidates_chunks_with_the_blocks() -> None:
    chunks = open_chunks()
    plain, lora = CacheContext("a", "m"), CacheContext("a", "m", adapter="lora")
    chunks.put(plain, OTHER, kv_of(OTHER, 1.0))
    chunks.put(lora, OTHER, kv_of(OTHER, 2.0))
    chunks.cache.bump_epoch("m", "lora")
    assert chunks.get(lora, OTHER) is None and chunks.get(plain, OTHER) is not None
    with chunks.match(plain, OTHER) as pinned:
        assert pinned.cached_tokens == 12
        chunks.cache.bump_epoch("m")
        assert chunks.get(plain, OTHER) is None  # at once, even while pinned
        assert chunks.put(plain, OTHER, kv_of(OTHER, 3.0)) == 12  # the new epoch's chain
    got = chunks.get(plain, OTHER)
    assert got is not None and tag_of(got.kv) == 3.0
    chunks.cache.close()


def test_purge_and_purge_prefix_remove_chunks() -> None:
    chunks = open_chunks()
    cache = chunks.cache
    a, b = CacheContext("a", "m"), CacheContext("b", "m")
    for ctx in (a, b):
        chunks.put(ctx, OTHER, kv_of(OTHER, 1.0))
        chunks.put(ctx, DOC, kv_of(DOC, 1.0))
    assert cache.purge("b") > 0
    assert chunks.get(b, OTHER) is None and chunks.get(a, OTHER) is not None
    cache.purge_prefix(OTHER[:6], a)  # a prompt's prefix: chunks are another context
    assert chunks.contains(a, OTHER)
    assert chunks.purge_prefix(a, OTHER[:6]) == 8  # the block holding the prefix's end, and below
    assert not chunks.contains(a, OTHER) and chunks.get(a, OTHER) is None and chunks.contains(a, DOC)
    assert chunks.purge_prefix(a, list(range(99))) == 0  # longer than any chunk
    cache.close()


def test_ttl_expires_unused_chunks() -> None:
    clock = Clock()
    chunks = open_chunks(clock=clock, ttl_seconds=10.0)
    ctx = CacheContext("a", "m")
    chunks.put(ctx, OTHER, kv_of(OTHER, 1.0))
    clock.now = 8.0
    assert chunks.get(ctx, OTHER) is not None  # a hit renews it
    clock.now = 15.0
    assert chunks.contains(ctx, OTHER)
    clock.now = 18.5
    assert chunks.get(ctx, OTHER) is None
    chunks.cache.close()


def test_a_pinned_chunk_is_never_evicted() -> None:
    chunks = open_chunks(memory(3))
    ctx = CacheContext("a", "m")
    chunks.put(ctx, OTHER, kv_of(OTHER, 1.0))
    with chunks.match(ctx, OTHER) as pin:
        assert pin.cached_tokens == 12
        assert chunks.put(ctx, DOC, kv_of(DOC, 2.0)) == 0  # no room that is not pinned
        assert chunks.get(ctx, OTHER) is not None
    assert chunks.put(ctx, DOC, kv_of(DOC, 2.0)) == 8  # released: evicted for it
    assert not chunks.contains(ctx, OTHER)
    chunks.cache.close()


# ---------------------------------------------------------------------------- tiers


def test_a_corrupt_frame_on_disk_is_a_miss(tmp_path: Path) -> None:
    chunks = open_chunks(disk(tmp_path))
    ctx = CacheContext("a", "m")
    chunks.put(ctx, OTHER, kv_of(OTHER, 7.0))
    assert chunks.cache.flush(10)
    with chunks.match(ctx, OTHER) as m:
        last = m.block_keys[-1].hex()
    (path,) = [p for p in (tmp_path / "disk").rglob("*") if p.is_file() and p.name.startswith(last)]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit in the last block's payload
    path.write_bytes(bytes(raw))
    assert chunks.get(ctx, OTHER) is None  # the load came back short: never a shorter chunk
    assert chunks.put(ctx, OTHER, kv_of(OTHER, 8.0)) == 4  # the lost block, written again
    chunks.cache.flush(10)
    got = chunks.get(ctx, OTHER)
    assert got is not None and np.all(got.kv[..., :8, 0] == 7.0) and np.all(got.kv[..., 8:, 0] == 8.0)
    chunks.cache.close()


def test_a_restarted_cache_finds_its_chunks_on_disk(tmp_path: Path) -> None:
    ctx = CacheContext("a", "m")
    first = open_chunks(memory(write="through"), disk(tmp_path))
    first.put(ctx, OTHER, kv_of(OTHER, 3.0))
    assert first.cache.close(10)
    again = open_chunks(memory(write="through"), disk(tmp_path))
    assert again.get(CacheContext("b", "m"), OTHER) is None  # another tenant: another chain
    got = again.get(ctx, OTHER)
    assert got is not None and got.tier_tokens.get("disk") == 12 and np.array_equal(got.kv, kv_of(OTHER, 3.0))
    got = again.get(ctx, OTHER)
    assert got is not None and got.tier_tokens.get("memory") == 12  # adopted and promoted
    again.cache.close()


def test_a_chunk_write_to_disk_never_runs_on_the_callers_thread(tmp_path: Path) -> None:
    writers: set[int] = set()
    fsynced = threading.Event()  # the disk's writes wait for it: a disk that takes as long as the test says

    def slow_disk(tier: TierConfig, frame: int, seed: str) -> TierStore:
        store = open_store(tier, frame, seed)
        if tier.kind == "disk":
            real = store.put

            def put(key: bytes, data: Any) -> None:
                writers.add(threading.get_ident())
                fsynced.wait(60)  # an fsync on a slow disk
                real(key, data)

            store.put = put  # type: ignore[method-assign]
        return store

    config = CacheConfig(block_size=BS, kv_layout=LAYOUT, tiers=(memory(write="through"), disk(tmp_path)))
    cache = PrefixCache(config, store_factory=slow_disk)
    chunks, ctx = Chunks(cache), CacheContext("a", "m")
    try:
        assert chunks.put(ctx, OTHER, kv_of(OTHER, 1.0)) == 12  # three blocks, while no disk write can end:
        assert chunks.get(ctx, OTHER) is not None  # not waited for, and served from memory meanwhile
        assert cache.stats().tiers[1].bytes_written == 0
    finally:
        fsynced.set()
    assert cache.flush(10)
    assert writers and threading.get_ident() not in writers
    cache.close()


def test_two_caches_share_a_chunk_through_redis(redis_server: Any) -> None:
    redis = TierConfig(kind="redis", capacity_bytes=1 << 20, url=redis_server.url)
    one, two = open_chunks(memory(write="through"), redis), open_chunks(memory(write="through"), redis)
    ctx = CacheContext("a", "m")
    one.put(ctx, OTHER, kv_of(OTHER, 5.0))
    assert one.cache.flush(10)
    assert two.get(CacheContext("b", "m"), OTHER) is None
    got = two.get(ctx, OTHER)
    assert got is not None and got.tier_tokens.get("redis") == 12 and np.array_equal(got.kv, kv_of(OTHER, 5.0))
    one.cache.close()
    two.cache.close()


# ---------------------------------------------------------------------------- the state machine

TENANTS = ("a", "b", "c")
MODELS = ("m1", "m2")
LINES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9, 9, 9], [7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22]]


class ChunkMachine(RuleBasedStateMachine):
    """Puts, gets, bumps and purges across tenants, models and isolation modes, against a
    reference. A chunk's KV is a pure function of (namespace, model, epoch, token,
    position), so a get is sound only if it returns exactly the KV of its own namespace
    at the model's current epoch (never another tenant's, never a stale one), whole;
    and, when the tier holds everything, complete: what was put and not removed is found."""

    @initialize(
        isolation=st.sampled_from(["shared", "namespace", "partitioned"]),
        big=st.booleans(),
        partial=st.booleans(),
        policy=st.sampled_from(["lru", "fifo", "sieve", "s3fifo"]),
    )
    def start(self, isolation: str, big: bool, partial: bool, policy: str) -> None:
        self.chunks = open_chunks(memory(256 if big else 5), isolation=isolation, partial_blocks=partial, policy=policy)
        self.big, self.shared = big, isolation == "shared"
        self.epochs = dict.fromkeys(MODELS, 0)
        self.present: set[tuple[str, str, int]] = set()  # (namespace, model, line) stored at the current epoch

    def teardown(self) -> None:
        if hasattr(self, "chunks"):
            self.chunks.cache.close()

    def ns(self, tenant: str) -> str:
        return PUBLIC if self.shared else tenant

    def kv(self, tenant: str, model: str, tokens: list[int]) -> np.ndarray:
        code = (TENANTS.index(tenant) + 1 if not self.shared else 9) * 100 + MODELS.index(model) * 10
        kv = np.full(LAYOUT.shape(len(tokens)), code + self.epochs[model], dtype=np.float32)
        kv[..., 1] = np.array(tokens, dtype=np.float32) * 64 + np.arange(len(tokens))
        return kv

    @rule(tenant=st.sampled_from(TENANTS), model=st.sampled_from(MODELS), line=st.integers(0, len(LINES) - 1))
    def put(self, tenant: str, model: str, line: int) -> None:
        tokens = LINES[line]
        self.chunks.put(CacheContext(tenant, model), tokens, self.kv(tenant, model, tokens))
        if self.big and self.chunks.reusable(len(tokens)):
            self.present.add((self.ns(tenant), model, line))

    @rule(tenant=st.sampled_from(TENANTS), model=st.sampled_from(MODELS), line=st.integers(0, len(LINES) - 1))
    def get(self, tenant: str, model: str, line: int) -> None:
        tokens = LINES[line]
        got = self.chunks.get(CacheContext(tenant, model), tokens)
        if got is None:
            assert (self.ns(tenant), model, line) not in self.present, "put, not removed, yet missed"
            return
        bs = BS
        assert got.tokens in (len(tokens), len(tokens) // bs * bs) and got.tokens
        assert np.array_equal(got.kv, self.kv(tenant, model, tokens[: got.tokens])), "another's or a stale chunk"

    @rule(model=st.sampled_from(MODELS))
    def bump(self, model: str) -> None:
        self.chunks.cache.bump_epoch(model)
        self.epochs[model] += 1
        self.present = {p for p in self.present if p[1] != model}

    @rule(tenant=st.sampled_from(TENANTS))
    def purge(self, tenant: str) -> None:
        self.chunks.cache.purge(tenant)
        # NOTE: shared mode: a block belongs to whoever stored it first, so any line may go
        self.present = {p for p in self.present if not self.shared and p[0] != tenant}

    @invariant()
    def within_the_tier(self) -> None:
        if hasattr(self, "chunks"):
            (tier,) = self.chunks.cache.stats().tiers
            assert tier.used_bytes <= tier.capacity_bytes


ChunkMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestChunkMachine = ChunkMachine.TestCase


# ---------------------------------------------------------------------------- the fallback's book


def vector(i: int) -> np.ndarray:
    v = np.zeros(8, dtype=np.float32)
    v[i % 8] = 1.0
    return v


def book(chunks: Chunks, sweep: int = 0) -> KnownChunks:
    return KnownChunks(chunks, ChunkIndex(AnnConfig(dim=8)), sweep=sweep)


def test_an_evicted_chunk_leaves_the_index() -> None:
    chunks = open_chunks(memory(6))
    known, ctx = book(chunks), CacheContext("a", "m")
    lines = [[i * 50 + t for t in range(8)] for i in range(4)]  # two blocks each: three fit
    chunks.put(ctx, lines[0], kv_of(lines[0], 0.0))
    assert known.add(ctx, lines[0], vector(0))
    assert [k.tokens for _, k in known.candidates(ctx, vector(0), 3, 0.5)] == [tuple(lines[0])]
    for i in (1, 2, 3):
        chunks.put(ctx, lines[i], kv_of(lines[i], float(i)))
        known.add(ctx, lines[i], vector(i))
    assert not chunks.contains(ctx, lines[0])  # the oldest went for the fourth
    assert len(known.index or []) == 4  # still indexed: nobody asked yet
    assert known.candidates(ctx, vector(0), 3, 0.5) == []  # asked: checked against the cache, gone
    assert len(known) == 3 and len(known.index or []) == 3


def test_a_sweep_drops_removed_chunks_nobody_asks_about() -> None:
    chunks = open_chunks()
    known, ctx = book(chunks, sweep=2), CacheContext("a", "m")
    for i in range(3):
        line = [i * 50 + t for t in range(8)]
        chunks.put(ctx, line, kv_of(line, float(i)))
        known.add(ctx, line, vector(i))
    chunks.cache.purge("a")
    assert known.sweep(2) == 2 and len(known) == 1 and known.sweep(2) == 1 and len(known.index or []) == 0


def test_bump_purge_and_purge_prefix_clear_the_index() -> None:
    chunks = open_chunks()
    known, a, b = book(chunks), CacheContext("a", "m"), CacheContext("b", "m")
    for ctx in (a, b):
        chunks.put(ctx, OTHER, kv_of(OTHER, 1.0))
        known.add(ctx, OTHER, vector(1))
    assert known.forget_tenant("b") == 1 and len(known) == 1
    assert chunks.contains(b, OTHER)  # the book's side only: the cache's purge(tenant) removes it
    assert known.forget_prefix(a, OTHER[:3]) == 1 and len(known) == 0
    known.add(a, OTHER, vector(1))
    old = known.epoch("m")
    chunks.cache.bump_epoch("m")
    assert known.bump("m") == old + 1 and len(known) == 0 and len(known.index or []) == 0
    assert not chunks.contains(a, OTHER)  # the cache's bump invalidated the chunk itself
    assert known.candidates(a, vector(1), 3, 0.5) == []
