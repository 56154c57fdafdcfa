"""The disk tier: atomic writes, a warm restart, a hard byte cap, and every bad file
quarantined and counted, never served (design.md invariants 6 and 8)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixcache.storage import base as base_module
from prefixcache.storage import codec
from prefixcache.storage import disk as disk_module
from prefixcache.storage.base import TierError, TierFull
from prefixcache.storage.disk import FSYNC_POLICIES, MAX_KEY_BYTES, DiskStore
from prefixcache.storage.placed import Place

HERE = Path(__file__).resolve().parent
SMALL = (2, 2, 2, 4, 8)  # 256 items
BIG = (4, 2, 8, 16, 64)  # 65,536 float32 items: 256 KiB, so a SIGKILL lands mid-write often


def key_of(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4  # 16 bytes, like a block key


def frame_for(key: bytes, shape: tuple[int, ...] = SMALL) -> bytes:
    """A frame derived from its key alone, so that another process writes the same bytes."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    tokens = rng.integers(0, 2**31, shape[3], dtype="<u4").tobytes()
    return codec.encode(key, tokens, rng.standard_normal(shape).astype(np.float32))


def block_file(store: DiskStore, key: bytes) -> Path:
    return store.directory / "blocks" / key.hex()[:2] / f"{key.hex()}.blk"


def files_in(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def run_child(code: str, directory: Path) -> subprocess.Popen[str]:
    prelude = f"import sys; sys.path.insert(0, {str(HERE)!r}); from test_tiers_disk import *\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code, str(directory)], stdout=subprocess.PIPE, text=True, cwd=HERE
    )


# ---------------------------------------------------------------------------- round trip


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    frames: dict[bytes, bytes] = {}
    for i in range(40):
        key = rng.bytes(int(rng.integers(1, 33)))
        shape = tuple(int(d) for d in rng.integers(1, 5, 5))
        dtype = ["float32", "float16", "bfloat16"][i % 3]
        if dtype == "bfloat16":
            kv = rng.integers(0, 2**16, shape, dtype=np.uint16)
        else:
            kv = rng.standard_normal(shape).astype(dtype)
        frames[key] = codec.encode(key, b"\1\0\0\0", kv, dtype=dtype)
    with DiskStore(tmp_path, 1 << 20) as store:
        assert isinstance(store, DiskStore)
        for key, frame in frames.items():
            store.put(key, memoryview(frame))
        got = store.get_many(list(frames))
        assert got == list(frames.values())
        assert all(type(f) is bytes for f in got)
        assert store.used_bytes == sum(map(len, frames.values())) == store.stats.bytes_written == store.stats.bytes_read
        assert len(store) == len(frames) == store.stats.puts == store.stats.hits
        assert store.kind == "disk"
        assert not store.stats.errors
    assert files_in(tmp_path / "tmp") == []


def test_miss_replace_delete(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    a, b = key_of(1), key_of(2)
    assert store.get_many([a]) == [None] and store.stats.misses == 1
    store.put(a, frame_for(a))
    store.put(a, frame_for(a, (1, 2, 1, 4, 8)))  # replaced: the old size is freed
    assert store.used_bytes == len(frame_for(a, (1, 2, 1, 4, 8))) and len(store) == 1
    assert store.get_many([a, b]) == [frame_for(a, (1, 2, 1, 4, 8)), None]
    assert store.delete(a) and not store.delete(a)
    assert a not in store and store.used_bytes == 0 and store.stats.deletes == 1
    assert not block_file(store, a).exists()


def test_a_frame_takes_its_own_length_of_used_bytes(tmp_path: Path) -> None:
    """``footprint`` as the base says: the disk's ``used_bytes`` sums the frames' lengths."""
    store = DiskStore(tmp_path, 1 << 20)
    frame = frame_for(key_of(1))
    store.put(key_of(1), frame)
    assert store.footprint(len(frame)) == store.used_bytes == len(frame)


def test_put_refuses_what_is_not_a_frame_of_the_key(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    a, b = key_of(1), key_of(2)
    with pytest.raises(ValueError, match="frame is for key"):
        store.put(b, frame_for(a))
    with pytest.raises(codec.FrameError):
        store.put(a, b"not a frame at all, not even close")
    with pytest.raises(ValueError, match="its header says"):
        store.put(a, frame_for(a)[:-1])
    with pytest.raises(ValueError, match="names a file"):
        store.put(b"k" * (MAX_KEY_BYTES + 1), b"")
    with pytest.raises(TypeError):
        not_bytes: Any = "key"
        store.put(not_bytes, frame_for(a))
    assert len(store) == 0 and files_in(tmp_path) == []


def test_contains_prefix(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    chain = [key_of(i) for i in range(8)]
    for key in chain[:5]:
        store.put(key, frame_for(key))
    assert store.contains_prefix(chain) == 5
    assert store.contains_prefix(chain[:3]) == 3
    assert store.contains_prefix([]) == 0
    assert DiskStore(tmp_path, 1 << 20).contains_prefix(chain) == 5  # after a restart too


def test_close_is_idempotent_and_final(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    store.put(key_of(1), frame_for(key_of(1)))
    store.close()
    store.close()
    assert len(store) == 0 and store.get_many([key_of(1)]) == [None]
    with pytest.raises(TierError, match="closed"):
        store.put(key_of(1), frame_for(key_of(1)))


# ---------------------------------------------------------------------------- fsync


@pytest.mark.parametrize(("policy", "syncs_per_put"), [("none", 0), ("data", 1), ("full", 2)])
def test_fsync_policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str, syncs_per_put: int) -> None:
    store = DiskStore(tmp_path, 1 << 20, fsync=policy)
    calls: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(disk_module.os, "fsync", counting)
    keys = [key_of(i) for i in range(3)]
    for key in keys:
        store.put(key, frame_for(key))
    monkeypatch.undo()
    assert len(calls) == 3 * syncs_per_put
    assert DiskStore(tmp_path, 1 << 20, fsync=policy).get_many(keys) == [frame_for(k) for k in keys]


def test_unknown_fsync_policy_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="none, data, full") as info:
        DiskStore(tmp_path, 1 << 20, fsync="always")
    assert "'always'" in str(info.value) and FSYNC_POLICIES == ("none", "data", "full")


# ---------------------------------------------------------------------------- warm restart


def test_warm_restart_in_process(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = [key_of(i) for i in range(20)]
    with DiskStore(tmp_path, 1 << 20) as store:
        for key in keys:
            store.put(key, frame_for(key))
        used = store.used_bytes
    caplog.set_level(logging.INFO, logger="prefixcache.tiers")
    reopened = DiskStore(tmp_path, 1 << 20)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("event=tier_opened tier=disk") and f"blocks=20 bytes={used} rejected=0" in line
    assert sorted(reopened.keys()) == sorted(keys) and reopened.used_bytes == used
    assert reopened.get_many(keys) == [frame_for(k) for k in keys]
    assert not reopened.stats.errors


def test_warm_restart_in_a_fresh_process(tmp_path: Path) -> None:
    keys = [key_of(i) for i in range(10)]
    with DiskStore(tmp_path, 1 << 20) as store:
        for key in keys:
            store.put(key, frame_for(key))
    code = (
        "store = DiskStore(sys.argv[1], 1 << 20)\n"
        "keys = [key_of(i) for i in range(10)]\n"
        "assert store.get_many(keys) == [frame_for(k) for k in keys], 'frames differ'\n"
        "assert not store.stats.errors, store.stats.errors\n"
        "print(len(store))\n"
    )
    child = run_child(code, tmp_path)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and out.strip() == "10"


def test_lowered_cap_refuses_puts_until_under_it(tmp_path: Path) -> None:
    keys = [key_of(i) for i in range(4)]
    size = len(frame_for(keys[0]))
    with DiskStore(tmp_path, 4 * size) as store:
        for key in keys:
            store.put(key, frame_for(key))
    store = DiskStore(tmp_path, 2 * size)
    assert len(store) == 4 and store.used_bytes == 4 * size > store.capacity_bytes  # nothing dropped
    assert store.get_many(keys) == [frame_for(k) for k in keys]
    with pytest.raises(TierFull):
        store.put(keys[0], frame_for(keys[0]))  # even a same-size replace
    for key in keys[:3]:
        store.delete(key)
    store.put(keys[0], frame_for(keys[0]))  # under the cap again: this put brings it to the cap exactly
    assert store.used_bytes == 2 * size == store.capacity_bytes


# ---------------------------------------------------------------------------- bad files


def test_flipped_payload_bit_is_quarantined_and_never_served(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    a, b = key_of(1), key_of(2)
    store.put(a, frame_for(a))
    store.put(b, frame_for(b))
    path = block_file(store, a)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(data)
    assert store.get_many([a, b]) == [None, frame_for(b)]
    assert store.stats.errors["checksum"] == 1 and store.stats.misses == 1 and store.quarantined == 1
    assert a not in store and store.used_bytes == len(frame_for(b)) and not path.exists()
    assert [p.read_bytes() for p in files_in(tmp_path / "quarantine")] == [bytes(data)]
    assert store.get_many([a]) == [None]  # a plain miss now: not counted twice
    assert store.stats.errors["checksum"] == 1
    reopened = DiskStore(tmp_path, 1 << 20)
    assert a not in reopened and reopened.get_many([a]) == [None]


def test_flipped_header_bit_is_quarantined_on_open(tmp_path: Path) -> None:
    a = key_of(1)
    with DiskStore(tmp_path, 1 << 20) as store:
        store.put(a, frame_for(a))
        path = block_file(store, a)
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01  # the dtype code
    path.write_bytes(data)
    store = DiskStore(tmp_path, 1 << 20)
    assert a not in store and store.stats.errors["checksum"] == 1 and store.quarantined == 1
    assert store.get_many([a]) == [None]


@pytest.mark.parametrize("when", ["before open", "after open"])
def test_truncated_file_is_quarantined(tmp_path: Path, when: str) -> None:
    a = key_of(1)
    store = DiskStore(tmp_path, 1 << 20)
    store.put(a, frame_for(a))
    if when == "before open":
        store.close()
    path = block_file(store, a)
    path.write_bytes(path.read_bytes()[: len(frame_for(a)) // 2])
    if when == "before open":
        store = DiskStore(tmp_path, 1 << 20)
        assert a not in store
    assert store.get_many([a]) == [None]
    assert store.stats.errors["checksum"] == 1 and store.quarantined == 1 and store.used_bytes == 0
    assert len(files_in(tmp_path / "quarantine")) == 1 and not path.exists()


def test_deleted_file_is_a_counted_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    a = key_of(1)
    store.put(a, frame_for(a))
    block_file(store, a).unlink()
    assert store.get_many([a]) == [None]
    assert store.stats.errors["missing"] == 1 and store.stats.misses == 1
    assert a not in store and store.used_bytes == 0 and store.quarantined == 0


def test_stray_and_misnamed_files_are_quarantined_on_open(tmp_path: Path) -> None:
    a, b, c = key_of(1), key_of(2), key_of(3)
    with DiskStore(tmp_path, 1 << 20) as store:
        store.put(a, frame_for(a))
        store.put(c, frame_for(c))
    blocks = tmp_path / "blocks"
    block_file(store, b).write_bytes(frame_for(a))  # a whole frame of a, under b's name
    block_file(store, c).rename(blocks / "00" / block_file(store, c).name)  # the wrong fan-out dir
    (blocks / "ab" / "notes.txt").write_text("hello")
    (blocks / "README").write_text("hello")
    (blocks / "ab" / f"{a.hex().upper()}.blk").write_bytes(frame_for(a))
    store = DiskStore(tmp_path, 1 << 20)
    assert store.keys() == [a] and store.get_many([a, b, c]) == [frame_for(a), None, None]
    assert store.stats.errors["key"] == 1 and store.stats.errors["stray"] == 4 and store.quarantined == 5
    assert len(files_in(tmp_path / "quarantine")) == 5
    assert files_in(blocks) == [block_file(store, a)]


def test_leftover_temp_files_are_deleted_and_counted(tmp_path: Path) -> None:
    a = key_of(1)
    DiskStore(tmp_path, 1 << 20).put(a, frame_for(a))
    (tmp_path / "tmp" / f"{a.hex()}.dead.tmp").write_bytes(frame_for(a)[:50])
    (tmp_path / "tmp" / "other.tmp").write_bytes(b"")
    store = DiskStore(tmp_path, 1 << 20)
    assert store.stats.errors["partial"] == 2 and files_in(tmp_path / "tmp") == []
    assert store.get_many([a]) == [frame_for(a)]


# ---------------------------------------------------------------------------- full


def test_byte_cap_raises_tier_full_and_writes_nothing(tmp_path: Path) -> None:
    keys = [key_of(i) for i in range(3)]
    size = len(frame_for(keys[0]))
    store = DiskStore(tmp_path, 2 * size + size // 2)
    store.put(keys[0], frame_for(keys[0]))
    store.put(keys[1], frame_for(keys[1]))
    with pytest.raises(TierFull):
        store.put(keys[2], frame_for(keys[2]))
    assert keys[2] not in store and store.used_bytes == 2 * size and store.stats.puts == 2
    assert not block_file(store, keys[2]).exists() and files_in(tmp_path / "tmp") == []
    store.put(keys[1], frame_for(keys[1]))  # a replace frees the old size first
    store.delete(keys[0])
    store.put(keys[2], frame_for(keys[2]))
    assert sorted(store.keys()) == sorted(keys[1:])
    with pytest.raises(TierFull):
        DiskStore(tmp_path / "zero", 0).put(keys[0], frame_for(keys[0]))


def test_disk_full_enospc_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = key_of(1), key_of(2)
    store = DiskStore(tmp_path, 1 << 20)
    store.put(a, frame_for(a))
    real = os.write

    def half_then_full(fd: int, data: memoryview) -> int:
        real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(disk_module.os, "write", half_then_full)
        with pytest.raises(TierError, match="disk write failed") as info:
            store.put(b, frame_for(b))
        with pytest.raises(TierError):
            store.put(a, frame_for(a, (1, 2, 1, 4, 8)))  # a failed replace keeps the old frame
    assert not isinstance(info.value, TierFull)
    assert store.stats.errors["io"] == 2 and store.stats.puts == 1
    assert b not in store and not block_file(store, b).exists() and files_in(tmp_path / "tmp") == []
    assert store.get_many([a, b]) == [frame_for(a), None] and store.used_bytes == len(frame_for(a))


def test_write_errors_are_logged_once_a_minute_with_a_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prefixcache.tiers")
    now = [1000.0]
    monkeypatch.setattr(base_module.time, "monotonic", lambda: now[0])
    store = DiskStore(tmp_path, 1 << 20)

    def full(fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module.os, "write", full)
    for step in (0.0, 1.0, 1.0, 58.0):  # three failures in the first minute, a fourth a minute after the first
        now[0] += step
        with pytest.raises(TierError):
            store.put(key_of(1), frame_for(key_of(1)))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"event=tier_error store=disk:{tmp_path} kind=io total=1 unlogged_since_last=0 "
        "detail='write: No space left on device'",
        f"event=tier_error store=disk:{tmp_path} kind=io total=4 unlogged_since_last=2 "
        "detail='write: No space left on device'",
    ]
    assert store.stats.errors["io"] == 4


def test_failed_directory_sync_unpublishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = key_of(1)
    store = DiskStore(tmp_path, 1 << 20, fsync="full")

    def broken(path: Path) -> None:
        raise OSError(errno.EIO, "dir fsync failed")

    monkeypatch.setattr(disk_module, "_fsync_dir", broken)
    with pytest.raises(TierError, match="disk write failed"):
        store.put(a, frame_for(a))
    assert a not in store and store.used_bytes == 0 and files_in(tmp_path / "blocks") == []
    assert store.stats.errors["io"] == 1


# ---------------------------------------------------------------------------- crash


@pytest.mark.parametrize("hang", [True, False], ids=["mid-write", "at-random"])
def test_kill_9_mid_write_leaves_only_whole_verified_frames(tmp_path: Path, hang: bool) -> None:
    # NOTE: "mid-write" makes the child's 41st put write half its frame and hang, so the
    # kill lands inside a write every time; "at-random" kills a free-running loop.
    code = (
        "import os, time\n"
        "from prefixcache.storage import disk as disk_module\n"
        "store = DiskStore(sys.argv[1], 1 << 30, fsync='none')\n"
        "frames = {key_of(i): frame_for(key_of(i), BIG) for i in range(16)}\n"
        "real, n = os.write, 0\n"
        "def write(fd, data):\n"
        f"    if {hang} and n == 40:\n"
        "        real(fd, data[: len(data) // 2])\n"
        "        print('mid', flush=True)\n"
        "        time.sleep(60)\n"
        "    return real(fd, data)\n"
        "disk_module.os.write = write\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    key = key_of(n % 16)\n"
        "    store.put(key, frames[key])\n"
        "    print(n % 16, flush=True)\n"
        "    n += 1\n"
    )
    child = run_child(code, tmp_path)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    acked: set[bytes] = set()
    deadline = time.monotonic() + 0.3
    while (line := child.stdout.readline().strip()) != "mid":
        acked.add(key_of(int(line)))
        if not hang and time.monotonic() > deadline and len(acked) >= 4:
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    child.stdout.close()
    assert child.returncode == -signal.SIGKILL

    store = DiskStore(tmp_path, 1 << 30)
    assert files_in(tmp_path / "tmp") == []
    assert acked <= set(store.keys())  # every acknowledged put survived the crash
    for key, frame in zip(store.keys(), store.get_many(store.keys()), strict=True):
        assert frame == frame_for(key, BIG)
        assert frame is not None and codec.decode(frame, key=key).shape == BIG
    assert store.stats.errors.keys() <= {"partial"} and store.quarantined == 0
    if hang:  # the half-written replace of key 8: deleted, and key 8's old frame still served
        assert store.stats.errors["partial"] == 1 and len(store) == 16


# ---------------------------------------------------------------------------- bounded reads


def _unhung(fn: Any) -> Any:
    """``fn()`` on a thread: a read that blocks (a FIFO's open) fails the test instead of
    hanging it. NOTE: the bound only turns a hang into a failure; the read takes microseconds."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(60)
    assert out, "the read blocked"
    return out[0]


@pytest.mark.parametrize("thing", ["fifo", "link to /dev/zero", "longer than a frame"])
@pytest.mark.parametrize("placed", [False, True], ids=["whole", "placed"])
def test_a_name_that_is_no_frame_file_is_a_miss_never_a_hang_or_an_endless_read(
    tmp_path: Path, thing: str, placed: bool
) -> None:
    """Whoever writes the disk tier's folder may put a FIFO, a link to ``/dev/zero`` or a
    huge (sparse) file under a block's name: a read neither waits nor reads more than a
    frame of the tier's layout; the name is a counted miss, quarantined (issue #39)."""
    a, b = key_of(1), key_of(2)
    frame = frame_for(a)
    store = DiskStore(tmp_path, 1 << 20, max_frame_bytes=len(frame))
    store.put(a, frame)
    store.put(b, frame_for(b))
    path = block_file(store, a)
    path.unlink()
    if thing == "fifo":
        os.mkfifo(path)
    elif thing == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        with path.open("wb") as f:
            f.write(frame)
            f.truncate(4 << 30)  # sparse: no disk is used
    if placed:
        buffer = bytearray(len(frame))
        out = np.zeros(SMALL, np.float32)
        place = Place(memoryview(out).cast("B"), 0, 32, 32, 32, 32)
        assert _unhung(lambda: store.read_placed(a, buffer, place)) is None
    else:
        assert _unhung(lambda: store.get_many([a, b])) == [None, frame_for(b)]
    assert sum(store.stats.errors.values()) == 1 and a not in store
    assert not path.exists() and not path.is_symlink()  # quarantined, not deleted: an operator may look
    assert store.get_many([a]) == [None]
    with pytest.raises(ValueError, match="max_frame_bytes"):
        DiskStore(tmp_path, 1 << 20, max_frame_bytes=0)
