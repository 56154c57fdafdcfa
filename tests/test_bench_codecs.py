"""Smoke test of benchmarks/bench_codecs.py: its quick run (no model, no Redis) finishes and
prints every section, with a row for every codec and ratios that compress.

Marked slow: it replays a real Mooncake trace and times the tiers, a few seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.storage import codec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_codecs.py"


@pytest.fixture(scope="module")
def output() -> str:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--no-model", "--no-redis"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def section(text: str, number: str) -> str:
    """The lines of section ``number`` (up to the next numbered section)."""
    match = re.search(rf"^{re.escape(number)}\. .*?(?=^\d+b?\. |\Z)", text, re.M | re.S)
    assert match, f"section {number} missing from:\n{text}"
    return match.group(0)


def test_sizes_have_every_codec_and_lossy_ones_compress(output: str) -> None:
    sizes = section(output, "1")
    for dtype in ("float32", "bfloat16"):
        for name in codec.CODECS:
            row = re.search(rf"^\s+{dtype}\s+{name}\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)x\s+([\d.]+)x$", sizes, re.M)
            assert row, f"no {dtype} {name} row in:\n{sizes}"
            same, bf16 = float(row.group(3)), float(row.group(4))
            if name in ("int8", "int4"):
                assert same > 1 and bf16 > 1, row.group(0)
            if name == "raw":
                assert same == 1.0, row.group(0)


def test_throughput_loads_and_hit_rates_have_every_codec(output: str) -> None:
    for number in ("2", "3", "4"):
        text = section(output, number)
        for name in codec.CODECS:
            assert re.search(rf"^\s.*\b{name}\s+[\d(]", text, re.M), f"no {name} row in section {number}"
    loads = section(output, "3")
    for tier in ("memory", "disk warm", "disk cold"):
        assert re.search(rf"^\s+{tier}\s+int8\s", loads, re.M), f"no {tier} row"
    hits = section(output, "4")
    assert "mooncake_conversation_trace" in hits
    rows = re.findall(r"^\s+float32\s+(?:[\d.]+ GB\s+)?(\w+)\s+([\d,]+)\s+([\d.]+)%\s+([\d.]+)x$", hits, re.M)
    gains = {name: float(gain) for name, _, _, gain in rows}
    assert gains["raw"] == 1.0 and gains["int8"] > 1.0, rows


def test_summary_names_the_dtype_of_each_ratio(output: str) -> None:
    summary = section(output, "5")
    for name in ("int8", "int4"):
        for dtype in ("float32", "bfloat16"):
            assert re.search(rf"{name} on {dtype} KV vs raw {dtype}: [\d.]+x tokens per byte", summary), summary
