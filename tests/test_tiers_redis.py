"""The Redis tier against a real ``redis-server`` on loopback: bit-exact frames, sharing across
processes with no shared index, namespaces, corruption, and a dead, stalled, flushed or
evicting Redis turned into counted misses (never exceptions out of a read, never wrong bytes)
within bounded time by the circuit breaker."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from prefixcache.storage import codec
from prefixcache.storage.base import TierError, TierFull
from prefixcache.storage.redis import EXISTS_CHUNK, CircuitBreaker, RedisStore
from redis_server import REDIS_SERVER, RedisServer, StallingProxy, free_port
from support import SHAPE, TOKENS, Clock, frame_of, key_of, random_kv

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not Path(REDIS_SERVER).exists(), reason="redis-server is not installed"),
]

BIG = 1 << 30
SEED = "deploy-1"


@pytest.fixture
def clock() -> Clock:
    return Clock()


def store_at(url: str, clock: Clock | None = None, namespace: str = SEED, **kwargs: object) -> RedisStore:
    breaker = CircuitBreaker(clock=clock) if clock is not None else None
    return RedisStore(url, BIG, namespace, breaker=breaker, **kwargs)  # type: ignore[arg-type]


def timed(fn: object, *args: object) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn(*args)  # type: ignore[operator]
    return result, time.perf_counter() - start


# ============================================================================ contract


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_codec_frames_round_trip_bit_exact(redis_server: RedisServer, dtype: str) -> None:
    with store_at(redis_server.url) as store:
        frames = {key_of(i): frame_of(i, dtype) for i in range(6)}
        store.put(key_of(0), frames[key_of(0)])
        store.put_many([(k, memoryview(f)) for k, f in frames.items() if k != key_of(0)])
        out = store.get_many([*frames, key_of(99)])
        assert out[:-1] == list(frames.values())
        assert out[-1] is None
        for key, frame in zip(frames, out, strict=False):
            assert frame is not None
            kv = codec.decode(frame, key=key, tokens=TOKENS, shape=SHAPE, dtype=dtype)
            assert kv.tobytes() == random_kv(dtype, int.from_bytes(key, "little")).tobytes()
        assert (store.stats.hits, store.stats.misses, store.stats.puts) == (6, 1, 6)
        assert len(store) == 6 and store.used_bytes == sum(map(len, frames.values()))
        assert key_of(3) in store and key_of(99) not in store


def test_budget_replace_and_delete(redis_server: RedisServer) -> None:
    size = len(frame_of(0))
    with RedisStore(redis_server.url, 2 * size, SEED) as store:
        store.put(key_of(0), frame_of(0))
        store.put(key_of(0), frame_of(0))  # a replace does not grow the budget
        store.put(key_of(1), frame_of(1))
        with pytest.raises(TierFull):
            store.put(key_of(2), frame_of(2))
        assert key_of(2) not in store and store.used_bytes == 2 * size
        assert store.delete(key_of(0)) and not store.delete(key_of(0))
        store.put(key_of(2), frame_of(2))
        assert len(store) == 2 and store.get_many([key_of(0)]) == [None]


def test_namespace_is_required_and_isolates(redis_server: RedisServer) -> None:
    with pytest.raises(ValueError, match="namespace"):
        RedisStore(redis_server.url, BIG, "")
    with store_at(redis_server.url, namespace="a") as a, store_at(redis_server.url, namespace="b") as b:
        a.put(key_of(1), frame_of(1))
        assert b.get_many([key_of(1)]) == [None] and key_of(1) not in b and b.contains_prefix([key_of(1)]) == 0
        raw = redis.Redis.from_url(redis_server.url)
        assert raw.get(b"a:" + key_of(1)) == frame_of(1) and raw.dbsize() == 1
        raw.close()


WRITER = """
import sys
import numpy as np
from prefixcache.storage import codec
from prefixcache.storage.redis import RedisStore
url, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def key_of(i): return i.to_bytes(16, "little")
def kv(i): return np.frombuffer(np.random.default_rng(i).bytes(2 * 128), dtype="<f2").reshape(2, 2, 1, 4, 8)
tokens = (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + (3).to_bytes(4, "little") + (4).to_bytes(4, "little")
with RedisStore(url, 1 << 30, seed) as store:
    store.put_many([(key_of(i), codec.encode(key_of(i), tokens, kv(i))) for i in range(n)])
    assert len(store) == n
"""


def test_second_process_reads_blocks_with_no_shared_index(redis_server: RedisServer) -> None:
    subprocess.run([sys.executable, "-c", WRITER, redis_server.url, SEED, "5"], check=True, timeout=20)
    chain = [key_of(i) for i in range(8)]  # the writer put the first 5 blocks of this chain
    with store_at(redis_server.url) as store:
        assert len(store) == 0  # nothing local: all it knows is in Redis
        assert store.contains_prefix(chain) == 5
        out = store.get_many(chain[:5])
        assert out == [frame_of(i) for i in range(5)]  # the same bytes this process would have written


def test_contains_prefix_counts_leading_keys_across_chunks_and_stops_at_a_hole(redis_server: RedisServer) -> None:
    n = EXISTS_CHUNK + 20
    frame = frame_of(0)
    with store_at(redis_server.url) as store:
        store.put_many([(key_of(i), frame) for i in range(n)])
        chain = [key_of(i) for i in range(n + 5)]
        assert store.contains_prefix(chain) == n
        assert store.contains_prefix([]) == 0
        # Redis's own eviction knows no chains: a parent may go while its children stay
        redis.Redis.from_url(redis_server.url).delete(f"{SEED}:".encode() + key_of(EXISTS_CHUNK + 3))
        assert store.contains_prefix(chain) == EXISTS_CHUNK + 3
        assert store.contains_prefix(chain[:10]) == 10


def test_corrupt_values_are_counted_misses_and_deleted(redis_server: RedisServer) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    with store_at(redis_server.url) as store:
        store.put_many([(key_of(i), frame_of(i)) for i in range(3)])
        raw.set(f"{SEED}:".encode() + key_of(0), b"garbage")
        raw.set(f"{SEED}:".encode() + key_of(1), frame_of(7))  # a good frame of another block
        flipped = bytearray(frame_of(2))
        flipped[-1] ^= 1
        raw.set(f"{SEED}:".encode() + key_of(2), bytes(flipped))
        assert store.get_many([key_of(i) for i in range(3)]) == [None, None, None]
        assert store.stats.errors["checksum"] == 3 and store.stats.misses == 3
        assert raw.dbsize() == 0 and len(store) == 0 and store.used_bytes == 0
    raw.close()


def test_a_value_longer_than_a_frame_of_the_tier_is_never_read_whole(redis_server: RedisServer) -> None:
    """Whoever writes the Redis may put a huge value under a block's key: the store reads
    one byte past a frame of its layout at most (GETRANGE), and the value is a counted
    miss, deleted (issue #39); an empty value is a plain miss."""
    raw = redis.Redis.from_url(redis_server.url)
    frame = frame_of(0)
    with store_at(redis_server.url, max_frame_bytes=len(frame)) as store:
        raw.set(f"{SEED}:".encode() + key_of(0), frame + b"\0" * (1 << 20))
        raw.set(f"{SEED}:".encode() + key_of(2), b"")
        store.put(key_of(1), frame_of(1))
        assert store.get_many([key_of(0), key_of(1), key_of(2)]) == [None, frame_of(1), None]
        assert store.stats.errors["checksum"] == 1 and store.stats.bytes_read == len(frame)
        assert raw.exists(f"{SEED}:".encode() + key_of(0)) == 0
    raw.close()


# ============================================================================ failures


def test_killed_redis_opens_the_breaker_which_backs_off_and_recovers(
    redis_server: RedisServer, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prefixcache.tiers")
    with store_at(redis_server.url, clock) as store:
        store.put(key_of(1), frame_of(1))
        assert store.get_many([key_of(1)]) == [frame_of(1)]
        redis_server.kill()
        for i in range(3):  # failure_threshold: each call one refused connection, no retry
            assert store.get_many([key_of(1), key_of(2)]) == [None, None]
            assert store.stats.errors["connection"] == i + 1
        assert store.breaker.state == "open"
        assert breaker_events(caplog) == ["event=tier_breaker_open"]  # once, not per call
        (error,) = [r.getMessage() for r in caplog.records if "event=tier_error" in r.getMessage()]  # one a minute
        assert f"store=redis:redis://127.0.0.1:{redis_server.port}/0 kind=connection total=1" in error, error
        # no network while open: a call that tried the dead server would count a connection error
        assert store.get_many([key_of(1)]) == [None] and store.contains_prefix([key_of(1)]) == 0
        assert store.stats.errors["breaker_open"] == 2 and store.stats.errors["connection"] == 3
        with pytest.raises(TierError):
            store.put(key_of(3), frame_of(3))

        clock.now += 1.0  # the backoff passed: one trial, which fails and doubles the backoff
        assert store.get_many([key_of(1)]) == [None]
        assert store.breaker.state == "open" and store.breaker.backoff == 2.0
        assert store.stats.errors["connection"] == 4

        redis_server.start()  # same port, empty (no persistence)
        clock.now += 1.0
        assert store.get_many([key_of(1)]) == [None] and store.breaker.state == "open"  # still backing off
        clock.now += 1.0
        assert store.get_many([key_of(1)]) == [None]  # the trial reaches Redis: a plain miss
        assert store.breaker.state == "closed" and store.breaker.backoff == 1.0
        assert breaker_events(caplog) == ["event=tier_breaker_open", "event=tier_breaker_closed"]
        store.put(key_of(1), frame_of(1))
        assert store.get_many([key_of(1)]) == [frame_of(1)]


def breaker_events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().split()[0] for r in caplog.records if "breaker" in r.getMessage().split()[0]]


def test_the_log_lines_name_the_tier_without_its_credentials(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="prefixcache.tiers")
    store = RedisStore(f"redis://admin:s3cret@127.0.0.1:{free_port()}/2", BIG, "ns")
    assert store.breaker.name.startswith("redis://127.0.0.1:") and store.stats.where.startswith("redis:redis://127.")
    assert store.get_many([key_of(1)]) == [None]
    store.close()
    assert caplog.records and not any("s3cret" in r.getMessage() or "admin" in r.getMessage() for r in caplog.records)


def test_unreachable_at_start_is_misses_not_exceptions() -> None:
    with store_at(f"redis://127.0.0.1:{free_port()}/0") as store:
        assert store.get_many([key_of(1)]) == [None] and store.stats.errors["connection"] == 1  # refused, once
        assert key_of(1) not in store and store.contains_prefix([key_of(1), key_of(2)]) == 0
        with pytest.raises(TierError):
            store.put(key_of(1), frame_of(1))
        assert not store.delete(key_of(1))
        assert store.stats.errors["connection"] == 3 and store.stats.errors["breaker_open"] >= 1


def test_stalled_redis_is_a_miss_at_the_read_deadline(redis_server: RedisServer) -> None:
    proxy = StallingProxy(redis_server.port)
    try:
        with store_at(proxy.url, read_timeout=0.2) as store:
            store.put(key_of(1), frame_of(1))
            assert store.get_many([key_of(1)]) == [frame_of(1)]
            proxy.stall()
            out, elapsed = timed(store.get_many, [key_of(1)])
            assert out == [None] and elapsed > 0.15  # it waited for its read deadline ...
            assert store.stats.errors["timeout"] == 1 and proxy.swallowed == 1  # ... once: the command, no retry
            assert key_of(1) not in store
            assert store.stats.errors["timeout"] == 2 and proxy.swallowed == 2
    finally:
        proxy.stop()


def test_flushall_mid_run_is_misses_and_forgets_the_keys(redis_server: RedisServer) -> None:
    with store_at(redis_server.url) as store:
        store.put_many([(key_of(i), frame_of(i)) for i in range(4)])
        redis.Redis.from_url(redis_server.url).flushall()
        assert store.get_many([key_of(i) for i in range(4)]) == [None] * 4
        assert len(store) == 0 and store.used_bytes == 0 and not store.stats.errors


def test_redis_eviction_under_maxmemory_never_returns_wrong_bytes(tmp_path: Path) -> None:
    # NOTE: 4 MiB, well above an empty Redis's own memory (about 1 MiB), where Redis can
    # still make room: at its own footprint it refuses reads in a MULTI (``_fetch``)
    srv = RedisServer(tmp_path, extra=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")).start()
    try:
        shape = (4, 2, 4, 16, 64)  # 64 KiB of float16 per frame; 200 frames is 12.5 MiB
        frames = {key_of(i): frame_of(i, shape=shape) for i in range(200)}
        with store_at(srv.url) as store:
            items = list(frames.items())
            for start in range(0, len(items), 20):
                store.put_many(items[start : start + 20])
            out = store.get_many(list(frames))
            served = [(key, got) for key, got in zip(frames, out, strict=True) if got is not None]
            assert 0 < len(served) < len(frames)  # Redis evicted some, kept some
            for key, got in served:
                assert got == frames[key]
                codec.decode(got, key=key, tokens=TOKENS, shape=shape, dtype="float16")
            assert len(store) == len(served) and not store.stats.errors
    finally:
        srv.stop()


# ============================================================================ breaker alone


def test_breaker_backoff_doubles_to_the_cap_and_resets_on_success(clock: Clock) -> None:
    breaker = CircuitBreaker(failure_threshold=2, reset_after=1.0, max_backoff=4.0, clock=clock)
    breaker.record_failure()
    assert breaker.allow() and breaker.state == "closed"
    breaker.record_success()  # consecutive failures only
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow()
    for expected in (2.0, 4.0, 4.0):
        clock.now += breaker.backoff
        assert breaker.allow() and breaker.state == "half_open"
        assert not breaker.allow()  # one trial at a time
        breaker.record_failure()
        assert breaker.state == "open" and breaker.backoff == expected
    clock.now += 4.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.backoff == 1.0
    with pytest.raises(ValueError):
        CircuitBreaker(reset_after=0)
