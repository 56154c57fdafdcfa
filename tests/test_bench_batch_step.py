"""Smoke test of benchmarks/bench_batch_step.py: its quick run finishes and prints a step
time for each row count and dtype, and a chunk's cost with and without the rows' tokens.

Marked slow and model: it loads SmolLM2 twice (float32, bfloat16), a few seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_prints_every_figure() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_batch_step.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    for dtype in ("float32", "bfloat16"):
        section = run.stdout.split(f"{dtype}: one decode step of every row")[1].split("\n\n")[0]
        steps = re.findall(r"(\d+) rows: +([\d.]+) ms a step, +([\d.]+) tok/s, against 1 row ([\d.]+)x", section)
        drift = [float(d) for d in re.findall(r"row 0's logits differ from alone by ([\d.e+-]+)", section)]
        assert len(drift) == 2 and drift[0] == 0.0, section  # one row is the row alone
        if dtype == "float32":
            assert drift[1] < 1e-3, section  # batch invariant within float32 rounding
        assert [int(n) for n, *_ in steps] == [1, 4], section
        one = float(steps[0][1])
        for n, ms, rate, gain in steps:
            # NOTE: the figures agree within what their printing rounds off (ms to 0.05, a rate
            # to 0.05, a gain to 0.005): the faster the machine, the more a rounded ms moves them
            rows, step = int(n), float(ms)
            assert step > 0.05 and one > 0.05, section
            assert 1000 * rows / (step + 0.05) - 0.05 <= float(rate) <= 1000 * rows / (step - 0.05) + 0.05, section
            low, high = rows * (one - 0.05) / (step + 0.05), rows * (one + 0.05) / (step - 0.05)
            assert low - 0.005 <= float(gain) <= high + 0.005, section  # one round: no spread
        assert re.search(r"chunk of +32: +[\d.]+ ms; with 16 tokens more \+ *-?[\d.]+ ms", section), section


def test_bad_arguments_are_refused() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_batch_step.py"), "--tokens", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert run.returncode != 0 and "--tokens must be >= 2" in run.stderr, run.stderr
