"""Reports of a replay: strict JSON, the terminal table, the self-contained HTML page, progress."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console

from prefixcache.config import CacheConfig
from prefixcache.sim.html_report import largest_capacities, write_html
from prefixcache.sim.report import format_tokens, progress, render_table, to_json
from prefixcache.sim.results import COVERAGE, ReplayConfig, ReplayResult, TenantResult, TimePoint, cache_capacity

CAPACITIES = (1e6, 1e7, math.inf)


def make_result(policy: str, capacity: float, index: int, *, cost: bool = False, block_size: int = 16) -> ReplayResult:
    """A hand-built result whose numbers differ per (policy, capacity) so rows can be told apart.

    With index i: 1000 requests, lookup 100,000 tokens, hit 10,000 * (i + 1) tokens, hit
    requests 100 * (i + 2), optimum (for finite capacities) 5,000 tokens above the hits."""
    hit = 10_000 * (index + 1)
    result = ReplayResult(
        ReplayConfig(
            CacheConfig(
                policy=policy, capacity_tokens=cache_capacity(capacity), block_size=block_size, isolation="namespace"
            )
        ),
        trace="chat-trace",
        requests=1000,
        warmup_requests=250,
        lookup_tokens=100_000,
        hit_tokens=hit,
        hit_requests=100 * (index + 2),
        evictions=0 if math.isinf(capacity) else 12_345 + index,
        optimal_hit_tokens=None if math.isinf(capacity) else hit + 5_000,
        tenants={
            "acme": TenantResult(requests=600, lookup_tokens=60_000, hit_tokens=hit // 2, hit_requests=50),
            "<script>": TenantResult(requests=400, lookup_tokens=40_000, hit_tokens=hit // 4, hit_requests=20),
        },
        timeline=[
            TimePoint(t_start=10.0 * k, t_end=10.0 * (k + 1), requests=100, lookup_tokens=10_000,
                      hit_tokens=1_000 * k + index, evictions=k)
            for k in range(5)
        ],
    )  # fmt: skip
    if cost:
        result.prefill_flops_total = 1e18
        result.prefill_flops_saved = 2.5e17 * (index + 1) / 6
        result.gpu_hours_saved = 0.5 + index
        result.cost_profile = "llama-3-8b@h100 u=0.50"
    return result


def make_results(cost: bool = False) -> list[ReplayResult]:
    return [
        make_result(policy, capacity, i * len(CAPACITIES) + j, cost=cost)
        for i, policy in enumerate(("lru", "s3fifo"))
        for j, capacity in enumerate(CAPACITIES)
    ]


def reject_constant(name: str) -> object:
    raise AssertionError(f"non-strict JSON constant {name}")


# --- JSON -------------------------------------------------------------------------


def test_json_is_strict_and_complete() -> None:
    results = make_results(cost=True)
    data = json.loads(to_json(results), parse_constant=reject_constant)
    assert len(data["results"]) == len(results)
    for got, result in zip(data["results"], results, strict=True):
        assert got["policy"] == result.config.policy
        assert got["block_size"] == 16
        assert got["isolation"] == "namespace"
        assert got["token_hit_rate"] == pytest.approx(result.token_hit_rate)
        assert got["request_hit_rate"] == pytest.approx(result.request_hit_rate)
        assert got["optimal_token_hit_rate"] == result.optimal_token_hit_rate
        assert got["gpu_hours_saved"] == result.gpu_hours_saved
        if math.isinf(result.config.capacity_tokens):
            assert got["capacity_tokens"] is None
            assert got["unlimited"] is True
            assert got["optimal_token_hit_rate"] is None
        else:
            assert got["capacity_tokens"] == int(result.config.capacity_tokens)
            assert got["unlimited"] is False
        assert set(got["per_tenant"]) == {"acme", "<script>"}
        assert len(got["timeline"]) == 5


def test_json_turns_non_finite_values_into_null() -> None:
    result = make_result("lru", 1e6, 0)
    result.seconds = math.nan
    result.prefill_flops_total = math.inf
    result.prefill_flops_saved = 1.0
    text = to_json([result])
    data = json.loads(text, parse_constant=reject_constant)["results"][0]
    assert data["seconds"] is None
    assert data["prefill_flops_total"] is None
    assert data["prefill_flops_saved"] == 1.0


def test_json_of_nothing() -> None:
    assert json.loads(to_json([])) == {"results": [], "coverage": COVERAGE}


# --- terminal table -----------------------------------------------------------------


def rendered(results: list[ReplayResult]) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    render_table(results, console=console)
    return console.export_text()


def row_of(text: str, policy: str, capacity: str) -> str:
    rows = [line for line in text.splitlines() if re.search(rf"\b{policy}\b.*\b{re.escape(capacity)}\b", line)]
    assert len(rows) == 1, (policy, capacity, text)
    return rows[0]


def test_table_rows_hold_each_results_numbers() -> None:
    text = rendered(make_results(cost=True))
    assert "chat-trace" in text
    assert "warm-up 250" in text
    # index i: token hit 10 (i+1) %, request hit 10 (i+2) %, optimum +5 points, evictions 12,345 + i
    for i, (policy, capacity) in enumerate((p, c) for p in ("lru", "s3fifo") for c in ("1M", "10M", "inf")):
        row = row_of(text, policy, capacity)
        assert f"{10 * (i + 1):.1f}%" in row
        assert f"{10 * (i + 2):.1f}%" in row
        assert "1,000" in row  # requests
        assert ("0.500" if i == 0 else f"{0.5 + i:.2f}") in row  # GPU-hours saved, 3 significant digits
        assert f"{25 * (i + 1) / 6:.1f}%" in row  # compute avoided
        if capacity == "inf":
            assert row.count("—") == 2  # no optimum, no gap
            assert re.search(r"\b0\b", row)  # evictions
        else:
            assert f"{10 * (i + 1) + 5:.1f}%" in row  # optimum
            assert "5.0" in row  # gap to optimum in points
            assert f"{12_345 + i:,}" in row


def test_table_without_cost_has_no_cost_columns() -> None:
    text = rendered(make_results())
    assert "GPU-h" not in text
    assert "compute avoided" not in text


def test_table_shows_block_hits_when_a_result_has_them() -> None:
    results = make_results()
    assert "block hit" not in rendered(results)
    results[0].blocks_looked_up = 8_000
    results[0].block_hits = 2_000
    text = rendered(results)
    assert "block hit" in text
    assert "25.0%" in row_of(text, "lru", "1M")
    assert row_of(text, "lru", "10M").count("—") == 1  # no block hits there


def test_table_keeps_the_given_order() -> None:
    results = make_results()[::-1]
    text = rendered(results)
    positions = [text.index(row_of(text, r.config.policy, format_tokens(r.config.capacity_tokens))) for r in results]
    assert positions == sorted(positions)


@pytest.mark.parametrize(
    ("tokens", "text"),
    [(math.inf, "inf"), (0, "0"), (16, "16"), (1500, "1.5K"), (1e6, "1M"), (1 << 20, "1.05M"), (1e7, "10M"),
     (999_999, "1M"), (2.5e9, "2.5G")],
)  # fmt: skip
def test_format_tokens(tokens: float, text: str) -> None:
    assert format_tokens(tokens) == text


# --- HTML ---------------------------------------------------------------------------


def html_of(results: list[ReplayResult], tmp_path: Path) -> str:
    path = tmp_path / "report.html"
    write_html(results, path)
    return path.read_text(encoding="utf-8")


def test_html_is_self_contained_with_every_figure(tmp_path: Path) -> None:
    page = html_of(make_results(cost=True), tmp_path)
    # capacity curve, per tenant, over time, evictions
    assert page.count("<img") == 4
    assert page.count('src="data:image/png;base64,') == 4
    assert "http://" not in page
    assert "https://" not in page
    assert "<script" not in page
    assert "&lt;script&gt;" in page  # the tenant, as text in the per-tenant table
    assert "<table>" in page
    assert "12,345" in page  # the comparison table


def test_html_figures_only_for_data_present(tmp_path: Path) -> None:
    results = make_results()
    for r in results:
        r.tenants = {}
        r.timeline = []
    page = html_of(results, tmp_path)
    assert page.count("<img") == 2  # capacity curve and evictions


def test_html_escapes_configuration_and_trace_names(tmp_path: Path) -> None:
    result = make_result("lru", 1e6, 0)
    result.trace = 'a<b>&"c"'
    result.tenants["$\\frac"] = TenantResult(requests=1, lookup_tokens=1, hit_tokens=1)  # no mathtext parse
    page = html_of([result], tmp_path)
    assert "a&lt;b&gt;&amp;&quot;c&quot;" in page
    assert "a<b>" not in page


def test_html_bounded_for_many_configurations(tmp_path: Path) -> None:
    # NOTE: twelve series: a configuration names a real policy, so they differ in block size.
    capacities = (1e5, 1e6, 1e7, 1e8, math.inf)
    results = [make_result("lru", capacity, k % 5, block_size=k + 1) for k in range(12) for capacity in capacities]
    page = html_of(results, tmp_path)
    assert page.count("<img") == 4  # one figure per kind, however many configurations
    assert page.count("<tr>") == 1 + len(results) + 1 + 2  # full table; tenant table: header + 2 tenants


def test_html_of_nothing(tmp_path: Path) -> None:
    page = html_of([], tmp_path)
    assert "No results" in page
    assert "<img" not in page


def test_largest_capacities_keeps_order() -> None:
    results = make_results()
    picked = largest_capacities(results, 2)
    assert [r.config.capacity_tokens for r in picked] == [math.inf, math.inf]
    assert [r.config.policy for r in picked] == ["lru", "s3fifo"]
    assert largest_capacities(results, 10) == results


# --- progress -----------------------------------------------------------------------


def test_progress_disabled_is_silent(capsys: pytest.CaptureFixture[str]) -> None:
    console = Console(file=io.StringIO(), force_terminal=True)
    with progress(100, "replay", enabled=False, console=console) as bar:
        for _ in range(100):
            bar.advance(1)
    assert console.file.getvalue() == ""  # type: ignore[attr-defined]
    with progress(100, "replay", enabled=False) as bar:
        bar.advance(5)
    assert capsys.readouterr() == ("", "")


def test_progress_off_a_terminal_is_silent() -> None:
    console = Console(file=io.StringIO(), force_terminal=False)
    with progress(None, "replay", enabled=True, console=console) as bar:
        bar.advance(3)
    assert console.file.getvalue() == ""  # type: ignore[attr-defined]


def test_progress_on_a_terminal_draws_and_counts() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with progress(10, "replaying lru", enabled=True, console=console) as bar:
        for _ in range(10):
            bar.advance(1)
    assert "replaying lru" in out.getvalue()
    assert "10/10" in out.getvalue()  # advances are batched, but all arrive by the end
