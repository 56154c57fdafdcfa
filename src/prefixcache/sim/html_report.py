"""The replay's HTML report: one self-contained page of the comparison table, plots of
hit rate against capacity, per tenant and over time, and evictions.

Apart from the terminal report because it is what needs matplotlib, and because its
choices (which series fit in a plot, where ``inf`` sits on a log axis) are its own.
The table it shows is ``report.table_rows``, so page and terminal never disagree.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from prefixcache.sim.inputs import format_capacity
from prefixcache.sim.report import (
    NONE,
    format_tokens,
    isolation_label,
    percent,
    result_notes,
    table_headers,
    table_rows,
    title,
)
from prefixcache.sim.results import ReplayResult

MAX_LINES = 8
"""Most lines (or bar groups) in one plot; beyond it a plot shows the largest capacities."""
MAX_TENANTS = 20
"""Most tenants in the per-tenant plot and table (those with the most lookup tokens)."""
MAX_BARS = 32
"""Most configurations in the evictions plot."""


def _series_key(r: ReplayResult) -> tuple[object, ...]:
    """Everything of a configuration but its capacity: one line of hit rate vs capacity."""
    c = r.config
    return (c.policy, c.block_size, isolation_label(c), c.mode, c.cache.partial_blocks)


def _series_label(r: ReplayResult, results: Sequence[ReplayResult]) -> str:
    """The policy, plus whatever else varies between the results (and only that)."""
    c = r.config
    parts = [c.policy]
    if len({x.config.block_size for x in results}) > 1:
        parts.append(f"bs={c.block_size}")
    if len({isolation_label(x.config) for x in results}) > 1:
        parts.append(isolation_label(c))
    if len({x.config.mode for x in results}) > 1:
        parts.append(c.mode)
    if len({x.config.cache.partial_blocks for x in results}) > 1 and c.cache.partial_blocks:
        parts.append("partial")
    return " ".join(parts)


def _config_label(r: ReplayResult, results: Sequence[ReplayResult]) -> str:
    return f"{_series_label(r, results)} {format_capacity(r.config.capacity_tokens)}"


def largest_capacities(results: Sequence[ReplayResult], limit: int) -> list[ReplayResult]:
    """At most ``limit`` results, the largest capacities first chosen, kept in the given order."""
    if len(results) <= limit:
        return list(results)
    ranked = sorted(range(len(results)), key=lambda i: -results[i].config.capacity_tokens)
    return [results[i] for i in sorted(ranked[:limit])]


def _capacity_positions(results: Sequence[ReplayResult]) -> tuple[dict[float, float], float | None]:
    """Where each capacity sits on a log axis; ``inf`` goes one decade past the largest
    finite capacity (returned too, to label its tick)."""
    finite = [c for c in (r.config.capacity_tokens for r in results) if math.isfinite(c) and c > 0]
    top = max(finite) * 10 if finite else 1.0
    positions = {}
    for r in results:
        c = r.config.capacity_tokens
        positions[c] = top if math.isinf(c) else max(c, min(finite) / 10 if finite else 1.0)
    has_inf = any(math.isinf(r.config.capacity_tokens) for r in results)
    return positions, (top if has_inf else None)


def _legend(ax: Axes) -> None:
    """Outside the axes, on the right: with up to eight series it would hide data inside."""
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _plot_capacity(ax: Axes, results: Sequence[ReplayResult]) -> None:
    series: dict[tuple[object, ...], list[ReplayResult]] = {}
    for r in results:
        series.setdefault(_series_key(r), []).append(r)
    shown = list(series.values())[:MAX_LINES]
    positions, inf_x = _capacity_positions([r for s in shown for r in s])
    for points in shown:
        points = sorted(points, key=lambda r: r.config.capacity_tokens)
        xs = [positions[r.config.capacity_tokens] for r in points]
        (line,) = ax.plot(
            xs, [100 * r.token_hit_rate for r in points], marker="o", label=_series_label(points[0], results)
        )
        opt = [(x, r.optimal_token_hit_rate) for x, r in zip(xs, points, strict=True)]
        opt_known = [(x, 100 * o) for x, o in opt if o is not None]
        if opt_known:
            ox, oy = zip(*opt_known, strict=True)
            ax.plot(ox, oy, linestyle="--", color=line.get_color(), label=f"{line.get_label()} (optimum)")
    ax.set_xscale("log")
    if inf_x is not None:
        ticks = [t for t in ax.get_xticks() if t < inf_x / 3] + [inf_x]
        ax.set_xticks(ticks, [format_tokens(t) for t in ticks[:-1]] + ["inf"])
        ax.set_xlim(min(positions.values()) / 2, inf_x * 2)
    ax.set_xlabel("capacity (tokens)")
    ax.set_ylabel("token hit rate (%)")
    note = f" ({MAX_LINES} of {len(series)} series)" if len(series) > MAX_LINES else ""
    ax.set_title("Hit rate vs capacity; dashed: optimum" + note)
    _legend(ax)


def chart_capacity(results: Sequence[ReplayResult], wanted: float | None = None) -> float | None:
    """The capacity the per-tenant chart shows: ``wanted``, else the largest replayed
    (``None`` when no result has tenants). An unreplayed one is an error listing those."""
    replayed = sorted({r.config.capacity_tokens for r in results if r.tenants})
    if not replayed:
        return None
    if wanted is None:
        return replayed[-1]
    if wanted not in replayed:
        listed = ", ".join(format_capacity(c) for c in replayed)
        raise ValueError(f"capacity {format_capacity(wanted)} was not replayed; replayed capacities: {listed}")
    return wanted


def _tenant_results(results: Sequence[ReplayResult], capacity: float | None) -> list[ReplayResult]:
    """The results at ``capacity`` that have tenants, one per series, at most ``MAX_LINES``."""
    return [r for r in results if r.tenants and r.config.capacity_tokens == capacity][:MAX_LINES]


def _tenant_title(capacity: float, wanted: float | None) -> str:
    how = "chosen with --tenant-capacity" if wanted is not None else "the largest replayed; --tenant-capacity picks"
    return f"Token hit rate per tenant at capacity {format_capacity(capacity)} ({how})"


def _top_tenants(results: Sequence[ReplayResult]) -> list[str]:
    volume: dict[str, int] = {}
    for r in results:
        for name, t in r.tenants.items():
            volume[name] = volume.get(name, 0) + t.lookup_tokens
    ranked = sorted(volume, key=lambda n: (-volume[n], n))[:MAX_TENANTS]
    return sorted(ranked)


def _plot_tenants(ax: Axes, results: Sequence[ReplayResult], all_results: Sequence[ReplayResult], heading: str) -> None:
    tenants = _top_tenants(results)
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        rates = [100 * r.tenants[n].token_hit_rate if n in r.tenants else 0.0 for n in tenants]
        xs = [k + (i - (len(results) - 1) / 2) * width for k in range(len(tenants))]
        ax.bar(xs, rates, width=width, label=_config_label(r, all_results))
    ax.set_xticks(range(len(tenants)), tenants, rotation=45 if len(tenants) > 6 else 0, ha="right")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(heading, fontsize="medium")
    _legend(ax)


def _plot_timeline(ax: Axes, results: Sequence[ReplayResult], all_results: Sequence[ReplayResult]) -> None:
    for r in results:
        xs = [p.t_end for p in r.timeline]
        ax.plot(xs, [100 * p.token_hit_rate for p in r.timeline], label=_config_label(r, all_results))
    ax.set_xlabel("trace time (s)")
    ax.set_ylabel("token hit rate in window (%)")
    note = f" ({len(results)} largest capacities)" if len(results) < len([r for r in all_results if r.timeline]) else ""
    ax.set_title("Hit rate over time" + note)
    _legend(ax)


def _plot_evictions(ax: Axes, results: Sequence[ReplayResult], all_results: Sequence[ReplayResult]) -> None:
    labels = [_config_label(r, all_results) for r in results]
    ax.barh(range(len(results)), [r.evictions for r in results])
    ax.set_yticks(range(len(results)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("evictions (whole replay)")
    note = f" (first {MAX_BARS} of {len(all_results)})" if len(all_results) > MAX_BARS else ""
    ax.set_title("Evictions per configuration" + note)


def _figure_png(draw: Callable[[Axes], None], height: float = 4.5) -> str:
    """Draw one figure and return it as a base64 PNG.

    NOTE: a bare ``Figure`` on an Agg canvas, never pyplot: no global figure registry
    to leak into, no display needed, nothing left open. Mathtext is off so that a
    tenant called ``$x$`` (or ``$\\frac``) is drawn as typed instead of parsed."""
    with matplotlib.rc_context({"text.parse_math": False}):
        fig = Figure(figsize=(9, height), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        draw(fig.add_subplot())
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _figures(results: Sequence[ReplayResult], tenants: tuple[list[ReplayResult], str]) -> list[tuple[str, str]]:
    """(caption, base64 PNG) of every figure the results have data for; ``tenants``: the
    per-tenant chart's results and heading."""
    figures = [("Hit rate vs capacity", _figure_png(lambda ax: _plot_capacity(ax, results)))]
    tenant_results, heading = tenants
    if tenant_results:
        png = _figure_png(lambda ax: _plot_tenants(ax, tenant_results, results, heading))
        figures.append((heading, png))
    timed = largest_capacities([r for r in results if r.timeline], MAX_LINES)
    if timed:
        figures.append(("Hit rate over time", _figure_png(lambda ax: _plot_timeline(ax, timed, results))))
    bars = list(results[:MAX_BARS])
    height = max(3.0, 0.3 * len(bars) + 1.5)
    figures.append(("Evictions", _figure_png(lambda ax: _plot_evictions(ax, bars, results), height)))
    return figures


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def _tenant_rate(r: ReplayResult, name: str) -> str:
    tenant = r.tenants.get(name)
    return NONE if tenant is None else percent(tenant.token_hit_rate)


def _tenant_table(results: Sequence[ReplayResult], all_results: Sequence[ReplayResult]) -> str:
    """The per-tenant figure's numbers as text: searchable, and readable without the image."""
    tenants = _top_tenants(results)
    headers = ["tenant"] + [_config_label(r, all_results) for r in results]
    rows = [[name] + [_tenant_rate(r, name) for r in results] for name in tenants]
    return _html_table(headers, rows)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; }
td:first-child, th:first-child { text-align: left; }
figure { margin: 1.5em 0; }
img { max-width: 100%; }
"""


def render_html(
    results: Sequence[ReplayResult], tenant_capacity: float | None = None, notes: Sequence[str] = ()
) -> str:
    """The whole report as one HTML string: no scripts, no external resources. The
    per-tenant chart shows ``tenant_capacity`` (default: the largest replayed; one not
    replayed is a ``ValueError`` listing those that were); ``notes`` follow the table."""
    capacity = chart_capacity(results, tenant_capacity)
    tenant_results = _tenant_results(results, capacity)
    tenant_heading = "" if capacity is None else _tenant_title(capacity, tenant_capacity)
    heading = html.escape(title(results))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{heading}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{heading}</h1>",
    ]
    if not results:
        parts.append("<p>No results.</p>")
    else:
        parts.append(_html_table(table_headers(results), table_rows(results)))
        parts += [f"<p>{html.escape(line)}</p>" for line in [*result_notes(results), *notes]]
        for caption, png in _figures(results, (tenant_results, tenant_heading)):
            alt = html.escape(caption)
            parts.append(f'<figure><img alt="{alt}" src="data:image/png;base64,{png}"><figcaption>{alt}</figcaption>')
            parts.append("</figure>")
        if tenant_results:
            parts.append(f"<h2>{html.escape(tenant_heading)}</h2>")
            parts.append(_tenant_table(tenant_results, results))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_html(
    results: Sequence[ReplayResult], path: str | Path, tenant_capacity: float | None = None, notes: Sequence[str] = ()
) -> None:
    """Write the self-contained report (``render_html``) to ``path``."""
    Path(path).write_text(render_html(results, tenant_capacity, notes), encoding="utf-8")
