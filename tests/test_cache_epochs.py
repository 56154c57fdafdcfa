"""Epochs are kept where the blocks they invalidate are kept (issue 39, finding 2): a bump
outlives a restart on a disk tier, and reaches every server on a shared Redis, Redis
Cluster or bucket at its next sync; what a tier hands back is checked before it is
believed, and an epoch only ever goes up.

Syncs are called (``sync_epochs``) or waited for (``wait_synced``): no test depends on
how long anything takes.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import redis

from book_support import TOKENS, cache_of, disk, matched, on_redis, store
from guard_store import guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache.cache.epochbook import MAX_EPOCH, EpochNotKept, EpochRecord, decode, encode, record_name
from prefixcache.hashing import CacheContext
from prefixcache.storage.base import TierError
from redis_cluster import LocalCluster
from redis_server import RedisServer
from s3_server import HAS_MOTO, MotoServer
from test_tiers_s3 import _server, aws_env, client, s3  # noqa: F401  (moto's server, per module)
from tier_worker import S3_BUCKET, S3_PREFIX, SEED, s3_tier

LORA = CacheContext(tenant="acme", model="m", adapter="lora")
M = record_name("m", None)


def record(epoch: object, model: object = "m", adapter: object = None, **extra: object) -> bytes:
    fields = {"format": "prefixcache.epoch", "version": 1, "model": model, "adapter": adapter, "epoch": epoch}
    return json.dumps(fields | extra).encode()


# ============================================================================ the record


def test_a_record_round_trips_and_anything_else_is_refused() -> None:
    good = EpochRecord("m", "lora", 7)
    assert decode(record_name("m", "lora"), encode(good)) == good
    with pytest.raises(ValueError):
        encode(EpochRecord("m", None, MAX_EPOCH + 1))
    with pytest.raises(ValueError):
        encode(EpochRecord("m" * 5000, None, 1))
    for bad in HOSTILE.values():
        with pytest.raises(ValueError):
            decode(M, bad)


HOSTILE: dict[str, bytes] = {
    "garbage": b"\x00\xffnot json",
    "empty": b"",
    "negative": record(-1),
    "zero": record(0),
    "huge": record(2**63),
    "past the last epoch": record(MAX_EPOCH + 1),
    "a float": record(3.0),
    "a string": record("3"),
    "a bool": record(True),
    "null": record(None),
    "another model's": record(9, model="other"),
    "an extra field": record(9, note="x"),
    "a missing field": json.dumps({"format": "prefixcache.epoch", "version": 1, "model": "m", "epoch": 9}).encode(),
    "another version": record(9).replace(b'"version": 1', b'"version": 2'),
    "another format": record(9).replace(b"prefixcache.epoch", b"prefixcache.epoc"),
    "a list": b"[9]",
    "nested past the parser": b"[" * 4000,
    "too long": record(9, model="m" * 5000),
    "not utf-8": record(9).replace(b'"m"', b'"\xff"'),
}


# ============================================================================ a disk tier: restarts


def test_a_bump_outlives_a_restart_of_a_cache_on_its_disk(tmp_path: Path) -> None:
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
        assert matched(cache) == 100 and cache.bump_epoch("m") == 1 and matched(cache) == 0
        store(cache, tokens=TOKENS[:40])  # under the new epoch
    with cache_of(disk(tmp_path)) as restarted:
        assert matched(restarted) == 40  # the new epoch's blocks, none of the old (before: 100, old KV)
        assert restarted.bump_epoch("m") == 2 and matched(restarted) == 0
    assert decode(M, (tmp_path / "epochs" / f"{M}.epoch").read_bytes()).epoch == 2


def test_an_adapters_epoch_is_kept_apart_from_its_models(tmp_path: Path) -> None:
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
        store(cache, LORA)
        assert cache.bump_epoch("m", "lora") == 1
    with cache_of(disk(tmp_path)) as restarted:
        assert matched(restarted, LORA) == 0 and matched(restarted) == 100


def test_no_epoch_record_is_written_until_a_bump(tmp_path: Path) -> None:
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
    assert not (tmp_path / "epochs").exists()


@pytest.mark.parametrize("how", sorted(HOSTILE))
def test_a_hostile_record_on_disk_is_logged_and_ignored(tmp_path: Path, how: str, caplog: Any) -> None:
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
    (tmp_path / "epochs").mkdir()
    (tmp_path / "epochs" / f"{M}.epoch").write_bytes(HOSTILE[how])
    with caplog.at_level(logging.WARNING, "prefixcache"), cache_of(disk(tmp_path)) as restarted:
        assert matched(restarted) == 100  # no epoch taken from it: nothing invalidated, nothing raised
        refused = [r for r in caplog.records if "epoch_record_refused" in r.getMessage()]
        errors = restarted.stats().tiers[1].errors
        assert len(refused) == 1 or errors["epoch"] == 1, (refused, errors)
        assert restarted.bump_epoch("m") == 1  # and a bump writes over it
    assert decode(M, (tmp_path / "epochs" / f"{M}.epoch").read_bytes()).epoch == 1


@pytest.mark.parametrize("what", ["a symlink to /dev/zero", "a fifo", "a folder", "a stray name"])
def test_what_is_no_record_file_in_the_epochs_folder_is_skipped(tmp_path: Path, what: str) -> None:
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
    folder = tmp_path / "epochs"
    folder.mkdir()
    target = folder / f"{M}.epoch"
    if what == "a symlink to /dev/zero":
        target.symlink_to("/dev/zero")
    elif what == "a fifo":
        os.mkfifo(target)
    elif what == "a folder":
        target.mkdir()
    else:
        (folder / "notes.txt").write_bytes(record(5))
    with cache_of(disk(tmp_path)) as restarted:
        assert matched(restarted) == 100 and restarted.stats().tiers[1].errors["epoch"] == 1


def test_a_bump_the_disk_failed_to_keep_is_an_error_and_written_at_the_next_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
        assert cache._io is not None
        held = cache._io.transfer.stores[1]
        inner = getattr(held, "inner", held)  # the disk store under the test's lock guard

        def full(name: str, record: bytes, book: str = "epochs") -> None:
            raise TierError("disk full")

        with monkeypatch.context() as patch:
            patch.setattr(inner, "write_epoch", full)
            with pytest.raises(EpochNotKept, match="disk"):
                cache.bump_epoch("m")
            assert cache.sync_epochs() == [] and not (tmp_path / "epochs" / f"{M}.epoch").exists()
        assert matched(cache) == 0  # it held here all along
        assert cache.sync_epochs() == []  # and is written now, though no sync reads the disk
    with cache_of(disk(tmp_path)) as restarted:
        assert matched(restarted) == 0


# ============================================================================ shared tiers: Redis


def test_two_servers_on_one_redis_one_bumps_the_other_misses_after_its_sync(redis_server: RedisServer) -> None:
    with cache_of(on_redis(redis_server.url)) as a, cache_of(on_redis(redis_server.url)) as b:
        store(a)
        assert matched(b) == 100  # found in Redis
        assert a.bump_epoch("m") == 1 and matched(a) == 0
        assert b.sync_epochs() == [("m", None)]
        assert matched(b) == 0  # before: 100, the old blocks, forever
        assert b.bump_epoch("m") == 2 and a.sync_epochs() == [("m", None)]
        store(a, tokens=TOKENS[:40])
        assert matched(b, tokens=TOKENS[:40]) == 40  # both on epoch 2: sharing again
    with cache_of(on_redis(redis_server.url)) as restarted:  # a server that starts later reads it at open
        assert matched(restarted) == 40  # epoch 2's blocks only, none of epoch 0's 100


def test_the_background_sync_applies_another_servers_bump(redis_server: RedisServer) -> None:
    with cache_of(on_redis(redis_server.url)) as a, cache_of(on_redis(redis_server.url), sync_s=0.01) as b:
        store(a)
        assert matched(b) == 100
        keeping = b._epochs
        assert keeping is not None
        a.bump_epoch("m")
        # NOTE: two syncs ending after the bump: the second began after the first ended, so
        # after the bump's record landed (a sync that read before it may end first)
        assert keeping.wait_synced(keeping.syncs + 1, timeout=60)
        assert matched(b) == 0


def hostile_redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def test_hostile_records_in_redis_are_refused_and_a_bump_is_kept_over_them(redis_server: RedisServer) -> None:
    r = hostile_redis(redis_server.url)
    key = f"{SEED}:~epochs"
    with cache_of(on_redis(redis_server.url)) as a, cache_of(on_redis(redis_server.url)) as b:
        store(a)
        for i, data in enumerate(HOSTILE.values()):
            r.hset(key, M if i % 2 else record_name("m", f"x{i}"), data)
        r.hset(key, "short", record(9))
        r.hset(key, record_name("n", None), b"x" * 10_000)  # read no further than a record, in Redis
        assert b.sync_epochs() == [] and matched(b) == 100  # nothing believed, nothing raised
        assert b.stats().tiers[1].errors["epoch"] >= 1
        assert a.bump_epoch("m") == 1  # written over the hostile one
        assert b.sync_epochs() == [("m", None)] and matched(b) == 0


def test_an_epoch_read_below_the_one_known_is_written_up_never_taken(redis_server: RedisServer, tmp_path: Path) -> None:
    r = hostile_redis(redis_server.url)
    key = f"{SEED}:~epochs"
    with cache_of(disk(tmp_path), on_redis(redis_server.url)) as cache:
        store(cache)
        for _ in range(3):
            cache.bump_epoch("m")
        r.hset(key, M, encode(EpochRecord("m", None, 1)))  # a race, or a flushed Redis rewritten by an old server
        r.hset(key, record_name("m", "lora"), encode(EpochRecord("m", "lora", 2)))
        assert cache.sync_epochs() == [("m", "lora")]  # the adapter's is news; the model's is lower: not taken
        assert decode(M, r.hget(key, M) or b"").epoch == 3  # and written up again
    r.delete(key)  # Redis lost them all; the disk still knows
    with cache_of(disk(tmp_path), on_redis(redis_server.url)) as restarted:
        assert matched(restarted) == 0
        assert decode(M, r.hget(key, M) or b"").epoch == 3


def test_a_bump_redis_cannot_keep_is_an_error_and_is_written_at_the_next_sync(redis_server: RedisServer) -> None:
    with cache_of(on_redis(redis_server.url)) as a, cache_of(on_redis(redis_server.url)) as b:
        store(a)
        redis_server.kill()
        with pytest.raises(EpochNotKept, match="redis"):
            a.bump_epoch("m")
        redis_server.start()  # empty: it kept nothing
        assert matched(a) == 0  # the bump held here
        assert b.sync_epochs() == []  # Redis never took it
        assert a.sync_epochs() == []  # nothing new to a, which writes what Redis lacks
        assert b.sync_epochs() == [("m", None)]


def test_a_wrong_typed_epochs_key_costs_the_sync_and_refuses_a_bump(redis_server: RedisServer) -> None:
    hostile_redis(redis_server.url).set(f"{SEED}:~epochs", b"not a hash")
    with cache_of(on_redis(redis_server.url)) as cache:
        store(cache)
        assert cache.sync_epochs() == [] and matched(cache) == 100
        with pytest.raises(EpochNotKept):
            cache.bump_epoch("m")
        assert matched(cache) == 0


# ============================================================================ shared tiers: Redis Cluster


def test_two_servers_on_one_redis_cluster_one_bumps_the_other_misses(redis_cluster: LocalCluster) -> None:
    tier = on_redis(redis_cluster.url, cluster=True)
    with cache_of(tier) as a, cache_of(tier) as b:
        store(a)
        assert matched(b) == 100
        assert a.bump_epoch("m") == 1
        assert b.sync_epochs() == [("m", None)] and matched(b) == 0


# ============================================================================ shared tiers: S3


@pytest.mark.s3
@pytest.mark.skipif(not HAS_MOTO, reason="moto[server] is not installed")
def test_two_servers_on_one_bucket_one_bumps_the_other_misses(s3: MotoServer) -> None:  # noqa: F811
    with cache_of(s3_tier(s3.endpoint)) as a, cache_of(s3_tier(s3.endpoint)) as b:
        store(a)
        assert matched(b) == 100
        assert a.bump_epoch("m") == 1
        assert b.sync_epochs() == [("m", None)] and matched(b) == 0
    with cache_of(s3_tier(s3.endpoint)) as restarted:
        assert matched(restarted) == 0


@pytest.mark.s3
@pytest.mark.skipif(not HAS_MOTO, reason="moto[server] is not installed")
def test_hostile_objects_in_the_bucket_are_refused(s3: MotoServer) -> None:  # noqa: F811
    folder = f"{S3_PREFIX}/{SEED}/~epochs/"
    with cache_of(s3_tier(s3.endpoint)) as a:
        store(a)
        c = client()
        for i, data in enumerate(HOSTILE.values()):
            c.put_object(Bucket=S3_BUCKET, Key=folder + (M if i == 0 else record_name("m", f"x{i}")), Body=data)
        c.put_object(Bucket=S3_BUCKET, Key=folder + "stray", Body=record(9))
        c.put_object(Bucket=S3_BUCKET, Key=folder + record_name("n", None), Body=b"x" * 100_000)
        with cache_of(s3_tier(s3.endpoint)) as b:
            assert matched(b) == 100 and b.sync_epochs() == []
            assert b.stats().tiers[1].errors["epoch"] >= 2
            assert a.bump_epoch("m") == 1
            assert b.sync_epochs() == [("m", None)] and matched(b) == 0
