"""The connector's KV events in vLLM's own schema (its msgspec structs, encoded as its
ZMQ publisher encodes them), from a real cache's stores and removals."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from prefixcache.config import CacheConfig, TierConfig
from prefixcache.integrations.vllm.connector import PrefixCacheConnector, PrefixCacheEvents
from prefixcache.integrations.vllm.paged import PagedKV
from prefixcache.integrations.vllm.scope import Scope
from prefixcache.integrations.vllm.wall import Wall
from prefixcache.integrations.vllm.worker import ConnectorWorker, SaveSpec
from prefixcache.integrations.vllm.worker_hooks import WorkerHooks

N = 4


def test_stores_and_removals_become_vllm_events_with_the_tier_kind_as_medium(tmp_path: Path) -> None:
    caches = {f"l{i}": torch.randn(6, 2, N, 16) for i in range(2)}
    config = CacheConfig(tiers=(TierConfig(kind="memory", capacity_bytes=1 << 20, name="ram"),), writer="inline")
    worker = ConnectorWorker(config, PagedKV(caches, kv_heads=2, head_dim=8, block_size=N), "m@1")
    connector = PrefixCacheConnector.__new__(PrefixCacheConnector)  # the worker half alone, without an engine
    connector.wall, connector.block_size = Wall(), N
    connector._hooks = WorkerHooks(worker, wall=connector.wall)
    worker.save(SaveSpec("r", Scope("acme"), tuple(range(2 * N)), ((0, 3),)))
    worker.cache.purge("acme")
    events = connector.get_kv_connector_kv_cache_events()
    assert isinstance(events, PrefixCacheEvents)
    stored, *removed = events.get_all_events()
    assert isinstance(stored, BlockStored) and all(isinstance(r, BlockRemoved) for r in removed)
    assert stored.medium == "memory" and {r.medium for r in removed} == {"memory"} and stored.block_size == N
    assert stored.token_ids == list(range(2 * N))  # the tier kind is the medium, whatever the tier is named
    assert len(stored.block_hashes) == 2 and stored.parent_block_hash is None
    assert stored.extra_keys == [("acme", "m@1")] * 2  # [namespace, model] per block
    assert {h for r in removed for h in r.block_hashes} == set(stored.block_hashes)
    wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[stored, *removed]))
    batch = msgspec.msgpack.decode(wire, type=KVEventBatch)
    assert batch.events == [stored, *removed]
    assert connector.get_kv_connector_kv_cache_events() is None  # taken once
