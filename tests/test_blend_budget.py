"""Blend never raises what the tiers may take: with ``[blend]`` on, every tier of
``[cache]`` is split between the block cache and the chunk store (``chunk_share``), the
two parts adding up to the configured capacity; off, the block cache gets it whole. A
bad share, or one too small for a single frame of a tier, is a clear error at start.
All at the settings level: no model is loaded."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from prefixcache.blend.chunks import ChunkStore
from prefixcache.blend.serve_types import split_tiers
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.server.settings import Settings, load_settings

SMOLLM2 = KVLayout(30, 3, 64, "float32")  # 46080 bytes of KV per token
MiB, GiB = 1 << 20, 1 << 30
KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}


def tiers(tmp: Path, memory: int = GiB + 7, disk: int = 20 * GiB + 3) -> list[dict[str, Any]]:
    return [
        {"kind": "memory", "capacity_bytes": memory, "write": "through"},
        {"kind": "disk", "capacity_bytes": disk, "path": str(tmp / "disk"), "write": "through"},
    ]


def settings(tmp: Path, blend: dict[str, Any] | None = None, **cache: Any) -> Settings:
    overrides: dict[str, dict[str, Any]] = {
        "auth": {"api_keys": KEYS},
        "cache": {"tiers": tiers(tmp)} | cache,
    }
    if blend is not None:
        overrides["blend"] = {"tenants": ["acme"]} | blend
    return load_settings(env={}, overrides=overrides)


CAPACITIES = [
    pytest.param({}, id="derived-from-tiers"),
    pytest.param({"capacity_tokens": 50_000}, id="tokens"),
    pytest.param({"capacity_bytes": 2 * GiB, "bytes_per_token": SMOLLM2.bytes_per_token}, id="bytes"),
]


@pytest.mark.parametrize("share", [0.25, 0.1, 0.6])
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_blend_on_splits_every_tier_between_blocks_and_chunks(
    tmp_path: Path, share: float, capacity: dict[str, Any]
) -> None:
    configured = settings(tmp_path, **capacity).cache.tiers
    on = settings(tmp_path, {"chunk_share": share}, **capacity)
    split = on.tier_split(SMOLLM2)
    assert split.chunks is not None and on.cache_config(SMOLLM2) == split.cache
    assert [t.kind for t in configured] == ["memory", "disk"]
    for whole, blocks, chunks in zip(configured, split.cache.tiers, split.chunks.tiers, strict=True):
        assert blocks.capacity_bytes + chunks.capacity_bytes == whole.capacity_bytes
        assert chunks.capacity_bytes == int(whole.capacity_bytes * share)
        assert dataclasses.replace(blocks, capacity_bytes=whole.capacity_bytes) == whole  # kind, path, policy kept
        assert dataclasses.replace(chunks, capacity_bytes=whole.capacity_bytes) == whole
    assert split.cache.kv_layout == split.chunks.kv_layout == SMOLLM2
    assert split.chunks.capacity == split.cache.capacity  # partitioned pools: the same fractions of each side


def test_blend_off_gives_the_block_cache_every_tier_whole(tmp_path: Path) -> None:
    off = settings(tmp_path)
    assert not off.blend.enabled
    split = off.tier_split(SMOLLM2)
    assert split.chunks is None
    assert split.cache == off.cache_config(SMOLLM2) == dataclasses.replace(off.cache, kv_layout=SMOLLM2)
    no_tenants = load_settings(env={"PREFIXCACHE_BLEND_CHUNK_SHARE": "0.5"})  # a share alone changes nothing
    assert no_tenants.cache_config(SMOLLM2) == dataclasses.replace(no_tenants.cache, kv_layout=SMOLLM2)


def test_the_default_share_is_a_quarter_and_the_environment_sets_it(tmp_path: Path) -> None:
    assert settings(tmp_path, {}).blend.config().chunk_share == 0.25
    env = {"PREFIXCACHE_BLEND_TENANTS": "local", "PREFIXCACHE_BLEND_CHUNK_SHARE": "0.4"}
    split = load_settings(env=env).tier_split(SMOLLM2)
    assert split.chunks is not None
    assert [t.capacity_bytes for t in split.chunks.tiers] == [int(0.4 * 2 * GiB), int(0.4 * 20 * GiB)]


@pytest.mark.parametrize("share", [0, 1, -0.25, 1.5, "half", float("nan"), float("inf")])
def test_bad_chunk_shares_are_clear_errors(tmp_path: Path, share: object) -> None:
    with pytest.raises(ValueError, match=r"^invalid setting blend\.chunk_share: "):
        settings(tmp_path, {"chunk_share": share})


@pytest.mark.parametrize("share", [0.0, 1.0, -1.0])
def test_blend_config_refuses_a_share_outside_zero_and_one(share: float) -> None:
    base = settings(Path("/tmp"), {}).blend.config()
    with pytest.raises(ValueError, match="chunk_share must be above 0 and below 1"):
        dataclasses.replace(base, chunk_share=share)


def test_a_share_too_small_for_one_chunk_slot_names_the_tier_and_the_setting(tmp_path: Path) -> None:
    # 64 MiB of memory: a quarter is 16 MiB, less than one slot of 512 tokens' KV (about 22.5 MiB)
    small = settings(tmp_path, {}, tiers=tiers(tmp_path, memory=64 * MiB))
    with pytest.raises(ValueError, match=r"chunk_share = 0\.25 of tier 'memory'") as error:
        small.tier_split(SMOLLM2)
    assert "less than one chunk of blend.max_chunk_tokens = 512" in str(error.value)
    fits = settings(tmp_path, {"max_chunk_tokens": 256}, tiers=tiers(tmp_path, memory=64 * MiB))
    assert fits.tier_split(SMOLLM2).chunks is not None  # smaller slots fit the same share
    disk = settings(tmp_path, {}, tiers=tiers(tmp_path, disk=64 * MiB))
    with pytest.raises(ValueError, match=r"of tier 'disk'"):
        disk.tier_split(SMOLLM2)


def test_a_share_that_leaves_the_block_cache_no_block_is_an_error(tmp_path: Path) -> None:
    blend = {"chunk_share": 0.999, "min_chunk_tokens": 16, "max_chunk_tokens": 16}
    greedy = settings(tmp_path, blend, tiers=tiers(tmp_path, memory=8 * MiB))
    with pytest.raises(ValueError, match=r"leaves the block cache \d+ bytes, less than one block of 16 tokens"):
        greedy.tier_split(SMOLLM2)


def test_partitioned_quotas_above_the_smaller_block_cache_are_an_error_naming_the_share(tmp_path: Path) -> None:
    memory = TierConfig(kind="memory", capacity_bytes=GiB)
    whole = GiB // SMOLLM2.bytes_per_token  # the capacity the tier derives
    config = CacheConfig(isolation="partitioned", quotas={"acme": whole - 10}, tiers=(memory,), kv_layout=SMOLLM2)
    blend = settings(tmp_path, {}).blend.config()
    with pytest.raises(ValueError, match=r"blend\.chunk_share = 0\.25 leaves the block cache too small: .*quotas"):
        split_tiers(config, blend)
    fits = dataclasses.replace(config, quotas={"acme": whole // 2})
    split = split_tiers(fits, blend)
    assert split.chunks is not None
    assert split.chunks.capacity == split.cache.capacity == (GiB - GiB // 4) // SMOLLM2.bytes_per_token


def test_the_stores_opened_on_the_split_hold_no_more_than_the_configured_tier(tmp_path: Path) -> None:
    layout = KVLayout(2, 1, 8, "float16")  # a small model: the slabs stay small
    memory = TierConfig(kind="memory", capacity_bytes=4 * MiB)
    config = CacheConfig(block_size=16, kv_layout=layout, tiers=(memory,))
    blend = dataclasses.replace(settings(tmp_path, {}).blend.config(), max_chunk_tokens=64)
    split = split_tiers(config, blend)
    assert split.chunks is not None
    cache, chunks = PrefixCache(split.cache), ChunkStore(split.chunks, max_chunk_tokens=64)
    try:
        held = cache.stats().tiers[0].capacity_bytes + chunks.config.tiers[0].capacity_bytes
        assert held <= memory.capacity_bytes
    finally:
        chunks.close()
        cache.close()


def test_each_plan_setting_builds_its_plan_with_its_own_gate_name(tmp_path: Path) -> None:
    """``plan`` picks the recompute plan; the gate store keys each under its own name, so
    figures measured for one plan never pass another."""
    from prefixcache.blend.gate import plan_name
    from prefixcache.blend.plan import CacheBlend, Epic, EpicBlend

    plans = {
        name: settings(tmp_path, {"plan": name, "k": 8, "r": 15.0}).blend.config().plan
        for name in ("epic", "cacheblend", "epicblend")
    }
    assert plans == {"epic": Epic(8), "cacheblend": CacheBlend(15.0, 1), "epicblend": EpicBlend(8, 15.0, 1)}
    assert len({plan_name(p) for p in plans.values()}) == 3
    with pytest.raises(ValueError, match=r"blend\.plan"):
        settings(tmp_path, {"plan": "fast"})
