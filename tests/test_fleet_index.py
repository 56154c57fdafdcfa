"""The router's index and the follower of a backend's stream: tenant scoping, shared
tiers, gaps closed by replay or snapshot (a real redis-server for the stream)."""

from __future__ import annotations

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.fleet.follow import Follower, Verdict
from prefixcache.fleet.index import EXPECT_S, GlobalIndex, IndexGap
from prefixcache.fleet.keys import chain_keys, root_key
from prefixcache.fleet.scoring import DEFAULT_CREDIT
from prefixcache.fleet.streams import StreamReader
from prefixcache.fleet.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Entry,
    KVEventBatch,
    Snapshot,
    encode_entry,
)
from redis_server import RedisServer
from support import wait_for

BS = 4
MODEL = "m"


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], ns: str = "acme", medium: str = "memory"):
    return BlockStored(hashes, parent, tokens, BS, None, medium, None, [(ns, MODEL)] * len(hashes))


def chain(ns: str, tokens: list[int]) -> list[bytes]:
    return chain_keys(root_key(ns, MODEL), tokens, BS)


TOKENS = list(range(100, 112))  # three blocks


def test_a_tenant_matches_its_own_and_public_blocks_only() -> None:
    index = GlobalIndex(rank=DEFAULT_CREDIT)
    index.apply("a", stored([b"1", b"2", b"3"], None, TOKENS, ns="acme"), MODEL)
    index.apply("b", stored([b"x"], None, TOKENS[:4], ns=""), MODEL)
    acme = index.matched([chain("acme", TOKENS), chain("", TOKENS)], ["a", "b"])
    assert acme == {"a": ("memory",) * 3, "b": ("memory",)}
    globex = index.matched([chain("globex", TOKENS), chain("", TOKENS)], ["a", "b"])
    assert globex == {"a": (), "b": ("memory",)}  # never acme's private blocks


def test_children_removals_media_and_clears() -> None:
    index = GlobalIndex(rank=DEFAULT_CREDIT)
    index.apply("a", stored([b"1"], None, TOKENS[:4]), MODEL)
    index.apply("a", stored([b"2", b"3"], b"1", TOKENS[4:]), MODEL)
    index.apply("a", stored([b"1"], None, TOKENS[:4], medium="disk"), MODEL)
    keys = [chain("acme", TOKENS)]
    assert index.matched(keys, ["a"])["a"] == ("memory",) * 3
    index.apply("a", BlockRemoved([b"1"], "memory"), MODEL)
    assert index.matched(keys, ["a"])["a"] == ("disk", "memory", "memory")
    index.apply("a", BlockRemoved([b"2"], None), MODEL)
    assert index.matched(keys, ["a"])["a"] == ("disk",)  # contiguous from the first block only
    index.apply("a", AllBlocksCleared(), MODEL)
    assert index.matched(keys, ["a"])["a"] == () and index.held("a") == 0


@pytest.mark.parametrize("shared", ["redis", "s3"])
def test_a_shared_medium_counts_for_every_backend_until_its_holder_leaves(shared: str) -> None:
    index = GlobalIndex(rank=DEFAULT_CREDIT)
    index.apply("a", stored([b"1", b"2"], None, TOKENS[:8], medium=shared), MODEL)
    index.apply("b", stored([b"9"], None, TOKENS[:4], medium="memory"), MODEL)
    got = index.matched([chain("acme", TOKENS)], ["a", "b", "c"])
    assert got == {"a": (shared, shared), "b": ("memory", shared), "c": (shared, shared)}
    index.drop("a")
    assert index.matched([chain("acme", TOKENS)], ["b", "c"]) == {"b": ("memory",), "c": ()}


def test_a_store_under_an_unknown_parent_is_a_gap_and_a_partial_block_is_not_indexed() -> None:
    index = GlobalIndex()
    with pytest.raises(IndexGap):
        index.apply("a", stored([b"2"], b"missing", TOKENS[4:8]), MODEL)
    index.apply("a", stored([b"1", b"t"], None, TOKENS[:6]), MODEL)  # a full block and a 2-token tail
    assert index.stats().blocks == 1
    follower = Follower("a", index, MODEL)
    for bad in (-1, 2**32, 2**64):  # a backend's event the keys cannot hold: a resync, never a crash
        entry = Entry("inc", 1, KVEventBatch(0.0, [stored([b"3"], None, [bad, *TOKENS[1:4]])]))
        follower.inc = "inc"
        assert follower.offer(entry) is Verdict.RESYNC and follower.inc is None
    assert index.stats().blocks == 1


def test_the_follower_applies_in_order_and_reports_gaps_and_incarnations() -> None:
    index = GlobalIndex()
    f = Follower("a", index, MODEL)
    f.load(Snapshot("i1", 0, []))
    batch = KVEventBatch(0.0, [stored([b"1"], None, TOKENS[:4])])
    assert f.offer(Entry("i1", 1, batch)) is Verdict.APPLIED
    assert f.offer(Entry("i1", 1, batch)) is Verdict.OLD
    assert f.offer(Entry("i1", 3, batch)) is Verdict.GAP
    assert f.offer(Entry("i2", 1, batch)) is Verdict.RESYNC
    orphan = KVEventBatch(0.0, [stored([b"5"], b"nope", TOKENS[:4])])
    assert f.offer(Entry("i1", 2, orphan)) is Verdict.RESYNC and not f.synced


# ---------------------------------------------------------------------------- property

EVENT = st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 5), st.sampled_from(["memory", "disk"]))


@settings(max_examples=150, deadline=None)
@given(st.lists(EVENT, max_size=40))
def test_the_index_equals_the_set_of_blocks_its_events_leave(ops: list[tuple[str, int, str]]) -> None:
    """A backend with six one-block chains (one per start token): after any sequence of
    stores and removals per medium, the index matches exactly the chains left held."""
    index = GlobalIndex(rank=DEFAULT_CREDIT)
    held: dict[int, set[str]] = {}
    for op, i, medium in ops:
        if op == "store":
            index.apply("a", stored([b"%d" % i], None, [i] * BS, medium=medium), MODEL)
            held.setdefault(i, set()).add(medium)
        elif op == "remove":
            index.apply("a", BlockRemoved([b"%d" % i], medium), MODEL)
            held.get(i, set()).discard(medium)
        else:
            index.apply("a", AllBlocksCleared(), MODEL)
            held.clear()
    for i in range(6):
        want = ("memory",) if "memory" in held.get(i, ()) else ("disk",) if held.get(i) else ()
        assert index.matched([chain("acme", [i] * BS)], ["a"])["a"] == want


# ---------------------------------------------------------------------------- stream


class FakeBackend:
    """A publisher without a cache: numbered batches of one-block chains on a stream,
    and a snapshot of what it published."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self.client, self.stream, self.inc, self.seq = client, stream, "inc-1", 0
        self.blocks: dict[bytes, BlockStored] = {}
        self.snapshots = 0

    def store(self, i: int, send: bool = True) -> None:
        event = stored([b"%d" % i], None, [i] * BS)
        self.blocks[b"%d" % i] = event
        self.seq += 1
        if send:
            self.client.xadd(self.stream, encode_entry(Entry(self.inc, self.seq, KVEventBatch(0.0, [event]))))

    def snapshot(self) -> Snapshot:
        self.snapshots += 1
        return Snapshot(self.inc, self.seq, list(self.blocks.values()))


def held_by(index: GlobalIndex, i: int) -> bool:
    return index.matched([chain("acme", [i] * BS)], ["a"])["a"] != ()


def test_lost_events_are_replayed_from_the_stream_then_from_a_snapshot(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    backend, index = FakeBackend(client, "s:a"), GlobalIndex()
    follower = Follower("a", index, MODEL)
    reader = StreamReader(follower, client, "s:a", backend.snapshot).start()
    try:
        backend.store(0)
        wait_for(lambda: held_by(index, 0))
        assert backend.snapshots == 1  # the start
        reader.lose_next(2)  # read and lost on the way: still in the stream
        for i in (1, 2, 3):
            backend.store(i)
        # the replay counts itself once it has read to the end of the stream, after
        # the blocks are in the index: wait for both, then check nothing else happened
        wait_for(lambda: all(held_by(index, i) for i in (1, 2, 3)) and follower.stats.replays == 1)
        assert follower.stats.replays == 1 and backend.snapshots == 1
        backend.store(4, send=False)  # never reached the stream (Redis was down)
        backend.store(5)
        wait_for(lambda: all(held_by(index, i) for i in range(6)) and follower.seq == 6)
        assert backend.snapshots == 2 and follower.seq == backend.seq == 6
    finally:
        reader.stop()


def test_an_expectation_stands_in_for_late_events_until_it_expires() -> None:
    now = [0.0]
    index = GlobalIndex(rank=DEFAULT_CREDIT, clock=lambda: now[0])
    keys = chain("acme", TOKENS)
    index.expect("a", keys)
    assert index.matched([keys], ["a", "b"]) == {"a": ("expected",) * 3, "b": ()}
    index.apply("a", stored([b"1"], None, TOKENS[:4]), MODEL)  # the events arrive: they win on rank
    assert index.matched([keys], ["a"])["a"] == ("memory", "expected", "expected")
    now[0] = EXPECT_S + 1
    assert index.matched([keys], ["a"])["a"] == ("memory",)
    index.expect("b", keys[:1])  # a later decision sweeps the expired ones
    assert index.matched([keys], ["a", "b"]) == {"a": ("memory",), "b": ("expected",)}


def test_an_object_store_tier_is_credited_below_redis() -> None:
    assert 0 < DEFAULT_CREDIT["s3"] < DEFAULT_CREDIT["redis"]
