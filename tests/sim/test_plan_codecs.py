"""The planner and the simulator know codecs (issue #29, item 4): a tier's codec turns
its bytes into more tokens by the codec's frame ratio, a hit from it costs a decode on
top of its transfer, and ``replay --codec`` at ``N`` bytes is raw at the tokens those
bytes hold. Without a codec every output is what it was, byte for byte (the golden
files were written by the planner before codecs existed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from prefixcache.sim.codec_replay import hit_rates_at_bytes
from prefixcache.sim.codec_sizing import (
    DecodeRate,
    decode_rate,
    measure_decode_rate,
    stored_bytes_per_token,
    stored_ratio,
    tokens_in,
)
from prefixcache.sim.costmodel import CostModel, get_gpu, get_model
from prefixcache.sim.plan import Plan, PlanInputs, make_plan
from prefixcache.sim.plan_inputs import (
    Tier,
    kv_layout,
    load_decode_rates_toml,
    load_tiers_toml,
    parse_decode_rate,
    parse_tier,
)
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import write_jsonl
from prefixcache.storage import codec
from support import CONVERSATION, SYNTHETIC, run_cli, source_of

GOLDEN = Path(__file__).parent / "golden"
KV = kv_layout(get_model("llama-3-8b"))
BPT = KV.bytes_per_token
CODECS = "raw, bf16, int8, int4"


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workload the golden files were written from (tests/sim/golden)."""
    path = tmp_path_factory.mktemp("codecs") / "w.jsonl"
    write_jsonl(WorkloadSpec(requests=600, tenants=3, seed=5, duration_s=900.0), path)
    return path


def plan_of(path: Path, *tiers: str, measure: Any = None, **kw: Any) -> Plan:
    model = get_model("llama-3-8b")
    inputs = PlanInputs(0.3, CostModel(model, get_gpu("h100")), KV, tiers=tuple(parse_tier(t) for t in tiers), **kw)
    extra = {} if measure is None else {"measure": measure}
    return make_plan(source_of(path), inputs, trace_name=path.name, jobs=1, **extra)


def no_measure(*_: object) -> float:
    raise AssertionError("a given decode rate must not be measured")


# ------------------------------------------------------------------------ parsing


def test_a_tier_names_its_codec_in_a_fourth_field_raw_by_default() -> None:
    assert parse_tier("disk:2T:2GB/s:int8") == Tier("disk", 2 * 1024**4, 2e9, "int8")
    assert parse_tier("memory:64G:20GB/s").codec == "raw"
    assert parse_tier(" disk : 2T : 2GB/s : int4 ").codec == "int4"


@pytest.mark.parametrize("spec", ["disk:2T:2GB/s:zstd", "disk:2T:2GB/s:INT8", "disk:2T:2GB/s:"])
def test_an_unknown_codec_is_an_error_listing_the_valid_ones(spec: str) -> None:
    with pytest.raises(ValueError, match=r"unknown codec|NAME:SIZE:BANDWIDTH") as info:
        parse_tier(spec)
    if spec.endswith(":zstd"):
        assert CODECS in str(info.value)


def test_the_cli_names_a_bad_codec(workload: Path) -> None:
    code, _, err = run_cli(["plan", str(workload), "--model", "llama-3-8b", "--target-hit-rate", "0.3",
                            "--tier", "disk:2T:2GB/s:zstd"])  # fmt: skip
    assert code == 2 and "unknown codec 'zstd'" in err and CODECS in err
    code, _, err = run_cli(["replay", str(workload), "--capacity-bytes", "1GiB", "--codec", "int8,lz4"])
    assert code == 2 and "unknown 'lz4'" in err and "int4" in err


def test_tiers_file_with_codecs_and_decode_rates(tmp_path: Path) -> None:
    path = tmp_path / "tiers.toml"
    path.write_text(
        '[[tier]]\nname = "memory"\nsize = "64G"\nbandwidth = "20GB/s"\n\n'
        '[[tier]]\nname = "disk"\nsize = "2T"\nbandwidth = "2GB/s"\ncodec = "int8"\n\n'
        '[decode_rate]\nint8 = "8GB/s"\n'
    )
    assert [t.codec for t in load_tiers_toml(path)] == ["raw", "int8"]
    assert load_decode_rates_toml(path) == [("int8", 8e9)]
    path.write_text('[[tier]]\nname = "disk"\nsize = "2T"\nbandwidth = "2GB/s"\ncodec = "int3"\n')
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        load_tiers_toml(path)
    path.write_text('[[tier]]\nname = "disk"\nsize = "2T"\nbandwidth = "2GB/s"\ncompression = "int8"\n')
    with pytest.raises(ValueError, match="optionally codec"):
        load_tiers_toml(path)


def test_decode_rates_parse_and_must_apply() -> None:
    assert parse_decode_rate("int8=8GB/s") == ("int8", 8e9)
    for bad, message in (("int8", "CODEC=RATE"), ("raw=1GB/s", "not decoded"), ("int9=1GB/s", "unknown codec")):
        with pytest.raises(ValueError, match=message):
            parse_decode_rate(bad)
    model = get_model("llama-3-8b")
    with pytest.raises(ValueError, match="int4, which no tier stores"):
        PlanInputs(0.5, CostModel(model, get_gpu("h100")), KV, decode_rates=(("int4", 1e9),))
    with pytest.raises(ValueError, match="given twice"):
        PlanInputs(0.5, CostModel(model, get_gpu("h100")), KV, codecs=("int4",), decode_rates=(("int4", 1e9),) * 2)


# ------------------------------------------------------------------------ raw is unchanged


def test_raw_outputs_are_byte_identical_to_before_codecs(workload: Path) -> None:
    plan = ["plan", str(workload), "--model", "llama-3-8b", "--target-hit-rate", "0.3", "--jobs", "1",
            "--tier", "memory:2G:20GB/s", "--tier", "disk:1T:0.5GB/s"]  # fmt: skip
    replay = ["replay", str(workload), "--model", "llama-3-8b", "--capacity-bytes", "1GiB,4GiB", "--warmup", "0.5",
              "--no-progress"]  # fmt: skip
    for name, args in (("plan.txt", plan), ("plan.json", [*plan, "--json"]), ("replay.txt", replay)):
        code, out, _ = run_cli(args)
        assert code == 0
        assert out.replace(str(workload), "W") == (GOLDEN / f"raw_{name}").read_text(), name


def test_an_explicit_raw_tier_is_the_same_tier() -> None:
    assert parse_tier("disk:1T:0.5GB/s:raw") == parse_tier("disk:1T:0.5GB/s")


# ------------------------------------------------------------------------ tokens per byte


@pytest.mark.parametrize("block", [16, 512])
@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
def test_a_codec_holds_its_ratio_in_tokens(name: str, block: int) -> None:
    shape = KV.shape(block)
    ratio = codec.encoded_size(shape, KV.dtype, 32) / codec.encoded_size(shape, KV.dtype, 32, name)
    assert stored_ratio(KV, block, name) == pytest.approx(ratio, rel=1e-12)
    n = 100 * 2**30
    raw = tokens_in(n, KV, block, "raw")
    assert raw == n // BPT
    assert tokens_in(n, KV, block, name) == math.floor(n / (BPT / ratio))
    assert tokens_in(n, KV, block, name) == pytest.approx(ratio * raw, abs=ratio + 1)
    assert stored_bytes_per_token(KV, block, "raw") == BPT and tokens_in(math.inf, KV, block, name) == math.inf


def test_int8_and_int4_store_more_tokens_at_larger_blocks() -> None:
    assert 1.8 < stored_ratio(KV, 16, "int8") < stored_ratio(KV, 512, "int8") < 2.0
    assert 3.0 < stored_ratio(KV, 16, "int4") < stored_ratio(KV, 512, "int4") < 4.0


# ------------------------------------------------------------------------ replay --codec


def replay_json(path: Path, *args: str) -> list[dict[str, Any]]:
    code, out, err = run_cli(["replay", str(path), "--model", "llama-3-8b", "--warmup", "0.5", "--no-optimal",
                              "--json", *args])  # fmt: skip
    assert code == 0, err
    results: list[dict[str, Any]] = json.loads(out)["results"]
    return results


def test_replay_codec_at_n_bytes_is_raw_at_the_tokens_they_hold(workload: Path) -> None:
    budgets = ["512MiB", "2GiB"]
    rows = replay_json(workload, "--capacity-bytes", ",".join(budgets), "--codec", "raw,int8,int4")
    by = {(r["codec"], r["capacity_tokens"]): r for r in rows}
    assert [r["codec"] for r in rows] == ["raw", "raw", "int8", "int8", "int4", "int4"]
    for n in (512 * 2**20, 2 * 2**30):
        raw = by["raw", n // BPT]
        for name in ("int8", "int4"):
            tokens = int(tokens_in(n, KV, 16, name))
            packed = by[name, tokens]
            assert tokens > 1.8 * raw["capacity_tokens"] and packed["capacity_stored_bytes"] == n
            assert packed["token_hit_rate"] >= raw["token_hit_rate"]
            (alone,) = replay_json(workload, "--capacity-tokens", str(tokens))  # raw with the capacity multiplied
            assert packed["hit_tokens"] == alone["hit_tokens"] and packed["evictions"] == alone["evictions"]
    n = 2 * 2**30
    rates = hit_rates_at_bytes(workload, n, ("raw", "int8"))
    int8 = by["int8", int(tokens_in(n, KV, 16, "int8"))]
    assert rates == {"raw": by["raw", n // BPT]["token_hit_rate"], "int8": int8["token_hit_rate"]}


def test_replay_codec_table_and_note(workload: Path) -> None:
    code, out, _ = run_cli(["replay", str(workload), "--model", "llama-3-8b", "--capacity-bytes", "1GiB",
                            "--codec", "raw,int8", "--no-progress", "--no-optimal"])  # fmt: skip
    assert code == 0
    assert "┃ codec ┃" in out and "│ int8  │" in out
    assert f"int8 ({stored_ratio(KV, 16, 'int8'):.3f}x at 16-token blocks) 1GiB = " in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--capacity-tokens", "1M", "--codec", "int8"], "give --capacity-bytes"),
        (["--capacity-bytes", "1GiB", "--codec", "int8", "--tenant-capacity", "1GiB", "--html", "x.html"], "codecs"),
    ],
)
def test_replay_codec_needs_bytes(workload: Path, extra: list[str], message: str) -> None:
    code, _, err = run_cli(["replay", str(workload), "--model", "llama-3-8b", *extra])
    assert code == 2 and message in err


# ------------------------------------------------------------------------ the plan


def test_a_codec_tier_holds_more_tokens_and_sizes_are_per_codec(workload: Path) -> None:
    raw = plan_of(workload, "memory:1G:20GB/s", "disk:1G:2GB/s")
    packed = plan_of(
        workload, "memory:1G:20GB/s", "disk:1G:2GB/s:int8", decode_rates=(("int8", 8e9),), codecs=("int4",)
    )
    assert raw.capacity_tokens == packed.capacity_tokens  # the curve is in tokens: a codec changes only bytes
    assert packed.tiers[1].capacity_tokens == math.floor(2**30 / stored_bytes_per_token(KV, 16, "int8"))
    assert packed.tiers[1].capacity_tokens > 1.8 * raw.tiers[1].capacity_tokens
    assert packed.tiers_hold > raw.tiers_hold
    assert [s.codec for s in packed.sizes] == ["raw", "int8", "int4"]
    for size in packed.sizes:
        assert size.kv_bytes == (packed.capacity_tokens or 0) * stored_bytes_per_token(KV, 16, size.codec)
    assert raw.sizes == () and not raw.inputs.codec_aware


def test_decode_cost_lowers_the_saving_exactly(workload: Path) -> None:
    tiers = ("memory:1G:20GB/s", "disk:100G:2GB/s:int8")
    fast = plan_of(workload, *tiers, decode_rates=(("int8", 1e15),), measure=no_measure)
    slow = plan_of(workload, *tiers, decode_rates=(("int8", 4e9),), measure=no_measure)
    disk = slow.tiers[1]
    stored = stored_bytes_per_token(KV, 16, "int8")
    assert disk.transfer_seconds_per_token == stored / 2e9
    assert disk.decode_seconds_per_token == BPT / 4e9
    assert disk.load_seconds_per_token == stored / 2e9 + BPT / 4e9
    assert slow.decode == {"raw": DecodeRate("raw", math.inf, "none"), "int8": DecodeRate("int8", 4e9, "given")}
    hits = [s.hit_rate * slow.lookup_tokens for s in slow.tiers]
    load = sum(h * s.load_seconds_per_token for h, s in zip(hits, slow.tiers, strict=True)) / 3600
    assert slow.net_gpu_hours_saved == pytest.approx(slow.gpu_hours_saved - load, rel=1e-12)
    assert slow.decode_hours == pytest.approx(hits[1] * BPT / 4e9 / 3600, rel=1e-12)
    assert fast.gpu_hours_saved == slow.gpu_hours_saved
    assert fast.net_gpu_hours_saved - slow.net_gpu_hours_saved == pytest.approx(
        hits[1] * (BPT / 4e9 - BPT / 1e15) / 3600, rel=1e-9
    )
    assert slow.net_gpu_hours_saved < fast.net_gpu_hours_saved < fast.gpu_hours_saved


def test_a_tier_whose_decode_cannot_beat_recompute_says_so(workload: Path) -> None:
    tiers = ("memory:1G:20GB/s", "disk:100G:10GB/s:int4")
    quick = plan_of(workload, *tiers, decode_rates=(("int4", 1e12),))
    assert quick.tiers[1].worth_it  # the link alone is fast enough ...
    slow = plan_of(workload, *tiers, decode_rates=(("int4", 1e8),))
    assert not slow.tiers[1].worth_it  # ... the decode is what makes it lose to recompute
    assert (slow.prefill_seconds_per_hit_token or 0) < slow.tiers[1].load_seconds_per_token
    from prefixcache.sim.plan_report import plan_json, render_text

    text = render_text(slow)
    assert "TOO SLOW: loading costs more" in text and "too slow to be worth it: disk" in text
    assert "(transfer + decode)" in text
    assert "decode rate of int4: 0.1 GB/s of decoded KV, given" in text
    assert "net of loading the hits the tiers serve" in text
    entry = plan_json(slow)["tiers"][1]
    assert entry["codec"] == "int4" and entry["worth_it"] is False
    assert entry["decode_seconds_per_token"] == BPT / 1e8


def test_decode_rates_are_measured_unless_given(workload: Path) -> None:
    asked: list[tuple[int, str]] = []

    def measure(kv: object, block: int, name: str) -> float:
        asked.append((block, name))
        return 5e9

    plan = plan_of(workload, "disk:100G:2GB/s:int8", codecs=("int4",), measure=measure)
    assert asked == [(16, "int8"), (16, "int4")]
    assert plan.decode["int8"] == DecodeRate("int8", 5e9, "measured")
    from prefixcache.sim.plan_report import render_text

    assert "decode rate of int8: 5 GB/s of decoded KV, measured" in render_text(plan)
    rate = measure_decode_rate(KV, 16, "int8")
    assert math.isfinite(rate) and rate > 0 and measure_decode_rate(KV, 16, "int8") == rate  # cached
    assert decode_rate("int8", KV, 16, {"int8": 3e9}, no_measure) == DecodeRate("int8", 3e9, "given")


def test_the_cli_plans_with_codecs(workload: Path) -> None:
    code, out, err = run_cli(["plan", str(workload), "--model", "llama-3-8b", "--target-hit-rate", "0.3", "--jobs",
                              "1", "--tier", "memory:1G:20GB/s", "--tier", "disk:1T:2GB/s:int8", "--codec", "int4",
                              "--decode-rate", "int8=8GB/s", "--decode-rate", "int4=4GB/s", "--json"])  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert [c["codec"] for c in data["codecs"]] == ["raw", "int8", "int4"]
    assert [c["decode_rate_source"] for c in data["codecs"]] == ["none", "given", "given"]
    assert data["tiers"][1]["codec"] == "int8" and data["net_gpu_hours_saved"] < data["gpu_hours_saved"]
    code, out, _ = run_cli(["plan", str(workload), "--model", "llama-3-8b", "--target-hit-rate", "0.3", "--jobs",
                            "1", "--codec", "int8,int4", "--decode-rate", "int8=8GB/s", "--decode-rate",
                            "int4=4GB/s"])  # fmt: skip
    assert code == 0
    assert "stored as frames at 16-token blocks:" in out and "int4 " in out and "tokens per byte of raw" in out


# ------------------------------------------------------------------------ the Mooncake traces


@pytest.mark.slow
@pytest.mark.parametrize("path", [SYNTHETIC, CONVERSATION], ids=["synthetic", "conversation"])
def test_codecs_buy_hit_rate_on_the_mooncake_traces(path: Path) -> None:
    rates = hit_rates_at_bytes(path, 1_000_000 * BPT, ("raw", "int8", "int4"))
    assert rates["raw"] < rates["int8"] < rates["int4"]
