"""Honest inputs to ``prefixcache replay``: an empty trace is an error; capacities are
typed as people say them (tokens with suffixes, or bytes of a model's KV) and printed
back the same way; options that apply to nothing are errors; every counted figure
covers the same requests; the cost profile says when it is a default, and prompts
beyond its context are a figure; the per-tenant chart is drawn at a chosen capacity."""

from __future__ import annotations

import json
import math
import re
import types
from pathlib import Path
from typing import Any

import pytest

from prefixcache.sim import replay as replay_module
from prefixcache.sim.inputs import bytes_to_tokens, format_bytes, format_capacity, parse_bytes, parse_tokens
from prefixcache.sim.replay import replay
from prefixcache.sim.results import COVERAGE
from prefixcache.sim.traces import read_trace

from .test_cli import run_cli, strict_json

LLAMA_8B_KV = 2 * 32 * 8 * 128 * 2  # bytes a token: K and V, 32 layers, 8 KV heads of 128, bfloat16


@pytest.fixture(scope="module")
def hashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "hashed.jsonl"
    code, _, _ = run_cli(["workload", str(path), "--requests", "120", "--tenants", "3"])
    assert code == 0
    return path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "tokens.jsonl"
    code, _, _ = run_cli(["workload", str(path), "--requests", "60", "--tenants", "2", "--emit", "tokens"])
    assert code == 0
    return path


def fails(args: list[str], *messages: str) -> str:
    code, out, err = run_cli(["replay", *args])
    assert code == 2, (code, out, err)
    assert out == ""
    for message in messages:
        assert message in err, err
    return err


def results_of(args: list[str]) -> list[dict[str, Any]]:
    code, out, err = run_cli(["replay", *args, "--json", "--no-progress"])
    assert code == 0, err
    data = strict_json(out)
    assert data["coverage"] == COVERAGE
    results: list[dict[str, Any]] = data["results"]
    return results


# ---------------------------------------------------------------------------- empty traces


@pytest.mark.parametrize("content", [b"", b"\n", b"   \n\n\t\n"])
@pytest.mark.parametrize("fmt", ["auto", "jsonl", "mooncake"])
def test_an_empty_or_blank_trace_is_an_error(tmp_path: Path, content: bytes, fmt: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    fails([str(path), "--format", fmt], str(path), "no requests: the trace is empty or holds only blank lines")


def test_an_empty_trace_is_an_error_in_a_fleet_replay_too(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"\n")
    fails([str(path), "--backends", "2"], "no requests")


# ---------------------------------------------------------------------------- capacities


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("16384", 16384), ("1e6", 1e6), ("2.5k", 2500), ("2.5K", 2500), ("1M", 1e6), ("1.5G", 1.5e9),
     ("2T", 2e12), ("0", 0), ("inf", math.inf), (" 10M ", 1e7), ("81.92K", 81920)],
)  # fmt: skip
def test_token_capacities_take_suffixes(text: str, tokens: float) -> None:
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize(
    ("text", "n"),
    [("4096", 4096), ("4096B", 4096), ("10G", 10**10), ("10GB", 10**10), ("10GiB", 10 * 2**30),
     ("1.5MiB", 1536 * 1024), ("80gb", 8 * 10**10), ("2Ti", 2 * 2**40), ("512KiB", 512 * 1024)],
)  # fmt: skip
def test_byte_capacities_take_units(text: str, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["abc", "-1", "1.5", "nan", "1x", "1MiB", "k", "1e", "1..5k"])
def test_a_bad_token_capacity_names_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"accepted: a whole number of tokens .* suffix k, M, G or T .* or inf"):
        parse_tokens(text)


@pytest.mark.parametrize("text", ["abc", "-1GiB", "0.5B", "10X", "10Gb/s"])
def test_a_bad_byte_capacity_names_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"accepted: bytes with a unit: B, KB, .* KiB, MiB, GiB, TiB"):
        parse_bytes(text)


@pytest.mark.parametrize(
    "tokens",
    [0, 1, 16, 999, 1000, 1500, 12345, 81920, 999_999, 1 << 20, 10**6, 2_500_000, 10**7, 1.5e9, 2e12, math.inf],
)
def test_capacities_print_as_they_are_typed(tokens: float) -> None:
    text = format_capacity(tokens)
    assert parse_tokens(text) == tokens
    assert "," not in text and len(text) <= 8  # a list item, and short


def test_capacity_print_forms() -> None:
    assert [format_capacity(n) for n in (10**6, 1500, 81920, 1 << 20, math.inf)] == [
        "1M",
        "1.5K",
        "81.92K",
        "1048576",
        "inf",
    ]
    assert [format_bytes(n) for n in (LLAMA_8B_KV, 10 * 2**30, 10**10, 1000)] == ["128KiB", "10GiB", "10GB", "1KB"]
    for n in (LLAMA_8B_KV, 10 * 2**30, 10**10, 1000, 1536, 23040):
        assert parse_bytes(format_bytes(n)) == n


def test_bytes_become_whole_tokens() -> None:
    assert bytes_to_tokens(10 * 2**30, LLAMA_8B_KV) == 81920
    assert bytes_to_tokens(LLAMA_8B_KV + 1, LLAMA_8B_KV) == 1
    assert bytes_to_tokens(math.inf, LLAMA_8B_KV) == math.inf
    with pytest.raises(ValueError, match=r"1KiB holds no token's KV \(131,072 bytes a token\)"):
        bytes_to_tokens(1024, LLAMA_8B_KV, "1KiB")


def test_the_table_prints_capacities_that_type_back(hashed: Path) -> None:
    args = [str(hashed), "--capacity-tokens", "2.5k,81920,1048576,inf", "--model", "none", "--no-optimal"]
    code, out, err = run_cli(["replay", *args, "--no-progress"])
    assert code == 0, err
    shown = [line.split("│")[2].strip() for line in out.splitlines() if line.startswith("│")]
    assert shown == ["2.5K", "81.92K", "1048576", "inf"]
    retyped = results_of([str(hashed), "--capacity-tokens", ",".join(shown), "--model", "none", "--no-optimal"])
    assert [r["capacity_tokens"] for r in retyped] == [2500, 81920, 1048576, None]


def test_capacity_bytes_need_a_model_and_become_tokens(hashed: Path) -> None:
    results = results_of([str(hashed), "--capacity-bytes", "1GiB,10G,inf", "--model", "llama-3-8b", "--no-optimal"])
    assert [r["capacity_tokens"] for r in results] == [2**30 // LLAMA_8B_KV, 10**10 // LLAMA_8B_KV, None]
    assert [r["kv_bytes_per_token"] for r in results] == [LLAMA_8B_KV] * 3
    assert results[0]["capacity_kv_bytes"] == 2**30 and results[2]["capacity_kv_bytes"] is None
    code, out, _ = run_cli(["replay", str(hashed), "--capacity-bytes", "1GiB", "--model", "llama-3-8b", "--no-optimal"])
    assert code == 0
    assert "in tokens of llama-3-8b KV (bfloat16, 128KiB a token): 1GiB = 8.192K" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity-bytes", "10GiB"], "--capacity-bytes needs --model NAME"),
        (["--capacity-bytes", "10GiB", "--model", "none"], "--capacity-bytes needs --model NAME"),
        (["--capacity-bytes", "10GiB", "--capacity-tokens", "1M", "--model", "llama-3-8b"], "not both"),
        (["--capacity-bytes", "1KiB", "--model", "llama-3-8b"], "1KiB holds no token's KV"),
        (
            ["--capacity-bytes", "10GiB", "--model", "m:params=7e9,layers=32,hidden=4096,context=32768"],
            "needs the KV layout of model 'm'",
        ),
        (["--capacity-bytes", "10Gb/s", "--model", "llama-3-8b"], "--capacity-bytes: not a valid value: '10Gb/s'"),
        (["--capacity-tokens", "1MiB"], "accepted: a whole number of tokens"),
        (["--capacity-bytes", "10GiB", "--model", "llama-3-8b", "--backends", "2"], "--capacity-bytes"),
    ],
)
def test_bad_capacities_exit_2_naming_them(hashed: Path, args: list[str], message: str) -> None:
    fails([str(hashed), *args], message)


def test_a_spec_with_a_kv_layout_converts_bytes(hashed: Path) -> None:
    spec = "tiny:params=1e8,layers=2,hidden=64,context=4096,kv_heads=1,head_dim=16,dtype=float32"
    (r,) = results_of([str(hashed), "--capacity-bytes", "256KiB", "--model", spec, "--no-optimal"])
    assert r["kv_bytes_per_token"] == 2 * 2 * 16 * 4 and r["capacity_tokens"] == 256 * 1024 // 256


# ---------------------------------------------------------------------------- options that do not apply


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--publish", "2"], "--publish applies to namespace and partitioned isolation"),
        (["--publish", "2", "--isolation", "shared"], "--publish applies to namespace and partitioned"),
        (["--publish-min-tokens", "64"], "--publish-min-tokens applies only with --publish K"),
        (["--mode", "flat", "--ttl", "60"], "--ttl applies to tree mode only"),
        (["--mode", "flat", "--isolation", "namespace", "--publish", "2"], "--publish applies to tree mode only"),
        (["--mode", "flat", "--metrics", "/nonexistent/m"], "--metrics applies to tree mode only"),
        (["--mode", "flat", "--engine", "native"], "--engine native applies to tree mode only"),
        (["--mode", "flat", "--include-output"], "--include-output applies to tree mode only"),
        (["--mode", "flat", "--partial-blocks"], "--partial-blocks applies to tree mode only"),
        (["--model", "none", "--gpu", "a100"], "--gpu prices the cost model, which --model none turns off"),
        (["--model", "none", "--utilization", "0.4"], "--utilization prices the cost model"),
        (["--tenant-capacity", "1M"], "--tenant-capacity picks the capacity of the HTML report's"),
    ],
)
def test_an_option_that_applies_to_nothing_is_an_error(hashed: Path, args: list[str], message: str) -> None:
    fails([str(hashed), *args], message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "64"], "--block-size applies to token traces"),
        (["--partial-blocks"], "--partial-blocks needs the tokens inside a block"),
        (["--include-output"], "--include-output inserts output token ids"),
        (["--tokenizer", "utf8"], "--tokenizer reads 'text' prompts"),
    ],
)
def test_options_for_token_traces_on_a_pre_hashed_one(hashed: Path, args: list[str], message: str) -> None:
    fails([str(hashed), *args], message, "is pre-hashed (hash_ids in blocks of 16 tokens)")


def test_hashed_blocks_on_a_token_trace_is_an_error(tokens: Path) -> None:
    fails([str(tokens), "--hashed-blocks", "full"], "--hashed-blocks full applies to pre-hashed traces")


def test_options_for_token_traces_apply_to_one(tokens: Path) -> None:
    args = [str(tokens), "--block-size", "16,32", "--include-output", "--tokenizer", "utf8", "--no-optimal"]
    assert [r["block_size"] for r in results_of(args)] == [16, 32]


def test_in_a_mixed_list_only_the_configurations_an_option_applies_to_carry_it(hashed: Path) -> None:
    args = [str(hashed), "--mode", "tree,flat", "--isolation", "shared,namespace", "--publish", "2", "--ttl", "30"]
    results = results_of([*args, "--no-optimal", "--model", "none"])
    got = [(r["mode"], r["isolation"], r["publish_min_tenants"], r["ttl_seconds"]) for r in results]
    assert got == [
        ("tree", "shared", None, 30),
        ("tree", "namespace", 2, 30),
        ("flat", "shared", None, None),
        ("flat", "namespace", None, None),
    ]


def test_tree_options_with_a_flat_mode_in_the_list_run(tokens: Path) -> None:
    results = results_of([str(tokens), "--mode", "tree,flat", "--partial-blocks", "--no-optimal", "--model", "none"])
    assert [(r["mode"], r["partial_blocks"]) for r in results] == [("tree", True), ("flat", False)]


# ---------------------------------------------------------------------------- what the figures cover


def test_blocks_and_seconds_cover_the_counted_requests(hashed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(10**9))
    fake_time = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr(replay_module, "time", fake_time)  # each timed step costs exactly 1 "second"
    requests = list(read_trace(hashed))
    counted = requests[len(requests) // 2 :]
    (r,) = replay(lambda: iter(requests), [_config()], warmup=0.5, optimal=False)
    assert r.requests == len(counted) == r.seconds
    assert r.blocks_looked_up == sum(len(q.hash_ids or ()) for q in counted)
    assert r.lookup_tokens == sum(q.input_length for q in counted)


def _config() -> Any:
    from prefixcache.config import CacheConfig
    from prefixcache.sim.results import ReplayConfig

    return ReplayConfig(CacheConfig(capacity_tokens=4096, block_size=16))


def test_the_json_says_what_each_figure_covers(hashed: Path) -> None:
    (r,) = results_of([str(hashed), "--warmup", "0.5", "--no-optimal", "--capacity-tokens", "4096"])
    assert r["requests"] == 60 and r["warmup_requests"] == 60
    for name in ("blocks_looked_up", "seconds", "hit_tokens", "prompts_over_context", "per_tenant"):
        assert name in COVERAGE["counted"]
    assert "evictions" in COVERAGE["whole_replay"]
    assert "warm-up excluded" in COVERAGE["seconds"]


# ---------------------------------------------------------------------------- the cost model


def test_a_default_cost_profile_says_so(hashed: Path, tmp_path: Path) -> None:
    (r,) = results_of([str(hashed), "--no-optimal"])
    assert r["cost_profile"] == "llama-3-8b@h100 u=0.50"
    assert r["cost_defaults"] == ["model", "gpu", "utilization"]
    code, out, _ = run_cli(["replay", str(hashed), "--no-optimal", "--html", str(tmp_path / "r.html")])
    assert code == 0
    said = "llama-3-8b@h100 u=0.50 (defaults: model, gpu, utilization; set with --model, --gpu, --utilization)"
    assert said in " ".join(out.split())
    assert said in (tmp_path / "r.html").read_text(encoding="utf-8")


def test_a_chosen_cost_profile_is_not_called_a_default(hashed: Path) -> None:
    args = [str(hashed), "--model", "llama-3-70b", "--gpu", "a100", "--utilization", "0.4", "--no-optimal"]
    (r,) = results_of(args)
    assert r["cost_defaults"] == [] and r["cost_profile"] == "llama-3-70b@a100 u=0.40"
    code, out, _ = run_cli(["replay", *args])
    assert code == 0 and "default" not in out
    (r,) = results_of([str(hashed), "--model", "llama-3-8b", "--no-optimal"])
    assert r["cost_defaults"] == ["gpu", "utilization"]


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four prompts, two of them beyond smollm2-135m's 8,192-token context."""
    path = tmp_path_factory.mktemp("inputs") / "long.jsonl"
    rows = []
    for i, length in enumerate((1000, 9000, 8192, 20000)):
        ids = list(range(-(-length // 16)))
        rows.append(
            {"timestamp": i, "tenant": "t", "model": "m", "hash_ids": ids, "block_size": 16, "input_length": length}
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_prompts_beyond_the_context_are_a_figure(long_prompts: Path, tmp_path: Path) -> None:
    (r,) = results_of([str(long_prompts), "--model", "smollm2-135m", "--no-optimal"])
    assert r["prompts_over_context"] == 2 and r["prompts_over_context_share"] == 0.5
    assert r["context_length"] == 8192 and r["cost_profile"] == "smollm2-135m@h100 u=0.50"
    html_path = tmp_path / "r.html"
    code, out, _ = run_cli(["replay", str(long_prompts), "--model", "smollm2-135m", "--html", str(html_path)])
    assert code == 0
    line = "Prompts beyond the context of smollm2-135m (8,192 tokens): 2 of 4 counted (50.0%)"
    assert line in out
    assert line in html_path.read_text(encoding="utf-8")
    (r,) = results_of([str(long_prompts), "--no-optimal"])  # llama-3-8b: 131,072 tokens
    assert r["prompts_over_context"] == 0
    code, out, _ = run_cli(["replay", str(long_prompts), "--no-optimal"])
    assert "Prompts beyond" not in out


# ---------------------------------------------------------------------------- the per-tenant chart


def tenant_heading(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    (heading,) = re.findall(r"<h2>(Token hit rate per tenant[^<]*)</h2>", text)
    return heading


def test_the_per_tenant_chart_is_at_the_largest_capacity_by_default(hashed: Path, tmp_path: Path) -> None:
    path = tmp_path / "r.html"
    code, _, err = run_cli(["replay", str(hashed), "--capacity-tokens", "4096,1M", "--html", str(path)])
    assert code == 0, err
    assert tenant_heading(path) == (
        "Token hit rate per tenant at capacity 1M (the largest replayed; --tenant-capacity picks)"
    )


@pytest.mark.parametrize(
    ("args", "capacity"),
    [
        (["--capacity-tokens", "4096,1M,inf", "--tenant-capacity", "4.096k"], "4.096K"),
        (["--capacity-tokens", "4096,1M,inf", "--tenant-capacity", "1e6"], "1M"),
        (["--capacity-bytes", "1GiB,10GiB", "--model", "llama-3-8b", "--tenant-capacity", "1GiB"], "8.192K"),
    ],
)
def test_the_per_tenant_chart_at_a_chosen_capacity(
    hashed: Path, tmp_path: Path, args: list[str], capacity: str
) -> None:
    path = tmp_path / "r.html"
    code, _, err = run_cli(["replay", str(hashed), *args, "--html", str(path), "--no-optimal"])
    assert code == 0, err
    assert tenant_heading(path) == f"Token hit rate per tenant at capacity {capacity} (chosen with --tenant-capacity)"
    text = path.read_text(encoding="utf-8")
    table = text[text.index("<h2>Token hit rate per tenant") :]
    assert f"lru {capacity}</th>" in table  # the tenant table shows that capacity's numbers


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity-tokens", "4096,1M", "--tenant-capacity", "2M"], "replayed capacities (tokens): 4.096K, 1M"),
        (["--capacity-tokens", "4096,1M", "--tenant-capacity", "lots"], "accepted: a whole number of tokens"),
        (["--backends", "2", "--tenant-capacity", "inf"], "--tenant-capacity applies to a single-cache replay"),
    ],
)
def test_an_unknown_tenant_capacity_is_an_error(hashed: Path, tmp_path: Path, args: list[str], message: str) -> None:
    fails([str(hashed), *args, "--html", str(tmp_path / "r.html")], message)
    assert not (tmp_path / "r.html").exists()
