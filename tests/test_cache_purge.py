"""A tenant purge is final everywhere (invariant 7; issue 39, finding 9's sequel): it raises
the generation of the tenant's key namespace, part of every root of it, and the
generation is kept where the blocks are (a disk's folder, Redis, the bucket), as an epoch
is (``test_cache_epochs.py``). So after a purge no key of the tenant's old blocks is
computed again: not on this server, not after its restart, not on a server that shares
the tier once it syncs. What a tier hands back as a generation is checked before it is
believed, and a generation only goes up.

Syncs are called (``sync_epochs``): no test depends on how long anything takes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import redis

from book_support import TOKENS, cache_of, disk, loaded, matched, on_redis, store
from guard_store import guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache.cache.contexts import generation_name
from prefixcache.cache.epochbook import (
    MAX_EPOCH,
    EpochNotKept,
    GenerationRecord,
    decode_generation,
    encode,
)
from prefixcache.config import PublishConfig
from prefixcache.hashing import CacheContext
from prefixcache.storage.base import EPOCH_RECORDS, TierError
from prefixcache.storage.s3 import S3Store
from redis_cluster import LocalCluster
from redis_server import RedisServer
from s3_server import HAS_MOTO, MotoServer
from test_tiers_s3 import _server, aws_env, client, s3  # noqa: F401  (moto's server, per module)
from tier_worker import BLOCK, CTX, S3_BUCKET, S3_PREFIX, SEED, kv_for, s3_tier

GLOBEX = CacheContext(tenant="globex", model="m")
ACME = generation_name(SEED, "acme")  # the name acme's generation is kept under


def record(generation: object, namespace: object = ACME, **extra: object) -> bytes:
    fields = {"format": "prefixcache.generation", "version": 1, "namespace": namespace, "generation": generation}
    return json.dumps(fields | extra).encode()


HOSTILE: dict[str, bytes] = {
    "garbage": b"\x00\xffnot json",
    "empty": b"",
    "negative": record(-1),
    "zero": record(0),
    "huge": record(2**63),
    "past the last generation": record(MAX_EPOCH + 1),
    "a float": record(3.0),
    "a string": record("3"),
    "a bool": record(True),
    "null": record(None),
    "another namespace's": record(9, namespace=generation_name(SEED, "globex")),
    "a tenant's name for a namespace": record(9, namespace="acme"),
    "an extra field": record(9, tenant="acme"),
    "a missing field": json.dumps({"format": "prefixcache.generation", "version": 1, "generation": 9}).encode(),
    "another version": record(9).replace(b'"version": 1', b'"version": 2'),
    "another format": record(9).replace(b"prefixcache.generation", b"prefixcache.epoch"),
    "an epoch record": json.dumps(
        {"format": "prefixcache.epoch", "version": 1, "model": "m", "adapter": None, "epoch": 9}
    ).encode(),
    "a list": b"[9]",
    "nested past the parser": b"[" * 4000,
    "too long": record(9, note="x" * 5000),
    "not utf-8": record(9).replace(b'"prefixcache.generation"', b'"\xff"'),
}


# ============================================================================ the record


def test_a_generation_record_round_trips_and_anything_else_is_refused() -> None:
    good = GenerationRecord(ACME, 7)
    assert decode_generation(ACME, encode(good)) == good
    for bad in (GenerationRecord(ACME, 0), GenerationRecord(ACME, MAX_EPOCH + 1), GenerationRecord("acme", 1)):
        with pytest.raises(ValueError):
            encode(bad)
    for how, data in HOSTILE.items():
        with pytest.raises(ValueError):
            decode_generation(ACME, data)
        assert how


def test_a_records_name_and_bytes_show_no_tenant_name_and_depend_on_the_seed() -> None:
    data = encode(GenerationRecord(ACME, 1))
    assert b"acme" not in data and "acme" not in ACME
    assert generation_name("another seed", "acme") != ACME != generation_name(SEED, "acme2")
    assert generation_name(SEED, "acme") == ACME  # the same on every server of one deployment


# ============================================================================ a disk tier: restarts


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
def test_a_purge_after_a_restart_reaches_the_blocks_on_disk(tmp_path: Path, isolation: str) -> None:
    """The scenario of the bug: the purging process knows none of the tenant's blocks."""
    with cache_of(disk(tmp_path), isolation=isolation) as cache:
        store(cache)
        store(cache, GLOBEX)
    with cache_of(disk(tmp_path), isolation=isolation) as restarted:
        assert restarted.purge("acme") == 0  # the tree knew nothing of acme yet
        assert matched(restarted) == 0  # before: 100, the purged blocks, adopted from the disk
        assert loaded(restarted, GLOBEX) == 100  # another tenant's blocks are untouched
        assert store(restarted, tokens=TOKENS[:40]) == 40  # acme starts again, in its new generation
        assert matched(restarted, tokens=TOKENS[:40]) == 40
    assert decode_generation(ACME, (tmp_path / "generations" / f"{ACME}.epoch").read_bytes()).generation == 1


def test_a_prefix_purge_after_a_restart_adopts_nothing_of_the_prefix_from_disk(tmp_path: Path) -> None:
    """A prefix purge reaches only the blocks the tree knows; after a restart the disk's
    copies are unknown to it, and a match would adopt them again (found by the writer
    state machine). Within the process that purged, no probed frame under the prefix is
    adopted; the rest of the tenant's prompts and other tenants' are."""
    other = TOKENS[:8] + [9000 + t for t in TOKENS[8:]]  # shares less than the purged prefix
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
        store(cache, tokens=other)
        store(cache, GLOBEX)
    with cache_of(disk(tmp_path)) as restarted:
        assert restarted.purge_prefix(TOKENS[:12], CTX) == 0  # the tree knew nothing yet
        assert matched(restarted) == 8  # before: 100, the purged blocks adopted from the disk
        assert loaded(restarted, tokens=other) == 100
        assert loaded(restarted, GLOBEX) == 100
        assert store(restarted) == 92  # stored again after the purge: a new store, served
        assert loaded(restarted) == 100


def test_a_purge_outlives_the_purging_servers_restart(tmp_path: Path) -> None:
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
        store(cache, GLOBEX)
        assert cache.purge("acme") == 100 and matched(cache) == 0
        store(cache, tokens=TOKENS[:40])
    with cache_of(disk(tmp_path)) as restarted:
        assert matched(restarted) == 40  # the new generation's blocks, none of the old 100
        assert loaded(restarted, GLOBEX) == 100
        assert restarted.purge("acme") == 40 and matched(restarted) == 0  # generation 2: the 40 go too
    with cache_of(disk(tmp_path)) as again:
        assert matched(again) == 0 and matched(again, GLOBEX) == 100


def test_a_purge_in_shared_isolation_reaches_only_what_the_tree_knows(tmp_path: Path) -> None:
    """Documented: in shared isolation every tenant's blocks share one namespace, which no
    tenant's purge may invalidate; the purge removes what this tree holds, nothing else."""
    with cache_of(disk(tmp_path), isolation="shared") as cache:
        store(cache)
        assert cache.purge("acme") == 100 and matched(cache) == 0
        store(cache)
    with cache_of(disk(tmp_path), isolation="shared") as restarted:
        assert restarted.purge("acme") == 0
        assert matched(restarted) == 100  # the disk's frames, which the tree did not know
    assert not (tmp_path / "generations").exists()


def test_no_generation_record_is_written_until_a_purge(tmp_path: Path) -> None:
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
        cache.bump_epoch("m")
    assert not (tmp_path / "generations").exists() and (tmp_path / "epochs").is_dir()


def test_a_prefix_acme_helped_publish_stays_public_after_its_purge(tmp_path: Path) -> None:
    """The public pool is everybody's: a tenant purge takes the tenant's namespace, not
    the public copies of prefixes it was one of ``min_tenants`` to send."""
    publish = PublishConfig(min_tenants=2, min_tokens=BLOCK)
    others = [CacheContext(tenant=t, model="m") for t in ("globex", "initech")]
    with cache_of(disk(tmp_path), publish=publish) as cache:
        for ctx in (CTX, *others):
            store(cache, ctx)
        assert cache.purge("acme") == 100
        assert matched(cache, others[1]) == 100
    with cache_of(disk(tmp_path), publish=publish) as restarted:
        assert loaded(restarted, CacheContext(tenant="hooli", model="m")) == 100  # the public copy
        assert loaded(restarted) == 100  # acme too reaches it, as every tenant does


@pytest.mark.parametrize("how", sorted(HOSTILE))
def test_a_hostile_generation_record_on_disk_is_logged_and_ignored(tmp_path: Path, how: str, caplog: Any) -> None:
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
    (tmp_path / "generations").mkdir()
    (tmp_path / "generations" / f"{ACME}.epoch").write_bytes(HOSTILE[how])
    with caplog.at_level(logging.WARNING, "prefixcache"), cache_of(disk(tmp_path)) as restarted:
        assert matched(restarted) == 100  # no generation taken from it: nothing invalidated, nothing raised
        refused = [r for r in caplog.records if "epoch_record_refused" in r.getMessage()]
        errors = restarted.stats().tiers[1].errors
        assert len(refused) == 1 or errors["epoch"] == 1, (refused, errors)
        assert restarted.purge("acme") == 100 and matched(restarted) == 0  # and a purge writes over it
    assert decode_generation(ACME, (tmp_path / "generations" / f"{ACME}.epoch").read_bytes()).generation == 1


def test_a_purge_the_disk_failed_to_keep_is_an_error_and_written_at_the_next_sync(
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
                cache.purge("acme")
            assert not (tmp_path / "generations").exists()
        assert matched(cache) == 0  # it held here all along
        cache.sync_epochs()  # and is written now, though no sync reads the disk
    with cache_of(disk(tmp_path)) as restarted:
        assert matched(restarted) == 0


def test_a_purge_past_the_records_a_book_holds_is_an_error_not_a_hidden_record(tmp_path: Path) -> None:
    """A store hands back at most ``EPOCH_RECORDS`` records of a book: one more would hide
    one of them from every reader, so it is refused, loudly, and holds here."""
    with cache_of(disk(tmp_path)) as cache:
        store(cache)
    folder = tmp_path / "generations"
    folder.mkdir()
    for i in range(EPOCH_RECORDS):
        name = generation_name(SEED, f"tenant-{i}")
        (folder / f"{name}.epoch").write_bytes(encode(GenerationRecord(name, 1)))
    with cache_of(disk(tmp_path)) as restarted:
        with pytest.raises(EpochNotKept, match="the most a cache reads"):
            restarted.purge("acme")
        assert matched(restarted) == 0  # held here
        assert restarted.purge("tenant-7") == 0  # a namespace the book holds is raised in place
    assert not (folder / f"{ACME}.epoch").exists() and len(list(folder.iterdir())) == EPOCH_RECORDS
    assert decode_generation(name, (folder / f"{name}.epoch").read_bytes()).generation == 1
    seven = generation_name(SEED, "tenant-7")
    assert decode_generation(seven, (folder / f"{seven}.epoch").read_bytes()).generation == 2


# ============================================================================ shared tiers: Redis


def test_two_servers_on_one_redis_one_purges_the_other_misses_after_its_sync(redis_server: RedisServer) -> None:
    with cache_of(on_redis(redis_server.url)) as a, cache_of(on_redis(redis_server.url)) as b:
        store(a)
        store(a, GLOBEX)
        assert matched(b) == 100 and matched(b, GLOBEX) == 100  # found in Redis
        assert a.purge("acme") == 100 and matched(a) == 0
        assert matched(b) == 100  # b has not synced yet: the bound is one sync
        assert b.sync_epochs() == []  # no epoch raised: a generation, which names no tenant
        assert matched(b) == 0  # before: 100, the purged blocks, forever
        assert loaded(b, GLOBEX) == 100
        store(b, tokens=TOKENS[:40])  # acme's new generation, shared again
        assert matched(a, tokens=TOKENS[:40]) == 40
    with cache_of(on_redis(redis_server.url)) as restarted:  # a server that starts later reads it at open
        assert matched(restarted) == 40 and matched(restarted, GLOBEX) == 100
    fields = redis.Redis.from_url(redis_server.url).hgetall(f"{SEED}:~generations")
    assert list(fields) == [ACME.encode()] and b"acme" not in b"".join(fields.values())


def test_a_store_decided_before_another_servers_purge_is_dropped(redis_server: RedisServer) -> None:
    """A request in flight on b when a's purge reaches it: its store must not bring the
    purged prefix back under the new generation (what b computed may hold the old KV)."""
    with cache_of(on_redis(redis_server.url)) as a, cache_of(on_redis(redis_server.url)) as b:
        store(a)
        stamp = b.stamp()
        assert matched(b) == 100
        a.purge("acme")
        b.sync_epochs()
        assert b.insert(TOKENS, CTX, kv=kv_for(TOKENS), since=stamp) == 0
        assert b.stats().voided_tokens == 100
        assert b.insert(TOKENS, GLOBEX, kv=kv_for(TOKENS), since=stamp) == 100  # another namespace's is not
        assert matched(a) == matched(b) == 0


def test_hostile_generation_records_in_redis_are_refused_and_a_purge_is_kept_over_them(
    redis_server: RedisServer,
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    key = f"{SEED}:~generations"
    with cache_of(on_redis(redis_server.url)) as a, cache_of(on_redis(redis_server.url)) as b:
        store(a)
        for i, data in enumerate(HOSTILE.values()):
            r.hset(key, ACME if i % 2 else generation_name(SEED, f"x{i}"), data)
        r.hset(key, "short", record(9))
        r.hset(key, generation_name(SEED, "n"), b"x" * 10_000)  # read no further than a record, in Redis
        assert b.sync_epochs() == [] and matched(b) == 100  # nothing believed, nothing raised
        assert b.stats().tiers[1].errors["epoch"] >= 1
        a.purge("acme")  # written over the hostile one
        b.sync_epochs()
        assert matched(b) == 0


def test_a_generation_read_below_the_one_known_is_written_up_never_taken(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    key = f"{SEED}:~generations"
    with cache_of(disk(tmp_path), on_redis(redis_server.url)) as cache:
        store(cache)
        for _ in range(3):
            cache.purge("acme")
        r.hset(key, ACME, encode(GenerationRecord(ACME, 1)))  # a race, or a flushed Redis rewritten by an old server
        cache.sync_epochs()
        assert decode_generation(ACME, r.hget(key, ACME) or b"").generation == 3  # written up again
        store(cache, tokens=TOKENS[:40])
    r.delete(key)  # Redis lost them all; the disk still knows
    with cache_of(disk(tmp_path), on_redis(redis_server.url)) as restarted:
        assert matched(restarted) == 40  # generation 3's, none of the older ones
        assert decode_generation(ACME, r.hget(key, ACME) or b"").generation == 3


def test_a_purge_redis_cannot_keep_is_an_error_and_is_written_at_the_next_sync(redis_server: RedisServer) -> None:
    with cache_of(on_redis(redis_server.url)) as a, cache_of(on_redis(redis_server.url)) as b:
        store(b)  # NOTE: a knows none of it, so its purge deletes nothing: one read and one write fail
        redis_server.kill()
        with pytest.raises(EpochNotKept, match="redis"):
            a.purge("acme")
        redis_server.start()  # empty: it kept nothing
        assert matched(a) == 0  # the purge held here
        b.sync_epochs()
        assert matched(b) == 100  # Redis never took it: b still hits acme's old generation
        a.sync_epochs()  # a writes what Redis lacks
        b.sync_epochs()
        assert matched(b) == 0


def test_two_servers_on_one_redis_cluster_one_purges_the_other_misses(redis_cluster: LocalCluster) -> None:
    tier = on_redis(redis_cluster.url, cluster=True)
    with cache_of(tier) as a, cache_of(tier) as b:
        store(a)
        store(a, GLOBEX)
        assert matched(b) == 100
        a.purge("acme")
        b.sync_epochs()
        assert matched(b) == 0 and matched(b, GLOBEX) == 100


# ============================================================================ shared tiers: S3


@pytest.mark.s3
@pytest.mark.skipif(not HAS_MOTO, reason="moto[server] is not installed")
def test_two_servers_on_one_bucket_one_purges_the_other_misses(
    s3: MotoServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gets: list[str] = []
    bounded = S3Store._bounded_record

    def counted(store: S3Store, path: str) -> Any:
        gets.append(path)
        return bounded(store, path)

    monkeypatch.setattr(S3Store, "_bounded_record", counted)
    with cache_of(s3_tier(s3.endpoint)) as a, cache_of(s3_tier(s3.endpoint)) as b:
        store(a)
        store(a, GLOBEX)
        assert matched(b) == 100
        assert a.purge("acme") == 100
        b.sync_epochs()
        assert matched(b) == 0 and loaded(b, GLOBEX) == 100
        gets.clear()
        b.sync_epochs()
        assert gets == []  # a record read before and unchanged since is not fetched again
        store(b, tokens=TOKENS[:40])
        assert a.purge("acme") == 0  # a knew none of generation 1's blocks; its record goes to 2
        gets.clear()
        b.sync_epochs()
        assert len(gets) == 1 and matched(b, tokens=TOKENS[:40]) == 0  # the changed record was fetched
    with cache_of(s3_tier(s3.endpoint)) as restarted:
        assert matched(restarted) == 0 and matched(restarted, GLOBEX) == 100
    listed = client().list_objects_v2(Bucket=S3_BUCKET, Prefix=f"{S3_PREFIX}/{SEED}/~generations/")
    assert [o["Key"].rsplit("/", 1)[1] for o in listed["Contents"]] == [ACME]


@pytest.mark.s3
@pytest.mark.skipif(not HAS_MOTO, reason="moto[server] is not installed")
def test_hostile_generation_objects_in_the_bucket_are_refused(s3: MotoServer) -> None:  # noqa: F811
    folder = f"{S3_PREFIX}/{SEED}/~generations/"
    with cache_of(s3_tier(s3.endpoint)) as a:
        store(a)
        c = client()
        for i, data in enumerate(HOSTILE.values()):
            c.put_object(Bucket=S3_BUCKET, Key=folder + (ACME if i == 0 else generation_name(SEED, f"x{i}")), Body=data)
        c.put_object(Bucket=S3_BUCKET, Key=folder + "stray", Body=record(9))
        with cache_of(s3_tier(s3.endpoint)) as b:
            assert matched(b) == 100 and b.sync_epochs() == []
            assert b.stats().tiers[1].errors["epoch"] >= 1
            a.purge("acme")
            b.sync_epochs()
            assert matched(b) == 0
