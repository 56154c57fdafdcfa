"""``prefixcache replay --backends N``: the fleet flags of the simulator's command line,
what they describe (``FleetSpec``) and the replay through a router that they ask for
(docs/routing-sim.md). ``cli.py`` adds them to ``replay`` and hands over."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable

from prefixcache.fleet.scoring import Routing, Scorer
from prefixcache.sim.costmodel import CostModel
from prefixcache.sim.fleet import replay_fleet
from prefixcache.sim.fleet_results import DEFAULT_DECODE_SECONDS, DEFAULT_EVENT_LAG, FleetSpec
from prefixcache.sim.inputs import parse_list
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.summary import TraceSummary
from prefixcache.sim.traces import Request

__all__ = ["FLEET_FLAGS", "add_fleet_flags", "fleet_spec", "run_fleet", "wants_fleet"]


def _backends(item: str) -> int:
    try:
        value = int(item)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--backends: not an integer: {item!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--backends: need at least 1 backend, got {value}")
    return value


FLEET_FLAGS = ("routing", "event_lag", "decode_ms", "load_weight", "no_oracle")


def add_fleet_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet (routing across backends)")
    g.add_argument("--backends", type=_backends, default=None, metavar="N", help="replay through N backend caches")
    g.add_argument(
        "--routing",
        default=None,
        type=lambda t: parse_list(t, Routing, "--routing", [r.value for r in Routing]),
        help=f"routings to compare, comma-separated ({', '.join(r.value for r in Routing)}; default all)",
    )
    g.add_argument(
        "--event-lag",
        type=int,
        default=None,
        metavar="K",
        help=f"requests routed before a backend's KV event reaches the router (default {DEFAULT_EVENT_LAG})",
    )
    g.add_argument(
        "--decode-ms",
        type=float,
        default=None,
        help=f"decode time per output token on a backend, ms (default {1000 * DEFAULT_DECODE_SECONDS:g})",
    )
    g.add_argument(
        "--load-weight", type=float, default=None, help="the cost routing's load weight (default: Scorer's, 0.25)"
    )
    g.add_argument("--no-oracle", action="store_true", default=None, help="skip the oracle runs of prefix and cost")


def wants_fleet(args: argparse.Namespace) -> bool:
    """Whether the flags ask for a fleet replay (``--backends`` or any fleet flag)."""
    return args.backends is not None or any(getattr(args, name) is not None for name in FLEET_FLAGS)


def fleet_spec(args: argparse.Namespace, parser: argparse.ArgumentParser) -> FleetSpec:
    """The fleet the flags describe; a usage error where they ask what a fleet replay cannot do."""
    given = [f"--{name.replace('_', '-')}" for name in FLEET_FLAGS if getattr(args, name) is not None]
    if args.backends is None:
        parser.error(f"{', '.join(given)} needs --backends N")
    unsupported = [
        flag
        for flag, on in (
            ("--mode flat", "flat" in args.mode),
            ("--partial-blocks", args.partial_blocks),
            ("--publish", args.publish is not None),
            ("--ttl", args.ttl is not None),
            ("--include-output", args.include_output),
            ("--metrics", args.metrics is not None),
            ("--model none", args.model == "none"),
            ("--capacity-bytes", args.capacity_bytes is not None),
        )
        if on
    ]
    if unsupported:
        parser.error(
            f"--backends does not combine with {', '.join(unsupported)} (a fleet replay routes whole blocks "
            "on tree-mode caches, and needs the cost model for its timing)"
        )
    if args.event_lag is not None and args.event_lag < 0:
        parser.error(f"--event-lag must be >= 0 requests, got {args.event_lag}")
    try:
        scorer = Scorer() if args.load_weight is None else Scorer(load_weight=args.load_weight)
        return FleetSpec(
            args.backends,
            tuple(args.routing) if args.routing is not None else tuple(Routing),
            DEFAULT_EVENT_LAG if args.event_lag is None else args.event_lag,
            DEFAULT_DECODE_SECONDS if args.decode_ms is None else args.decode_ms / 1000.0,
            scorer,
            oracle=not args.no_oracle,
        )
    except ValueError as exc:
        parser.error(str(exc))


def run_fleet(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    source: Callable[[], Iterable[Request]],
    cost: CostModel | None,
    summary: TraceSummary,
    configs: list[ReplayConfig],
) -> int:
    """Replay through ``args.backends`` caches once per routing, and report."""
    from prefixcache.sim import fleet_report, report

    spec = fleet_spec(args, parser)
    assert cost is not None  # --model none is refused above
    show = not args.no_progress and not args.json and sys.stderr.isatty()
    try:
        results = replay_fleet(
            source,
            configs,
            spec,
            cost,
            trace_name=args.trace.name,
            warmup=args.warmup,
            engine=args.engine,
            progress=lambda total, label: report.progress(total, label, show),
            summary=summary,
        )
    except ValueError as exc:
        print(f"prefixcache replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(fleet_report.fleet_json(results))
    else:
        fleet_report.render_fleet_table(results)
    if args.html is not None:
        fleet_report.write_fleet_html(results, args.html)
        if not args.json:
            print(f"HTML report: {args.html}")
    return 0
