"""Load bandwidth of a 2,048-token prefix of SmolLM2-135M-shaped KV from each tier store.

SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float16; block size 16, so the
prefix is 128 blocks of 368,640 payload bytes (47 MB). "Load" is what a hit costs: the
store's ``get_many`` of the 128 keys, every frame verified by the codec (checksums),
and each block's KV copied into one contiguous destination array ready for the model.

Each tier is printed beside its physical baseline, measured in the same run on the same
bytes: a numpy copy for memory; reading the same files with plain ``open().read()`` for
disk (page cache warm for both; the bytes read are kept, as a load keeps them); and
redis-py ``GET``s of the same raw values for Redis (a server this script starts on
loopback). Targets (the storage issue): memory >= 70 %
of the copy's bandwidth, disk >= 60 % of the plain read, Redis >= 70 % of raw redis-py.

NOTE: this measures the stores and the codec; the tiered cache that will call them
(promotion, demotion, prefetch) is not built yet, and its load path will be measured here.

Run:  .venv/bin/python benchmarks/bench_tiers.py
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from prefixcache import codec
from prefixcache.tiers import DiskStore, MemoryStore, TierStore

SHAPE = (30, 2, 3, 16, 64)  # [layers, 2, kv_heads, block_tokens, head_dim]
BLOCKS = 2048 // 16
TOKENS = np.arange(16, dtype="<u4").tobytes()
TARGETS = {"memory": 0.70, "disk": 0.60, "redis": 0.70}


def blocks() -> tuple[list[bytes], list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    keys = [i.to_bytes(16, "little") for i in range(BLOCKS)]
    kvs = [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(BLOCKS)]
    frames = [codec.encode(k, TOKENS, kv) for k, kv in zip(keys, kvs, strict=True)]
    return keys, frames, kvs


def best_seconds(fn: Callable[[], object], repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load(store: TierStore, keys: list[bytes], dest: np.ndarray) -> None:
    """A hit: fetch the frames, verify them, copy each block's KV into ``dest``."""
    for i, (key, frame) in enumerate(zip(keys, store.get_many(keys), strict=True)):
        assert frame is not None
        # A store that verifies its reads has hashed this payload already: hash it once.
        check = not store.verifies_reads
        dest[i] = codec.decode(frame, key=key, tokens=TOKENS, shape=SHAPE, dtype="float16", check_payload=check)


def report(name: str, ours: float, base: float, base_name: str, nbytes: int) -> None:
    ratio = base / ours
    verdict = "met" if ratio >= TARGETS[name] else "NOT met"
    print(
        f"{name:>6}: load {nbytes / ours / 1e9:6.2f} GB/s | {base_name} {nbytes / base / 1e9:6.2f} GB/s"
        f" | {ratio:5.0%} of baseline (target {TARGETS[name]:.0%}: {verdict})"
    )


def bench_memory(keys: list[bytes], frames: list[bytes], kvs: list[np.ndarray], dest: np.ndarray) -> None:
    store = MemoryStore.for_blocks(BLOCKS, SHAPE, "float16")
    for key, frame in zip(keys, frames, strict=True):
        store.put(key, frame)
    source = np.stack(kvs)
    base = best_seconds(lambda: np.copyto(dest, source))
    ours = best_seconds(lambda: load(store, keys, dest))
    report("memory", ours, base, "numpy copy", source.nbytes)


def bench_disk(keys: list[bytes], frames: list[bytes], dest: np.ndarray, root: Path) -> None:
    store = DiskStore(root / "disk", capacity_bytes=1 << 32, fsync="none")
    for key, frame in zip(keys, frames, strict=True):
        store.put(key, frame)
    paths = sorted((root / "disk" / "blocks").rglob("*.blk"))

    def plain() -> list[bytes]:
        out = []  # NOTE: kept, as a load keeps them: reading into freed buffers would flatter it
        for path in paths:
            with open(path, "rb") as f:
                out.append(f.read())
        return out

    base = best_seconds(plain)
    ours = best_seconds(lambda: load(store, keys, dest))
    report("disk", ours, base, "plain file read", dest.nbytes)
    store.close()


def bench_redis(keys: list[bytes], frames: list[bytes], dest: np.ndarray, root: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import redis

    from prefixcache.tiers.redis import RedisStore
    from redis_server import RedisServer  # the tests' helper: a real server on loopback

    (root / "redis").mkdir()
    server = RedisServer(root / "redis").start()
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        store = RedisStore(url, capacity_bytes=1 << 32, namespace="bench", read_timeout=5.0)
        store.put_many(list(zip(keys, frames, strict=True)))
        raw = redis.Redis.from_url(url)
        names = [b"bench:" + key for key in keys]
        base = best_seconds(lambda: [raw.get(name) for name in names])
        ours = best_seconds(lambda: load(store, keys, dest))
        report("redis", ours, base, "redis-py GETs", dest.nbytes)
        store.close()
        raw.close()
    finally:
        server.stop()


def main() -> None:
    keys, frames, kvs = blocks()
    dest = np.empty((BLOCKS, *SHAPE), dtype=np.float16)
    print(f"2,048-token prefix: {BLOCKS} blocks of {SHAPE} float16, {dest.nbytes / 1e6:.1f} MB")
    bench_memory(keys, frames, kvs, dest)
    root = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    try:
        bench_disk(keys, frames, dest, root)
        if shutil.which("redis-server") or Path("/usr/bin/redis-server").exists():
            bench_redis(keys, frames, dest, root)
        else:
            print(" redis: skipped (no redis-server; `make test` installs it)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
