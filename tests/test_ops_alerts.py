"""ops/alerts.yml: Prometheus's own promtool checks the rules and runs their unit tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from prefixcache.fleet.route_metrics import ROUTE_METRICS
from prefixcache.ops.metrics import metric_names

ROOT = Path(__file__).resolve().parent.parent
OPS = ROOT / "ops"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found (Debian package prometheus: `make system-deps` installs it)"
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=OPS, capture_output=True, text=True, timeout=120)


def alert_names() -> list[str]:
    return re.findall(r"^\s*- alert: (\w+)$", (OPS / "alerts.yml").read_text(), re.MULTILINE)


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_issue_s_alerts_exist_and_each_is_unit_tested_firing_and_silent() -> None:
    names = alert_names()
    assert set(names) >= {
        "PrefixcacheHitRateDropped",
        "PrefixcacheL0EvictionsHigh",
        "PrefixcacheL1EvictionsHigh",
        "PrefixcachePrefillSavedLow",
        "PrefixcacheInvalidationStorm",
        "PrefixcacheEpochBumpsTooFrequent",
        "PrefixcacheTierErrors",
        "PrefixcacheRedisUnreachable",
        "PrefixcacheWritesDropped",
    }
    tests = (OPS / "alerts_test.yml").read_text()
    for name in names:
        evals = re.findall(rf"alertname: {name}\n\s+exp_alerts:( \[\]|\n)", tests)
        assert " []" in evals, f"{name}: no evaluation where it must stay silent"
        assert "\n" in evals, f"{name}: no evaluation where it must fire"


def test_rules_use_only_exported_metrics() -> None:
    used = set(re.findall(r"\bprefixcache_[a-z0-9_]+", (OPS / "alerts.yml").read_text()))
    known = metric_names() | ROUTE_METRICS  # the servers' and the router's
    assert used and used <= known, used - known


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_runbook_link_lands_on_a_runbook_section() -> None:
    runbook = (ROOT / "docs" / "operations.md").read_text()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", runbook, re.MULTILINE)}
    links = re.findall(r'runbook_url: "docs/operations\.md#([\w-]+)"', (OPS / "alerts.yml").read_text())
    assert len(links) == len(alert_names())
    assert not set(links) - anchors, set(links) - anchors
