"""The chunk store (blend/chunks.py): content keys, namespaces, epochs, tiers, pins.

A state machine drives put / get / pin / bump / purge / clock steps across tenants and
isolation modes and checks, after every step, against a reference of what was put:
soundness (a get returns exactly a KV put for the same context and tokens in a visible
namespace, or None), isolation (never another tenant's), epochs (nothing from before a
bump), capacity (no tier above its bytes), pins (a pinned chunk stays), and, when the
disk tier can hold everything, completeness (what was put and not removed is found).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache import CacheConfig, CacheContext
from prefixcache.blend.chunk_keys import CHUNK_TAG, ChunkKeys, Epochs
from prefixcache.blend.chunks import ChunkStore
from prefixcache.config import KVLayout, PublishConfig, TierConfig
from prefixcache.hashing import KeyChain, get_hash, root_encoding, root_hasher, token_bytes
from prefixcache.tenancy import PUBLIC
from support import Clock

LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=2, dtype="float32")
MAX_TOKENS = 8
TENANTS = ("a", "b", "c")
MODELS = ("m1", "m2")
CHUNKS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [1, 2, 3, 4], [10, 11, 12, 13, 14, 15, 16, 17]]


def kv_of(tokens: list[int], tag: float) -> np.ndarray:
    """A chunk's KV that names the put it came from (``tag``), so a get tells whose it is."""
    kv = np.full(LAYOUT.shape(len(tokens)), tag, dtype=np.float32)
    kv[..., 1] = np.arange(len(tokens), dtype=np.float32)
    return kv


def _encoded(tokens: int) -> int:
    from prefixcache.storage import codec

    return codec.encoded_size(LAYOUT.shape(tokens), LAYOUT.dtype, 16)


SLOT = -(-_encoded(MAX_TOKENS) // 16) * 16


def config(tmp: Path, isolation: str = "namespace", memory_slots: int = 2, disk_bytes: int = 1 << 20, **kw: object):
    tiers = (
        TierConfig(kind="memory", capacity_bytes=memory_slots * SLOT),
        TierConfig(kind="disk", capacity_bytes=disk_bytes, path=str(tmp), fsync="none"),
    )
    return CacheConfig(tiers=tiers, kv_layout=LAYOUT, isolation=isolation, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- keys


def test_chunk_keys_cover_the_context_and_never_equal_block_keys() -> None:
    keys = ChunkKeys("seed", get_hash("xxh3_128"))
    data = token_bytes([5, 6, 7, 8])
    zero = Epochs(0, 0)
    base = keys.key(CacheContext("t", "m"), data, "t", zero)
    others = [
        keys.key(CacheContext("t", "m2"), data, "t", zero),
        keys.key(CacheContext("t", "m", adapter="lora"), data, "t", zero),
        keys.key(CacheContext("t", "m", tokenizer="tok"), data, "t", zero),
        keys.key(CacheContext("t", "m", extra=(b"img",)), data, "t", zero),
        keys.key(CacheContext("t", "m"), data, "u", zero),
        keys.key(CacheContext("t", "m"), data, "t", Epochs(1, 0)),
        keys.key(CacheContext("t", "m"), token_bytes([5, 6, 7]), "t", zero),
        ChunkKeys("seed2", get_hash("xxh3_128")).key(CacheContext("t", "m"), data, "t", zero),
    ]
    assert len({base, *others}) == len(others) + 1
    # the same tokens as a block of a prompt: another hash domain, another key
    enc = root_encoding("seed", CacheContext("t", "m"), "t", 0, 0)
    block = KeyChain(root_hasher(get_hash("xxh3_128"), enc), data, root_enc=enc).at(4)
    assert block != base and not enc.startswith(CHUNK_TAG)


def test_key_is_the_same_wherever_the_chunk_appears(tmp_path: Path) -> None:
    store = ChunkStore(config(tmp_path), max_chunk_tokens=MAX_TOKENS)
    ctx = CacheContext("a", "m1")
    assert store.key(ctx, [4, 5, 6]) == store.key(ctx, np.array([4, 5, 6]))
    assert store.key(ctx, [4, 5, 6]) != store.key(CacheContext("b", "m1"), [4, 5, 6])
    assert store.key(ctx, [4, 5, 6], public=True) == store.key(CacheContext("b", "m1"), [4, 5, 6], public=True)
    store.close()


# ---------------------------------------------------------------------------- the state machine


class ChunkMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.tag = 0.0
        self.epochs: dict[str, int] = dict.fromkeys(MODELS, 0)
        # (namespace, model, epoch, chunk index) -> tags of the puts that may be stored there
        self.allowed: dict[tuple[str, str, int, int], set[float]] = {}
        self.owner: dict[tuple[str, str, int, int], str] = {}
        self.pins: list[tuple[object, tuple[str, str, int, int]]] = []

    @initialize(
        isolation=st.sampled_from(["shared", "namespace", "partitioned"]),
        memory_slots=st.integers(1, 4),
        big_disk=st.booleans(),
        policy=st.sampled_from(["lru", "fifo", "sieve", "s3fifo"]),
        ttl=st.sampled_from([None, 5.0]),
    )
    def start(self, isolation: str, memory_slots: int, big_disk: bool, policy: str, ttl: float | None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="chunks-"))
        self.isolation = isolation
        self.complete = big_disk
        disk = 1 << 20 if big_disk else 3 * SLOT
        cfg = config(self.dir, isolation, memory_slots, disk, policy=policy, ttl_seconds=ttl)
        self.store = ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS, clock=self.clock)
        self.ttl = ttl
        self.used: dict[tuple[str, str, int, int], float] = {}

    def teardown(self) -> None:
        if hasattr(self, "store"):
            for handle, _ in self.pins:
                handle.__exit__(None, None, None)  # type: ignore[attr-defined]
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def ns(self, tenant: str, public: bool = False) -> str:
        return PUBLIC if public or self.isolation == "shared" else tenant

    def ref_key(self, tenant: str, model: str, chunk: int, public: bool = False) -> tuple[str, str, int, int]:
        return (self.ns(tenant, public), model, self.epochs[model], chunk)

    def live(self, key: tuple[str, str, int, int]) -> bool:
        if self.ttl is not None and self.clock.now - self.used.get(key, -1e9) >= self.ttl:
            return False
        return bool(self.allowed.get(key))

    @rule(
        tenant=st.sampled_from(TENANTS),
        model=st.sampled_from(MODELS),
        chunk=st.integers(0, len(CHUNKS) - 1),
        public=st.booleans(),
    )
    def put(self, tenant: str, model: str, chunk: int, public: bool) -> None:
        self.tag += 1.0
        key = self.ref_key(tenant, model, chunk, public)
        if not self.live(key):
            self.allowed.pop(key, None)
        kv = kv_of(CHUNKS[chunk], self.tag)
        stored = self.store.put(CacheContext(tenant, model), CHUNKS[chunk], kv, public=public)
        if stored:
            self.allowed.setdefault(key, set()).add(self.tag)
            self.owner.setdefault(key, PUBLIC if public else tenant)
        if stored or self.live(key):
            self.used[key] = self.clock.now

    @rule(tenant=st.sampled_from(TENANTS), model=st.sampled_from(MODELS), chunk=st.integers(0, len(CHUNKS) - 1))
    def get(self, tenant: str, model: str, chunk: int) -> None:
        got = self.store.get(CacheContext(tenant, model), CHUNKS[chunk])
        own, public = self.ref_key(tenant, model, chunk), self.ref_key(tenant, model, chunk, public=True)
        visible = [k for k in dict.fromkeys((own, public)) if self.live(k)]
        if got is None:
            if self.complete and self.ttl is None:
                assert not visible, f"{visible} were put and not removed, yet missed"
            return
        tag = float(got.kv.reshape(-1)[0])
        assert got.kv.shape == LAYOUT.shape(len(CHUNKS[chunk]))
        assert np.array_equal(got.kv, kv_of(CHUNKS[chunk], tag))
        source = [k for k in visible if tag in self.allowed[k]]
        assert source, f"tenant {tenant} got the KV of put {tag}, not one it may see"
        for key in (own, public):
            if self.live(key):
                self.used[key] = self.clock.now

    @rule(tenant=st.sampled_from(TENANTS), model=st.sampled_from(MODELS), chunk=st.integers(0, len(CHUNKS) - 1))
    def pin(self, tenant: str, model: str, chunk: int) -> None:
        if len(self.pins) >= 2:
            handle, _ = self.pins.pop(0)
            handle.__exit__(None, None, None)  # type: ignore[attr-defined]
        handle = self.store.pin(CacheContext(tenant, model), [CHUNKS[chunk]])
        pinned = handle.__enter__()
        if pinned.keys[0] is not None:
            own = self.ref_key(tenant, model, chunk)
            key = own if self.live(own) else self.ref_key(tenant, model, chunk, public=True)
            self.pins.append((handle, key))
        else:
            handle.__exit__(None, None, None)

    @rule(model=st.sampled_from(MODELS))
    def bump(self, model: str) -> None:
        self.store.bump_epoch(model)
        self.epochs[model] += 1

    @rule(tenant=st.sampled_from((*TENANTS, None)))
    def purge(self, tenant: str | None) -> None:
        self.store.purge(tenant)
        for key in list(self.allowed):
            if tenant is None or tenant in (key[0], self.owner.get(key)):
                del self.allowed[key]
                self.owner.pop(key, None)

    @rule(seconds=st.sampled_from([1.0, 3.0, 6.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        for key in [k for k in self.allowed if not self.live(k)]:
            del self.allowed[key]
            self.owner.pop(key, None)

    @invariant()
    def capacity(self) -> None:
        if not hasattr(self, "store"):
            return
        stats = self.store.stats()
        for used, store in zip(stats.tier_bytes, self.store._stores, strict=True):
            assert 0 <= used <= store.capacity_bytes
            assert store.used_bytes <= store.capacity_bytes

    @invariant()
    def pinned_stay(self) -> None:
        for _, key in getattr(self, "pins", []):
            namespace, model, epoch, chunk = key
            if self.live(key) and epoch == self.epochs[model]:
                tenant = namespace if namespace != PUBLIC else "a"
                if namespace == PUBLIC and self.isolation != "shared":
                    continue  # pinned through the public namespace: checked by its own tenant's get
                assert self.store.contains(CacheContext(tenant, model), CHUNKS[chunk])


ChunkMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestChunkMachine = ChunkMachine.TestCase


# ---------------------------------------------------------------------------- tiers


def test_corrupt_frame_on_disk_is_a_miss(tmp_path: Path) -> None:
    cfg = CacheConfig(tiers=(TierConfig(kind="disk", capacity_bytes=1 << 20, path=str(tmp_path)),), kv_layout=LAYOUT)
    ctx, tokens = CacheContext("a", "m1"), [1, 2, 3, 4]
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as store:
        assert store.put(ctx, tokens, kv_of(tokens, 7.0))
        key = store.key(ctx, tokens).hex()
        (path,) = [p for p in (tmp_path / "chunks").rglob("*") if p.is_file() and key in p.name]
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF  # a flipped bit in the payload
        path.write_bytes(bytes(raw))
        assert store.get(ctx, tokens) is None
        stats = store.stats()
        assert stats.misses == 1 and stats.chunks == 0 and stats.removed["lost"] == 1
        assert store.put(ctx, tokens, kv_of(tokens, 8.0))  # written again, served again
        got = store.get(ctx, tokens)
        assert got is not None and np.array_equal(got.kv, kv_of(tokens, 8.0))


def test_a_restarted_store_finds_its_chunks_on_disk(tmp_path: Path) -> None:
    cfg = config(tmp_path, memory_slots=2)
    ctx, tokens = CacheContext("a", "m1"), [4, 5, 6, 7, 8]
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as store:
        assert store.put(ctx, tokens, kv_of(tokens, 3.0))
        assert store.put(ctx, [9], kv_of([9], 4.0))
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as store:
        assert store.get(CacheContext("b", "m1"), tokens) is None  # another tenant: another key
        assert store.get(CacheContext("a", "m2"), tokens) is None
        got = store.get(ctx, tokens)
        assert got is not None and got.tier == "disk" and np.array_equal(got.kv, kv_of(tokens, 3.0))
        again = store.get(ctx, tokens)
        assert again is not None and again.tier == "memory"  # adopted and promoted
        assert store.purge() == 2  # the adopted chunk and the orphan still unclaimed
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as store:
        assert store.get(ctx, tokens) is None and store.get(ctx, [9]) is None


def test_partial_frame_left_after_a_restart_is_a_miss(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    ctx, tokens = CacheContext("a", "m1"), [1, 2, 3]
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as store:
        store.put(ctx, tokens, kv_of(tokens, 1.0))
        key = store.key(ctx, tokens).hex()
    (path,) = [p for p in (tmp_path / "chunks").rglob("*") if p.is_file() and key in p.name]
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(bytes(raw))
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as store:
        assert store.get(ctx, tokens) is None
        assert store.get(ctx, tokens) is None


def test_two_stores_share_a_chunk_through_redis(tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    tiers = (
        TierConfig(kind="memory", capacity_bytes=4 * SLOT),
        TierConfig(kind="redis", capacity_bytes=1 << 20, url=redis_server.url),
    )
    cfg = CacheConfig(tiers=tiers, kv_layout=LAYOUT)
    ctx, tokens = CacheContext("a", "m1"), [10, 11, 12]
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as one, ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as two:
        assert one.put(ctx, tokens, kv_of(tokens, 5.0))
        assert not two.contains(ctx, tokens)  # not known here until a get finds it
        assert two.get(CacheContext("b", "m1"), tokens) is None
        got = two.get(ctx, tokens)
        assert got is not None and got.tier == "redis" and np.array_equal(got.kv, kv_of(tokens, 5.0))
        local = two.get(ctx, tokens)
        assert local is not None and local.tier == "memory"
        one.bump_epoch("m1")
        assert one.get(ctx, tokens) is None


# ---------------------------------------------------------------------------- pins, epochs, purge, ttl


def test_pinned_chunks_are_never_evicted(tmp_path: Path) -> None:
    cfg = CacheConfig(tiers=(TierConfig(kind="memory", capacity_bytes=2 * SLOT),), kv_layout=LAYOUT)
    ctx = CacheContext("a", "m1")
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as store:
        store.put(ctx, CHUNKS[0], kv_of(CHUNKS[0], 1.0))
        store.put(ctx, CHUNKS[1], kv_of(CHUNKS[1], 2.0))
        with store.pin(ctx, [CHUNKS[0], CHUNKS[1], CHUNKS[2]]) as pinned:
            assert pinned.keys[0] is not None and pinned.keys[1] is not None and pinned.keys[2] is None
            assert not store.put(ctx, CHUNKS[2], kv_of(CHUNKS[2], 3.0))  # no room that is not pinned
            assert store.stats().pinned == 2
        assert store.put(ctx, CHUNKS[2], kv_of(CHUNKS[2], 3.0))
        assert store.stats().removed["capacity"] == 1


def test_a_bump_hides_and_reclaims_at_once_even_when_pinned(tmp_path: Path) -> None:
    with ChunkStore(config(tmp_path), max_chunk_tokens=MAX_TOKENS) as store:
        plain, lora = CacheContext("a", "m1"), CacheContext("a", "m1", adapter="lora")
        store.put(plain, CHUNKS[0], kv_of(CHUNKS[0], 1.0))
        store.put(lora, CHUNKS[0], kv_of(CHUNKS[0], 2.0))
        store.bump_epoch("m1", "lora")
        assert store.get(lora, CHUNKS[0]) is None and store.get(plain, CHUNKS[0]) is not None
        with store.pin(plain, [CHUNKS[0]]):
            store.bump_epoch("m1")
            assert store.get(plain, CHUNKS[0]) is None
            assert store.put(plain, CHUNKS[0], kv_of(CHUNKS[0], 3.0))  # the new epoch's key
        assert store.stats().removed["stale"] == 2
        assert not store.put(plain, CHUNKS[0], kv_of(CHUNKS[0], 4.0))  # stored already: nothing written
        got = store.get(plain, CHUNKS[0])
        assert got is not None and float(got.kv.reshape(-1)[0]) == 3.0


def test_purge_a_tenant_leaves_the_others(tmp_path: Path) -> None:
    with ChunkStore(config(tmp_path), max_chunk_tokens=MAX_TOKENS) as store:
        for tenant in TENANTS:
            store.put(CacheContext(tenant, "m1"), CHUNKS[1], kv_of(CHUNKS[1], 1.0))
        assert store.purge("b") == 1
        assert store.get(CacheContext("b", "m1"), CHUNKS[1]) is None
        assert store.get(CacheContext("a", "m1"), CHUNKS[1]) is not None
        assert store.stats().removed["purge"] == 1


def test_ttl_expires_unused_chunks(tmp_path: Path) -> None:
    clock = Clock()
    cfg = config(tmp_path, ttl_seconds=10.0)
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS, clock=clock) as store:
        ctx = CacheContext("a", "m1")
        store.put(ctx, CHUNKS[0], kv_of(CHUNKS[0], 1.0))
        clock.now = 8.0
        assert store.get(ctx, CHUNKS[0]) is not None  # a hit renews it
        clock.now = 15.0
        assert store.contains(ctx, CHUNKS[0])
        clock.now = 18.0
        assert store.get(ctx, CHUNKS[0]) is None
        assert store.stats().removed["ttl"] == 1


# ---------------------------------------------------------------------------- isolation


def test_public_only_when_declared_or_published(tmp_path: Path) -> None:
    cfg = config(tmp_path, publish=PublishConfig(min_tenants=2, min_tokens=1))
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as store:
        a, b, c = (CacheContext(t, "m1") for t in TENANTS)
        store.put(a, CHUNKS[0], kv_of(CHUNKS[0], 1.0))
        store.get(a, CHUNKS[0])
        store.put(a, CHUNKS[0], kv_of(CHUNKS[0], 1.0))
        assert store.get(c, CHUNKS[0]) is None  # one tenant alone never publishes
        store.put(b, CHUNKS[0], kv_of(CHUNKS[0], 2.0))  # a second tenant: published
        got = store.get(c, CHUNKS[0])
        assert got is not None and got.public
        store.put(a, CHUNKS[1], kv_of(CHUNKS[1], 3.0), public=True)  # declared by an operator
        got = store.get(b, CHUNKS[1])
        assert got is not None and got.public and float(got.kv.reshape(-1)[0]) == 3.0


def test_partitioned_tenants_do_not_evict_each_other(tmp_path: Path) -> None:
    tiers = (TierConfig(kind="memory", capacity_bytes=4 * SLOT),)
    cfg = CacheConfig(tiers=tiers, kv_layout=LAYOUT, isolation="partitioned", capacity_tokens=100, quotas={"a": 50})
    with ChunkStore(cfg, max_chunk_tokens=MAX_TOKENS) as store:
        b = CacheContext("b", "m1")
        store.put(b, CHUNKS[2], kv_of(CHUNKS[2], 9.0))
        for i, chunk in enumerate(CHUNKS):
            store.put(CacheContext("a", "m1"), chunk, kv_of(chunk, float(i)))
        assert store.get(b, CHUNKS[2]) is not None  # a's five puts stayed in a's half
        assert sum(store.contains(CacheContext("a", "m1"), chunk) for chunk in CHUNKS) == 2


def test_bad_arguments_are_errors(tmp_path: Path) -> None:
    with ChunkStore(config(tmp_path), max_chunk_tokens=MAX_TOKENS) as store:
        ctx = CacheContext("a", "m1")
        with pytest.raises(ValueError, match="shape"):
            store.put(ctx, [1, 2], kv_of([1, 2, 3], 1.0))
        with pytest.raises(ValueError, match="max_chunk_tokens"):
            store.put(ctx, list(range(MAX_TOKENS + 1)), kv_of(list(range(MAX_TOKENS + 1)), 1.0))
        with pytest.raises(ValueError, match="at least one token"):
            store.get(ctx, [])
