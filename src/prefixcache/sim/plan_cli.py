"""``prefixcache plan``: how much cache a trace needs for a target hit rate (``sim/plan.py``).

Exit status: 0 with a plan; 1 when the target is above the trace's ceiling (the answer
is printed all the same, with the ceiling; ``reachable`` is false in the JSON); 2 for
bad input (an unknown profile, a bad tier, an empty trace, a malformed line).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prefixcache.config import ISOLATION_MODES, CacheConfig
from prefixcache.policies import POLICIES
from prefixcache.sim.codec_sizing import codecs
from prefixcache.sim.costmodel import GPUS, MODELS, CostModel, get_gpu, get_model
from prefixcache.sim.engines import ENGINES
from prefixcache.sim.forks import cpus
from prefixcache.sim.plan import DEFAULT_PRECISION, DEFAULT_PRICE_PER_GPU_HOUR, PlanInputs, make_plan
from prefixcache.sim.plan_inputs import (
    CODEC_TIER_EXAMPLE,
    TIER_EXAMPLE,
    Tier,
    load_decode_rates_toml,
    load_groups_toml,
    load_tiers_toml,
    parse_decode_rate,
    parse_tier,
    plan_layout,
)
from prefixcache.sim.tracefile import HASHED_BLOCKS
from prefixcache.sim.traces import FORMATS, Request, read_trace

EXIT_UNREACHABLE = 1

PLAN_EPILOG = """\
examples:
  prefixcache plan trace.jsonl --model llama-3-8b --target-hit-rate 0.8
  prefixcache plan trace.jsonl --model llama-3-70b --target-hit-rate 0.5 --tier memory:512G:20GB/s \\
      --tier disk:4T:2GB/s --price-per-gpu-hour 3.5 --html plan.html
  prefixcache plan trace.jsonl --model my-7b:params=7e9,layers=32,hidden=4096,context=32768 \\
      --kv-layout kv_heads=8,head_dim=128,dtype=float16 --target-hit-rate 0.6 --json
  prefixcache plan trace.jsonl --model llama-3-8b --target-hit-rate 0.8 --tier memory:64G:20GB/s \\
      --tier disk:2T:2GB/s:int8 --codec int4 --decode-rate int8=8GB/s
  prefixcache plan trace.jsonl --model gemma-3-27b --target-hit-rate 0.8 --tier memory:512G:20GB/s

The capacity is the smallest at which the policy's token hit rate on the counted requests
(after --warmup) reaches the target, found by replaying the trace at the capacities a
search needs (to --precision, relative). Sizes: 64G = 64GiB = 64 x 2^30 bytes; 64GB =
64 x 10^9; bandwidths end in /s (20GB/s). Tiers are filled fastest first; each serves
the hits a cache of its cumulative size adds to the faster ones'. A tier's 4th field is
the codec it stores frames in (raw by default): its bytes hold more tokens, and a hit
it serves costs a decode on top of its transfer (--decode-rate, else measured here).
Exit status: 0 with a plan, 1 when the target is above the trace's ceiling (reported),
2 for bad input.
"""


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="how much cache (tokens, GiB, tiers) a trace needs for a target hit rate, and what it saves",
        description="Find the cache capacity at which a policy reaches a target token hit rate on a trace, "
        "in tokens and GiB of KV, split across storage tiers, with the prefill GPU-hours and money it saves "
        "per hour of traffic.",
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", type=Path, help="trace file (JSONL, optionally .gz)")
    p.add_argument(
        "--target-hit-rate", type=float, required=True, metavar="RATE", help="token hit rate to reach, in (0, 1]"
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"model profile: {', '.join(sorted(MODELS))}, or 'name:params=7e9,layers=32,hidden=4096,context=32768'",
    )
    p.add_argument(
        "--kv-layout",
        default=None,
        metavar="SPEC",
        help="the model's KV layout or a change to it: kv_heads=8,head_dim=128,dtype=float16 (any subset; "
        "needed for a model without a built-in layout)",
    )
    p.add_argument(
        "--kv-groups",
        type=Path,
        default=None,
        metavar="FILE",
        help="the model's layer groups (full, sliding windows, recurrent state) from a TOML file of [[group]] "
        "tables, for a model whose layers differ (docs/planner.md, 'Models whose layers differ')",
    )
    p.add_argument("--gpu", default="h100", help=f"GPU profile: {', '.join(sorted(GPUS))} or 'name:peak=500e12'")
    p.add_argument(
        "--utilization", type=float, default=0.5, help="assumed prefill utilization of GPU peak (default 0.5)"
    )
    p.add_argument(
        "--price-per-gpu-hour",
        type=float,
        default=DEFAULT_PRICE_PER_GPU_HOUR,
        metavar="DOLLARS",
        help=f"what one GPU-hour costs (default {DEFAULT_PRICE_PER_GPU_HOUR:g}, stated in the output)",
    )
    default_policy, default_isolation = CacheConfig().policy, CacheConfig().isolation
    p.add_argument(
        "--policy",
        default=default_policy,
        choices=sorted(POLICIES),
        help=f"eviction policy (default {default_policy}, the library's)",
    )
    p.add_argument(
        "--isolation",
        choices=ISOLATION_MODES,
        default=default_isolation,
        help=f"isolation mode (default {default_isolation}, the library's)",
    )
    p.add_argument("--block-size", type=int, default=16, help="block size of a token trace (default 16)")
    p.add_argument(
        "--warmup", type=float, default=0.5, help="fraction of requests that only warm the cache (default 0.5)"
    )
    p.add_argument(
        "--precision",
        type=float,
        default=DEFAULT_PRECISION,
        help=f"relative precision of the capacity search (default {DEFAULT_PRECISION:g}: within 1%%)",
    )
    p.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="NAME:SIZE:BANDWIDTH[:CODEC]",
        help=f"a storage tier, e.g. {TIER_EXAMPLE} or {CODEC_TIER_EXAMPLE} (codec: {', '.join(codecs())}; "
        "default raw; repeat for more)",
    )
    p.add_argument(
        "--tiers",
        type=Path,
        metavar="FILE",
        help="storage tiers from a TOML file of [[tier]] tables (and an optional [decode_rate] table)",
    )
    p.add_argument(
        "--codec",
        default=None,
        metavar="LIST",
        help=f"also size the cache in these codecs' stored bytes, comma-separated ({', '.join(codecs())})",
    )
    p.add_argument(
        "--decode-rate",
        action="append",
        default=[],
        metavar="CODEC=RATE",
        help="a codec's decode rate in decoded bytes a second, e.g. int8=8GB/s, for deterministic output "
        "(default: measured on this machine; repeat for more)",
    )
    p.add_argument("--format", choices=("auto", *FORMATS), default="auto", help="trace format (default: auto)")
    p.add_argument("--hashed-blocks", choices=HASHED_BLOCKS, default="auto", help="as for replay (default auto)")
    p.add_argument("--engine", choices=ENGINES, default="auto", help="tree mode's engine, as for replay")
    p.add_argument("--jobs", type=int, default=None, help=f"processes for the replays (default {cpus()})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--html", type=Path, help="also write an HTML report with the hit-rate curve to this file")


def _tiers(args: argparse.Namespace) -> list[Tier]:
    tiers = [parse_tier(spec) for spec in args.tier]
    if args.tiers is not None:
        tiers += load_tiers_toml(args.tiers)
    return tiers


def _decode_rates(args: argparse.Namespace) -> list[tuple[str, float]]:
    rates = [parse_decode_rate(spec) for spec in args.decode_rate]
    if args.tiers is not None:
        rates += load_decode_rates_toml(args.tiers)
    return rates


def plan_inputs(args: argparse.Namespace) -> PlanInputs:
    """The planner's inputs from the flags; a ValueError names what is wrong."""
    model = get_model(args.model)
    named = [c.strip() for c in (args.codec or "").split(",") if c.strip()]
    if args.codec is not None and not named:
        raise ValueError("--codec: give at least one codec")
    return PlanInputs(
        target=args.target_hit_rate,
        cost=CostModel(model, get_gpu(args.gpu), args.utilization),
        kv=plan_layout(model, args.kv_layout, None if args.kv_groups is None else load_groups_toml(args.kv_groups)),
        policy=args.policy,
        isolation=args.isolation,
        block_size=args.block_size,
        warmup=args.warmup,
        precision=args.precision,
        tiers=tuple(_tiers(args)),
        price_per_gpu_hour=args.price_per_gpu_hour,
        codecs=tuple(named),
        decode_rates=tuple(_decode_rates(args)),
    )


def run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.trace.exists():
        parser.error(f"no such trace file: {args.trace}")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    try:
        inputs = plan_inputs(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.html is not None:
        try:
            import matplotlib  # noqa: F401  (the 'sim' extra)
        except ImportError:
            parser.error("--html needs matplotlib: pip install 'prefixcache[sim]'")

    def source() -> Iterable[Request]:
        return read_trace(args.trace, args.format, None, args.hashed_blocks)

    from prefixcache.sim import plan_report

    try:
        plan = make_plan(source, inputs, trace_name=args.trace.name, engine=args.engine, jobs=args.jobs)
    except ValueError as exc:  # an empty trace, a malformed line (named), an engine that lacks a feature
        print(f"prefixcache plan: {exc}", file=sys.stderr)
        return 2
    print(plan_report.to_json(plan) if args.json else plan_report.render_text(plan))
    if args.html is not None:
        plan_report.write_html(plan, args.html)
        if not args.json:
            print(f"HTML report: {args.html}")
    return 0 if plan.reachable else EXIT_UNREACHABLE
