"""Smoke test of benchmarks/bench_serve_load.py: its quick run on the working tree's engine
alone (no git baseline, so no git history needed) finishes, its JSON parses, and the
concurrent chats answer exactly as each chat served alone.

Marked slow and model: it loads SmolLM2 and serves a few chats twice, tens of seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_serve_load.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[dict[str, object]]]]:
    out = tmp_path_factory.mktemp("bench-serve-load") / "figures.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--configs", "new", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout, json.loads(out.read_text())


def test_quick_run_has_figures_and_no_wrong_outputs(report: tuple[str, dict[str, list[dict[str, object]]]]) -> None:
    stdout, figures = report
    (run,) = figures["runs"]
    assert run["config"] == "new"
    assert run["requests"] == 8  # 4 clients, 2 turns
    assert isinstance(run["output_tokens"], int) and run["output_tokens"] > 0
    assert isinstance(run["tokens_per_s"], float) and run["tokens_per_s"] > 0
    assert isinstance(run["ttft_p50_s"], float) and isinstance(run["ttft_p95_s"], float)
    assert 0 < run["ttft_p50_s"] <= run["ttft_p95_s"]
    assert run["compared"] == 8, run  # every turn's history matched the reference's
    assert run["wrong"] == 0 and run["errors"] == 0, run
    assert figures["ratios"] == []  # no baseline, no ratio
    assert "new       working tree" in stdout, stdout
