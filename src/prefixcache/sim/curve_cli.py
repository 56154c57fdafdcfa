"""``prefixcache curve``: a whole hit-rate-versus-capacity curve of one configuration
on a trace, fast (``sim/curves.py``).

Exit status: 0 with a curve; 2 for bad input (an empty trace, a malformed line, a
configuration the curves do not model).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from typing import Any

from prefixcache.config import ISOLATION_MODES, CacheConfig
from prefixcache.policies import POLICIES
from prefixcache.sim.curves import DEFAULT_POINTS, DEFAULT_SAMPLE, METHODS, Curve, curve
from prefixcache.sim.forks import cpus
from prefixcache.sim.inputs import TOKEN_FORMS, parse_list, parse_tokens
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.tracefile import HASHED_BLOCKS
from prefixcache.sim.traces import FORMATS, Request, read_trace

CURVE_EPILOG = f"""\
examples:
  prefixcache curve trace.jsonl --policy s3fifo
  prefixcache curve trace.jsonl --policy gittins --isolation namespace --warmup 0.5 --json
  prefixcache curve trace.jsonl --capacity-tokens 1M,4M,16M,inf --method replay

Methods: sampled (the default, 'auto'): miniature caches at a sampling rate that keeps
{DEFAULT_SAMPLE:,} block lookups (rate 1, exact, on a smaller trace), every policy;
stack: textbook LRU by stack distances, one pass, not quite the cache's LRU; replay:
a full replay per capacity, the reference. Without --capacity-tokens, {DEFAULT_POINTS}
capacities evenly spaced in log up to the trace's distinct blocks.
Exit status: 0 with a curve, 2 for bad input.
"""


def add_curve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "curve",
        help="token hit rate versus capacity of one configuration on a trace, fast",
        description="Draw a whole token-hit-rate-versus-capacity curve of one cache configuration on a "
        "trace: by sampled miniature caches (every policy), LRU stack distances, or full replays.",
        epilog=CURVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="trace file (JSONL, optionally .gz)")
    p.add_argument("--format", choices=("auto", *FORMATS), default="auto", help="trace format (default: auto)")
    p.add_argument("--hashed-blocks", choices=HASHED_BLOCKS, default="auto", help="as for replay (default auto)")
    p.add_argument("--policy", choices=sorted(POLICIES), default=CacheConfig().policy, help="eviction policy")
    p.add_argument("--isolation", choices=ISOLATION_MODES, default="shared", help="tenant isolation (default shared)")
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="block size of a token trace (default 16; a pre-hashed trace has its own)",
    )
    p.add_argument("--ttl", type=float, default=None, help="expire blocks unused this many seconds of trace time")
    p.add_argument("--warmup", type=float, default=0.0, help="fraction of requests replayed but not counted")
    p.add_argument(
        "--capacity-tokens",
        type=lambda t: parse_list(t, parse_tokens, "--capacity-tokens"),
        default=None,
        help=f"the capacities, comma-separated: {TOKEN_FORMS} for unlimited (default: {DEFAULT_POINTS} points)",
    )
    p.add_argument("--method", choices=METHODS, default="auto", help="how to draw it (default auto: sampled)")
    p.add_argument("--rate", type=float, default=None, help="the sampled method's rate in (0, 1] (default: above)")
    p.add_argument("--seed", type=int, default=None, help="salt of the sampled method's hash (default 0)")
    p.add_argument("--jobs", type=int, default=None, help=f"processes for the miniatures (default {cpus()})")
    p.add_argument("--json", action="store_true", help="print the curve as JSON")


def run_curve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = _config(args, parser)
    if not 0.0 <= args.warmup < 1.0:
        parser.error(f"--warmup must be a fraction in [0, 1), got {args.warmup}")
    if args.method in ("stack", "replay"):
        given = [flag for flag, value in (("--seed", args.seed), ("--jobs", args.jobs)) if value is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            parser.error(f"{' and '.join(given)} {verb} to the sampled method, not --method {args.method}")

    def source() -> Iterable[Request]:
        return read_trace(args.trace, args.format, None, args.hashed_blocks)

    try:
        first = next(iter(source()), None)
        if first is not None and first.hash_ids is not None and args.block_size is not None:
            raise ValueError(
                f"--block-size applies to token traces: {args.trace} is pre-hashed (hash_ids in blocks of "
                f"{first.block_size} tokens), which fixes the block size"
            )
        got = curve(
            source,
            config,
            args.capacity_tokens,
            warmup=args.warmup,
            method=args.method,
            rate=args.rate,
            seed=0 if args.seed is None else args.seed,
            jobs=args.jobs,
        )
    except (OSError, ValueError) as exc:  # no such file, an empty trace, a malformed line, a refusal
        print(f"prefixcache curve: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(got.to_json(), indent=2) if args.json else render_text(got, str(args.trace)))
    return 0


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ReplayConfig:
    try:
        cache = CacheConfig(
            policy=args.policy,
            isolation=args.isolation,
            block_size=16 if args.block_size is None else args.block_size,
            ttl_seconds=args.ttl,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return ReplayConfig(cache)


def render_text(got: Curve, trace: str) -> str:
    """The curve as a table, with how it was drawn and what that promises."""
    if got.method == "sampled" and got.sampling_rate is not None and got.sampling_rate < 1.0:
        how = (
            f"sampled miniature caches at rate {got.sampling_rate:.3g} (no error bound is claimed below rate 1;"
            " the errors measured against full replays are in docs/simulator.md, 'Curves')"
        )
    elif got.method == "sampled":
        how = "miniature caches at rate 1: every request replayed, exact"
    elif got.method == "stack":
        how = "LRU stack distances: textbook LRU, which the cache's LRU outlives (docs/simulator.md)"
    else:
        how = "a full replay per capacity, exact"
    lines = [
        f"{trace}: {got.requests:,} requests counted, {got.lookup_tokens:,} prompt tokens",
        f"policy {got.policy}, {got.isolation} isolation, block size {got.block_size}",
        f"drawn by {how}, in {got.seconds:.1f} s",
        "",
        f"{'capacity (tokens)':>20}  {'token hit rate':>14}",
    ]
    for capacity, rate in zip(got.capacities, got.token_hit_rates, strict=True):
        shown = "unlimited" if math.isinf(capacity) else f"{capacity:,.0f}"
        lines.append(f"{shown:>20}  {rate:>14.4f}")
    return "\n".join(lines)
