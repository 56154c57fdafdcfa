"""ops/dashboard.json: a Grafana dashboard whose every query reads metrics the code exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from prefixcache.ops.metrics import SERVING_LABELS, TIER_LABELS, metric_names

DASHBOARD = Path(__file__).resolve().parent.parent / "ops" / "dashboard.json"
# Grafana's variables, replaced by what Grafana would put there, so promtool can parse the query.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "6h", "$model": ".*"}


def exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    titles = " | ".join(panel["title"].lower() for panel in json.loads(DASHBOARD.read_text())["panels"])
    for wanted in ("hit rate", "tier occupancy", "evictions", "prefill time saved", "tenants"):
        assert wanted in titles


def test_every_query_reads_only_exported_metrics() -> None:
    known = metric_names()
    for expr in exprs():
        used = set(re.findall(r"\bprefixcache_[a-z0-9_]+", expr))
        assert used, f"no prefixcache metric in {expr!r}"
        assert used <= known, f"{expr!r} reads {used - known}, which nothing exports"


def test_every_grouping_label_exists() -> None:
    labels = {*SERVING_LABELS, *TIER_LABELS, "reason", "error", "le"}
    for expr in exprs():
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            names = {name.strip() for name in group.split(",")}
            assert names <= labels, f"{expr!r} groups by {names - labels}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not found (Debian package prometheus)")
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule), Grafana's variables filled in."""
    rules = []
    for i, expr in enumerate(exprs()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    promtool = shutil.which("promtool")
    assert promtool is not None
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
