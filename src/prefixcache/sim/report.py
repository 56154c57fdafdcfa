"""Reports of a replay: a terminal table, strict JSON, and a progress bar for the
replay itself (the HTML page with plots is ``html_report``).

The terminal and HTML tables read the same rows (``table_rows``), so the two never
disagree about a number.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import rich.progress
from rich.console import Console
from rich.table import Table

from prefixcache.sim.inputs import format_capacity
from prefixcache.sim.results import COVERAGE, ReplayConfig, ReplayResult

NONE = "—"

# ---------------------------------------------------------------------------------
# Formatting: one place, shared by the terminal table and the HTML table.
# ---------------------------------------------------------------------------------


def format_tokens(n: float) -> str:
    """A token count as people say it, rounded to 3 digits: ``1M``, ``10M``, ``1.05M``,
    ``inf`` (plot ticks; tables print capacities exactly, ``inputs.format_capacity``)."""
    if math.isinf(n):
        return "inf"
    for suffix, scale in (("", 1.0), ("K", 1e3), ("M", 1e6), ("G", 1e9)):
        text = f"{n / scale:.3g}"
        if abs(float(text)) < 1000:
            return text + suffix
    return f"{n / 1e12:.3g}T"


def percent(rate: float | None) -> str:
    return NONE if rate is None or not math.isfinite(rate) else f"{100 * rate:.1f}%"


def _quantity(x: float | None) -> str:
    """A positive amount with sensible precision at any scale (GPU-hours: 0.00123 to 12,345)."""
    if x is None or not math.isfinite(x):
        return NONE
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1 or x == 0:
        return f"{x:.2f}"
    return f"{x:#.3g}"  # "#" keeps trailing zeros: 0.500, aligned with 1.50


def _gap(result: ReplayResult) -> str:
    """Percentage points between the optimum (Belady) and the policy."""
    optimal = result.optimal_token_hit_rate
    if optimal is None:
        return NONE
    return f"{100 * (optimal - result.token_hit_rate):.1f}"


def _has_cost(results: Sequence[ReplayResult]) -> bool:
    return any(r.prefill_flops_saved is not None for r in results)


def _has_block_hits(results: Sequence[ReplayResult]) -> bool:
    return any(r.block_hit_rate is not None for r in results)


def isolation_label(c: ReplayConfig) -> str:
    """The isolation mode, with hot-prefix publication when it is on."""
    publish = c.cache.publish
    return f"{c.isolation}+publish{publish.min_tenants}" if publish is not None else c.isolation


def _has_codec(results: Sequence[ReplayResult]) -> bool:
    return any(r.config.codec is not None for r in results)


def _has_retention(results: Sequence[ReplayResult]) -> bool:
    return any(r.config.retention.on for r in results)


def retention_label(c: ReplayConfig) -> str:
    """The retention replayed, with the share of the cache it may hold: ``auto:90 @0.25``."""
    return f"{c.retention.label} @{c.cache.retention.share:g}" if c.retention.on else "off"


def table_headers(results: Sequence[ReplayResult]) -> list[str]:
    codec = ["codec"] if _has_codec(results) else []
    retention = ["retention"] if _has_retention(results) else []
    headers = ["policy", *codec, "capacity", "block", "isolation", "mode", *retention, "requests", "token hit"]
    headers.append("request hit")
    if _has_block_hits(results):
        headers.append("block hit")
    headers += ["optimal", "gap (pp)", "evictions"]
    if _has_cost(results):
        headers += ["GPU-h saved", "compute avoided"]
    return headers


def table_rows(results: Sequence[ReplayResult]) -> list[list[str]]:
    """One row of display strings per result, in the given order.

    NOTE: the block-hit (flat mode) and cost columns exist only when some result has
    them; a result without shows a dash, so that a mixed table stays aligned."""
    with_cost = _has_cost(results)
    with_block_hits = _has_block_hits(results)
    with_codec = _has_codec(results)
    with_retention = _has_retention(results)
    rows = []
    for r in results:
        c = r.config
        block = f"{c.block_size}" + (" partial" if c.cache.partial_blocks else "")
        mode = f"{c.mode} ({r.engine})" if c.mode == "tree" else c.mode
        codec = [c.codec or "raw"] if with_codec else []
        row = [c.policy, *codec, format_capacity(c.capacity_tokens), block, isolation_label(c), mode]
        if with_retention:
            row.append(retention_label(c))
        row.append(f"{r.requests:,}")
        row += [percent(r.token_hit_rate), percent(r.request_hit_rate)]
        if with_block_hits:
            row.append(percent(r.block_hit_rate))
        row += [percent(r.optimal_token_hit_rate), _gap(r), f"{r.evictions:,}"]
        if with_cost:
            row += [_quantity(r.gpu_hours_saved), percent(r.prefill_compute_avoided)]
        rows.append(row)
    return rows


def title(results: Sequence[ReplayResult]) -> str:
    """Trace name(s) and warm-up, the two things a reader needs to compare two reports."""
    traces = ", ".join(dict.fromkeys(r.trace for r in results)) or "(no results)"
    warmups = "/".join(f"{w:,}" for w in dict.fromkeys(r.warmup_requests for r in results)) or "0"
    profiles = ", ".join(dict.fromkeys(cost_label(r) for r in results if r.cost_profile))
    text = f"Replay of {traces}; warm-up {warmups} requests (not counted)"
    return f"{text}; cost {profiles}" if profiles else text


def cost_label(r: ReplayResult) -> str:
    """The cost profile, and which of its parts are defaults nobody chose."""
    if not r.cost_defaults:
        return r.cost_profile or ""
    names = ", ".join(r.cost_defaults)
    flags = ", ".join(f"--{name}" for name in r.cost_defaults)
    return f"{r.cost_profile} (defaults: {names}; set with {flags})"


def result_notes(results: Sequence[ReplayResult]) -> list[str]:
    """Lines a reader needs under the table: prompts the cost profile's model could not
    have served, a figure of its own (JSON: ``prompts_over_context``)."""
    lines = []
    for r in results:
        n = r.prompts_over_context
        if not n or r.context_length is None:
            continue
        model = (r.cost_profile or "").split("@")[0]
        line = (
            f"Prompts beyond the context of {model} ({r.context_length:,} tokens): {n:,} of {r.requests:,} "
            f"counted ({percent(r.prompts_over_context_share)}); costed by the same formula, though that model "
            "could not have served them"
        )
        if line not in lines:
            lines.append(line)
    retaining = [r for r in results if r.config.retention.on]
    if retaining:
        engines = ", ".join(sorted({r.engine for r in retaining}))
        lines.append(
            f"Retention: replayed by the {engines} engine (the PrefixCache: the compiled kernel does not model "
            "retention); each prompt retained after its access, charged to its tenant, the share of the cache "
            "split among the tenants that retain"
        )
        for r in retaining:
            got = r.retention
            if got is not None and got.calls:
                kept = percent(got.retained_tokens / got.asked_tokens if got.asked_tokens else 0.0)
                lines.append(
                    f"  {r.config.label}: {got.calls:,} retain calls, {got.capped:,} cut by the cap, "
                    f"{kept} of the tokens asked retained"
                )
    return lines


def render_table(results: list[ReplayResult], console: Console | None = None, notes: Sequence[str] = ()) -> None:
    """Print the comparison table, one row per result, in the order given, then the
    notes (``result_notes(results)``, and the caller's ``notes``)."""
    table = Table(title=title(results))
    text_columns = {"policy", "codec", "capacity", "block", "isolation", "mode", "retention"}
    for header in table_headers(results):
        # NOTE: fold, never ellipsis: "39…" in a narrow terminal reads as a number.
        table.add_column(header, justify="left" if header in text_columns else "right", overflow="fold")
    for row in table_rows(results):
        table.add_row(*row)
    console = console or _default_console()
    console.print(table)
    for line in [*result_notes(results), *notes]:
        console.print(line, markup=False, highlight=False)


def _default_console() -> Console:
    """Stdout; when it is a file or a pipe, as wide as the table needs, since rich would
    otherwise squeeze it into 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=1000)


# ---------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------


def _finite(value: Any) -> Any:
    """The value with every non-finite float replaced by None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def to_json(results: Sequence[ReplayResult]) -> str:
    """``{"results": [...]}``, pretty-printed, strict JSON.

    NOTE: a NaN or infinity would make the file unreadable by strict parsers (and by
    ``jq``); such a value means "not defined here", so it becomes ``null``. Unlimited
    capacity is already ``null`` with ``unlimited: true`` (see ``ReplayResult.to_json``).
    ``coverage`` says which requests each figure covers (``results.COVERAGE``)."""
    payload = {"results": [_finite(r.to_json()) for r in results], "coverage": COVERAGE}
    return json.dumps(payload, indent=2, allow_nan=False)


# ---------------------------------------------------------------------------------
# Progress of a long replay
# ---------------------------------------------------------------------------------


class Progress:
    """What the replay sees of a progress bar: ``advance(n)``, and nothing when silent.

    NOTE: rich's own ``advance`` takes a lock and records a speed sample; called per
    request of a million-request trace that is seconds of overhead. So advances are
    summed here and handed to rich at most every ``flush_seconds``."""

    def __init__(
        self,
        bar: rich.progress.Progress | None = None,
        task: rich.progress.TaskID | None = None,
        flush_seconds: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bar = bar
        self._task = task
        self._flush_seconds = flush_seconds
        self._clock = clock
        self._pending = 0
        self._last_flush = clock()

    def advance(self, n: int = 1) -> None:
        if self._bar is None:
            return
        self._pending += n
        now = self._clock()
        if now - self._last_flush >= self._flush_seconds:
            self.flush()
            self._last_flush = now

    def flush(self) -> None:
        if self._bar is not None and self._task is not None and self._pending:
            self._bar.advance(self._task, self._pending)
            self._pending = 0


@contextmanager
def progress(
    total: int | None, description: str, enabled: bool = True, console: Console | None = None
) -> Iterator[Progress]:
    """A progress bar for the duration of the block, yielding its ``Progress``.

    Silent (a no-op ``Progress``) when disabled or when the console is not a terminal,
    so that piped or redirected output (``--json > out.json``, CI logs) holds no bar."""
    console = console or Console()
    if not enabled or not console.is_terminal:
        yield Progress()
        return
    # NOTE: no stdout/stderr redirection: it would swap sys.stdout process-wide.
    with rich.progress.Progress(
        *rich.progress.Progress.get_default_columns(),
        rich.progress.MofNCompleteColumn(),
        console=console,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    ) as bar:
        handle = Progress(bar, bar.add_task(description, total=total))
        try:
            yield handle
        finally:
            handle.flush()
