"""The prefill cost model: closed form against brute force, savings, profiles, accumulation."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.config import CacheConfig, KVLayout
from prefixcache.sim.costmodel import (
    GPUS,
    MODELS,
    CostAccumulator,
    CostModel,
    GPUProfile,
    ModelProfile,
    attention_flops,
    get_gpu,
    get_model,
    parse_gpu,
    parse_model_profile,
)
from prefixcache.sim.results import UNLIMITED, ReplayConfig, ReplayResult

TINY = ModelProfile("tiny", params=1000.0, layers=2, hidden=8, context_length=4096)
REPLAY_CONFIG = ReplayConfig(CacheConfig(policy="lru", capacity_tokens=UNLIMITED, isolation="shared"))


def brute_force(model: ModelProfile, length: int, cached: int) -> tuple[float, float]:
    """Token by token: 2 P for the matmuls, 4 n d p for attention at position p."""

    def cost(p: int) -> float:
        return 2 * model.params + 4 * model.layers * model.hidden * p

    total = sum(cost(p) for p in range(length))
    computed = sum(cost(p) for p in range(cached, length))
    return total, total - computed


def cost_model(model: ModelProfile = TINY, utilization: float = 0.5) -> CostModel:
    return CostModel(model, GPUProfile("test", 1e12), utilization)


@given(st.integers(0, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_closed_form_equals_brute_force(case: tuple[int, int]) -> None:
    length, cached = case
    total, saved = cost_model().request(length, cached)
    want_total, want_saved = brute_force(TINY, length, cached)
    assert total == pytest.approx(want_total, rel=1e-12)
    assert saved == pytest.approx(want_saved, rel=1e-12)


@given(st.integers(0, 200), st.integers(0, 200))
def test_attention_closed_form_equals_loop(a: int, b: int) -> None:
    start, end = min(a, b), max(a, b)
    assert attention_flops(TINY, start, end) == 4 * TINY.layers * TINY.hidden * sum(range(start, end))


@pytest.mark.parametrize("length", [1, 7, 512, 4096])
def test_saved_is_zero_without_hit_and_everything_with_full_hit(length: int) -> None:
    model = cost_model()
    total, saved = model.request(length, 0)
    assert saved == 0
    assert model.request(length, length) == (total, total)


def test_saved_grows_with_the_hit() -> None:
    model = cost_model()
    saved = [model.request(1000, h)[1] for h in range(0, 1001, 10)]
    assert all(a < b for a, b in itertools.pairwise(saved))


def test_cached_prefix_saves_less_than_its_token_share() -> None:
    """Attention makes late tokens dearer, so half the tokens is under half the compute."""
    total, saved = cost_model().request(4096, 2048)
    assert saved < total / 2


def test_attention_is_quadratic() -> None:
    for length in (64, 1000, 4096):
        single = attention_flops(TINY, 0, length)
        double = attention_flops(TINY, 0, 2 * length)
        assert double > 2 * single
        assert double == pytest.approx(4 * single, rel=3 / length)


def test_llama_3_8b_by_hand() -> None:
    """L = 2048, h = 1024, P = 8.03e9, n = 32, d = 4096; 4 n d = 524,288 = 2^19.

    total  = 2 P L + 2^19 * (2048 * 2047 / 2)
           = 2 * 8.03e9 * 2048 + 2^19 * 2,096,128
           = 32,890,880,000,000 + 1,098,974,756,864       (2^19 * 2,096,128 = 2^29 * 2047)
           = 33,989,854,756,864
    saved  = 2 P h + 2^19 * (1024 * 1023 / 2)
           = 2 * 8.03e9 * 1024 + 2^19 * 523,776
           = 16,445,440,000,000 + 274,609,471,488         (2^19 * 523,776 = 2^28 * 1023)
           = 16,720,049,471,488
    """
    total, saved = CostModel(get_model("llama-3-8b"), get_gpu("h100")).request(2048, 1024)
    assert total == pytest.approx(33_989_854_756_864, rel=1e-12)
    assert saved == pytest.approx(16_720_049_471_488, rel=1e-12)


def test_gpu_seconds_divide_by_peak_times_utilization() -> None:
    model = CostModel(get_model("llama-3-8b"), get_gpu("a100"), utilization=0.4)
    # 312e12 * 0.4 = 124.8e12 FLOP/s
    assert model.gpu_seconds(124.8e12) == pytest.approx(1.0)
    assert model.gpu_seconds(0.0) == 0.0


@pytest.mark.parametrize("utilization", [0, -0.1, 1.01, float("nan"), True])
def test_utilization_must_be_in_zero_one(utilization: float) -> None:
    with pytest.raises(ValueError, match="utilization"):
        cost_model(utilization=utilization)


def test_full_utilization_is_allowed() -> None:
    assert cost_model(utilization=1.0).gpu_seconds(1e12) == pytest.approx(1.0)


def test_prompt_longer_than_context_is_an_error() -> None:
    model = CostModel(get_model("smollm2-135m"), get_gpu("l40s"))
    model.request(8192, 0)
    with pytest.raises(ValueError, match="context_length"):
        model.request(8193, 0)


@pytest.mark.parametrize(
    ("length", "cached", "field"),
    [(-1, 0, "input_length"), (10, -1, "cached_tokens"), (10, 11, "cached_tokens"), (10.0, 0, "input_length")],
)
def test_bad_request_names_the_field(length: int, cached: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        cost_model().request(length, cached)


def test_builtin_profiles() -> None:
    assert set(MODELS) == {"llama-3-8b", "llama-3-70b", "smollm2-135m"} | {
        "gemma-3-27b", "gpt-oss-120b", "qwen3-next-80b-a3b"  # layer groups: tests/sim/test_plan_groups.py
    }  # fmt: skip
    assert set(GPUS) == {"h100", "h200", "a100", "l40s"}
    assert get_model("llama-3-70b") == ModelProfile(
        "llama-3-70b", 70.6e9, 80, 8192, 131072, KVLayout(80, 8, 128, "bfloat16")
    )
    # KV bytes a token: 2 (K, V) x layers x kv_heads x head_dim x 2 bytes (bfloat16)
    assert get_model("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert get_model("smollm2-135m").kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert get_gpu("h200").peak_flops == 989e12


def test_registries_are_read_only() -> None:
    with pytest.raises(TypeError):
        MODELS["mine"] = TINY  # type: ignore[index]


@pytest.mark.parametrize(("get", "kind"), [(get_model, "model"), (get_gpu, "gpu")])
def test_unknown_name_lists_the_valid_ones(get: object, kind: str) -> None:
    registry = MODELS if kind == "model" else GPUS
    with pytest.raises(ValueError, match=f"unknown {kind} 'nope'") as err:
        get("nope")  # type: ignore[operator]
    for name in registry:
        assert name in str(err.value)


def test_parse_model_profile() -> None:
    spec = "mine:params=7e9,layers=32,hidden=4096,context=32768"
    assert parse_model_profile(spec) == ModelProfile("mine", 7e9, 32, 4096, 32768)
    assert get_model(spec) == parse_model_profile(spec)
    # spaces, any order, whole floats for integer fields
    spaced = parse_model_profile("mine: context=128e3, hidden=4096, layers=32, params=7000000000")
    assert spaced == ModelProfile("mine", 7e9, 32, 4096, 128000)
    assert isinstance(spaced.context_length, int)


def test_parse_gpu() -> None:
    assert parse_gpu("mine:peak=500e12") == GPUProfile("mine", 500e12)
    assert get_gpu("mine:peak=500e12") == GPUProfile("mine", 500e12)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ("mine:params=abc,layers=32,hidden=4096,context=32768", "params"),
        ("mine:params=-7e9,layers=32,hidden=4096,context=32768", "params"),
        ("mine:params=inf,layers=32,hidden=4096,context=32768", "params"),
        ("mine:params=7e9,layers=32.5,hidden=4096,context=32768", "layers"),
        ("mine:params=7e9,layers=0,hidden=4096,context=32768", "layers"),
        ("mine:params=7e9,layers=32,hidden=x,context=32768", "hidden"),
        ("mine:params=7e9,layers=32,hidden=4096,context=0", "context"),
        ("mine:params=7e9,layers=32,hidden=4096", "context"),
        ("mine:params=7e9,layers=32,hidden=4096,context=1,heads=8", "heads"),
        ("mine:params=7e9,params=8e9,layers=32,hidden=4096,context=1", "params"),
        ("mine:params=7e9,layers,hidden=4096,context=1", "layers"),
        (":params=7e9,layers=32,hidden=4096,context=32768", "name"),
    ],
)
def test_bad_model_spec_names_the_field(spec: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse_model_profile(spec)


@pytest.mark.parametrize(
    ("spec", "field"),
    [("mine:peak=0", "peak"), ("mine:peak=fast", "peak"), ("mine:", "peak"), ("mine:speed=1e12", "speed")],
)
def test_bad_gpu_spec_names_the_field(spec: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse_gpu(spec)


def test_spec_without_colon_is_an_error() -> None:
    with pytest.raises(ValueError, match="':'"):
        parse_gpu("peak=1e12")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": ""}, "name"),
        ({"params": 0}, "params"),
        ({"layers": 1.5}, "layers"),
        ({"hidden": True}, "hidden"),
        ({"context_length": 0}, "context_length"),
    ],
)
def test_model_profile_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"name": "m", "params": 1e9, "layers": 2, "hidden": 64, "context_length": 128}
    with pytest.raises(ValueError, match=field):
        ModelProfile(**{**base, **kwargs})  # type: ignore[arg-type]


def test_accumulator_fills_a_result() -> None:
    model = CostModel(get_model("llama-3-8b"), get_gpu("h100"))
    acc = CostAccumulator(model)
    requests = [(2048, 1024), (100, 0), (4096, 4096)]
    for length, cached in requests:
        acc.add(length, cached)
    result = ReplayResult(REPLAY_CONFIG, trace="t", requests=3)
    acc.apply(result)

    want_total = sum(model.request(n, h)[0] for n, h in requests)
    want_saved = sum(model.request(n, h)[1] for n, h in requests)
    assert acc.requests == 3
    assert result.prefill_flops_total == pytest.approx(want_total)
    assert result.prefill_flops_saved == pytest.approx(want_saved)
    assert result.gpu_hours_saved == pytest.approx(want_saved / (989e12 * 0.5) / 3600)
    assert result.cost_profile == "llama-3-8b@h100 u=0.50"
    assert result.cost_defaults == ()
    assert result.prompts_over_context == 0 and result.context_length == 131072
    assert result.kv_bytes_per_token == 131072
    assert result.prefill_compute_avoided == pytest.approx(want_saved / want_total)
    assert result.to_json()["gpu_hours_saved"] == result.gpu_hours_saved


def test_empty_accumulator_applies_zeros() -> None:
    result = ReplayResult(REPLAY_CONFIG, trace="t")
    CostAccumulator(cost_model()).apply(result)
    assert result.prefill_flops_total == 0.0
    assert result.gpu_hours_saved == 0.0
    assert result.prefill_compute_avoided is None


def test_prompts_beyond_the_context_are_a_figure_not_a_label() -> None:
    model = CostModel(get_model("smollm2-135m"), get_gpu("h100"), defaults=("gpu", "utilization"))
    acc = CostAccumulator(model)
    for length in (100, 9000, 8192, 20000):
        acc.add(length, 0)
    result = ReplayResult(REPLAY_CONFIG, trace="t", requests=4)
    acc.apply(result)
    assert result.cost_profile == "smollm2-135m@h100 u=0.50"
    assert result.prompts_over_context == 2 and result.prompts_over_context_share == 0.5
    data = result.to_json()
    assert data["prompts_over_context"] == 2 and data["prompts_over_context_share"] == 0.5
    assert data["cost_defaults"] == ["gpu", "utilization"] and data["context_length"] == 8192


def test_cost_model_defaults_must_name_its_parts() -> None:
    with pytest.raises(ValueError, match="defaults may name model, gpu and utilization"):
        CostModel(get_model("llama-3-8b"), get_gpu("h100"), defaults=("tokenizer",))


def test_model_spec_with_a_kv_layout() -> None:
    m = parse_model_profile("m:params=7e9,layers=32,hidden=4096,context=32768,kv_heads=8,head_dim=128")
    assert m.kv == KVLayout(32, 8, 128, "bfloat16") and m.kv_bytes_per_token == 131072
    m = parse_model_profile("m:params=7e9,layers=2,hidden=64,context=512,kv_heads=1,head_dim=8,dtype=float32")
    assert m.kv_bytes_per_token == 2 * 2 * 1 * 8 * 4
    assert parse_model_profile("m:params=7e9,layers=2,hidden=64,context=512").kv_bytes_per_token is None


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (",kv_heads=8", "needs both kv_heads and head_dim"),
        (",kv_heads=8,head_dim=128,dtype=int4", "unknown dtype 'int4'"),
        (",kv_heads=0,head_dim=128", "kv_heads"),
        (",heads=8", "unknown field 'heads'"),
    ],
)
def test_bad_kv_layout_in_a_spec_names_it(tail: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_model_profile("m:params=7e9,layers=32,hidden=4096,context=32768" + tail)


def test_kv_layout_must_have_the_models_layers() -> None:
    with pytest.raises(ValueError, match="KVLayout of the model's 32 layers"):
        ModelProfile("m", 7e9, 32, 4096, 32768, KVLayout(16, 8, 128))
