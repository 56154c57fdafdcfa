"""The planner and the simulator know layer groups (issue #40, item 4): a model's KV
cache as full, sliding-window and recurrent-state groups (``kv_groups``), the built-in
profiles of three such models from their published configs, bytes per token and tier
capacity from the groups' bytes per block. A uniform model's plan is byte for byte what
it was: the golden files ``tests/sim/golden/uniform_*`` were written before groups
existed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.config import KV_DTYPES, KVLayout
from prefixcache.kv_groups import GroupedLayout, LayerGroup, LayerKind, grouped
from prefixcache.sim.costmodel import CostModel, ModelProfile, get_gpu, get_model
from prefixcache.sim.plan import PlanInputs, make_plan
from prefixcache.sim.plan_inputs import kv_layout, load_groups_toml, parse_tier, plan_layout
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import write_jsonl
from support import SYNTHETIC, run_cli, source_of

GOLDEN = Path(__file__).parent / "golden"
GEMMA, GPT_OSS, QWEN_NEXT = "gemma-3-27b", "gpt-oss-120b", "qwen3-next-80b-a3b"


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workload the uniform golden files were written from."""
    path = tmp_path_factory.mktemp("groups") / "w.jsonl"
    write_jsonl(WorkloadSpec(requests=600, tenants=3, seed=5, duration_s=900.0), path)
    return path


def golden_cases(w: str) -> dict[str, list[str]]:
    return {
        "llama-3-70b_tiers": ["plan", w, "--model", "llama-3-70b", "--target-hit-rate", "0.3", "--jobs", "1",
                              "--tier", "memory:2G:20GB/s", "--tier", "disk:1T:0.5GB/s"],
        "smollm2-135m": ["plan", w, "--model", "smollm2-135m", "--target-hit-rate", "0.4", "--jobs", "1"],
        "user-7b": ["plan", w, "--model", "my-7b:params=7e9,layers=32,hidden=4096,context=32768",
                    "--kv-layout", "kv_heads=8,head_dim=128,dtype=float16", "--target-hit-rate", "0.3", "--jobs", "1",
                    "--tier", "memory:1G:20GB/s"],
        "llama-3-8b_mooncake": ["plan", str(SYNTHETIC), "--model", "llama-3-8b", "--target-hit-rate", "0.8",
                                "--jobs", "1", "--tier", "memory:64G:20GB/s", "--tier", "disk:2T:2GB/s"],
    }  # fmt: skip


@pytest.mark.parametrize("name", ["llama-3-70b_tiers", "smollm2-135m", "user-7b", "llama-3-8b_mooncake"])
@pytest.mark.parametrize("suffix", ["txt", "json"])
def test_a_uniform_model_plans_byte_for_byte_as_before_groups(workload: Path, name: str, suffix: str) -> None:
    args = golden_cases(str(workload))[name] + (["--json"] if suffix == "json" else [])
    code, out, err = run_cli(args)
    assert code == 0, err
    assert out.replace(str(workload), "W") == (GOLDEN / f"uniform_{name}.{suffix}").read_text()


def test_one_full_group_from_a_file_is_the_uniform_plan_byte_for_byte(workload: Path, tmp_path: Path) -> None:
    groups = tmp_path / "groups.toml"
    groups.write_text('[[group]]\nkind = "full"\nlayers = 80\nkv_heads = 8\nhead_dim = 128\ndtype = "bfloat16"\n')
    args = [*golden_cases(str(workload))["llama-3-70b_tiers"], "--kv-groups", str(groups)]
    code, out, _ = run_cli(args)
    assert code == 0
    assert out.replace(str(workload), "W") == (GOLDEN / "uniform_llama-3-70b_tiers.txt").read_text()


# ------------------------------------------------------------------------ invariants

dtypes = st.sampled_from(sorted(KV_DTYPES))
tokens = st.integers(0, 1 << 20)
blocks = st.integers(1, 4096)


@given(
    layers=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    heads=st.integers(1, 16),
    dim=st.sampled_from([32, 64, 128, 256]),
    dtype=dtypes,
    n=tokens,
    block=blocks,
)
def test_full_groups_are_the_uniform_layout_for_every_token_count(
    layers: list[int], heads: int, dim: int, dtype: str, n: int, block: int
) -> None:
    kv = KVLayout(sum(layers), heads, dim, dtype)
    split = GroupedLayout(tuple(LayerGroup(LayerKind.FULL, k, heads, dim, dtype) for k in layers))
    for layout in (split, grouped(kv)):
        assert layout.prefix_bytes(n) == n * kv.bytes_per_token
        assert layout.bytes_per_block(block) == kv.stored_bytes(block, "raw") == block * kv.bytes_per_token
        assert layout.stored_bytes_per_token(block) == kv.bytes_per_token
        assert layout.full_bytes_per_token == kv.bytes_per_token
    assert grouped(kv).uniform == kv and grouped(kv) == GroupedLayout.of(kv)


@given(layers=st.integers(1, 64), heads=st.integers(1, 16), window=st.integers(1, 1 << 16), n=tokens, block=blocks)
def test_a_sliding_group_never_keeps_more_than_a_full_one(
    layers: int, heads: int, window: int, n: int, block: int
) -> None:
    sliding = LayerGroup(LayerKind.SLIDING, layers, heads, 128, "bfloat16", window=window)
    full = LayerGroup(LayerKind.FULL, layers, heads, 128, "bfloat16")
    assert sliding.prefix_bytes(n) <= full.prefix_bytes(n)
    assert sliding.bytes_per_block(block) <= full.bytes_per_block(block)
    assert sliding.prefix_bytes(n) == min(n, window) * full.full_bytes_per_token  # the window before the end
    assert sliding.bytes_per_block(block) <= window * full.full_bytes_per_token  # bounded by the window
    assert (sliding.bytes_per_block(block) == full.bytes_per_block(block)) == (block <= window)


@given(layers=st.integers(1, 64), size=st.integers(1, 1 << 24), a=st.integers(1, 1 << 20), b=st.integers(1, 1 << 20))
def test_a_state_group_is_the_same_bytes_whatever_the_tokens(layers: int, size: int, a: int, b: int) -> None:
    state = LayerGroup(LayerKind.STATE, layers, state_bytes=size)
    assert state.bytes_per_block(a) == state.bytes_per_block(b) == state.prefix_bytes(a) == layers * size
    assert state.prefix_bytes(0) == 0 and state.full_bytes_per_token == 0 and state.kv is None


@given(model=st.sampled_from([GEMMA, GPT_OSS, QWEN_NEXT]), a=blocks, b=blocks)
def test_a_larger_block_never_costs_more_a_token(model: str, a: int, b: int) -> None:
    layout = get_model(model).groups
    assert layout is not None
    small, large = sorted((a, b))
    assert layout.stored_bytes_per_token(large) <= layout.stored_bytes_per_token(small)


# ------------------------------------------------------------------------ the built-in models


def test_gemma_3_27b_is_five_sliding_to_one_global() -> None:
    model = get_model(GEMMA)
    layout = model.groups
    assert model.kv is None and model.kv_bytes_per_token is None and layout is not None
    assert [(g.kind, g.layers, g.window) for g in layout.groups] == [("sliding", 52, 1024), ("full", 10, None)]
    per_layer = 2 * 16 * 128 * 2  # K and V, 16 KV heads of 128, bfloat16
    assert layout.full_bytes_per_token == 62 * per_layer
    # blocks no larger than the window: a hit at any boundary needs every token of every layer
    assert layout.stored_bytes_per_token(512) == layout.full_bytes_per_token
    assert layout.stored_bytes_per_token(4096) == (10 + 52 * 1024 / 4096) * per_layer
    # one 32K prompt resumed at its end alone: ~5.3x less than full KV (issue #40's "about 5x")
    full = layout.full_bytes_per_token * 32768
    assert layout.prefix_bytes(32768) == (10 * 32768 + 52 * 1024) * per_layer
    assert 5.2 < full / layout.prefix_bytes(32768) < 5.4


def test_gpt_oss_120b_alternates_128_token_windows() -> None:
    layout = get_model(GPT_OSS).groups
    assert layout is not None
    assert [(g.kind, g.layers, g.window) for g in layout.groups] == [("sliding", 18, 128), ("full", 18, None)]
    per_layer = 2 * 8 * 64 * 2
    assert layout.bytes_per_block(512) == 18 * 512 * per_layer + 18 * 128 * per_layer


def test_qwen3_next_keeps_a_gated_deltanet_state_per_block() -> None:
    layout = get_model(QWEN_NEXT).groups
    assert layout is not None
    state, full = layout.groups
    recurrent = 32 * 128 * 128  # value heads x key dim x value dim
    conv = (2 * 16 * 128 + 32 * 128) * (4 - 1)  # conv_dim x (kernel - 1)
    assert (state.kind, state.layers, state.state_bytes) == ("state", 36, (recurrent + conv) * 2)
    assert (full.kind, full.layers) == ("full", 12) and full.full_bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert layout.bytes_per_block(16) == layout.bytes_per_block(512) - 496 * 24576 == 36 * 1_097_728 + 16 * 24576
    assert layout.stored_bytes_per_token(16) > 100 * layout.full_bytes_per_token  # the state dominates small blocks


# ------------------------------------------------------------------------ schema and errors


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "mamba", "layers": 2}, "unknown layer kind 'mamba'; valid: full, sliding, state"),
        ({"kind": "sliding", "layers": 2, "kv_heads": 1, "head_dim": 8}, r"sliding group.window \(tokens\)"),
        ({"kind": "full", "layers": 2, "kv_heads": 1, "head_dim": 8, "window": 4}, "a full group has no window"),
        ({"kind": "state", "layers": 2, "state_bytes": 8, "window": 4}, "state_bytes, not window"),
        ({"kind": "state", "layers": 2}, r"state_bytes \(per layer\) must be an integer"),
        ({"kind": "full", "layers": 0, "kv_heads": 1, "head_dim": 8}, "full group.layers must be >= 1"),
        ({"kind": "full", "layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "fp8"}, "unknown kv dtype 'fp8'"),
        ({"kind": "full", "layers": 2, "kv_heads": 1, "head_dim": 8, "state_bytes": 3}, "has no state_bytes"),
        ({"kind": "full", "layers": True, "kv_heads": 1, "head_dim": 8}, "must be an integer, got True"),
    ],
)
def test_a_bad_group_names_what_is_wrong(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LayerGroup(**fields)


def test_groups_file_is_the_dataclass_schema(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text(
        '[[group]]\nkind = "state"\nlayers = 36\nstate_bytes = 1097728\n\n'
        '[[group]]\nkind = "full"\nlayers = 12\nkv_heads = 2\nhead_dim = 256\ndtype = "bfloat16"\n'
    )
    assert load_groups_toml(path) == get_model(QWEN_NEXT).groups
    for text, message in (
        ('[[group]]\nkind = "full"\nlayers = 2\nheads = 2\n', r"group 1: unknown key\(s\) heads; valid: kind, layers"),
        ('[[group]]\nlayers = 2\n', "group 1: missing kind"),
        ('[[group]]\nkind = "state"\nlayers = 2\nstate_bytes = -1\n', "state_bytes .per layer. must be >= 1"),
        ('model = "x"\n', r"expected one or more \[\[group\]\] tables and nothing else"),
        ("[[group", "invalid TOML"),
    ):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_groups_toml(path)


def test_plan_layout_picks_and_checks_the_groups() -> None:
    gemma, llama = get_model(GEMMA), get_model("llama-3-8b")
    assert plan_layout(gemma) == gemma.groups
    assert plan_layout(llama) == kv_layout(llama) and isinstance(plan_layout(llama), KVLayout)
    with pytest.raises(ValueError, match="--kv-layout changes a uniform layout; model 'gemma-3-27b' has layer groups"):
        plan_layout(gemma, "dtype=float32")
    assert gemma.groups is not None
    with pytest.raises(ValueError, match="add up to 62 layers; model 'llama-3-8b' has 32"):
        plan_layout(llama, None, gemma.groups)
    with pytest.raises(ValueError, match="not both"):
        plan_layout(llama, "dtype=float32", gemma.groups)
    with pytest.raises(ValueError, match="GroupedLayout of the model's 3 layers"):
        ModelProfile("x", 1e9, 3, 64, 1024, groups=gemma.groups)


# ------------------------------------------------------------------------ the planner


def plan_json(path: Path, model: str, *extra: str) -> dict[str, Any]:
    code, out, err = run_cli(["plan", str(path), "--model", model, "--target-hit-rate", "0.3", "--jobs", "1",
                              "--json", *extra])  # fmt: skip
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.mark.parametrize("model", [GEMMA, GPT_OSS, QWEN_NEXT])
def test_a_grouped_plan_sizes_the_tiers_in_bytes_per_block(workload: Path, model: str) -> None:
    layout = get_model(model).groups
    assert layout is not None
    plan = plan_json(workload, model, "--tier", "memory:2G:20GB/s", "--tier", "disk:1T:0.5GB/s")
    per_token = layout.bytes_per_block(16) / 16
    assert plan["bytes_per_token"] == per_token and plan["bytes_per_block"] == layout.bytes_per_block(16)
    assert plan["full_kv_bytes_per_token"] == layout.full_bytes_per_token
    assert plan["kv_bytes"] == plan["capacity_tokens"] * per_token
    memory = plan["tiers"][0]
    assert memory["capacity_tokens"] == min(math.floor(2 * 2**30 / per_token), plan["capacity_tokens"])
    assert [g["kind"] for g in plan["kv_layout"]["groups"]] == [g.kind.value for g in layout.groups]
    mean = round(plan["mean_prompt_tokens"])
    assert plan["prefix_bytes_per_token_at_mean_prompt"] == layout.prefix_bytes(mean) / mean


def test_the_same_trace_needs_the_same_tokens_whatever_the_layout(workload: Path) -> None:
    """The hit-rate curve is the trace's; the groups change bytes, not tokens."""
    gemma, llama = plan_json(workload, GEMMA), plan_json(workload, "llama-3-8b")
    assert gemma["capacity_tokens"] == llama["capacity_tokens"] and gemma["curve"] == llama["curve"]


def test_the_text_names_each_group_and_both_figures() -> None:
    code, out, _ = run_cli(["plan", str(SYNTHETIC), "--model", GPT_OSS, "--target-hit-rate", "0.8", "--jobs", "2"])
    assert code == 0
    assert "KV of gpt-oss-120b: 36 layers in 2 groups, stored per 512-token block" in out
    assert "18 sliding (window 128) x 2 (K, V) x 8 KV heads x 64 dims x bfloat16: the last 128 of 512 tokens" in out
    assert "= 23,592,960 bytes a block = 46,080 bytes/token (full-KV equivalent: 73,728 bytes/token" in out
    assert "resumed at its end alone (vLLM's HMA on the GPU)" in out


def test_codecs_are_refused_for_layer_groups(workload: Path) -> None:
    for extra in (["--codec", "int8"], ["--tier", "disk:1T:1GB/s:int4"]):
        code, _, err = run_cli(["plan", str(workload), "--model", GEMMA, "--target-hit-rate", "0.3", *extra])
        assert code == 2 and "quantize the KV frames of a uniform layout" in err and "plan it raw" in err
    model = get_model(GEMMA)
    assert model.groups is not None
    with pytest.raises(ValueError, match=r"codec\(s\) int8"):
        PlanInputs(0.3, CostModel(model, get_gpu("h100")), model.groups, tiers=(parse_tier("d:1T:1GB/s:int8"),))


def test_make_plan_takes_a_grouped_layout(workload: Path) -> None:
    model = get_model(QWEN_NEXT)
    assert model.groups is not None
    inputs = PlanInputs(0.3, CostModel(model, get_gpu("h100")), model.groups)
    plan = make_plan(source_of(workload), inputs, trace_name="w", jobs=1)
    block = plan.block_size
    assert plan.bytes_per_token == model.groups.bytes_per_block(block) / block and plan.sizes == ()


def test_replay_capacity_bytes_says_why_it_cannot_size_groups(workload: Path) -> None:
    code, _, err = run_cli(["replay", str(workload), "--model", GEMMA, "--capacity-bytes", "1GiB", "--no-progress"])
    assert code == 2 and "has layer groups" in err and "--capacity-tokens" in err
