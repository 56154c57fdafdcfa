"""vLLM's KV cache groups as the connector reads them, against vLLM's own classes (issue 40):
the group kinds it stores, the layer kinds it refuses (every request bypasses, never wrong
KV), and a sliding group's kept blocks exactly as vLLM's manager keeps them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from prefixcache.integrations.vllm.groups import KVGroup, KVGroups, LayerKind, kv_groups
from prefixcache.integrations.vllm.scope import Bypass

F32 = torch.float32


def config(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(
        kv_cache_groups=[KVCacheGroupSpec(layer_names=[f"layers.{i}"], kv_cache_spec=s) for i, s in enumerate(specs)]
    )


def sliding(window: int = 32, block: int = 32, extra: int = 0) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block, num_kv_heads=1, head_size=32, dtype=F32, sliding_window=window, extra_retained_tokens=extra
    )


def full(block: int = 32) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=32, dtype=F32)


def test_a_gemma_like_model_is_five_sliding_groups_and_a_full_one() -> None:
    groups = kv_groups(config(*[sliding(extra=2)] * 5, full()), 32, None)
    assert isinstance(groups, KVGroups) and groups.hybrid
    assert [g.kind for g in groups.groups] == [LayerKind.SLIDING] * 5 + [LayerKind.FULL]
    assert {g.window for g in groups.partial} == {34}  # vLLM keeps the extra retained tokens too
    assert groups.block_size == 32 and groups.stride == 1024 // 32  # 4 windows is less than 1,024 tokens
    wide = kv_groups(config(*[sliding(window=512)] * 5, full()), 32, None)
    assert isinstance(wide, KVGroups) and wide.stride == 4 * 512 // 32  # a boundary every 4 windows


def test_a_mamba_hybrid_is_a_state_group_and_a_full_one() -> None:
    mamba = MambaSpec(block_size=64, shapes=((3, 160), (4, 32, 16)), dtypes=(F32, F32), mamba_cache_mode="align")
    groups = kv_groups(config(mamba, full(64)), 64, 0)
    assert isinstance(groups, KVGroups)
    assert [g.kind for g in groups.groups] == [LayerKind.STATE, LayerKind.FULL] and groups.stride == 0


def test_a_one_group_model_keys_as_it_always_did() -> None:
    groups = kv_groups(config(full(16)), 16, None)
    assert isinstance(groups, KVGroups) and not groups.hybrid


@pytest.mark.parametrize(
    ("specs", "reason"),
    [
        ((MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=F32),), "MLAAttentionSpec"),
        (
            (
                ChunkedLocalAttentionSpec(
                    block_size=32, num_kv_heads=1, head_size=32, dtype=F32, attention_chunk_size=64
                ),
                full(),
            ),
            "ChunkedLocalAttentionSpec",
        ),
        ((sliding(),), "no full-attention KV cache group"),  # every layer windowed: nothing chains a prefix
    ],
)
def test_a_layer_kind_the_connector_does_not_store_bypasses_naming_it(specs: tuple[object, ...], reason: str) -> None:
    found = kv_groups(config(*specs), 32, None)
    assert isinstance(found, Bypass) and found.reason.startswith("unsupported_layers:") and reason in found.reason


def test_a_sliding_group_needs_exactly_the_blocks_vllm_keeps() -> None:
    """vLLM allocates a load's sliding blocks from the first one its manager does not skip:
    the connector stores and checks exactly those (``KVGroup.needed``), for every window,
    retained tail, block size and boundary of a grid that crosses each edge."""
    for window in range(1, 300, 7):
        for extra in (0, 1, 5, 31):
            manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=extra)
            group = KVGroup(0, LayerKind.SLIDING, ("l",), window + extra)
            for block in (16, 32, 64, 128):
                for boundary in range(1, 40):
                    skipped = SlidingWindowManager.get_num_skipped_tokens(manager, boundary * block)  # type: ignore[arg-type]
                    assert group.needed(boundary, block) == range(skipped // block, boundary), (window, extra, block)
