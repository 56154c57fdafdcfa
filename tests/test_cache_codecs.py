"""Tiers that store compressed frames (``TierConfig.codec``): a block keeps its key in
every codec, a load gives exactly what the tier's codec decodes (never another block's
bytes, never a frame it cannot trust), a tier of N bytes holds more blocks, and what a
codec cannot hold or a damaged compressed frame is a counted error, never wrong KV."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash

from guard_store import guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache.cache import PrefixCache
from prefixcache.config import KV_CODECS, CacheConfig, KVLayout, TierConfig
from prefixcache.storage import codec
from prefixcache.storage.memory import MemoryStore
from redis_server import REDIS_SERVER, RedisServer
from tier_worker import BLOCK, CTX, cache_with, kv_for, prompt
from tier_worker import layout as tiny_layout

CODECS = [c for c in KV_CODECS if c != "raw"]
BIG = 1 << 30
KEY = b"k" * 16


def needs_redis(test: Callable[..., None]) -> Callable[..., None]:
    skip = pytest.mark.skipif(not Path(REDIS_SERVER).exists(), reason="redis-server is not installed")
    return pytest.mark.redis(skip(test))


def through(kv: np.ndarray, name: str, dtype: str = "float16") -> np.ndarray:
    """``kv`` (one block) as a tier of codec ``name`` gives it back."""
    frame = codec.encode(KEY, b"", np.ascontiguousarray(kv), dtype=dtype, codec=name)
    out: np.ndarray = codec.decode(frame, key=KEY)
    return out if out.dtype == kv.dtype else out.view(kv.dtype)  # bfloat16 as ml_dtypes -> its raw bits


def expected(tokens: list[int], names: list[str], dtype: str = "float16") -> np.ndarray:
    """The KV a load of ``tokens`` must give when block i came from a tier of ``names[i]``."""
    kv = kv_for(tokens, dtype)
    out = kv.copy()
    for i, name in enumerate(names):
        lo, hi = i * BLOCK, min((i + 1) * BLOCK, len(tokens))
        out[:, :, :, lo:hi] = through(kv[:, :, :, lo:hi], name, dtype)
    return out


def load(cache: PrefixCache, tokens: list[int]) -> tuple[int, np.ndarray, dict[str, int]]:
    with cache.match(tokens, CTX) as m:
        loaded = cache.load(m)
        return loaded.tokens, loaded.kv, loaded.tier_tokens


def frame_codecs(cache: PrefixCache, tier: int, tokens: list[int]) -> list[str]:
    """The codec named by the header of each of ``tokens``' blocks in ``tier``'s store."""
    books = cache._ledger.books
    assert books is not None and cache.flush(timeout=30)
    store = books.tiers[tier].store
    keys = [b.key for b in cache._ledger.tree.nodes.values() if b.res is not None and b.res.held & (1 << tier)]
    return sorted({codec.peek_header(bytes(f)).codec for f in store.get_many(keys) if f is not None})


def tier(kind: str, name: str, tmp: Path, **kwargs: object) -> TierConfig:
    extra: dict[str, object] = {"path": str(tmp), "fsync": "none"} if kind == "disk" else {}
    return TierConfig(kind=kind, capacity_bytes=BIG, codec=name, **extra, **kwargs)  # type: ignore[arg-type]


# ============================================================================ round trips


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_codec_tier_gives_back_what_its_codec_decodes(tmp_path: Path, kind: str, name: str, dtype: str) -> None:
    a = prompt(1)
    with cache_with(tier(kind, name, tmp_path), dtype=dtype) as cache:
        assert cache.insert(a, CTX, kv=kv_for(a, dtype)) == len(a)
        got, kv, _ = load(cache, a)
        assert got == len(a)
        want = expected(a, [name] * 6, dtype)
        assert np.array_equal(kv.view(np.uint8), want.view(np.uint8))
        assert frame_codecs(cache, 0, a) == [name]


def test_same_key_in_every_codec_and_a_restart_reads_another_codecs_disk(tmp_path: Path) -> None:
    """Keys do not change with the codec: a disk written in int8 is read by a cache whose
    disk tier now says int4 (each frame is decoded by the codec its header names)."""
    a = prompt(2)
    with cache_with(tier("disk", "int8", tmp_path)) as cache:
        cache.insert(a, CTX, kv=kv_for(a))
        keys = sorted(b.key for b in cache._ledger.tree.nodes.values())
    with cache_with(tier("memory", "raw", tmp_path)) as raw:
        raw.insert(a, CTX, kv=kv_for(a))
        assert sorted(b.key for b in raw._ledger.tree.nodes.values()) == keys
    with cache_with(tier("disk", "int4", tmp_path)) as cache:
        got, kv, tiers = load(cache, a)
        assert got == len(a) and tiers == {"disk": len(a)}
        assert np.array_equal(kv, expected(a, ["int8"] * 6))


def test_demoted_to_an_int8_disk_and_promoted_back_to_raw_memory(tmp_path: Path) -> None:
    slot = codec.encoded_size(tiny_layout().shape(BLOCK), "float16", 16)
    memory = TierConfig(kind="memory", capacity_bytes=6 * ((slot + 15) // 16 * 16))
    with cache_with(memory, tier("disk", "int8", tmp_path)) as cache:
        a, b = prompt(1), prompt(2)  # 6 blocks each, sharing the first
        cache.insert(a, CTX, kv=kv_for(a))
        cache.insert(b, CTX, kv=kv_for(b))  # a's own 5 blocks go down to disk, as int8
        assert frame_codecs(cache, 1, a) == ["int8"]
        got, kv, tiers = load(cache, a)
        assert (got, tiers) == (24, {"memory": 4, "disk": 20})
        want = expected(a, ["raw"] + ["int8"] * 5)
        assert np.array_equal(kv, want)
        got, kv, tiers = load(cache, a)  # promoted: memory holds raw frames of the decoded KV
        assert (got, tiers) == (24, {"memory": 24, "disk": 0})
        assert np.array_equal(kv, want)
        assert frame_codecs(cache, 0, a) == ["raw"]


# ============================================================================ capacity


@pytest.mark.parametrize("name", CODECS)
def test_a_tier_of_n_bytes_holds_more_blocks_in_a_smaller_codec(name: str) -> None:
    lay = KVLayout(layers=2, kv_heads=2, head_dim=64, dtype="float32")
    size = 64 * lay.bytes_per_token * 16
    counts = {}
    for c in ("raw", name):
        tc = TierConfig(kind="memory", capacity_bytes=size, codec=c)
        config = CacheConfig(block_size=16, kv_layout=lay, tiers=(tc,))
        with PrefixCache(config) as cache:
            counts[c] = cache._ledger.books.tiers[0].capacity  # type: ignore[union-attr]
            slot = MemoryStore.slot_for(codec.encoded_size(lay.shape(16), "float32", 16, c))
            assert counts[c] == size // slot
            assert config.capacity == config.tier_tokens(tc) == size * 16 // lay.stored_bytes(16, c)
    ratio = counts[name] / counts["raw"]
    assert ratio >= {"bf16": 1.9, "int8": 3.4, "int4": 5.5}[name], counts


# ============================================================================ bad values, bad frames


def test_values_a_codec_cannot_hold_are_a_counted_write_error_never_wrong_kv(tmp_path: Path) -> None:
    a = prompt(3, 2)
    kv = kv_for(a)
    kv[0, 0, 0, BLOCK + 1, 0] = np.inf  # the second block cannot be int8
    raw = TierConfig(kind="memory", capacity_bytes=BIG, write="through")
    with cache_with(raw, tier("disk", "int8", tmp_path)) as cache:
        cache.insert(a, CTX, kv=kv)
        assert cache.flush(timeout=30)
        disk = cache.stats().tiers[1]
        assert disk.errors.get("codec") == 1 and disk.blocks == 1
        got, loaded, _ = load(cache, a)
        assert got == len(a) and np.array_equal(loaded, kv)  # raw memory keeps the exact values
    with cache_with(tier("memory", "int8", tmp_path)) as cache:
        cache.insert(a, CTX, kv=kv)
        assert cache.stats().tiers[0].errors.get("codec") == 1
        got, loaded, _ = load(cache, a)
        assert got == BLOCK and np.array_equal(loaded, expected(a[:BLOCK], ["int8"]))


def reseal(frame: bytearray) -> bytes:
    """``frame`` with its payload and header checksums made to match what it now holds:
    damage only a check of the values themselves can catch. Offsets from the layout in
    storage/codec.py: 14 fixed bytes, 5 dims, the key, the token checksum, P, then the
    payload checksum; the header checksum is the header's last 8 bytes."""
    (h,) = struct.unpack_from("<H", frame, 6)
    (key_len,) = struct.unpack_from("<H", frame, 12)
    at = 14 + 20 + key_len + 16 + 8
    frame[at : at + 16] = xxhash.xxh3_128_digest(bytes(frame[h:]))
    frame[h - 8 : h] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(frame[: h - 8])))
    return bytes(frame)


@pytest.mark.parametrize("how", ["flip", "truncate", "nan-scale", "unknown-codec"])
def test_a_damaged_compressed_frame_on_disk_is_a_counted_miss(tmp_path: Path, how: str) -> None:
    a = prompt(4)
    with cache_with(tier("disk", "int8", tmp_path)) as cache:
        cache.insert(a, CTX, kv=kv_for(a))
        blocks = sorted(cache._ledger.tree.nodes.values(), key=lambda b: b.end)
        disk = cache._ledger.books.tiers[0].store  # type: ignore[union-attr]
        path = disk._path(blocks[3].key)  # type: ignore[attr-defined]
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[-5] ^= 0x10
        elif how == "truncate":
            del data[-7:]
        elif how == "nan-scale":
            data[-2:] = np.array([np.nan], dtype="<f2").tobytes()  # the last value scale
            data = bytearray(reseal(data))
        else:
            data[10] = 0xEE  # the codec byte: a codec this reader does not know
            data = bytearray(reseal(data))
        path.write_bytes(bytes(data))
        got, kv, _ = load(cache, a)
        assert got == 12  # blocks 0-2, never block 3's bytes
        assert np.array_equal(kv, expected(a[:12], ["int8"] * 3))
        assert sum(cache.stats().tiers[0].errors.values()) >= 1


@needs_redis
def test_two_caches_share_int8_frames_through_redis(redis_server: RedisServer) -> None:
    a = prompt(5)
    rds = TierConfig(kind="redis", capacity_bytes=BIG, url=redis_server.url, codec="int8")
    with cache_with(rds) as one:
        one.insert(a, CTX, kv=kv_for(a))
        assert one.flush(timeout=30)
    with cache_with(TierConfig(kind="memory", capacity_bytes=BIG), rds) as two:
        got, kv, tiers = load(two, a)
        assert got == len(a) and tiers.get("redis") == len(a)
        assert np.array_equal(kv, expected(a, ["int8"] * 6))
        got, kv, tiers = load(two, a)  # now from raw memory: the same decoded values
        assert tiers == {"memory": len(a), "redis": 0} and np.array_equal(kv, expected(a, ["int8"] * 6))


# ============================================================================ configuration


def test_a_tier_codec_is_checked_with_a_teaching_error(tmp_path: Path) -> None:
    from prefixcache.settings import load_settings

    with pytest.raises(ValueError, match="unknown tier codec 'int9'; valid: raw, bf16, int8, int4"):
        TierConfig(kind="memory", capacity_bytes=BIG, codec="int9")
    with pytest.raises(ValueError, match="a device tier stores raw frames"):
        TierConfig(kind="device", capacity_bytes=BIG, codec="int8")
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[[cache.tiers]]\nkind = "memory"\ncapacity_bytes = 1048576\n'
        f'[[cache.tiers]]\nkind = "disk"\ncapacity_bytes = 1048576\npath = "{tmp_path}"\ncodec = "int8"\n'
    )
    tiers = load_settings(toml, env={}).cache.tiers
    assert [t.codec for t in tiers] == ["raw", "int8"]
    toml.write_text(toml.read_text().replace('"int8"', '"zstd"'))
    with pytest.raises(ValueError, match=r"cache\.tiers: unknown tier codec .zstd."):
        load_settings(toml, env={})
