"""``prefixcache replay`` and ``prefixcache workload`` from the command line: the
documented example on a Mooncake trace, strict JSON, the table and HTML report, a
complete ``--help``, errors that exit 2 naming the problem, and one run of the
installed entry point."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prefixcache.cli import main
from prefixcache.sim.traces import read_trace
from support import SYNTHETIC, run_cli

EXAMPLE = ["--format", "mooncake", "--policy", "lru,s3fifo", "--capacity-tokens", "1e6,1e7,inf", "--warmup", "0.5"]
REQUIRED = (
    "policy",
    "capacity_tokens",
    "block_size",
    "isolation",
    "token_hit_rate",
    "request_hit_rate",
    "optimal_token_hit_rate",
)

slow = pytest.mark.slow


def strict_json(text: str) -> Any:
    def reject(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=reject)


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "work.jsonl"
    code, out, _ = run_cli(["workload", str(path), "--requests", "300", "--tenants", "3"])
    assert code == 0 and "300" in out
    return path


@pytest.fixture(scope="module")
def example() -> list[dict[str, Any]]:
    """The --help example, with --json, on the Mooncake synthetic trace."""
    code, out, err = run_cli(["replay", str(SYNTHETIC), *EXAMPLE, "--json"])
    assert code == 0, err
    data = strict_json(out)
    assert list(data) == ["results", "coverage"]  # coverage: which requests each figure covers
    results: list[dict[str, Any]] = data["results"]
    return results


# ---------------------------------------------------------------------------- the example


@slow
def test_example_gives_one_result_per_configuration(example: list[dict[str, Any]]) -> None:
    assert len(example) == 6
    got = [(r["policy"], r["capacity_tokens"], r["unlimited"]) for r in example]
    caps = [(1_000_000, False), (10_000_000, False), (None, True)]
    assert got == [(p, c, u) for p in ("lru", "s3fifo") for c, u in caps]
    for r in example:
        for key in REQUIRED:
            assert key in r, key
        assert r["block_size"] == 512  # the trace's own
        assert r["isolation"] == "shared"
        assert r["mode"] == "tree"
        assert r["warmup_requests"] == int(3993 * 0.5) == 1996
        assert r["requests"] == 3993 - 1996
        assert 0.0 < r["token_hit_rate"] <= r["optimal_token_hit_rate"] <= 1.0
        assert 0.0 < r["request_hit_rate"] <= 1.0
        assert r["trace"] == SYNTHETIC.name
        assert r["gpu_hours_saved"] > 0  # the default cost model is on
        assert sum(p["requests"] for p in r["timeline"]) == r["requests"]


@slow
def test_example_hit_rates_grow_with_capacity(example: list[dict[str, Any]]) -> None:
    for policy in ("lru", "s3fifo"):
        rates = [r["token_hit_rate"] for r in example if r["policy"] == policy]
        assert rates == sorted(rates)
    ceilings = {r["token_hit_rate"] for r in example if r["unlimited"]}
    assert len(ceilings) == 1  # every policy reaches the same ceiling
    assert {r["optimal_token_hit_rate"] for r in example if r["unlimited"]} == ceilings


# ---------------------------------------------------------------------------- table and HTML


def test_table_and_html_report(workload: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    html = tmp_path / "out.html"
    args = ["replay", str(workload), "--policy", "lru,fifo,s3fifo", "--capacity-tokens", "2e4,inf"]
    assert main([*args, "--no-progress", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    for word in ("lru", "fifo", "s3fifo", "inf", "20K", "token hit", "optimal", "GPU-h saved"):
        assert word in out, word
    assert f"HTML report: {html}" in out
    assert out.count("│ lru ") + out.count("| lru ") >= 2  # one row per configuration
    text = html.read_text()
    images = re.findall(r"<img\b[^>]*>", text)
    assert images
    assert all('src="data:image/png;base64,' in img for img in images)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", text)  # self-contained
    assert "<link" not in text and "<script src" not in text


def test_model_none_drops_the_cost_columns(workload: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(workload), "--model", "none", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "token hit" in out
    assert "GPU-h saved" not in out and "compute avoided" not in out
    assert main(["replay", str(workload), "--model", "none", "--json"]) == 0
    (r,) = strict_json(capsys.readouterr().out)["results"]
    assert r["gpu_hours_saved"] is None and r["cost_profile"] is None and r["prefill_compute_avoided"] is None


def test_engine_is_chosen_and_reported(workload: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["replay", str(workload), "--model", "none", "--no-optimal", "--json", "--capacity-tokens", "2e4"]
    results = {}
    for engine in ("auto", "native", "python"):
        assert main([*args, "--engine", engine]) == 0
        (results[engine],) = strict_json(capsys.readouterr().out)["results"]
    assert [results[e]["engine"] for e in ("auto", "native", "python")] == ["native", "native", "python"]
    same = {k for k in results["python"] if k not in ("seconds", "engine")}
    assert {k: results["native"][k] for k in same} == {k: results["python"][k] for k in same}
    # native refuses what it does not model, before any replay: no metrics file is written
    metrics = tmp_path / "metrics"
    assert main([*args, "--engine", "native", "--metrics", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert "--engine native cannot replay" in err and "--metrics" in err
    assert not list(metrics.glob("*.prom"))


def test_user_defined_model_and_gpu(workload: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = "mymodel:params=7e9,layers=32,hidden=4096,context=32768"
    args = ["replay", str(workload), "--model", model, "--gpu", "mygpu:peak=500e12", "--utilization", "0.4"]
    assert main([*args, "--json"]) == 0
    (r,) = strict_json(capsys.readouterr().out)["results"]
    assert r["cost_profile"].startswith("mymodel@mygpu u=0.40")
    assert r["prefill_flops_saved"] > 0
    assert r["gpu_hours_saved"] == pytest.approx(r["prefill_flops_saved"] / (500e12 * 0.4) / 3600)
    assert 0 < r["prefill_compute_avoided"] <= 1


# ---------------------------------------------------------------------------- help


def test_metrics_of_each_configuration_read_like_a_server_and_diagnose_them(workload: Path, tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    out_dir = tmp_path / "metrics"
    code, out, _ = run_cli(["replay", str(workload), "--policy", "lru,s3fifo", "--capacity-tokens", "2e4",
                            "--no-optimal", "--json", "--metrics", str(out_dir)])  # fmt: skip
    assert code == 0
    results = {r["policy"]: r for r in strict_json(out)["results"]}
    files = sorted(out_dir.glob("*.prom"))
    assert [f.name.split("_")[0] for f in files] == ["lru", "s3fifo"]
    for path in files:
        samples = [s for f in text_string_to_metric_families(path.read_text()) for s in f.samples]
        hits: dict[str, float] = {}
        for sample in samples:
            if sample.name == "prefixcache_hit_tokens_total":
                hits[sample.labels["tenant"]] = hits.get(sample.labels["tenant"], 0.0) + sample.value
        result = results[path.name.split("_")[0]]
        assert sum(hits.values()) == sum(t["hit_tokens"] for t in result["per_tenant"].values()) > 0
        evicted = [
            s.value for s in samples if s.name == "prefixcache_evictions_total" and s.labels["reason"] == "capacity"
        ]
        assert evicted == [result["evictions"]]
        code, report, _ = run_cli(["diagnose", str(path)])
        assert code in (0, 1) and "token hit rate" in report


def test_replay_help_is_complete(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["replay", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    options = [
        "--hashed-blocks",
        *("--format", "--policy", "--capacity-tokens", "--block-size", "--isolation", "--mode", "--partial-blocks"),
        *("--ttl", "--warmup", "--include-output", "--no-optimal", "--model", "--gpu", "--utilization"),
        *("--tokenizer", "--json", "--html", "--no-progress", "--publish", "--publish-min-tokens", "--metrics"),
    ]
    for option in options:
        assert option in text, option
    example = "prefixcache replay trace.jsonl " + " ".join(EXAMPLE)
    assert example in text
    words = ("lru", "s3fifo", "fifo", "sieve", "lfuda", "gittins", "shared", "namespace", "partitioned", "flat", "tree")
    for word in words:
        assert word in text, word


def test_top_level_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "replay" in text and "workload" in text


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "bogus"], "--policy: unknown 'bogus'"),
        (["--policy", "lru,lruu"], "unknown 'lruu'"),
        (["--capacity-tokens", "abc"], "--capacity-tokens: not a valid value: 'abc'"),
        (["--capacity-tokens", "-1"], "--capacity-tokens: not a valid value: '-1'"),
        (["--capacity-tokens", "1.5"], "--capacity-tokens: not a valid value: '1.5'"),
        (["--capacity-tokens", "1e6,nan"], "'nan'"),
        (["--capacity-tokens", ","], "--capacity-tokens: give at least one value"),
        (["--block-size", "0"], "--block-size: not a valid value: '0'"),
        (["--isolation", "tenant"], "--isolation: unknown 'tenant'"),
        (["--mode", "btree"], "--mode: unknown 'btree'"),
        (["--format", "csv"], "--format"),
        (["--warmup", "1.0"], "--warmup must be a fraction in [0, 1)"),
        (["--warmup", "-0.1"], "--warmup must be a fraction in [0, 1)"),
        (["--ttl", "0"], "--ttl must be a positive number"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--model", "m:params=7e9"], "missing field(s)"),
        (["--gpu", "tpu"], "unknown gpu 'tpu'"),
        (["--utilization", "0"], "utilization"),
        (["--tokenizer", "nope"], "unknown tokenizer 'nope'"),
        (["--publish", "1"], "--publish needs K >= 2"),
        (["--publish", "two"], "--publish"),
        (["--publish", "2", "--publish-min-tokens", "0"], "--publish-min-tokens must be >= 1"),
    ],
)
def test_bad_option_exits_2_naming_it(workload: Path, args: list[str], message: str) -> None:
    code, out, err = run_cli(["replay", str(workload), *args])
    assert code == 2
    assert message in err, err
    assert out == ""


def test_missing_trace_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    code, _, err = run_cli(["replay", str(missing)])
    assert code == 2
    assert f"no such trace file: {missing}" in err


def test_malformed_trace_line_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "hash_ids": [0]}) + "\n")
    code, out, err = run_cli(["replay", str(path), "--format", "mooncake", "--json"])
    assert code == 2
    assert out == ""
    assert f"{path}:2: field 'hash_ids'" in err
    assert err.startswith("prefixcache replay: ")


def test_mixed_block_size_trace_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    rows = [
        {"timestamp": 0, "tenant": "a", "model": "m", "hash_ids": [1], "block_size": 16, "input_length": 16},
        {"timestamp": 1, "tenant": "a", "model": "m", "hash_ids": [2], "block_size": 64, "input_length": 64},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli(["replay", str(path)])
    assert code == 2
    assert "block size" in err


def mooncake_600(path: Path, *ids: list[int]) -> Path:
    """One 600-token Mooncake request per list of hash ids, a second apart."""
    rows = [{"timestamp": t, "input_length": 600, "output_length": 1, "hash_ids": i} for t, i in enumerate(ids)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("ids", "flag", "code", "expected"),
    [
        ([0], [], 0, 512 / 1200),  # detected: only the full block hashed, the tail never a hit
        ([0], ["--hashed-blocks", "full"], 0, 512 / 1200),
        ([0, 1], [], 0, 600 / 1200),  # Mooncake's convention
        ([0], ["--hashed-blocks", "all"], 2, "field 'hash_ids': has 1 ids"),
        ([0, 1], ["--hashed-blocks", "full"], 2, "hashed blocks 'full' needs 600//512 = 1"),
    ],
)
def test_hashed_blocks_convention_from_the_command_line(
    tmp_path: Path, ids: list[int], flag: list[str], code: int, expected: float | str
) -> None:
    path = mooncake_600(tmp_path / "t.jsonl", ids, ids)
    got, out, err = run_cli(["replay", str(path), "--model", "none", "--json", *flag])
    assert got == code, err
    if isinstance(expected, str):
        assert f"{path}:1: " in err and expected in err
    else:
        (result,) = strict_json(out)["results"]
        assert result["token_hit_rate"] == result["optimal_token_hit_rate"] == pytest.approx(expected)


def test_a_trace_mixing_hashed_block_conventions_exits_2_naming_both_lines(tmp_path: Path) -> None:
    path = mooncake_600(tmp_path / "mixed.jsonl", [0], [0, 1])
    code, out, err = run_cli(["replay", str(path), "--json"])
    assert (code, out) == (2, "")
    assert f"{path}:2: field 'hash_ids'" in err and f"since {path}:1" in err and "one convention" in err


# ---------------------------------------------------------------------------- workload


def test_workload_is_readable_and_deterministic(workload: Path, tmp_path: Path) -> None:
    lines = workload.read_bytes().splitlines()
    assert len(lines) == 300
    requests = list(read_trace(workload))
    assert len(requests) == 300
    assert {r.tenant for r in requests} == {"tenant-00", "tenant-01", "tenant-02"}
    assert all(r.hash_ids is not None and r.block_size == 16 for r in requests)
    again = tmp_path / "again.jsonl"
    code, out, _ = run_cli(["workload", str(again), "--requests", "300", "--tenants", "3"])
    assert code == 0
    assert out.strip() == f"wrote 300 requests to {again}"
    assert again.read_bytes() == workload.read_bytes()
    other = tmp_path / "other.jsonl"
    assert run_cli(["workload", str(other), "--requests", "300", "--tenants", "3", "--seed", "1"])[0] == 0
    assert other.read_bytes() != workload.read_bytes()


@pytest.mark.parametrize("args", [["--requests", "-1"], ["--tenants", "0"], ["--block-size", "0"], ["--emit", "text"]])
def test_workload_bad_option_exits_2(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "w.jsonl"
    code, _, err = run_cli(["workload", str(out), *args])
    assert code == 2 and err
    assert not out.exists()


def test_isolation_modes_on_a_generated_workload(workload: Path) -> None:
    code, out, err = run_cli(["replay", str(workload), "--isolation", "shared,namespace,partitioned", "--json"])
    assert code == 0, err
    results = strict_json(out)["results"]
    assert [r["isolation"] for r in results] == ["shared", "namespace", "partitioned"]
    shared, namespace, partitioned = (r["token_hit_rate"] for r in results)
    assert shared >= namespace > 0
    assert shared >= partitioned > 0
    for r in results:
        assert r["unlimited"] and r["capacity_tokens"] is None
        assert r["block_size"] == 16  # the workload's hash_ids block size
        assert set(r["per_tenant"]) == {"tenant-00", "tenant-01", "tenant-02"}


def test_block_size_on_a_pre_hashed_trace_is_an_error(workload: Path) -> None:
    # NOTE: it used to merge silently into the trace's own block size; its hash_ids fix it.
    code, out, err = run_cli(["replay", str(workload), "--block-size", "16,64,256", "--json", "--no-optimal"])
    assert code == 2 and out == ""
    assert "--block-size applies to token traces" in err and "blocks of 16 tokens" in err
    code, out, _ = run_cli(["replay", str(workload), "--json", "--no-optimal"])
    assert code == 0
    (r,) = strict_json(out)["results"]
    assert r["block_size"] == 16 and r["optimal_token_hit_rate"] is None


def test_publication_from_the_command_line(workload: Path) -> None:
    args = ["replay", str(workload), "--isolation", "shared,namespace", "--publish", "2", "--json", "--no-optimal"]
    code, out, _ = run_cli(args)
    assert code == 0
    shared, namespace = strict_json(out)["results"]
    assert shared["publish_min_tenants"] is None  # nothing to publish when all is shared
    assert namespace["publish_min_tenants"] == 2 and namespace["publish_min_tokens"] == 256
    assert shared["token_hit_rate"] >= namespace["token_hit_rate"] > 0


def test_flat_mode_and_ttl_from_the_command_line(workload: Path) -> None:
    args = ["replay", str(workload), "--mode", "tree,flat", "--capacity-tokens", "5e4", "--ttl", "60", "--json"]
    code, out, _ = run_cli(args)
    assert code == 0
    tree, flat = strict_json(out)["results"]
    assert (tree["mode"], flat["mode"]) == ("tree", "flat")
    assert tree["ttl_seconds"] == 60 and flat["ttl_seconds"] is None  # flat mode has no clock: it ran without
    assert tree["block_hit_rate"] is None and 0 < flat["block_hit_rate"] < 1


# ---------------------------------------------------------------------------- the installed command


def test_installed_entry_point(workload: Path) -> None:
    exe = Path(sys.executable).with_name("prefixcache")
    assert exe.is_file(), f"{exe} missing: is the package installed in this environment?"
    proc = subprocess.run(
        [str(exe), "replay", str(workload), "--policy", "lru,s3fifo", "--capacity-tokens", "1e5,inf", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results = strict_json(proc.stdout)["results"]
    assert [(r["policy"], r["unlimited"]) for r in results] == [
        ("lru", False),
        ("lru", True),
        ("s3fifo", False),
        ("s3fifo", True),
    ]
    assert proc.stderr == ""  # no progress bars off a terminal
