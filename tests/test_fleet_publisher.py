"""The fleet publisher against a real Redis: what a router reads from the stream (and from
a snapshot) is the cache's residency, block for block and tier kind for tier kind."""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from prefixcache import CacheContext, PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.fleet.keys import chain_keys, root_key
from prefixcache.fleet.publisher import FleetPublisher, PublisherConfig
from prefixcache.fleet.translate import wire_events
from prefixcache.fleet.wire import AllBlocksCleared, BlockRemoved, BlockStored, Entry, decode_entry
from prefixcache.storage import codec
from redis_server import RedisServer

BS = 4
MODEL = "m"
LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=4)
FRAME = codec.encoded_size(LAYOUT.shape(BS), LAYOUT.dtype, 16)  # 16-byte keys (the default hash)
ACME, GLOBEX = CacheContext("acme", MODEL), CacheContext("globex", MODEL)


def make_cache(disk: Path, memory_frames: int = 64, disk_frames: int = 256, **extra: Any) -> PrefixCache:
    """Memory (written back to disk when it evicts) over disk; the writer inline, so every
    write is done when a call returns."""
    write = extra.pop("write", "back")
    tiers = (
        TierConfig(kind="memory", capacity_bytes=memory_frames * FRAME, write=write),
        TierConfig(kind="disk", capacity_bytes=disk_frames * FRAME, path=str(disk)),
    )
    cache = PrefixCache(CacheConfig(block_size=BS, kv_layout=LAYOUT, tiers=tiers, writer="inline", **extra))
    assert cache._io is not None and cache._io.books.tiers[0].capacity == memory_frames
    return cache


def insert(cache: PrefixCache, tokens: list[int], ctx: CacheContext = ACME) -> int:
    return cache.insert(tokens, ctx, kv=np.zeros((1, 2, 1, len(tokens), 4), dtype=np.float16))


def truth(cache: PrefixCache) -> set[tuple[bytes, str]]:
    """(key, tier kind) of every whole block the tiers hold or are writing, read from the books."""
    assert cache._io is not None
    books = cache._io.books
    return {
        (key, tier.config.kind)
        for key, block in books.owner.items()
        for tier in books.tiers
        if block.num_tokens == BS and books.avail(block) & tier.bit
    }


def entries(client: redis.Redis, stream: str) -> list[Entry]:
    return [decode_entry(fields) for _, fields in client.xrange(stream)]


@dataclass
class Index:
    """What a router rebuilds from the stream: (hash, medium), and each hash's router key."""

    held: set[tuple[bytes, str]] = field(default_factory=set)
    keys: dict[bytes, bytes] = field(default_factory=dict)  # backend hash -> router key
    namespaces: dict[bytes, str] = field(default_factory=dict)
    seq: int = 0

    def apply(self, entry: Entry) -> None:
        assert entry.seq == self.seq + 1, f"gap: {self.seq} -> {entry.seq}"
        self.seq = entry.seq
        for event in entry.batch.events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
                self.keys.clear()
            elif isinstance(event, BlockStored):
                self.store(event)
            else:
                assert isinstance(event, BlockRemoved) and event.medium is not None
                self.held -= {(h, event.medium) for h in event.block_hashes}  # type: ignore[misc]

    def store(self, event: BlockStored) -> None:
        assert event.medium is not None and event.extra_keys is not None and event.block_size == BS
        assert len(event.token_ids) == BS * len(event.block_hashes) == BS * len(event.extra_keys)
        namespace, model = event.extra_keys[0]  # type: ignore[misc]
        parent = event.parent_block_hash
        if parent is None:
            start = root_key(namespace, model)
        else:
            assert parent in self.keys, "a parent comes before its children"
            start = self.keys[parent]  # type: ignore[index]
        for h, key in zip(event.block_hashes, chain_keys(start, event.token_ids, BS), strict=True):
            self.held.add((h, event.medium))  # type: ignore[arg-type]
            self.keys[h] = key  # type: ignore[index]
            self.namespaces[h] = namespace  # type: ignore[index]


def publisher(cache: PrefixCache, srv: RedisServer, name: str = "b1", **extra: Any) -> FleetPublisher:
    registry = extra.pop("registry", None)
    config = PublisherConfig(srv.url, name, "test:fleet", **extra)
    return FleetPublisher(cache, config, MODEL, registry=registry, inc=extra.get("inc", "inc-1"))


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


# ====================================================================== the stream


def test_stores_moves_and_removals_reach_the_stream_in_order(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    cache = make_cache(tmp_path / "disk", memory_frames=4)
    pub = publisher(cache, redis_server)
    index = Index()
    a, b = list(range(12)), list(range(100, 112))
    insert(cache, a)
    pub.publish_pending()
    insert(cache, b)  # memory holds 4 frames: a's blocks go down to disk, deepest... as the policy says
    pub.publish_pending()
    for entry in entries(client, pub.config.stream):
        index.apply(entry)
    assert index.held == truth(cache) and {m for _, m in index.held} == {"memory", "disk"}
    first = entries(client, pub.config.stream)[0]
    assert first.inc == "inc-1" and first.seq == 1 and isinstance(first.batch.events[0], AllBlocksCleared)
    stored = [e for e in first.batch.events if isinstance(e, BlockStored)]
    assert len(stored) == 1 and stored[0].token_ids == a and stored[0].medium == "memory"
    assert stored[0].extra_keys == [("acme", MODEL)] * 3
    assert [index.keys[h] for h in stored[0].block_hashes] == chain_keys(root_key("acme", MODEL), a, BS)
    moved = entries(client, pub.config.stream)[1].batch.events
    assert any(isinstance(e, BlockRemoved) and e.medium == "memory" for e in moved)
    assert any(isinstance(e, BlockStored) and e.medium == "disk" for e in moved)

    cache.purge("acme")
    pub.publish_pending()
    for entry in entries(client, pub.config.stream)[index.seq :]:
        index.apply(entry)
    assert index.held == truth(cache) == set() and index.seq == 3
    pub.stop()
    cache.close()


def test_a_tenants_blocks_carry_its_namespace_and_public_ones_none(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    cache = make_cache(tmp_path / "disk")
    system = list(range(500, 508))
    cache.declare_public(system, ACME)
    insert(cache, [*system, 1, 2, 3, 4], ACME)
    insert(cache, [*system, 9, 9, 9, 9], GLOBEX)
    pub = publisher(cache, redis_server)
    pub.publish_pending()
    index = Index()
    for entry in entries(client, pub.config.stream):
        index.apply(entry)
    by_namespace: dict[str, int] = {}
    for namespace in index.namespaces.values():
        by_namespace[namespace] = by_namespace.get(namespace, 0) + 1
    assert by_namespace == {"": 2, "acme": 1, "globex": 1}  # the system prompt once, in public
    public = chain_keys(root_key("", MODEL), system, BS)
    assert sorted(k for h, k in index.keys.items() if index.namespaces[h] == "") == sorted(public)
    pub.stop()
    cache.close()


def test_shared_isolation_publishes_every_block_in_the_public_namespace(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    cache = make_cache(tmp_path / "disk", isolation="shared")
    insert(cache, list(range(8)), ACME)
    pub = publisher(cache, redis_server)
    pub.publish_pending()
    (entry,) = entries(client, pub.config.stream)
    (stored,) = [e for e in entry.batch.events if isinstance(e, BlockStored)]
    assert stored.extra_keys == [("", MODEL)] * 2
    cache.close()


def test_partial_tails_are_not_published(tmp_path: Path) -> None:
    cache = make_cache(tmp_path / "disk", partial_blocks=True)
    insert(cache, list(range(10)))  # two whole blocks and a tail of two tokens
    events = wire_events(cache.take_events(), BS, ["memory", "disk"])
    assert [(len(e.block_hashes), e.token_ids) for e in events if isinstance(e, BlockStored)] == [(2, list(range(8)))]
    cache.close()


# ====================================================================== snapshot and gaps


def test_a_snapshot_is_the_state_the_events_rebuild_at_its_seq(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    cache = make_cache(tmp_path / "disk", memory_frames=5, write="through")
    pub = publisher(cache, redis_server)
    insert(cache, list(range(12)))
    pub.publish_pending()
    insert(cache, list(range(8)) + [7] * 8)
    insert(cache, list(range(50, 62)), GLOBEX)  # not yet published: the snapshot sends it first
    snap = pub.snapshot()
    index = Index()
    for entry in entries(client, pub.config.stream):
        index.apply(entry)
    assert snap.inc == "inc-1" and snap.seq == index.seq == 2
    rebuilt = Index(seq=snap.seq)
    for event in snap.events:  # parents first: ``store`` asserts it
        rebuilt.store(event)
    assert rebuilt.held == index.held == truth(cache)
    assert rebuilt.keys == index.keys
    assert {m for _, m in rebuilt.held} == {"memory", "disk"}
    insert(cache, list(range(200, 204)))
    pub.publish_pending()
    for entry in entries(client, pub.config.stream)[snap.seq :]:  # the stream goes on from the snapshot
        rebuilt.apply(entry)
    assert rebuilt.held == truth(cache)
    cache.close()


def test_redis_down_drops_batches_counts_them_and_leaves_a_gap(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    now = [0.0]
    registry = CollectorRegistry()
    cache = make_cache(tmp_path / "disk")
    config = PublisherConfig(redis_server.url, "b1", "test:fleet", timeout_s=0.2, retry_s=1.0)
    pub = FleetPublisher(cache, config, MODEL, registry=registry, clock=lambda: now[0], inc="i")
    insert(cache, list(range(8)))
    pub.publish_pending()
    redis_server.kill()
    insert(cache, list(range(100, 108)))
    pub.publish_pending()  # fails: dropped, seq 2 spent
    now[0] = 0.5
    insert(cache, list(range(200, 208)))
    pub.publish_pending()  # within retry_s: dropped without trying, seq 3 spent
    assert registry.get_sample_value("prefixcache_fleet_batches_dropped_total") == 2
    assert insert(cache, list(range(300, 308))) == 8  # the cache never noticed
    redis_server.start()  # a new, empty Redis on the same port
    now[0] = 2.0
    pub.publish_pending()
    (entry,) = entries(client, pub.config.stream)
    assert entry.seq == 4  # seqs 2 and 3 are in no entry: a router sees the gap and takes a snapshot
    assert registry.get_sample_value("prefixcache_fleet_batches_published_total") == 2
    rebuilt = Index(seq=pub.snapshot().seq)
    assert rebuilt.seq == 4
    cache.close()


def test_an_overflowed_event_log_is_resent_whole(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    cache = make_cache(tmp_path / "disk", events_capacity=8)
    pub = publisher(cache, redis_server)
    pub.publish_pending()
    for i in range(6):  # far more than 8 events
        insert(cache, list(range(100 * i, 100 * i + 8)))
    pub.publish_pending()
    index = Index()
    for entry in entries(client, pub.config.stream):
        index.apply(entry)
    last = entries(client, pub.config.stream)[-1]
    assert isinstance(last.batch.events[0], AllBlocksCleared)
    assert index.held == truth(cache) and len(index.held) == 12
    cache.close()


def test_the_thread_publishes_and_stop_sends_the_last_events(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    cache = make_cache(tmp_path / "disk")
    pub = publisher(cache, redis_server, interval_s=0.01).start()
    insert(cache, list(range(8)))
    pub.stop()
    index = Index()
    for entry in entries(client, pub.config.stream):
        index.apply(entry)
    assert index.held == truth(cache) and len(index.held) == 2
    assert pub.info().stream == "test:fleet:events:b1" and pub.info().block_size == BS
    cache.close()


# ====================================================================== property


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from(["acme", "globex"]), st.integers(0, 5), st.integers(1, 4)),
        st.tuples(st.just("purge"), st.sampled_from(["acme", "globex"]), st.just(0), st.just(0)),
        st.tuples(st.just("publish"), st.just(""), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)
_names = itertools.count()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, write=st.sampled_from(["back", "through"]))
def test_replaying_the_stream_gives_the_caches_residency(
    redis_server: RedisServer, client: redis.Redis, ops: list[tuple[str, str, int, int]], write: str
) -> None:
    """Random inserts (sharing prefixes, evicting from a 3-frame memory tier and a
    6-frame disk) and purges: the stream replayed is the residency, (hash, medium)."""
    with tempfile.TemporaryDirectory() as tmp:
        cache = make_cache(Path(tmp), memory_frames=3, disk_frames=6, write=write)
        pub = publisher(cache, redis_server, name=f"p{next(_names)}")
        for op, tenant, family, blocks in ops:
            if op == "insert":
                tokens = [family] * BS + list(range(family * 50, family * 50 + BS * (blocks - 1)))
                insert(cache, tokens, CacheContext(tenant, MODEL))
            elif op == "purge":
                cache.purge(tenant)
            else:
                pub.publish_pending()
        pub.publish_pending()
        index = Index()
        for entry in entries(client, pub.config.stream):
            index.apply(entry)
        assert index.held == truth(cache)
        cache.close()


# ====================================================================== in the server


KEYS, ADMIN = {"sk-acme-0123456789": "acme"}, "adm-0123456789"


@pytest.mark.model  # the stand-in takes SmolLM2's converted tokenizer
def test_the_server_publishes_serves_info_and_snapshot_to_the_admin_and_survives_redis(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    import dataclasses
    import time

    import httpx
    import msgspec
    import uvicorn

    from engine_support import LiveServer
    from prefixcache.engine import Engine
    from prefixcache.fleet.wire import BackendInfo, Snapshot
    from prefixcache.server.main import create_app
    from prefixcache.settings import AuthSettings, FleetSettings, Settings
    from standin import STANDIN_ID, standin

    loaded = dataclasses.replace(standin(), context_length=256)
    tiers = (TierConfig(kind="memory", capacity_bytes=16 << 20),)
    cache = PrefixCache(CacheConfig(block_size=16, kv_layout=loaded.kv, tiers=tiers))
    settings = Settings(
        auth=AuthSettings(api_keys=KEYS, admin_key=ADMIN),
        fleet=FleetSettings(publish=True, redis_url=redis_server.url, name="b1", stream_prefix="t"),
    )
    engine = Engine(loaded, STANDIN_ID, cache=cache, max_queue=8, timeout_s=60.0)
    app = create_app(engine, settings, cache)
    live = LiveServer(app, engine, uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    live.start()
    admin, tenant = {"Authorization": f"Bearer {ADMIN}"}, {"Authorization": "Bearer sk-acme-0123456789"}

    def chat(text: str) -> httpx.Response:
        body = {"model": STANDIN_ID, "messages": [{"role": "user", "content": text * 8}], "max_tokens": 1}
        return httpx.post(live.url + "/v1/chat/completions", json=body, headers=tenant, timeout=60)

    def stream() -> list[Entry]:
        return entries(client, "t:events:b1")

    def until(check: Any) -> None:
        deadline = time.monotonic() + 60  # a hang guard
        while not check():
            assert time.monotonic() < deadline
            time.sleep(0.02)

    try:
        for path in ("/fleet/info", "/fleet/snapshot"):
            assert httpx.get(live.url + path).status_code == 401
            assert httpx.get(live.url + path, headers=tenant).status_code == 403
        info = msgspec.json.decode(httpx.get(live.url + "/fleet/info", headers=admin).content, type=BackendInfo)
        # the model as the cache keys it: the served name with the weights' fingerprint
        assert (info.name, info.stream, info.block_size, info.model) == ("b1", "t:events:b1", 16, engine.cache_model)
        assert engine.cache_model == loaded.key(STANDIN_ID) != STANDIN_ID
        assert chat("hello there ").status_code == 200
        until(lambda: any(isinstance(e, BlockStored) for x in stream() for e in x.batch.events))
        assert {x.inc for x in stream()} == {info.inc}

        redis_server.kill()
        assert chat("while redis is down ").status_code == 200  # the server answers: its events ...
        until(lambda: _dropped(live.url, admin) >= 1)  # ... are dropped and counted, off the request's path

        redis_server.start()
        time.sleep(1.1)  # batches within retry_s (1 s) of the failure are dropped untried
        assert chat("and after it came back ").status_code == 200
        until(lambda: bool(stream()))
        assert stream()[0].seq > 2  # a gap: what was dropped is in no entry
        response = httpx.get(live.url + "/fleet/snapshot", headers=admin)
        assert response.headers["content-type"] == "application/vnd.msgpack"
        snap = msgspec.msgpack.decode(response.content, type=Snapshot)
        assert snap.inc == info.inc and snap.seq in {x.seq for x in stream()}
        assert {m for e in snap.events for m in [e.medium]} == {"memory"}
        assert all(e.extra_keys == [("acme", engine.cache_model)] * len(e.block_hashes) for e in snap.events)
    finally:
        live.stop()
        engine.close()
        cache.close()


def _dropped(url: str, admin: dict[str, str]) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=admin).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "prefixcache_fleet_batches_dropped_total":
                return float(sample.value)
    return 0.0


# ====================================================================== settings


def test_the_fleet_section_is_checked_and_names_itself() -> None:
    from prefixcache.settings import load_settings

    settings = load_settings(env={"PREFIXCACHE_FLEET_PUBLISH": "true", "PREFIXCACHE_FLEET_REDIS_URL": "redis://r:1/0"})
    assert settings.fleet.publish and settings.fleet.maxlen == 10_000
    assert settings.fleet_name == "127.0.0.1:8000" and settings.fleet.stream_prefix == "prefixcache:fleet"
    with pytest.raises(ValueError, match=r"fleet\.publish = true needs fleet\.redis_url"):
        load_settings(env={"PREFIXCACHE_FLEET_PUBLISH": "true"})
    with pytest.raises(ValueError, match=r"unknown setting fleet\.url .*valid: publish, redis_url, name"):
        load_settings(overrides={"fleet": {"url": "redis://r"}})
    with pytest.raises(ValueError, match=r"fleet\.redis_url: must be a redis://"):
        load_settings(overrides={"fleet": {"redis_url": "http://r"}})
    with pytest.raises(ValueError, match="needs the cache's events"):
        load_settings(overrides={"fleet": {"publish": True, "redis_url": "redis://r"}, "cache": {"events_capacity": 0}})
