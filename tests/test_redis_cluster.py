"""Redis Cluster as the shared tier, against a real cluster of 3 masters on loopback
(tests/redis_cluster.py): blocks shared across processes and spread over every node,
each block's keys on one slot, reads split per node in a bounded number of round trips,
and a dead, restarted or flushed node a shorter match with the exact bytes, never a
wrong one, with the breaker of that node alone open."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from prefixcache.cache import PrefixCache
from prefixcache.config import TierConfig
from prefixcache.settings import load_settings
from prefixcache.storage.base import TierError
from prefixcache.storage.redis_cluster import REFRESH_EVERY_S, RedisClusterStore
from redis_cluster import LocalCluster, command
from redis_server import RedisServer, free_port
from support import Clock, frame_of, key_of
from test_cache_tiers import check_tiers, fetch, mem
from tier_worker import BLOCK, CTX, SEED, cache_with, prompt, store

HERE = Path(__file__).resolve().parent
BIG = 1 << 30
PROMPT_BLOCKS = 6


def cluster_tier(url: str, **kwargs: object) -> TierConfig:
    return TierConfig(kind="redis", capacity_bytes=BIG, url=url, cluster=True, **kwargs)  # type: ignore[arg-type]


def cluster_cache(cluster: LocalCluster, mem_blocks: int = 64) -> PrefixCache:
    """Host RAM written through to the cluster (as a fleet's servers run)."""
    return cache_with(mem(mem_blocks, write="through"), cluster_tier(cluster.url))


def block_keys(cache: PrefixCache, tokens: list[int]) -> tuple[bytes, ...]:
    with cache.match(tokens, CTX) as m:
        return m.block_keys


def cluster_store(cache: PrefixCache) -> RedisClusterStore:
    books = cache._ledger.books
    assert books is not None
    found = books.tiers[-1].store
    assert isinstance(found, RedisClusterStore)
    return found


def keys_on(node: RedisServer) -> list[bytes]:
    client = redis.Redis(port=node.port)
    try:
        return list(client.scan_iter(count=1000))
    finally:
        client.close()


# ============================================================================ sharing


WRITER = """
import sys
from prefixcache.config import TierConfig
from tier_worker import cache_with, store
url, n = sys.argv[1], int(sys.argv[2])
big = 1 << 30
tiers = (TierConfig(kind="memory", capacity_bytes=big, write="through"),
         TierConfig(kind="redis", capacity_bytes=big, url=url, cluster=True))
with cache_with(*tiers) as cache:
    for i in range(n):
        store(cache, [1, 2, 3, 4] + [1000 * (i + 1) + j for j in range(20)])
"""


def test_a_second_process_finds_the_blocks_spread_over_every_node(redis_cluster: LocalCluster) -> None:
    subprocess.run([sys.executable, "-c", WRITER, redis_cluster.url, "6"], check=True, timeout=60, cwd=HERE)
    with cluster_cache(redis_cluster) as cache:
        assert len(cache) == 0  # nothing local: all it knows is in the cluster
        for i in range(6):
            cached, loaded, per_tier = fetch(cache, prompt(i))  # bit-exact, checked in fetch
            shared = 0 if i == 0 else BLOCK  # the first block, promoted to memory by prompt 0's load
            assert cached == loaded == 24 and per_tier == {"memory": shared, "redis": 24 - shared}
        assert fetch(cache, prompt(9))[:2] == (4, 4)  # the shared first block only
        check_tiers(cache)
    per_node = [keys_on(node) for node in redis_cluster.nodes]
    assert all(per_node) and sum(map(len, per_node)) == 1 + 6 * (PROMPT_BLOCKS - 1)  # every node holds some


def test_each_block_key_is_tagged_and_lives_on_the_node_of_its_slot(redis_cluster: LocalCluster) -> None:
    with cluster_cache(redis_cluster) as cache:
        for i in range(4):
            store(cache, prompt(i))
        keys = {k for i in range(4) for k in block_keys(cache, prompt(i))}
        rstore = cluster_store(cache)
    prefix = f"{SEED}:".encode()
    expected = {prefix + b"{" + key.hex().encode() + b"}": key for key in keys}
    seen = set()
    for node in redis_cluster.nodes:
        for rkey in keys_on(node):
            key = expected[rkey]  # every Redis key belongs to a block, tagged by the block key
            slot = int(command(node.port, "CLUSTER", "KEYSLOT", rkey.decode()))
            assert slot == key_slot(key.hex().encode()) == rstore.slot_of(key)  # the tag alone places it
            assert redis_cluster.owner(slot) is node
            seen.add(key)
    assert seen == keys
    # a part of a block would share the slot: the tag is the same whatever follows it
    assert key_slot(prefix + b"{" + next(iter(keys)).hex().encode() + b"}:meta") == rstore.slot_of(next(iter(keys)))


def test_a_read_of_many_blocks_is_one_pipeline_per_node(
    redis_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    with RedisClusterStore(redis_cluster.url, BIG, SEED) as rstore:
        rstore.put_many([(key_of(i), frame_of(i)) for i in range(60)])
        calls: list[int] = []
        execute = redis.client.Pipeline.execute

        def counted(self: redis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
            calls.append(len(self.command_stack))
            return execute(self, raise_on_error)

        monkeypatch.setattr(redis.client.Pipeline, "execute", counted)
        keys = [key_of(i) for i in range(64)]
        assert rstore.get_many(keys) == [frame_of(i) for i in range(60)] + [None] * 4
        assert len(calls) == 3 and sum(calls) == 64  # a round trip per master, all keys asked
        calls.clear()
        assert rstore.contains_prefix(keys) == 60
        assert len(calls) == 3


# ============================================================================ a node down


def doomed_node(cluster: LocalCluster, rstore: RedisClusterStore, chains: list[tuple[bytes, ...]]) -> RedisServer:
    """A master that does not hold the shared first block but holds a later block of some chain."""
    first = cluster.owner(rstore.slot_of(chains[0][0]))
    later = {cluster.owner(rstore.slot_of(k)).port for chain in chains for k in chain[1:]}
    return next(node for node in cluster.nodes if node is not first and node.port in later)


def expected_tokens(
    cluster: LocalCluster, rstore: RedisClusterStore, chain: tuple[bytes, ...], dead: RedisServer
) -> int:
    for i, key in enumerate(chain):
        if cluster.owner(rstore.slot_of(key)) is dead:
            return i * BLOCK
    return len(chain) * BLOCK


def test_a_dead_master_is_a_shorter_exact_match_and_the_others_still_serve(redis_cluster: LocalCluster) -> None:
    prompts = [prompt(i) for i in range(6)]
    with cluster_cache(redis_cluster, mem_blocks=2) as writer:  # prompts end up in the cluster only
        for tokens in prompts:
            store(writer, tokens)
        chains = [block_keys(writer, tokens) for tokens in prompts]
        rstore = cluster_store(writer)
        dead = doomed_node(redis_cluster, rstore, chains)
        want = [expected_tokens(redis_cluster, rstore, chain, dead) for chain in chains]
        assert any(0 < n < 24 for n in want)
        dead.kill()

        # the process that wrote them: its tree says 24, the load stops at the dead node's block,
        # having asked the dead node no more than its breaker allows (refused connections,
        # counted, then none: no fetch waits on it)
        for tokens, n in zip(prompts, want, strict=True):
            refused = rstore.stats.errors["connection"]
            cached, loaded, _ = fetch(writer, tokens)
            assert rstore.stats.errors["connection"] - refused <= rstore.breaker.failure_threshold
            assert cached == 24 and loaded >= n  # its 2 memory blocks may add a little
        for _ in range(3):  # failure_threshold reads that reach the dead node
            rstore.get_many([k for chain in chains for k in chain])
        breakers = {name: b.state for name, b in rstore.node_breakers().items()}
        assert breakers.pop(f"127.0.0.1:{dead.port}") == "open" and set(breakers.values()) == {"closed"}
        assert len(breakers) == 2 and rstore.breaker.state == "closed"  # the slot map's breaker too

    # a fresh process: the membership test stops at the hole, and what it loads is exact
    redis_cluster.wait_failed(dead)  # the others have marked it failed: they still serve their slots
    with cluster_cache(redis_cluster) as reader:
        for tokens, n in zip(prompts, want, strict=True):
            assert fetch(reader, tokens)[:2] == (n, n)
        rstore = cluster_store(reader)

        def owner(key: bytes) -> RedisServer:
            return redis_cluster.owner(rstore.slot_of(key))

        # NOTE: the blocks after a hole may be gone from the live nodes too: the writer,
        # finding a block lost, dropped its descendants (no orphans, invariant 4)
        for chain, n in zip(chains, want, strict=True):
            frames = rstore.get_many(list(chain))
            assert all(frame is not None for frame in frames[: n // BLOCK])
            assert all(frame is None for key, frame in zip(chain, frames, strict=True) if owner(key) is dead)
        assert rstore.stats.errors["connection"] >= 1 and not rstore.stats.errors["checksum"]
        # writes go on: the live nodes take their blocks, the dead node's are dropped and counted
        errors = sum(rstore.stats.errors.values())
        store(reader, prompt(20))
        chain = block_keys(reader, prompt(20))
        assert (sum(rstore.stats.errors.values()) > errors) == any(owner(k) is dead for k in chain)
    with cluster_cache(redis_cluster) as third:
        n = expected_tokens(redis_cluster, rstore, chain, dead)
        assert fetch(third, prompt(20))[:2] == (n, n)


def test_a_killed_node_restarted_empty_is_misses_then_serves_again(redis_cluster: LocalCluster) -> None:
    clock = Clock()
    keys = [key_of(i) for i in range(30)]
    with RedisClusterStore(redis_cluster.url, BIG, SEED, clock=clock) as rstore:
        rstore.put_many([(k, frame_of(i)) for i, k in enumerate(keys)])
        dead = redis_cluster.owner(rstore.slot_of(keys[0]))
        on_dead = [redis_cluster.owner(rstore.slot_of(k)) is dead for k in keys]
        dead.kill()
        for _ in range(3):  # failure_threshold: then the breaker of that node opens
            out = rstore.get_many(keys)
            assert [f is None for f in out] == on_dead
            assert all(f == frame_of(i) for i, f in enumerate(out) if f is not None)
        name = f"127.0.0.1:{dead.port}"
        assert rstore.node_breakers()[name].state == "open" and rstore.stats.errors["connection"] == 3
        # no network to it: a call that tried the dead node would count a connection error
        assert rstore.contains_prefix(keys) == 0 and rstore.stats.errors["connection"] == 3
        with pytest.raises(TierError):
            rstore.put(keys[0], frame_of(0))
        rstore.put(keys[on_dead.index(False)], frame_of(on_dead.index(False)))  # the others take writes

        redis_cluster.revive()  # same port, same slots, no data
        clock.now += 1.0 + REFRESH_EVERY_S  # the backoff passed: the trial reaches the node
        out = rstore.get_many(keys)
        assert [f is None for f in out] == on_dead  # restarted empty: misses, never stale bytes
        assert rstore.node_breakers()[name].state == "closed"
        rstore.put_many([(k, frame_of(i)) for i, k in enumerate(keys)])
        assert rstore.get_many(keys) == [frame_of(i) for i in range(30)]


def test_a_stalled_node_is_misses_at_the_read_deadline_and_the_others_hit(redis_cluster: LocalCluster) -> None:
    keys = [key_of(i) for i in range(30)]
    with RedisClusterStore(redis_cluster.url, BIG, SEED, read_timeout=0.2) as rstore:
        rstore.put_many([(k, frame_of(i)) for i, k in enumerate(keys)])
        stalled = redis_cluster.owner(rstore.slot_of(keys[0]))
        on_stalled = [redis_cluster.owner(rstore.slot_of(k)) is stalled for k in keys]
        stalled.pause()  # SIGSTOP: its sockets stay open and nothing answers
        started = time.monotonic()
        out = rstore.get_many(keys)
        assert time.monotonic() - started > 0.15  # it waited for the read deadline ...
        assert out == [None if gone else frame_of(i) for i, gone in enumerate(on_stalled)]
        assert rstore.stats.errors["timeout"] == 1  # ... once, not once per key


def test_flushall_on_every_node_is_misses_never_wrong_bytes(redis_cluster: LocalCluster) -> None:
    with cluster_cache(redis_cluster, mem_blocks=2) as cache:
        store(cache, prompt(1))
        store(cache, prompt(2))
        redis_cluster.flushall()
        cached, loaded, _ = fetch(cache, prompt(1))
        assert cached == 24 and loaded == 4
        assert cache.stats().tiers[1].errors["missing"] >= 1
        check_tiers(cache, reachable=False)


def test_a_wrong_or_damaged_frame_is_a_counted_miss_and_deleted(redis_cluster: LocalCluster) -> None:
    with RedisClusterStore(redis_cluster.url, BIG, SEED) as rstore:
        rstore.put_many([(key_of(i), frame_of(i)) for i in range(3)])
        raw = redis.cluster.RedisCluster.from_url(redis_cluster.url)
        try:
            raw.set(rstore._rkey(key_of(0)), b"garbage")
            raw.set(rstore._rkey(key_of(1)), frame_of(7))  # a good frame of another block
            assert rstore.get_many([key_of(i) for i in range(3)]) == [None, None, frame_of(2)]
            assert rstore.stats.errors["checksum"] == 2
            assert raw.exists(rstore._rkey(key_of(0)), rstore._rkey(key_of(1))) == 0  # deleted
        finally:
            raw.close()


def test_moved_slots_ask_for_a_new_map_and_never_serve_wrong_bytes(redis_cluster: LocalCluster) -> None:
    clock = Clock()
    with RedisClusterStore(redis_cluster.url, BIG, SEED, clock=clock) as rstore:
        key = key_of(1)
        rstore.put(key, frame_of(1))
        slot = rstore.slot_of(key)
        old = redis_cluster.owner(slot)
        new = next(node for node in redis_cluster.nodes if node is not old)
        command(old.port, "DEL", rstore._rkey(key).decode())  # a slot moves empty (no migration here)
        new_id = command(new.port, "CLUSTER", "MYID")
        for node in (new, old, *[n for n in redis_cluster.nodes if n not in (new, old)]):
            assert command(node.port, "CLUSTER", "SETSLOT", str(slot), "NODE", new_id) == "OK"
        assert rstore.get_many([key]) == [None]  # MOVED: a counted miss
        assert rstore.stats.errors["redis"] == 1
        clock.now += REFRESH_EVERY_S
        rstore.put(key, frame_of(1))  # the new map sends it to the new owner
        assert rstore.get_many([key]) == [frame_of(1)]
        assert redis.Redis(port=new.port).exists(rstore._rkey(key)) == 1


# ============================================================================ configuration


def test_unreachable_at_start_is_misses_not_exceptions() -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    with RedisClusterStore(url, BIG, SEED, startup_nodes=[f"127.0.0.1:{free_port()}"]) as rstore:
        assert rstore.get_many([key_of(1)]) == [None] and rstore.contains_prefix([key_of(1)]) == 0
        with pytest.raises(TierError):
            rstore.put(key_of(1), frame_of(1))
        assert rstore.stats.errors["connection"] == 3 and rstore.breaker.state == "open"  # one refusal a call


def test_startup_nodes_find_the_cluster_when_the_url_node_is_down(redis_cluster: LocalCluster) -> None:
    down = f"redis://127.0.0.1:{free_port()}"
    with RedisClusterStore(down, BIG, SEED, startup_nodes=[f"127.0.0.1:{redis_cluster.ports[1]}"]) as rstore:
        rstore.put(key_of(1), frame_of(1))
        assert rstore.get_many([key_of(1)]) == [frame_of(1)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "memory", "cluster": True}, "redis tier only"),
        ({"cluster": "yes"}, "true or false"),
        ({"startup_nodes": ("127.0.0.1:7001",)}, "cluster = true only"),
        ({"cluster": True, "url": "redis://127.0.0.1:7000/3"}, "database 0 only"),
        ({"cluster": True, "url": "unix:///tmp/redis.sock"}, "redis://host:port"),
        ({"cluster": True, "startup_nodes": ("127.0.0.1",)}, "'host:port'"),
        ({"cluster": True, "namespace": "team{a}"}, "may not hold"),
    ],
)
def test_a_bad_cluster_configuration_is_a_clear_error(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"kind": "redis", "capacity_bytes": BIG, "url": "redis://127.0.0.1:7000"}
    with pytest.raises(ValueError, match=message):
        TierConfig(**{**base, **fields})  # type: ignore[arg-type]


def test_the_cluster_tier_comes_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "prefixcache.toml"
    path.write_text(
        '[[cache.tiers]]\nkind = "memory"\ncapacity_bytes = 1073741824\nwrite = "through"\n\n'
        '[[cache.tiers]]\nkind = "redis"\ncapacity_bytes = 1073741824\nurl = "redis://10.0.0.1:7000"\n'
        'cluster = true\nstartup_nodes = ["10.0.0.2:7000", "10.0.0.3:7000"]\n'
    )
    tier = load_settings(path, env={}).cache.tiers[1]
    assert tier.cluster and tier.startup_nodes == ("10.0.0.2:7000", "10.0.0.3:7000")
    path.write_text(path.read_text().replace('"10.0.0.3:7000"', '"10.0.0.3"'))
    with pytest.raises(ValueError, match="host:port"):
        load_settings(path, env={})
