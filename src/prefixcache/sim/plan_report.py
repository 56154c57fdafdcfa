"""The capacity plan as text, JSON and a self-contained HTML page.

The text is plain lines (what a terminal, a ticket and the docs all show the same way);
every figure in it is also in the JSON, unrounded, for scripts. A plan that names a
codec (a tier's, or ``--codec``) adds what codecs change: the capacity in each codec's
stored bytes, a codec and decode column in the tier table, where each decode rate came
from, and the savings net of loading; a plan without one prints what it always has.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from prefixcache.config import KVLayout
from prefixcache.sim.codec_sizing import MEASURE_MAX_BYTES, MEASURE_MAX_TOKENS
from prefixcache.sim.plan import DEFAULT_PRICE_PER_GPU_HOUR, Plan
from prefixcache.sim.plan_groups import group_json, group_lines
from prefixcache.sim.plan_inputs import layout_label
from prefixcache.sim.report import format_tokens

GIB = float(1 << 30)


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:,.1f} GiB"


def _pct(rate: float, digits: int = 1) -> str:
    return f"{100 * rate:.{digits}f}%"


def _us(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e6:,.1f} µs"


def _rate(bandwidth: float) -> str:
    return f"{bandwidth / 1e9:g} GB/s"


def _money(x: float) -> str:
    return f"-${-x:,.2f}" if x < 0 else f"${x:,.2f}"


def headline(plan: Plan) -> str:
    """One sentence: the answer, or why there is none."""
    target = _pct(plan.inputs.target)
    if plan.capacity_tokens is None:
        return (
            f"Target {target} is NOT reachable: an unlimited cache reaches {_pct(plan.ceiling)} on this trace "
            "(its ceiling: the other prompt tokens are never reused under this configuration)."
        )
    kv = plan.kv_bytes or 0.0
    return f"Target {target}: {format_tokens(plan.capacity_tokens)} tokens = {gib(kv)} of KV."


def render_text(plan: Plan) -> str:
    inp, cost = plan.inputs, plan.inputs.cost
    lines = [
        f"Capacity plan for {plan.trace}: {inp.policy}, {inp.isolation} isolation, block size {plan.block_size}; "
        f"warm-up {inp.warmup:g} "
        f"({plan.warmup_requests:,} requests not counted, {plan.requests:,} counted)",
        "",
        headline(plan),
    ]
    kv = inp.kv
    if isinstance(kv, KVLayout):
        lines.append(f"  KV of {cost.model.name}: {layout_label(kv)} = {kv.bytes_per_token:,} bytes/token")
    else:
        lines += group_lines(plan, kv)
    lines += _size_lines(plan)
    if plan.capacity_tokens is not None:
        lines.append(f"  hit rate at {plan.capacity_tokens:,.0f} tokens: {_pct(plan.hit_rate, 2)} (replayed)")
        if plan.below is not None:
            smaller = 1 - plan.below.capacity_tokens / plan.capacity_tokens
            lines.append(
                f"  hit rate at {plan.below.capacity_tokens:,.0f} tokens ({100 * smaller:.1f}% smaller): "
                f"{_pct(plan.below.token_hit_rate, 2)}; search precision {100 * inp.precision:g}%"
            )
    lines.append(f"  ceiling (unlimited cache): {_pct(plan.ceiling)}")
    if len(plan.curve) > 1:
        lines.append(f"  curve: {len(plan.curve)} capacities by {plan.curve_source}")
    if not plan.monotone:
        lines.append("  NOTE: the measured hit rate fell somewhere as capacity grew; the search assumes it does not")
    lines += _tier_lines(plan)
    lines += _savings_lines(plan)
    return "\n".join(lines)


def _size_lines(plan: Plan) -> list[str]:
    """The capacity in each codec's stored bytes (codec-aware plans only)."""
    if not plan.sizes:
        return []
    if plan.capacity_tokens is None:
        return [f"  stored per token at {plan.block_size}-token blocks: " + _per_token(plan)]
    out = [f"  the same {plan.capacity_tokens:,.0f} tokens stored as frames at {plan.block_size}-token blocks:"]
    for size in plan.sizes:
        out.append(
            f"    {size.codec:<5} {gib(size.kv_bytes or 0.0):>12}  "
            f"({size.ratio:.2f}x tokens per byte of raw, {size.stored_bytes_per_token:,.0f} bytes/token)"
        )
    return out


def _per_token(plan: Plan) -> str:
    return "; ".join(f"{s.codec} {s.stored_bytes_per_token:,.0f} bytes ({s.ratio:.2f}x)" for s in plan.sizes)


def _tier_lines(plan: Plan) -> list[str]:
    if not plan.tiers:
        return []
    per_hit = plan.prefill_seconds_per_hit_token
    codecs = plan.inputs.codec_aware
    codec_head = f" {'codec':<5}" if codecs else ""
    decode_head = f" {'transfer':>11} {'decode':>11}" if codecs else ""
    out = [
        "",
        f"Tiers, fastest filled first (a hit token saves {_us(per_hit)} of prefill GPU time on average):",
        f"  {'tier':<10} {'size':>12} {'bandwidth':>11}{codec_head} {'holds (tokens)':>15} "
        f"{'stored' if codecs else 'KV':>12} {'serves':>7}{decode_head} {'load/token':>11}",
    ]
    for s in plan.tiers:
        verdict = "" if s.capacity_tokens == 0 else ("  worth it" if s.worth_it else "  TOO SLOW: loading costs more")
        codec = f" {s.tier.codec:<5}" if codecs else ""
        decode = f" {_us(s.transfer_seconds_per_token):>11} {_us(s.decode_seconds_per_token):>11}" if codecs else ""
        out.append(
            f"  {s.tier.name:<10} {gib(s.tier.size_bytes):>12} {_rate(s.tier.bandwidth):>11}{codec} "
            f"{s.capacity_tokens:>15,.0f} {gib(s.kv_bytes):>12} {_pct(s.hit_rate):>7}{decode} "
            f"{_us(s.load_seconds_per_token):>11}{verdict}"
        )
    total = sum(s.hit_rate for s in plan.tiers)
    codec_pad = " " * len(codec_head)
    out.append(f"  {'total':<10} {'':>12} {'':>11}{codec_pad} {plan.tiers_hold:>15,.0f} {'':>12} {_pct(total):>7}")
    if not plan.tiers_suffice and plan.capacity_tokens is not None:
        last = plan.tiers[-1]
        per_token = last.stored_bytes_per_token if codecs else plan.bytes_per_token
        missing = (plan.capacity_tokens - plan.tiers_hold) * per_token
        stored = f" (as {last.tier.codec} frames, {last.tier.name}'s codec)" if codecs else ""
        out.append(f"  the tiers hold {_pct(total)}, short of the target: {gib(missing)} more KV needed{stored}")
    slow = [s.tier.name for s in plan.tiers if s.capacity_tokens and not s.worth_it]
    if slow:
        what = "loading a token's KV (transfer + decode)" if codecs else "loading a token's KV"
        out.append(
            f"  too slow to be worth it: {', '.join(slow)} ({what} takes longer than the prefill it "
            "saves; recomputing is faster unless the load overlaps other work)"
        )
    out += _decode_lines(plan)
    return out


def _decode_lines(plan: Plan) -> list[str]:
    """Where each decode rate the tiers use came from."""
    used = [rate for codec, rate in plan.decode.items() if any(s.tier.codec == codec for s in plan.tiers)]
    named = [r for r in used if r.source != "none"]
    if not named:
        return []
    where = {
        "given": "given (--decode-rate or the tiers file)",
        "measured": "measured: codec.decode of a synthetic block of this layout (up to "
        f"{MEASURE_MAX_TOKENS} tokens, {MEASURE_MAX_BYTES >> 20} MiB), on this machine",
    }
    return [
        f"  decode rate of {r.codec}: {r.bytes_per_second / 1e9:.3g} GB/s of decoded KV, {where[r.source]}"
        for r in named
    ]


def _savings_lines(plan: Plan) -> list[str]:
    cost, inp = plan.inputs.cost, plan.inputs
    profile = f"{cost.model.name} on {cost.gpu.name} at {100 * cost.utilization:g}% utilization"
    where = "at the plan's capacity" if plan.capacity_tokens is not None else "with an unlimited cache"
    out = ["", f"Savings {where} ({profile}):"]
    per_hour = plan.gpu_hours_per_hour
    if per_hour is None:
        out.append(
            f"  {plan.gpu_hours_saved:.4g} prefill GPU-hours over the trace; it spans no time, so no rate per hour"
        )
    else:
        out.append(
            f"  prefill GPU-hours saved per hour of traffic: {per_hour:.3g} "
            f"({plan.gpu_hours_saved:.3g} over {plan.traffic_seconds:,.0f} s of counted trace time)"
        )
        money = plan.money_per_hour or 0.0
        out.append(
            f"  money saved per hour of traffic: {_money(money)} at {_money(inp.price_per_gpu_hour)} per GPU-hour "
            f"({'the default; ' if inp.price_per_gpu_hour == DEFAULT_PRICE_PER_GPU_HOUR else ''}--price-per-gpu-hour)"
        )
    if plan.inputs.codec_aware and plan.tiers:
        out += _net_lines(plan)
    if plan.over_context:
        out.append(
            f"  {plan.over_context:,} counted prompts exceed {cost.model.name}'s {cost.model.context_length:,}-token "
            "context (costed by the same formula)"
        )
    return out


def _net_lines(plan: Plan) -> list[str]:
    """The savings less the loads of the hits the tiers serve (codec-aware plans)."""
    hours = plan.traffic_seconds / 3600
    if hours <= 0:
        return [
            f"  net of loading the tiers' hits: {plan.net_gpu_hours_saved:.4g} GPU-hours over the trace "
            f"(loads {plan.load_hours:.3g}, of which decode {plan.decode_hours:.3g})"
        ]
    net_money = plan.net_money_per_hour or 0.0
    return [
        f"  net of loading the hits the tiers serve, were the GPU to wait for each load: "
        f"{plan.net_gpu_hours_saved / hours:.3g} GPU-hours per hour of traffic, {_money(net_money)} per hour "
        f"(loads cost {plan.load_hours / hours:.3g} GPU-hours per hour, of which decode "
        f"{plan.decode_hours / hours:.3g})"
    ]


def plan_json(plan: Plan) -> dict[str, Any]:
    """Every figure of the plan, unrounded (``null`` where there is none)."""
    inp, cost = plan.inputs, plan.inputs.cost

    def cap(c: float) -> float | None:
        return None if math.isinf(c) else c

    out = {
        "trace": plan.trace,
        "target_hit_rate": inp.target,
        "reachable": plan.reachable,
        "ceiling_hit_rate": plan.ceiling,
        "capacity_tokens": plan.capacity_tokens,
        "kv_bytes": plan.kv_bytes,
        "kv_gib": None if plan.kv_bytes is None else plan.kv_bytes / GIB,
        "hit_rate": plan.hit_rate,
        "below": None
        if plan.below is None
        else {"capacity_tokens": plan.below.capacity_tokens, "token_hit_rate": plan.below.token_hit_rate},
        "precision": inp.precision,
        "block_size": plan.block_size,
        "policy": inp.policy,
        "isolation": inp.isolation,
        "warmup": inp.warmup,
        "requests": plan.requests,
        "warmup_requests": plan.warmup_requests,
        "model": cost.model.name,
        "kv_layout": None,  # below: a uniform layout's fields, or the groups
        "bytes_per_token": plan.bytes_per_token,
        "gpu": cost.gpu.name,
        "utilization": cost.utilization,
        "price_per_gpu_hour": inp.price_per_gpu_hour,
        "traffic_seconds": plan.traffic_seconds,
        "gpu_hours_saved": plan.gpu_hours_saved,
        "gpu_hours_saved_per_hour": plan.gpu_hours_per_hour,
        "money_saved_per_hour": plan.money_per_hour,
        "prefill_seconds_per_hit_token": plan.prefill_seconds_per_hit_token,
        "over_context_prompts": plan.over_context,
        "tiers": [
            {
                "name": s.tier.name,
                "size_bytes": s.tier.size_bytes,
                "bandwidth_bytes_per_s": s.tier.bandwidth,
                "capacity_tokens": s.capacity_tokens,
                "kv_bytes": s.kv_bytes,
                "hit_rate": s.hit_rate,
                "load_seconds_per_token": s.load_seconds_per_token,
                "worth_it": s.worth_it,
            }
            for s in plan.tiers
        ],
        "tiers_hold_tokens": cap(plan.tiers_hold),
        "tiers_suffice": plan.tiers_suffice,
        "monotone": plan.monotone,
        "curve_source": plan.curve_source,
        "engine": plan.engine,
        "curve": [{"capacity_tokens": cap(p.capacity_tokens), "token_hit_rate": p.token_hit_rate} for p in plan.curve],
    }
    if isinstance(inp.kv, KVLayout):
        kv = inp.kv
        out["kv_layout"] = {"layers": kv.layers, "kv_heads": kv.kv_heads, "head_dim": kv.head_dim, "dtype": kv.dtype}
    else:
        out |= group_json(plan, inp.kv)
    return _codec_json(plan, out) if inp.codec_aware else out


def _codec_json(plan: Plan, out: dict[str, Any]) -> dict[str, Any]:
    """What codecs add to the JSON (codec-aware plans only: the rest is unchanged)."""
    for entry, s in zip(out["tiers"], plan.tiers, strict=True):
        entry |= {
            "codec": s.tier.codec,
            "stored_bytes_per_token": s.stored_bytes_per_token,
            "transfer_seconds_per_token": s.transfer_seconds_per_token,
            "decode_seconds_per_token": s.decode_seconds_per_token,
        }
    out["codecs"] = [
        {
            "codec": size.codec,
            "ratio": size.ratio,
            "stored_bytes_per_token": size.stored_bytes_per_token,
            "kv_bytes": size.kv_bytes,
            "decode_bytes_per_s": None
            if math.isinf(plan.decode[size.codec].bytes_per_second)
            else plan.decode[size.codec].bytes_per_second,
            "decode_rate_source": plan.decode[size.codec].source,
        }
        for size in plan.sizes
    ]
    out["lookup_tokens"] = plan.lookup_tokens
    out["load_gpu_hours"] = plan.load_hours
    out["decode_gpu_hours"] = plan.decode_hours
    out["net_gpu_hours_saved"] = plan.net_gpu_hours_saved
    out["net_money_saved_per_hour"] = plan.net_money_per_hour
    return out


def to_json(plan: Plan) -> str:
    return json.dumps(plan_json(plan), indent=2)


# ------------------------------------------------------------------------------ HTML


def _curve_png(plan: Plan) -> str:
    from matplotlib.axes import Axes  # matplotlib: the 'sim' extra
    from matplotlib.ticker import FuncFormatter, NullFormatter

    from prefixcache.sim.html_report import _figure_png  # NOTE: the replay report's figure, same look

    def draw(ax: Axes) -> None:
        finite = [p for p in plan.curve if math.isfinite(p.capacity_tokens) and p.capacity_tokens > 0]
        ax.plot(
            [p.capacity_tokens for p in finite],
            [100 * p.token_hit_rate for p in finite],
            marker=".",
            label=f"{plan.inputs.policy} (replayed)",
        )
        ax.axhline(100 * plan.ceiling, color="grey", linestyle="--", label=f"ceiling {_pct(plan.ceiling)}")
        ax.axhline(100 * plan.inputs.target, color="tab:red", linestyle=":", label=f"target {_pct(plan.inputs.target)}")
        if plan.capacity_tokens is not None:
            ax.axvline(
                plan.capacity_tokens, color="tab:red", label=f"plan {format_tokens(plan.capacity_tokens)} tokens"
            )
        bound = 0.0
        for s in plan.tiers:
            bound += s.capacity_tokens
            if s.capacity_tokens and bound != plan.capacity_tokens:
                ax.axvline(bound, color="tab:green", linestyle="-.", label=f"end of {s.tier.name}")
        ax.set_xscale("log")
        # NOTE: the figure draws with mathtext off, so the log axis's 10^k labels are replaced
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_tokens(x)))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("capacity (tokens)")
        ax.set_ylabel("token hit rate (%)")
        ax.set_title("Token hit rate vs capacity, with the target and the plan")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))

    return _figure_png(draw)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
img { max-width: 100%; }
"""


def render_html(plan: Plan) -> str:
    """The plan as one HTML page: the text report and the curve; no scripts, no external resources."""
    heading = html.escape(f"Capacity plan: {plan.trace}")
    alt = "token hit rate vs capacity"
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{heading}</title><style>{_STYLE}</style></head><body>",
            f"<h1>{heading}</h1>",
            f"<p><strong>{html.escape(headline(plan))}</strong></p>",
            f'<figure><img alt="{alt}" src="data:image/png;base64,{_curve_png(plan)}"><figcaption>{alt}</figcaption>',
            "</figure>",
            f"<pre>{html.escape(render_text(plan))}</pre>",
            "</body></html>\n",
        ]
    )


def write_html(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(render_html(plan), encoding="utf-8")
