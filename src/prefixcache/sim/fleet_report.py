"""Reports of a fleet replay: the terminal table, strict JSON and an HTML page, all
from the same rows (``fleet_rows``), in the single replay's style (``report``)."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prefixcache.sim.fleet_results import RoutingResult
from prefixcache.sim.report import NONE, _default_console, _finite, format_tokens, percent

IMBALANCE = "load imbalance = max/mean of per-backend prefill GPU-seconds (1.00 = even)"

HEADERS = (
    "routing",
    "backends",
    "capacity",
    "policy",
    "isolation",
    "requests",
    "token hit",
    "hit per backend",
    "compute avoided",
    "load imbalance",
    "TTFT mean",
    "TTFT p99",
    "stale routes",
    "engine",
)
_TEXT = {"routing", "capacity", "policy", "isolation", "hit per backend", "engine"}


def _seconds(value: float | None) -> str:
    return NONE if value is None else f"{value:.3g}s"


def fleet_rows(results: Sequence[RoutingResult]) -> list[list[str]]:
    """One row of display strings per result, in the given order. The pooled row's
    capacity is its one cache's; its load columns are dashes (no routing happened)."""
    rows = []
    for r in results:
        c = r.config
        imbalance = r.load_imbalance
        rows.append(
            [
                r.label,
                f"{len(r.backends)}",
                format_tokens(c.capacity_tokens),
                c.policy,
                c.isolation,
                f"{r.requests:,}",
                percent(r.token_hit_rate),
                " / ".join(percent(b.token_hit_rate) for b in r.backends) if len(r.backends) > 1 else NONE,
                percent(r.compute_avoided),
                NONE if imbalance is None else f"{imbalance:.2f}",
                _seconds(r.ttft_mean),
                _seconds(r.ttft_p99),
                NONE if r.stale_routes is None else f"{r.stale_routes:,}",
                r.engine,
            ]
        )
    return rows


def fleet_title(results: Sequence[RoutingResult]) -> str:
    traces = ", ".join(dict.fromkeys(r.trace for r in results)) or "(no results)"
    warmups = "/".join(f"{w:,}" for w in dict.fromkeys(r.warmup_requests for r in results)) or "0"
    profiles = ", ".join(dict.fromkeys(r.cost_profile for r in results))
    return f"Fleet replay of {traces}; warm-up {warmups} requests (not counted); cost {profiles}; {IMBALANCE}"


def render_fleet_table(results: Sequence[RoutingResult], console: Console | None = None) -> None:
    table = Table(title=fleet_title(results))
    for header in HEADERS:
        table.add_column(header, justify="left" if header in _TEXT else "right", overflow="fold")
    for row in fleet_rows(results):
        table.add_row(*row)
    (console or _default_console()).print(table)


def fleet_json(results: Sequence[RoutingResult]) -> str:
    """``{"fleet": [...]}``, strict JSON (non-finite numbers become ``null``)."""
    return json.dumps({"fleet": [_finite(r.to_json()) for r in results]}, indent=2, allow_nan=False)


def write_fleet_html(results: Sequence[RoutingResult], path: str | Path) -> None:
    """A self-contained page: the table, and each routing's per-backend numbers."""
    heading = html.escape(fleet_title(results))
    parts = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        f"<title>{heading}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{heading}</h1>",
        _table(HEADERS, fleet_rows(results)),
        "<h2>Per backend</h2>",
    ]
    for r in results:
        rows = [
            [b.name, f"{b.requests:,}", percent(b.token_hit_rate), f"{b.prefill_seconds:.4g}", f"{b.evictions:,}"]
            for b in r.backends
        ]
        parts.append(f"<h3>{html.escape(r.label)}</h3>")
        parts.append(_table(("backend", "requests", "token hit", "prefill GPU-s", "evictions"), rows))
    parts.append("</body></html>\n")
    Path(path).write_text("\n".join(parts), encoding="utf-8")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; }
td:first-child, th:first-child { text-align: left; }
"""
