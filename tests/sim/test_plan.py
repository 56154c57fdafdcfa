"""``prefixcache plan``: the capacity it finds reaches the target when replayed and a
capacity just under it does not; bytes, tier shares and money follow from it by their
formulas; a target above the ceiling is an answer (exit 1); bad inputs exit 2 naming
the problem. The shipped Mooncake traces are the slow tests."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from prefixcache.config import CacheConfig, KVLayout
from prefixcache.sim.costmodel import CostModel, get_gpu, get_model
from prefixcache.sim.plan import CurvePoint, ExactCurve, Plan, PlanInputs, make_plan, search
from prefixcache.sim.plan_inputs import kv_layout, load_tiers_toml, parse_bandwidth, parse_bytes, parse_tier
from prefixcache.sim.replay import replay
from prefixcache.sim.results import UNLIMITED, ReplayConfig
from prefixcache.sim.traces import read_trace
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import write_jsonl
from support import CONVERSATION, SYNTHETIC, source_of
from support import run_cli as run_prefixcache

slow = pytest.mark.slow
LLAMA_8B_BYTES = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bfloat16


def run_cli(args: list[str]) -> tuple[int, str, str]:
    return run_prefixcache(["plan", *args])


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "w.jsonl"
    write_jsonl(WorkloadSpec(requests=1500, tenants=4, seed=3, duration_s=1800.0), path)
    return path


def inputs(target: float, **kw: Any) -> PlanInputs:
    model = get_model("llama-3-8b")
    return PlanInputs(target, CostModel(model, get_gpu("h100")), kv_layout(model), **kw)


def replayed(path: Path, plan: Plan, capacity: float) -> float:
    """The token hit rate `replay` measures at ``capacity`` under the plan's configuration."""
    inp = plan.inputs
    cache = CacheConfig(
        policy=inp.policy, capacity_tokens=int(capacity), block_size=inp.block_size, isolation=inp.isolation
    )
    cfg = ReplayConfig(cache)
    (result,) = replay(source_of(path), [cfg], warmup=plan.inputs.warmup, optimal=False)
    return result.token_hit_rate


def check_plan(path: Path, plan: Plan) -> None:
    """The plan's capacity reaches the target; the largest capacity the search saw miss
    is within its precision; 3 % less than the plan misses too."""
    assert plan.capacity_tokens is not None and plan.below is not None
    target, cap = plan.inputs.target, plan.capacity_tokens
    assert replayed(path, plan, cap) == pytest.approx(plan.hit_rate) and plan.hit_rate >= target
    below = plan.below.capacity_tokens
    assert below < cap and (cap <= below * (1 + plan.inputs.precision) or cap - below <= plan.block_size)
    assert replayed(path, plan, below) < target
    smaller = plan.block_size * math.floor(0.97 * cap / plan.block_size)
    assert replayed(path, plan, smaller) < target


# ---------------------------------------------------------------------------- the answer


def test_plan_capacity_reaches_the_target_and_a_smaller_one_does_not(workload: Path) -> None:
    plan = make_plan(source_of(workload), inputs(0.5), trace_name="w")
    assert plan.reachable and plan.ceiling >= 0.5 and plan.monotone
    check_plan(workload, plan)
    assert plan.capacity_tokens is not None and plan.capacity_tokens % plan.block_size == 0


def test_gib_is_tokens_times_bytes_per_token(workload: Path) -> None:
    plan = make_plan(source_of(workload), inputs(0.4))
    assert plan.bytes_per_token == LLAMA_8B_BYTES
    assert plan.capacity_tokens is not None
    assert plan.kv_bytes == plan.capacity_tokens * LLAMA_8B_BYTES
    model = get_model("llama-3-8b")
    fp32 = kv_layout(model, "dtype=float32")
    assert fp32.bytes_per_token == 2 * LLAMA_8B_BYTES and fp32.layers == 32


def test_tier_shares_add_up_to_the_hit_rate(workload: Path) -> None:
    plan = make_plan(source_of(workload), inputs(0.5))
    assert plan.capacity_tokens is not None
    third = plan.capacity_tokens * LLAMA_8B_BYTES / 3
    slow_tier, fast_tier = parse_tier(f"disk:{third:.0f}:1GB/s"), parse_tier("memory:1T:20GB/s")
    tiered = make_plan(source_of(workload), inputs(0.5, tiers=(slow_tier, fast_tier)))
    names = [s.tier.name for s in tiered.tiers]
    assert names == ["memory", "disk"]  # fastest filled first, whatever the order given
    assert tiered.tiers[0].capacity_tokens == plan.capacity_tokens  # 1 TiB holds it all
    assert tiered.tiers[1].capacity_tokens == 0 and tiered.tiers[1].hit_rate == 0
    assert sum(s.hit_rate for s in tiered.tiers) == pytest.approx(tiered.hit_rate)
    small = make_plan(source_of(workload), inputs(0.5, tiers=(parse_tier(f"hbm:{third:.0f}:3TB/s"), slow_tier)))
    first, second = small.tiers
    assert first.capacity_tokens == math.floor(third / LLAMA_8B_BYTES)
    assert 0 < first.hit_rate < small.hit_rate and second.hit_rate > 0
    assert sum(s.hit_rate for s in small.tiers) == pytest.approx(replayed(workload, small, small.tiers_hold))
    assert not small.tiers_suffice  # two thirds of the capacity: short of the target
    assert first.load_seconds_per_token == LLAMA_8B_BYTES / 3e12 and first.worth_it


def test_money_is_gpu_hours_times_price_per_hour_of_traffic(workload: Path) -> None:
    plan = make_plan(source_of(workload), inputs(0.5, price_per_gpu_hour=3.25))
    assert plan.capacity_tokens is not None
    cfg = ReplayConfig(CacheConfig(capacity_tokens=int(plan.capacity_tokens)))
    (result,) = replay(source_of(workload), [cfg], warmup=0.5, optimal=False, cost=plan.inputs.cost)
    assert plan.gpu_hours_saved == pytest.approx(result.gpu_hours_saved)
    requests = list(read_trace(workload))
    span = requests[-1].timestamp - requests[len(requests) // 2].timestamp
    assert plan.traffic_seconds == pytest.approx(span)
    assert plan.gpu_hours_per_hour == pytest.approx(plan.gpu_hours_saved * 3600 / span)
    assert plan.money_per_hour == pytest.approx(plan.gpu_hours_per_hour * 3.25)


def test_an_unreachable_target_is_reported_with_the_ceiling(workload: Path) -> None:
    plan = make_plan(source_of(workload), inputs(1.0))
    assert not plan.reachable and plan.capacity_tokens is None and plan.kv_bytes is None
    assert plan.ceiling < 1.0 and plan.hit_rate == plan.ceiling
    code, out, _ = run_cli([str(workload), "--model", "llama-3-8b", "--target-hit-rate", "1"])
    assert code == 1 and "NOT reachable" in out and f"{100 * plan.ceiling:.1f}%" in out
    code, out, _ = run_cli([str(workload), "--model", "llama-3-8b", "--target-hit-rate", "1", "--json"])
    data = json.loads(out)
    assert code == 1 and data["reachable"] is False and data["capacity_tokens"] is None
    assert data["ceiling_hit_rate"] == pytest.approx(plan.ceiling)


def test_search_reaches_its_precision_on_a_known_curve() -> None:
    class Known:
        label = "formula"
        calls = 0

        def hit_rates(self, capacities: Any) -> list[CurvePoint]:
            self.calls += 1
            return [CurvePoint(c, c / (c + 1e6)) for c in capacities]

    curve = Known()
    points = search(curve, 0.5, 1e9, 16, 0.01)
    answer = min(p.capacity_tokens for p in points if p.token_hit_rate >= 0.5)
    assert 1e6 <= answer <= 1.01 * 1e6 + 16
    assert curve.calls <= 8  # several probes a round, one pass each


def test_a_curve_source_plugs_in(workload: Path) -> None:
    """A faster curve replaces the exact one in one argument; the plan's own capacity is
    still replayed exactly."""
    base = inputs(0.5)
    exact = make_plan(source_of(workload), base)
    asked: list[float] = []

    class Recording:
        label = "recording"

        def __init__(self) -> None:
            from prefixcache.sim.summary import summarize

            self.inner = ExactCurve(source_of(workload), base, summarize(source_of(workload)))

        def hit_rates(self, capacities: Any) -> list[CurvePoint]:
            asked.extend(capacities)
            return self.inner.hit_rates(capacities)

    plan = make_plan(source_of(workload), base, curve=Recording())
    assert asked and plan.curve_source == "recording"
    assert plan.capacity_tokens == exact.capacity_tokens and plan.hit_rate == exact.hit_rate


def test_the_plan_is_the_same_in_any_number_of_processes(workload: Path) -> None:
    """Each round's capacities are replayed split across processes (sim/forks.py): the
    plan, every point of its curve included, does not change."""
    base = inputs(0.5, tiers=(parse_tier("memory:2G:20GB/s"), parse_tier("disk:1T:2GB/s")))
    one = make_plan(source_of(workload), base, jobs=1)
    assert len(one.curve) > 3
    for jobs in (2, 3):
        assert make_plan(source_of(workload), base, jobs=jobs) == one
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        make_plan(source_of(workload), base, jobs=0)


# ---------------------------------------------------------------------------- the command


def test_cli_text_json_and_html(workload: Path, tmp_path: Path) -> None:
    html = tmp_path / "plan.html"
    args = [str(workload), "--model", "llama-3-8b", "--target-hit-rate", "0.5", "--tier", "memory:8G:20GB/s"]
    code, out, _ = run_cli([*args, "--html", str(html)])
    assert code == 0
    for text in ("Target 50.0%", "GiB of KV", "memory", "per hour of traffic", "$2.00 per GPU-hour (the default"):
        assert text in out
    page = html.read_text()
    assert "data:image/png;base64," in page and "<script" not in page and "Target 50.0%" in page
    code, out, _ = run_cli([*args, "--json", "--price-per-gpu-hour", "4"])
    data = json.loads(out)
    assert code == 0 and data["reachable"] and data["price_per_gpu_hour"] == 4
    assert data["kv_bytes"] == data["capacity_tokens"] * LLAMA_8B_BYTES
    assert data["money_saved_per_hour"] == pytest.approx(4 * data["gpu_hours_saved_per_hour"])
    assert [t["name"] for t in data["tiers"]] == ["memory"] and data["curve"][-1]["capacity_tokens"] is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target-hit-rate", "0"], "target hit rate must be in (0, 1]"),
        (["--target-hit-rate", "1.5"], "target hit rate must be in (0, 1]"),
        (["--target-hit-rate", "0.5", "--model", "gpt-9"], "unknown model 'gpt-9'; valid: gemma-3-27b, gpt-oss-120b"),
        (["--target-hit-rate", "0.5", "--tier", "memory:64G"], "expected NAME:SIZE:BANDWIDTH"),
        (["--target-hit-rate", "0.5", "--tier", "memory:64X:1GB/s"], "not a size: '64X'"),
        (["--target-hit-rate", "0.5", "--tier", "memory:64G:20GB"], "must end in /s"),
        (["--target-hit-rate", "0.5", "--tier", "m:1G:1GB/s", "--tier", "m:2G:1GB/s"], "given twice: m"),
        (["--target-hit-rate", "0.5", "--tier", "memory:0G:1GB/s"], "must be > 0"),
        (["--target-hit-rate", "0.5", "--price-per-gpu-hour", "-1"], "price per GPU-hour must be >= 0"),
        (["--target-hit-rate", "0.5", "--jobs", "0"], "--jobs must be >= 1, got 0"),
        (["--target-hit-rate", "0.5", "--model", "x:params=7e9,layers=32,hidden=4096,context=32768"], "--kv-layout"),
    ],
)
def test_bad_inputs_exit_2_naming_the_problem(workload: Path, extra: list[str], message: str) -> None:
    args = [str(workload), "--model", "llama-3-8b", *extra]
    code, out, err = run_cli(args)
    assert code == 2 and message in err and not out


def test_an_empty_trace_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, out, err = run_cli([str(empty), "--model", "llama-3-8b", "--target-hit-rate", "0.5"])
    assert code == 2 and "no requests" in err and not out


def test_sizes_bandwidths_and_tier_files(tmp_path: Path) -> None:
    assert parse_bytes("64G") == parse_bytes("64GiB") == 64 * 2**30
    assert parse_bytes("500GB") == 500e9 and parse_bytes("1.5e3") == 1500
    assert parse_bandwidth("20GB/s") == 20e9 and parse_bandwidth("16GiB/s") == 16 * 2**30
    toml = tmp_path / "tiers.toml"
    toml.write_text('[[tier]]\nname = "memory"\nsize = "64G"\nbandwidth = "20GB/s"\n')
    assert load_tiers_toml(toml) == [parse_tier("memory:64G:20GB/s")]
    toml.write_text('[[tier]]\nname = "memory"\nsize = "64G"\n')
    with pytest.raises(ValueError, match="exactly the strings name, size and bandwidth"):
        load_tiers_toml(toml)
    custom = get_model("x:params=7e9,layers=4,hidden=512,context=4096")
    assert kv_layout(custom, "kv_heads=2,head_dim=64") == KVLayout(4, 2, 64, "bfloat16")
    with pytest.raises(ValueError, match="unknown kv dtype"):
        kv_layout(custom, "kv_heads=2,head_dim=64,dtype=fp7")


# ---------------------------------------------------------------------------- shipped traces


@slow
@pytest.mark.parametrize(("path", "target"), [(SYNTHETIC, 0.8), (SYNTHETIC, 0.4), (CONVERSATION, 0.3)])
def test_plan_on_the_mooncake_traces(path: Path, target: float) -> None:
    plan = make_plan(source_of(path), inputs(target), trace_name=path.name)
    assert plan.block_size == 512 and plan.reachable
    check_plan(path, plan)
    (unlimited,) = replay(source_of(path), [ReplayConfig(CacheConfig(capacity_tokens=UNLIMITED))], warmup=0.5)
    assert plan.ceiling == pytest.approx(unlimited.token_hit_rate)


@slow
def test_the_conversation_trace_cannot_reach_80_percent() -> None:
    code, out, _ = run_cli([str(CONVERSATION), "--model", "llama-3-8b", "--target-hit-rate", "0.8"])
    assert code == 1 and "NOT reachable" in out and "39.8%" in out
