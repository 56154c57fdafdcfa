"""``prefixcache curve`` (sim/curve_cli.py): the curve the API draws, as a table or
JSON, and bad input as exit status 2 with the reason, never a curve of nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.config import CacheConfig
from prefixcache.sim.curves import curve
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.traces import read_trace
from support import SYNTHETIC

pytest.importorskip("prefixcache.sim.native._curves", reason="the compiled curve engine is not built")
pytest.importorskip("prefixcache.sim.native._kernel", reason="the compiled replay kernel is not built")

TRACE = SYNTHETIC


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["curve", str(TRACE), *argv, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_the_cli_draws_the_apis_curve_exactly_on_a_small_trace(capsys: pytest.CaptureFixture[str]) -> None:
    got = _json(capsys, "--policy", "s3fifo", "--warmup", "0.5", "--capacity-tokens", "100k,1M,4M,inf")
    assert got["capacities"] == [100_000.0, 1_000_000.0, 4_000_000.0, None]
    assert (got["method"], got["sampling_rate"], got["error_bound"]) == ("sampled", 1.0, 0.0)
    config = ReplayConfig(CacheConfig(policy="s3fifo", isolation="shared"))
    caps = [1e5, 1e6, 4e6, math.inf]
    ref = curve(lambda: read_trace(TRACE), config, caps, warmup=0.5, method="replay")
    assert got["token_hit_rates"] == pytest.approx(list(ref.token_hit_rates), abs=1e-12)
    assert got["requests"] == ref.requests and ref.requests == 3_993 - int(3_993 * 0.5)
    assert got["block_size"] == 512  # the pre-hashed trace's own


def test_the_table_lists_every_point_and_says_how_it_was_drawn(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["curve", str(TRACE), "--policy", "lru", "--capacity-tokens", "1M,inf", "--rate", "0.5"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("1,000,000", "unlimited"))]
    assert [r[0] for r in rows] == ["1,000,000", "unlimited"] and all(0 <= float(r[1]) <= 1 for r in rows)
    assert "rate 0.5" in out and "no error bound is claimed" in out and "policy lru" in out
    assert main(["curve", str(TRACE), "--method", "stack", "--capacity-tokens", "1M"]) == 0
    assert "textbook LRU" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--block-size", "16"], "--block-size applies to token traces"),
        (["--isolation", "partitioned"], "partitioned isolation"),
        (["--method", "stack", "--rate", "0.5"], "applies to method 'sampled'"),
        (["--method", "stack", "--policy", "sieve"], "LRU only"),
        (["--jobs", "0"], "jobs must be >= 1"),
    ],
)
def test_bad_input_is_exit_two_with_the_reason(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    assert main(["curve", str(TRACE), *argv]) == 2
    captured = capsys.readouterr()
    assert reason in captured.err and captured.out == ""


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_an_empty_or_blank_trace_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    trace = tmp_path / "empty.jsonl"
    trace.write_text(text)
    assert main(["curve", str(trace)]) == 2
    assert "no requests" in capsys.readouterr().err
    assert main(["curve", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_flags_out_of_range_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--warmup", "1"],
        ["--capacity-tokens", "1Q"],
        ["--policy", "magic"],
        ["--ttl", "-1"],
        ["--method", "stack", "--seed", "3"],  # options of the sampled method only
        ["--method", "replay", "--jobs", "2"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(["curve", str(TRACE), *argv])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--seed applies to the sampled method, not --method stack" in err
    assert "--jobs applies to the sampled method, not --method replay" in err
