"""A restarted backend announces what its disk tier holds (issue 44, point 3).

The publisher journals the blocks that enter the disk tier; the next incarnation's
whole-residency batch and snapshot announce the disk's frames that a record names,
parents first, and an orphan that leaves the tier is announced removed. Against a real
Redis (the stream a router reads), with the cache's real disk tier; then through a real
server killed with SIGKILL and started again."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from prefixcache import PrefixCache
from prefixcache.config import TierConfig
from prefixcache.events import TierEntered
from prefixcache.fleet.journal import MAGIC, Journal, beside, orphan_entries
from prefixcache.fleet.publisher import FleetPublisher, PublisherConfig
from prefixcache.fleet.wire import BlockStored, Snapshot
from redis_server import RedisServer, free_port
from test_fleet_publisher import ACME, BS, GLOBEX, MODEL, Index, entries, insert, make_cache, truth


def publisher(cache: PrefixCache, srv: RedisServer, journal: Journal, inc: str = "inc-1") -> FleetPublisher:
    return FleetPublisher(cache, PublisherConfig(srv.url, "b1", "test:fleet"), MODEL, inc=inc, journal=journal)


def entry(key: bytes, parent: bytes | None, end: int) -> TierEntered:
    return TierEntered(key, parent, bytes(4 * BS), "acme", "m", None, "disk", end)


def disk_keys(cache: PrefixCache) -> set[bytes]:
    assert cache._io is not None
    return {key for key in cache._io.books.tiers[1].orphans} | {
        key for key, block in cache._io.books.owner.items() if block.num_tokens == BS and block.res is not None
    }


@pytest.fixture
def client(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


# ====================================================================== the journal alone


def test_a_torn_or_corrupt_tail_ends_the_read_and_keeps_what_came_before(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "fleet" / "b1.journal")
    assert journal.read() == []  # no file yet
    first = [entry(b"a" * 16, None, BS), entry(b"b" * 16, b"a" * 16, 2 * BS)]
    journal.append(first)
    journal.append([entry(b"c" * 16, b"b" * 16, 3 * BS)])
    assert [e.key for e in journal.read()] == [b"a" * 16, b"b" * 16, b"c" * 16]
    data = journal.path.read_bytes()
    journal.path.write_bytes(data[:-3])  # a crash mid-append
    assert [e.key for e in journal.read()] == [b"a" * 16, b"b" * 16]
    flipped = bytearray(data)
    flipped[len(MAGIC) + 8] ^= 0xFF  # the first record's payload: its checksum fails
    journal.path.write_bytes(bytes(flipped))
    assert journal.read() == []
    journal.path.write_bytes(b"not a journal at all")
    assert journal.read() == []


def test_a_record_that_does_not_decode_is_skipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.append([entry(b"a" * 16, None, BS)])
    payload = msgspec.msgpack.encode(["not", "an", "entry"])
    with journal.path.open("ab") as f:
        f.write(struct.pack("<II", len(payload), zlib.crc32(payload)) + payload)
    journal.append([entry(b"b" * 16, b"a" * 16, 2 * BS)])
    assert [e.key for e in journal.read()] == [b"a" * 16, b"b" * 16]


def test_orphans_are_announced_parents_first_and_only_under_an_announced_parent() -> None:
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    records = [entry(c, b, 3 * BS), entry(b, a, 2 * BS), entry(a, None, BS), entry(d, b"x" * 16, 2 * BS)]
    assert [e.key for e in orphan_entries(records, {a, b, c, d}, set())] == [a, b, c]  # d: its parent is unknown
    assert [e.key for e in orphan_entries(records, {b, c}, set())] == []  # a left the tier: b and c hang on nothing
    assert [e.key for e in orphan_entries(records, {b, c}, {a})] == [b, c]  # a is the tree's


def test_the_journal_sits_beside_the_first_disk_tier_under_a_safe_name(tmp_path: Path) -> None:
    tiers = [
        TierConfig(kind="memory", capacity_bytes=1 << 20),
        TierConfig(kind="disk", capacity_bytes=1 << 20, path=str(tmp_path)),
    ]
    got = beside(tiers, "host:8000")
    assert got is not None and got.path == tmp_path / "fleet" / "host:8000.journal"
    odd = beside(tiers, "../../etc/passwd")
    assert odd is not None and odd.path.parent == tmp_path / "fleet" and "/" not in odd.path.name
    assert beside(tiers[:1], "b1") is None


# ====================================================================== through the publisher


@pytest.mark.redis
def test_a_restarted_backend_announces_its_disk_and_the_router_keys_match(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    disk = tmp_path / "disk"
    journal = Journal(tmp_path / "disk" / "fleet" / "b1.journal")
    cache = make_cache(disk, memory_frames=5, write="through")
    pub = publisher(cache, redis_server, journal)
    insert(cache, list(range(16)))
    insert(cache, list(range(8)) + [9] * 12)
    insert(cache, list(range(100, 112)), GLOBEX)
    pub.publish_pending()
    before = Index()
    for got in entries(client, pub.config.stream):
        before.apply(got)
    on_disk = {k for k, m in before.held if m == "disk"}
    assert on_disk == {k for k, m in truth(cache) if m == "disk"} and len(on_disk) == 10  # 4 + 3 + 3 blocks
    # NOTE: killed: nothing closes the cache or stops the publisher (the writer is inline: the frames are there)
    again = make_cache(disk, memory_frames=5, write="through")
    pub2 = publisher(again, redis_server, Journal(journal.path), inc="inc-2")
    pub2.publish_pending()
    stream = entries(client, pub2.config.stream)
    after = Index()
    for got in stream[len(stream) - pub2.seq :]:
        after.apply(got)
    assert after.held == {(k, "disk") for k in on_disk}
    assert {h: after.keys[h] for h in on_disk} == {h: before.keys[h] for h in on_disk}  # the router's own keys
    snap: Snapshot = pub2.snapshot()
    rebuilt = Index(seq=snap.seq)
    for event in snap.events:
        rebuilt.store(event)
    assert rebuilt.held == after.held
    # a request adopts part of it; the rest stays announced as it was
    found = again.match(list(range(16)), ACME)
    assert found.cached_tokens == 16
    found.release()
    pub2.publish_pending()
    for got in entries(client, pub2.config.stream)[len(stream) :]:
        after.apply(got)
    assert {k for k, m in after.held if m == "disk"} == on_disk
    again.close()


@pytest.mark.redis
def test_an_orphan_that_leaves_the_disk_is_announced_removed(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    disk = tmp_path / "disk"
    journal = Journal(disk / "fleet" / "b1.journal")
    cache = make_cache(disk, memory_frames=5, disk_frames=8, write="through")
    pub = publisher(cache, redis_server, journal)
    insert(cache, list(range(16)))
    pub.publish_pending()
    again = make_cache(disk, memory_frames=5, disk_frames=8, write="through")
    pub2 = publisher(again, redis_server, Journal(journal.path), inc="inc-2")
    pub2.publish_pending()
    seen = len(entries(client, pub2.config.stream)) - pub2.seq
    for i in range(6):  # other prompts fill the disk: the orphans are its first victims
        insert(again, [1000 + 16 * i + j for j in range(16)], GLOBEX)
    pub2.publish_pending()
    index = Index()
    for got in entries(client, pub2.config.stream)[seen:]:
        index.apply(got)
    assert again._io is not None
    left = again._io.books.tiers[1].orphans
    assert len(left) < 4  # some orphans were evicted ...
    orphaned = {(k, "disk") for k in left}
    assert index.held == truth(again) | orphaned  # ... and announced removed; the rest still there
    again.close()
    cache.close()


@pytest.mark.redis
def test_the_journal_is_rewritten_once_it_grows(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("prefixcache.fleet.journal.COMPACT_AT", 1)
    disk = tmp_path / "disk"
    journal = Journal(disk / "fleet" / "b1.journal")
    cache = make_cache(disk, memory_frames=3, disk_frames=6, write="through")
    pub = publisher(cache, redis_server, journal)
    for i in range(400):  # thousands of blocks through a disk of six
        insert(cache, [16 * i + j for j in range(8)])
        pub.publish_pending()
    records = journal.read()
    assert len(records) <= 2 * 1024  # rewritten: not every block that ever came
    assert {e.key for e in records} >= {k for k in disk_keys(cache)}
    cache.close()


@pytest.mark.redis
def test_a_journal_that_cannot_be_written_leaves_the_publisher_serving(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis
) -> None:
    (tmp_path / "blocked").write_text("a file where the journal's folder would be")
    cache = make_cache(tmp_path / "disk", write="through")
    pub = publisher(cache, redis_server, Journal(tmp_path / "blocked" / "b1.journal"))
    insert(cache, list(range(12)))
    pub.publish_pending()
    index = Index()
    for got in entries(client, pub.config.stream):
        index.apply(got)
    assert index.held == truth(cache)
    cache.close()


# ====================================================================== a real server, killed


CONFIG = """
[server]
port = {port}
default_max_tokens = 2
[model]
models_dir = "{models}"
[cache]
[[cache.tiers]]
kind = "memory"
capacity_bytes = 268435456
write = "through"
[[cache.tiers]]
kind = "disk"
capacity_bytes = 1073741824
path = "{disk}"
[auth]
api_keys = {{ "sk-acme" = "acme" }}
admin_key = "sk-admin"
[fleet]
publish = true
redis_url = "{redis}"
name = "b1"
"""


def _serve(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "prefixcache.cli", "serve", "--config", str(cfg)],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def _snapshot_disk_blocks(url: str) -> int:
    response = httpx.get(f"{url}/fleet/snapshot", headers={"Authorization": "Bearer sk-admin"}, timeout=30)
    response.raise_for_status()
    snap = msgspec.msgpack.decode(response.content, type=Snapshot)
    return sum(len(e.block_hashes) for e in snap.events if e.medium == "disk")


def _until(cond: object, proc: subprocess.Popen[bytes], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the server exited"
        try:
            if cond():  # type: ignore[operator]
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.25)


@pytest.mark.redis
@pytest.mark.model
@pytest.mark.slow
def test_a_server_killed_and_started_again_announces_its_disk(tmp_path: Path, redis_server: RedisServer) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    models = Path(__file__).resolve().parent.parent / ".prefixcache" / "models"
    cfg = tmp_path / "b1.toml"
    cfg.write_text(CONFIG.format(port=port, models=models, disk=tmp_path / "disk", redis=redis_server.url))
    log = tmp_path / "b1.log"
    proc = _serve(cfg, log)
    try:
        _until(lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200, proc)
        prompt = " ".join(f"Item {i} costs {3 * i + 7} dollars." for i in range(40))
        answer = httpx.post(
            f"{url}/v1/completions",
            json={"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 1},
            headers={"Authorization": "Bearer sk-acme"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        _until(lambda: _snapshot_disk_blocks(url) > 0, proc)
        held = _snapshot_disk_blocks(url)
        journal = tmp_path / "disk" / "fleet" / "b1.journal"
        _until(lambda: len(Journal(journal).read()) >= held, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc = _serve(cfg, log)
        _until(lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200, proc)
        assert _snapshot_disk_blocks(url) == held, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


# ====================================================================== the vLLM connector


def test_the_vllm_connector_announces_its_disk_after_a_restart(tmp_path: Path) -> None:
    """The connector's first events after a start name the disk's blocks from before it
    (vLLM hands them to its own publisher, which a router follows): the same hashes and
    tokens as when they were stored; without the journal, nothing."""
    from prefixcache.integrations.vllm.scope import Scope
    from prefixcache.integrations.vllm.worker import SaveSpec
    from prefixcache.integrations.vllm.worker_hooks import WorkerHooks
    from test_vllm_parts import N, cpu_caches, worker

    tokens = tuple(range(100, 100 + 3 * N))
    hooks = WorkerHooks(worker(tmp_path, cpu_caches(1)), async_load=False)
    hooks.start_loads([])
    hooks.save([SaveSpec("r", Scope("acme"), tokens, ((1, 2, 3),))])
    before = [e for e in hooks.events() if isinstance(e, BlockStored) and e.medium == "disk"]
    assert sum(len(e.block_hashes) for e in before) == 3
    hooks.close(5)

    def first_events() -> list[BlockStored]:
        again = WorkerHooks(worker(tmp_path, cpu_caches(2)), async_load=False)
        try:
            return [e for e in again.events() if isinstance(e, BlockStored)]
        finally:
            again.close(5)

    after = first_events()
    assert [(e.block_hashes, e.token_ids, e.medium) for e in after] == [
        (e.block_hashes, e.token_ids, e.medium) for e in before
    ]
    (tmp_path / "disk" / "fleet" / "vllm-connector.journal").unlink()
    assert first_events() == []
