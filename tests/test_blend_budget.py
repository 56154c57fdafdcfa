"""Blend never raises what the tiers may take: chunks are blocks of the one cache, so
with ``[blend]`` on or off the cache gets every tier of ``[cache]`` whole, and chunks and
prompts' blocks share it under one policy. ``blend.chunk_share`` (which once split the
tiers) is still accepted, so old files load, and said to be ignored. All at the
settings level or with a tiny layout: no model is loaded."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixcache.blend.chunks import Chunks
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.hashing import CacheContext
from prefixcache.settings import Settings, load_settings
from prefixcache.storage import codec
from prefixcache.storage.memory import MemoryStore

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


@pytest.mark.parametrize("capacity", [{}, {"capacity_tokens": 50_000}], ids=["derived-from-tiers", "tokens"])
def test_blend_on_or_off_the_cache_gets_every_tier_whole(tmp_path: Path, capacity: dict[str, Any]) -> None:
    off, on = settings(tmp_path, **capacity), settings(tmp_path, {}, **capacity)
    assert on.blend.enabled and not off.blend.enabled
    whole = dataclasses.replace(off.cache, kv_layout=SMOLLM2)
    assert on.cache_config(SMOLLM2) == off.cache_config(SMOLLM2) == whole
    assert [t.capacity_bytes for t in whole.tiers] == [GiB + 7, 20 * GiB + 3]


def test_chunk_share_is_accepted_and_said_to_be_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="prefixcache.settings"):
        old = settings(tmp_path, {"chunk_share": 0.4})  # an old file's setting still loads
    assert "blend.chunk_share = 0.4 is deprecated and ignored" in caplog.text
    assert old.cache_config(SMOLLM2) == settings(tmp_path, {}).cache_config(SMOLLM2)
    assert not hasattr(old.blend.config(), "chunk_share")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefixcache.settings"):
        settings(tmp_path, {})
        env = load_settings(env={"PREFIXCACHE_BLEND_TENANTS": "local", "PREFIXCACHE_BLEND_CHUNK_SHARE": "0.5"})
    assert env.blend.chunk_share == 0.5 and caplog.text.count("chunk_share") == 1  # only when set


@pytest.mark.parametrize("share", [0, 1, -0.25, 1.5, "half", float("nan"), float("inf")])
def test_bad_chunk_shares_are_still_clear_errors(tmp_path: Path, share: object) -> None:
    with pytest.raises(ValueError, match=r"^invalid setting blend\.chunk_share: "):
        settings(tmp_path, {"chunk_share": share})


def test_chunks_and_blocks_share_one_tier_under_one_policy() -> None:
    layout = KVLayout(1, 1, 2, "float32")
    slot = MemoryStore.slot_for(codec.encoded_size(layout.shape(4), layout.dtype, 16))
    memory = TierConfig(kind="memory", capacity_bytes=4 * slot)
    cache = PrefixCache(CacheConfig(block_size=4, kv_layout=layout, tiers=(memory,)))
    chunks, ctx = Chunks(cache), CacheContext("acme", "m")
    prompt, doc = list(range(8)), list(range(100, 108))
    cache.insert(prompt, ctx, kv=np.zeros(layout.shape(8), np.float32))
    assert chunks.put(ctx, doc, np.ones(layout.shape(8), np.float32)) == 8  # the tier is full now
    assert cache.stats().tiers[0].used_bytes <= memory.capacity_bytes
    chunks.put(ctx, [t + 1000 for t in doc], np.ones(layout.shape(8), np.float32))
    assert cache.peek(prompt, ctx).cached_tokens == 0  # the least recent went, a prompt's here
    assert chunks.contains(ctx, doc)
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
