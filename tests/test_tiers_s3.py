"""The object-store tier against a real S3 API server (moto in server mode, a subprocess on
loopback) through the same client code a user runs against AWS: bit-exact frames under the
documented key layout, two processes sharing a bucket with no shared index, objects that
are not frames, the server killed, slowed or refusing, bad credentials and missing buckets
refused at start, and the cache's own deletes (TTL, epoch, purge) reaching the bucket.

One server per module (it takes a second to start); each test gets it reset, with an
empty bucket, and restarted if a test killed it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guard_store import guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache.cache import PrefixCache
from prefixcache.cache.contexts import generation_name
from prefixcache.cache.epochbook import record_name
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.storage import codec
from prefixcache.storage.base import TierError, TierFull
from prefixcache.storage.breaker import CircuitBreaker
from prefixcache.storage.s3 import S3StartError, S3Store
from redis_server import free_port
from s3_server import ENV, HAS_MOTO, DelayingProxy, MotoServer
from support import SHAPE, TOKENS, Clock, frame_of, key_of, random_kv, wait_for
from tier_worker import BLOCK, CTX, S3_BUCKET, S3_PREFIX, SEED, cache_with, kv_for, layout, prompt, s3_tier, store

pytestmark = [pytest.mark.s3, pytest.mark.skipif(not HAS_MOTO, reason="moto[server] is not installed")]

HERE = Path(__file__).resolve().parent
BIG = 1 << 30


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """moto's test credentials, and no profile or config file of the machine's."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))


@pytest.fixture(scope="module")
def _server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    srv = MotoServer(tmp_path_factory.mktemp("moto"))
    with pytest.MonkeyPatch.context() as env:
        for name, value in ENV.items():
            env.setenv(name, value)
        srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def s3(_server: MotoServer) -> MotoServer:
    """The module's server, up, reset, with an empty bucket ``S3_BUCKET``."""
    if _server.proc is None or _server.proc.poll() is not None:
        _server.start()
    _server.reset()
    _endpoint[0] = _server.endpoint
    client().create_bucket(Bucket=S3_BUCKET)
    return _server


_endpoint = [""]  # the module's server, for ``client()`` (one server per module)


def client(endpoint: str | None = None) -> Any:
    """A plain boto3 client: the operator's view of the bucket, apart from the tier's code."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint or _endpoint[0], region_name="us-east-1")


def objects(prefix: str = "") -> dict[str, bytes]:
    """Every object of the bucket under ``prefix``: key -> bytes (listed, as an operator would)."""
    c = client()
    listed = c.list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"]: c.get_object(Bucket=S3_BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def path_of(key: bytes, namespace: str = SEED) -> str:
    return f"{S3_PREFIX}/{namespace}/{key.hex()}"


def store_at(endpoint: str, namespace: str = SEED, **kwargs: Any) -> S3Store:
    kwargs.setdefault("read_timeout", 3.0)
    return S3Store(S3_BUCKET, kwargs.pop("capacity", BIG), namespace, prefix=S3_PREFIX, endpoint=endpoint, **kwargs)


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start


# ============================================================================ the store


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_frames_round_trip_bit_exact_under_the_documented_key_layout(s3: MotoServer, dtype: str) -> None:
    frames = {key_of(i): frame_of(i, dtype) for i in range(6)}
    with store_at(s3.endpoint) as st:
        for key, frame in frames.items():
            st.put(key, memoryview(frame))
        out = st.get_many([*frames, key_of(99)])
        assert [bytes(f) if f is not None else None for f in out] == [*frames.values(), None]
        for key, frame in zip(frames, out, strict=False):
            assert frame is not None
            kv = codec.decode(frame, key=key, tokens=TOKENS, shape=SHAPE, dtype=dtype)
            assert kv.tobytes() == random_kv(dtype, int.from_bytes(key, "little")).tobytes()
        assert (st.stats.hits, st.stats.misses, st.stats.puts) == (6, 1, 6)
        assert len(st) == 6 and st.used_bytes == sum(map(len, frames.values()))
    assert objects() == {path_of(k): f for k, f in frames.items()}  # <prefix>/<namespace>/<key hex>


def test_budget_replace_and_delete_really_delete_the_object(s3: MotoServer) -> None:
    size = len(frame_of(0))
    with store_at(s3.endpoint, capacity=2 * size) as st:
        st.put(key_of(0), frame_of(0))
        st.put(key_of(0), frame_of(0))  # a replace does not grow the budget
        st.put(key_of(1), frame_of(1))
        with pytest.raises(TierFull):
            st.put(key_of(2), frame_of(2))
        assert set(objects()) == {path_of(key_of(0)), path_of(key_of(1))}
        assert st.delete(key_of(0)) and st.stats.deletes == 1
        assert set(objects()) == {path_of(key_of(1))} and st.used_bytes == size
        st.put(key_of(2), frame_of(2))
        assert st.get_many([key_of(0)]) == [None] and len(st) == 2


def test_namespaces_isolate_and_a_second_process_finds_the_blocks(s3: MotoServer) -> None:
    with store_at(s3.endpoint, namespace="a") as a:
        a.put(key_of(1), frame_of(1))
    with store_at(s3.endpoint, namespace="b") as b, store_at(s3.endpoint, namespace="a") as again:
        assert b.get_many([key_of(1)]) == [None] and b.contains_prefix([key_of(1)]) == 0
        assert len(again) == 0 and again.contains_prefix([key_of(1), key_of(2)]) == 1  # nothing local, all in S3
        assert [bytes(f) for f in again.get_many([key_of(1)]) if f is not None] == [frame_of(1)]


def test_contains_prefix_probes_in_chunks_and_stops_at_a_hole(s3: MotoServer) -> None:
    with store_at(s3.endpoint, concurrency=4) as st:
        for i in range(10):
            st.put(key_of(i), frame_of(0))
        chain = [key_of(i) for i in range(14)]
        assert st.contains_prefix(chain) == 10 and st.contains_prefix([]) == 0
        client().delete_object(Bucket=S3_BUCKET, Key=path_of(key_of(6)))  # behind the store's back
        assert st.contains_prefix(chain) == 6 and key_of(6) not in st and key_of(7) in st
        assert st.get_many([key_of(6)]) == [None] and len(st) == 9


def test_objects_that_are_not_this_blocks_frame_are_counted_misses_and_deleted(s3: MotoServer) -> None:
    flipped = bytearray(frame_of(2))
    flipped[-1] ^= 1
    bad = {0: b"not a frame", 1: frame_of(7), 2: bytes(flipped), 3: frame_of(3)[:-5]}  # truncated last
    with store_at(s3.endpoint) as st:
        for i, body in bad.items():
            client().put_object(Bucket=S3_BUCKET, Key=path_of(key_of(i)), Body=body)
        assert st.get_many([key_of(i) for i in bad]) == [None] * 4
        assert st.stats.errors["checksum"] == 4 and st.stats.misses == 4 and st.stats.deletes == 4
    assert objects() == {}


def test_an_object_longer_than_a_frame_of_the_tier_is_never_read_whole(s3: MotoServer) -> None:
    """Whoever writes the bucket may put a huge object under a block's name: the store
    reads no more than a frame of its layout (the object's size, before its body), and
    the object is a counted miss, deleted (issue #39)."""
    frame = frame_of(0)
    with store_at(s3.endpoint, max_frame_bytes=len(frame)) as st:
        client().put_object(Bucket=S3_BUCKET, Key=path_of(key_of(0)), Body=frame + b"\0" * (1 << 20))
        st.put(key_of(1), frame_of(1))
        assert st.get_many([key_of(0), key_of(1)]) == [None, frame_of(1)]
        assert st.stats.errors["checksum"] == 1 and st.stats.bytes_read == len(frame)
    assert list(objects()) == [path_of(key_of(1))]
    with pytest.raises(ValueError, match="max_frame_bytes"):
        store_at(s3.endpoint, max_frame_bytes=0)


# ============================================================================ start-up


def test_a_missing_bucket_or_refusing_endpoint_is_a_clear_error_at_start(s3: MotoServer) -> None:
    with pytest.raises(S3StartError, match=r"bucket 'no-such-bucket' at http://127\.0\.0\.1:\d+: NoSuchBucket"):
        S3Store("no-such-bucket", BIG, SEED, endpoint=s3.endpoint)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(S3StartError, match=f"at {dead}: unreachable") as refused:
        S3Store(S3_BUCKET, BIG, SEED, endpoint=dead)  # refused: said at once, no retry (the client has none)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, TierError)


def test_missing_credentials_or_profile_are_clear_errors_at_start(
    s3: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(S3StartError, match="ProfileNotFound"):
        S3Store(S3_BUCKET, BIG, SEED, endpoint=s3.endpoint, profile="nobody")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask on this machine
    with pytest.raises(S3StartError, match="no AWS credentials found"):
        S3Store(S3_BUCKET, BIG, SEED, endpoint=s3.endpoint)


def test_bad_credentials_are_refused_at_start_without_showing_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    guarded = MotoServer(tmp_path, auth_after=1).start()  # moto checks every call after the first
    try:
        client(guarded.endpoint).create_bucket(Bucket=S3_BUCKET)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY00000000")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-1234")
        with pytest.raises(S3StartError, match="InvalidAccessKeyId; the credentials were refused") as refused:
            S3Store(S3_BUCKET, BIG, SEED, endpoint=guarded.endpoint)
        said = str(refused.value) + caplog.text
        assert "AKIAWRONGKEY" not in said and "wrong-secret" not in said and S3_BUCKET in said
    finally:
        guarded.stop()


# ============================================================================ failures


def test_a_killed_server_opens_the_breaker_and_reads_become_immediate_misses(
    s3: MotoServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prefixcache.tiers")
    clock = Clock()
    with store_at(s3.endpoint, breaker=CircuitBreaker(clock=clock), concurrency=1) as st:
        st.put(key_of(1), frame_of(1))
        s3.kill()
        for i in range(3):  # each read one refused connection, no retry
            assert st.get_many([key_of(1)]) == [None] and st.stats.errors["connection"] == i + 1
        assert st.breaker.state == "open"
        # immediate misses: a read that tried the dead server would count a connection error
        assert st.get_many([key_of(i) for i in range(8)]) == [None] * 8
        assert st.stats.errors["breaker_open"] == 8 and st.stats.errors["connection"] == 3
        with pytest.raises(TierError):
            st.put(key_of(2), frame_of(2))
    assert "testing" not in caplog.text  # the log names the bucket and endpoint, never a credential


def test_a_slow_endpoint_read_is_abandoned_at_its_deadline(s3: MotoServer) -> None:
    proxy = DelayingProxy(s3.port)
    try:
        with store_at(proxy.endpoint, read_timeout=0.3, connect_timeout=0.2) as st:
            st.put(key_of(1), frame_of(1))
            proxy.hold()  # the reply never comes: only the deadline ends the read
            out, elapsed = timed(st.get_many, [key_of(1)])
            assert out == [None] and elapsed > 0.25 and st.stats.errors["timeout"] == 1
    finally:
        proxy.stop()


# ============================================================================ through the cache


def s3_cache(endpoint: str, mem_blocks: int = 2, **kwargs: Any) -> PrefixCache:
    from tier_worker import frame_bytes

    memory = TierConfig(kind="memory", capacity_bytes=mem_blocks * frame_bytes(), write="through")
    writer = kwargs.pop("writer", "inline")
    return cache_with(memory, s3_tier(endpoint, **kwargs), writer=writer)


def fetch(cache: PrefixCache, tokens: list[int]) -> tuple[int, int, dict[str, int]]:
    """match + load + release; what was loaded must be the exact KV of the prefix."""
    with cache.match(tokens, CTX) as m:
        loaded = cache.load(m)
        want = kv_for(tokens)[:, :, :, : loaded.tokens, :]
        assert np.array_equal(loaded.kv.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))
        return m.cached_tokens, loaded.tokens, loaded.tier_tokens


def test_a_cache_round_trip_through_s3_is_bit_exact(s3: MotoServer) -> None:
    with s3_cache(s3.endpoint) as cache:
        for i in range(3):
            store(cache, prompt(i))
        cached, loaded, per_tier = fetch(cache, prompt(0))  # memory holds 2 blocks: the rest is in S3
        assert cached == loaded == 24 and per_tier["s3"] >= 16
        assert cache.stats().tiers[1].kind == "s3"
    assert len(objects(f"{S3_PREFIX}/{SEED}/")) == 16  # 1 shared + 3 x 5 blocks


def test_an_int8_s3_tier_loads_exactly_what_its_objects_decode_to(s3: MotoServer) -> None:
    with s3_cache(s3.endpoint, mem_blocks=0, codec="int8") as cache:
        tokens = prompt(1)
        store(cache, tokens)
        with cache.match(tokens, CTX) as m:
            loaded = cache.load(m)
            assert loaded.tokens == 24 and loaded.tier_tokens == {"memory": 0, "s3": 24}
            kv = loaded.kv.copy()
    stored = objects()
    assert len(stored) == 6 and all(codec.peek_header(f).codec == "int8" for f in stored.values())
    decoded = [codec.decode(f, key=bytes.fromhex(k.rsplit("/", 1)[1])) for k, f in stored.items()]
    assert sorted(d.tobytes() for d in decoded) == sorted(
        np.ascontiguousarray(kv[:, :, :, b * BLOCK : (b + 1) * BLOCK, :]).tobytes() for b in range(6)
    )
    assert np.abs(kv.astype(np.float32) - kv_for(tokens)).max() < 2.0  # lossy: within int8's step of these values


def test_two_processes_share_one_bucket_with_no_shared_index(s3: MotoServer) -> None:
    worker = [sys.executable, str(HERE / "tier_worker.py"), "s3", s3.endpoint, "3"]
    subprocess.run(worker, check=True, timeout=60, cwd=HERE)
    with s3_cache(s3.endpoint, 64) as cache:
        assert len(cache) == 0
        assert fetch(cache, prompt(2)) == (24, 24, {"memory": 0, "s3": 24})  # probed, adopted, loaded
        assert fetch(cache, prompt(2))[2] == {"memory": 24, "s3": 0}  # promoted
        assert fetch(cache, prompt(9))[:2] == (4, 4)  # the shared first block only


def test_objects_deleted_behind_the_cache_are_a_miss(s3: MotoServer) -> None:
    with s3_cache(s3.endpoint) as cache:
        store(cache, prompt(1))
        store(cache, prompt(2))  # prompt 1's blocks beyond the shared one now live in S3 only
        for key in list(objects()):
            client().delete_object(Bucket=S3_BUCKET, Key=key)
        cached, loaded, _ = fetch(cache, prompt(1))
        assert cached == 24 and loaded < 24
        assert cache.stats().tiers[1].errors["missing"] >= 1


def test_the_server_killed_before_and_during_reads_is_a_shorter_hit_never_wrong_bytes(s3: MotoServer) -> None:
    proxy = DelayingProxy(s3.port)
    try:
        with s3_cache(proxy.endpoint, read_timeout=1.0) as cache:
            long = [1, 2, 3, 4, *range(70_000, 70_000 + 4 * 63)]
            store(cache, long)
            store(cache, prompt(2))
            proxy.delay = 0.05
            killer = threading.Timer(0.1, s3.kill)
            killer.start()
            cached, loaded, _ = fetch(cache, long)  # the kill lands while its blocks stream in
            killer.join()
            assert cached == 256 and loaded <= 256
            cached, loaded, _ = fetch(cache, prompt(2))  # and with the server gone
            assert cached == 24 and loaded < 24
            errors = cache.stats().tiers[1].errors
            assert errors.get("connection", 0) + errors.get("timeout", 0) + errors.get("breaker_open", 0) >= 1
    finally:
        proxy.stop()


def test_no_request_waits_on_a_slow_write_and_a_kill_mid_write_loses_only_writes(s3: MotoServer) -> None:
    proxy = DelayingProxy(s3.port)
    try:
        with s3_cache(proxy.endpoint, writer="background", read_timeout=0.5) as cache:
            proxy.hold()  # no PUT is answered until the stores are done
            for i in range(5):
                store(cache, prompt(i))
            tier = cache.stats().tiers[1]
            assert tier.bytes_written == 0 and tier.writes_pending > 0  # 25 writes queued, none waited for
            proxy.delay = 0.2  # each PUT's reply comes late
            proxy.release()
            wait_for(lambda: cache.stats().tiers[1].bytes_written > 0)
            s3.kill()  # writes in flight and queued
            cache.flush(timeout=20)
            tier = cache.stats().tiers[1]
            assert tier.writes_failed + tier.writes_dropped >= 1
            for i in range(5):
                fetch(cache, prompt(i))  # every load exact: memory's blocks and what S3 still answers
    finally:
        proxy.stop()


def test_ttl_epoch_bump_and_purge_delete_the_objects(s3: MotoServer) -> None:
    clock = Clock()
    config = CacheConfig(
        block_size=BLOCK, seed=SEED, kv_layout=layout(), tiers=(s3_tier(s3.endpoint),), writer="inline", ttl_seconds=60
    )
    with PrefixCache(config, clock=clock) as cache:
        store(cache, prompt(1))
        assert len(objects()) == 6
        clock.now += 61
        assert cache.reclaim() == 6 and cache.flush(timeout=10)
        assert objects() == {}
        store(cache, prompt(2))
        cache.bump_epoch("m")
        cache.reclaim()
        epochs = f"{S3_PREFIX}/{SEED}/~epochs/"
        assert cache.flush(timeout=10) and list(objects()) == [epochs + record_name("m", None)]  # the epoch kept
        store(cache, prompt(3))
        assert cache.purge("acme") > 0 and cache.flush(timeout=10)
        generations = f"{S3_PREFIX}/{SEED}/~generations/"
        assert list(objects(generations)) == [generations + generation_name(SEED, "acme")]  # the purge kept
        assert objects(f"{S3_PREFIX}/{SEED}/") == objects(epochs) | objects(generations)
