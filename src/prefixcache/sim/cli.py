"""``prefixcache replay`` and ``prefixcache workload``: the simulator's command line.

What the flags accept and which apply is checked in ``inputs``; ``workload`` lives in
``workload_cli`` (re-exported here)."""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefixcache.config import ISOLATION_MODES, CacheConfig, PublishConfig
from prefixcache.policies import POLICIES
from prefixcache.sim.codec_replay import codec_capacities, codec_note
from prefixcache.sim.codec_sizing import codecs
from prefixcache.sim.costmodel import GPUS, MODELS, CostModel
from prefixcache.sim.engines import ENGINES
from prefixcache.sim.fleet_cli import add_fleet_flags, run_fleet, wants_fleet
from prefixcache.sim.inputs import (
    BYTE_FORMS,
    DEFAULT_GPU,
    DEFAULT_MODEL,
    DEFAULT_UTILIZATION,
    TOKEN_FORMS,
    capacities,
    cost_model,
    parse_bytes,
    parse_list,
    parse_tokens,
    static_errors,
    trace_errors,
)
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig, cache_capacity
from prefixcache.sim.retention_cli import (
    add_retention_flags,
    retention_configs,
    retention_errors,
    retention_trace_errors,
)
from prefixcache.sim.summary import TraceSummary, summarize
from prefixcache.sim.tokenizers import load_tokenizer
from prefixcache.sim.tracefile import HASHED_BLOCKS
from prefixcache.sim.traces import FORMATS, Request, read_trace
from prefixcache.sim.workload_cli import add_workload_parser as add_workload_parser
from prefixcache.sim.workload_cli import run_workload as run_workload

REPLAY_EPILOG = """\
examples:
  prefixcache replay trace.jsonl --format mooncake --policy lru,s3fifo --capacity-tokens 1e6,1e7,inf --warmup 0.5
  prefixcache replay users.jsonl --isolation shared,namespace,partitioned --block-size 16,64 --json
  prefixcache replay users.jsonl --mode flat --policy lru,fifo,s3fifo --html report.html
  prefixcache replay trace.jsonl --model llama-3-8b --capacity-bytes 64GiB --codec raw,int8,int4 --warmup 0.5
  prefixcache replay trace.jsonl --backends 4 --routing round_robin,least_loaded,prefix,cost --capacity-tokens 1e6

Lists are comma-separated; every combination is replayed (policies x capacities x block
sizes x isolation modes). A pre-hashed trace (Mooncake, Bailian, or JSONL with hash_ids)
is replayed at its own block size. Capacity "inf" means unlimited: the trace's ceiling.
The optimum is Belady with bypass on the block sequence at the same capacity.

With --backends N the trace goes through N caches (each of the given capacity) behind a
router, once per routing (docs/routing-sim.md): prefix and cost read the caches through
KV events --event-lag requests late, and run again as an oracle that reads them exactly;
a pooled cache of N x the capacity is the ceiling. Load imbalance is max/mean of the
backends' prefill GPU-seconds.
"""


_parse_list = parse_list
_capacity = parse_tokens


def _block_size(item: str) -> int:
    value = int(item)
    if value < 1:
        raise ValueError(item)
    return value


def add_replay_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a request trace through the cache and report hit rates and savings",
        description="Replay a request trace through the real cache (metadata only) under one or more "
        "configurations, and report token and request hit rates, the offline optimum, and prefill "
        "compute saved.",
        epilog=REPLAY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", type=Path, help="trace file (JSONL, optionally .gz)")
    p.add_argument("--format", choices=("auto", *FORMATS), default="auto", help="trace format (default: auto)")
    p.add_argument(
        "--hashed-blocks",
        choices=HASHED_BLOCKS,
        default="auto",
        help="which blocks a pre-hashed trace's hash_ids name: all (the partial last block too: "
        "ceil(input_length / block_size) ids, as Mooncake), full (only full blocks: input_length // block_size "
        "ids; the tail is never a hit), auto (detected from the trace; default)",
    )
    p.add_argument(
        "--policy",
        default="lru",
        type=lambda t: _parse_list(t, str, "--policy", POLICIES),
        help=f"eviction policies, comma-separated ({', '.join(sorted(POLICIES))}; default lru)",
    )
    p.add_argument(
        "--capacity-tokens",
        default=None,
        type=lambda t: _parse_list(t, _capacity, "--capacity-tokens"),
        help=f"cache capacities in tokens, comma-separated: {TOKEN_FORMS} for unlimited (default inf)",
    )
    p.add_argument(
        "--capacity-bytes",
        default=None,
        type=lambda t: _parse_list(t, parse_bytes, "--capacity-bytes"),
        help=f"cache capacities in bytes of KV, comma-separated, instead of --capacity-tokens: {BYTE_FORMS}; "
        "needs --model, whose KV layout turns bytes into tokens",
    )
    p.add_argument(
        "--codec",
        default=None,
        type=lambda t: _parse_list(t, str, "--codec", codecs()),
        help=f"with --capacity-bytes: the bytes are stored frames of these codecs, comma-separated "
        f"({', '.join(codecs())}); each turns them into its own number of tokens (default: raw KV bytes)",
    )
    p.add_argument(
        "--block-size",
        default=None,
        type=lambda t: _parse_list(t, _block_size, "--block-size"),
        help="block sizes for token traces, comma-separated (default 16; a pre-hashed trace has its own, and "
        "--block-size is then an error)",
    )
    p.add_argument(
        "--isolation",
        default="shared",
        type=lambda t: _parse_list(t, str, "--isolation", ISOLATION_MODES),
        help="isolation modes, comma-separated (shared, namespace, partitioned; default shared)",
    )
    p.add_argument(
        "--mode",
        default="tree",
        type=lambda t: _parse_list(t, str, "--mode", ("tree", "flat")),
        help="tree: the cache's block tree, pins, pools and policies (see --engine); flat: block ids as "
        "independent objects (default tree)",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="tree mode's engine: native (the compiled kernel: the cache's metadata path, step for step the same, "
        "~30x faster), python (the PrefixCache itself), auto (native where it models the configuration: "
        "not with --publish, --partial-blocks, --retention or --metrics; default auto)",
    )
    add_retention_flags(p)
    p.add_argument("--partial-blocks", action="store_true", help="token-granular matching inside a block")
    p.add_argument(
        "--publish",
        type=int,
        default=None,
        metavar="K",
        help="tree mode, namespace and partitioned isolation: publish a prefix to the shared pool once K "
        "distinct tenants sent it (K >= 2; default: no publication)",
    )
    p.add_argument(
        "--publish-min-tokens", type=int, default=None, help="shortest prefix --publish may publish (default 256)"
    )
    p.add_argument(
        "--ttl",
        type=float,
        default=None,
        help="tree mode: expire blocks unused this many seconds of trace time (default: no TTL)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="fraction of requests that only warm the cache (0.5 "
        "compares with published curves that measure the second half; default 0)",
    )
    p.add_argument(
        "--include-output",
        action="store_true",
        help="also insert each request's output tokens, as its next turn would send them (token traces)",
    )
    p.add_argument("--no-optimal", action="store_true", help="skip the Belady optimum")
    p.add_argument(
        "--model",
        default=None,
        help=f"cost model profile: {', '.join(sorted(MODELS))}, 'none', or "
        "'name:params=7e9,layers=32,hidden=4096,context=32768[,kv_heads=8,head_dim=128,dtype=bfloat16]' "
        f"(default {DEFAULT_MODEL}, said as a default in the output)",
    )
    p.add_argument(
        "--gpu",
        default=None,
        help=f"GPU profile: {', '.join(sorted(GPUS))} or 'name:peak=500e12' (default {DEFAULT_GPU})",
    )
    p.add_argument(
        "--utilization",
        type=float,
        default=None,
        help=f"assumed prefill utilization of GPU peak (default {DEFAULT_UTILIZATION})",
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer for 'text' records: utf8 (default) or a tokenizer.json path"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--html", type=Path, help="also write an HTML report with plots to this file")
    p.add_argument(
        "--tenant-capacity",
        default=None,
        metavar="CAP",
        help="the replayed capacity the HTML report's per-tenant chart shows, in the unit of the capacities "
        "given (default: the largest)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--metrics",
        type=Path,
        metavar="DIR",
        help="write each tree-mode configuration's Prometheus metrics (what a server would expose) to DIR/*.prom;"
        " `prefixcache diagnose FILE` reads them",
    )
    add_fleet_flags(p)


def run_replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.trace.exists():
        parser.error(f"no such trace file: {args.trace}")
    if not 0.0 <= args.warmup < 1.0:
        parser.error("--warmup must be a fraction in [0, 1)")
    if args.ttl is not None and not args.ttl > 0:
        parser.error("--ttl must be a positive number of seconds")
    if args.publish is not None and args.publish < 2:
        parser.error("--publish needs K >= 2 distinct tenants (one tenant alone must never publish)")
    if args.publish_min_tokens is not None and args.publish_min_tokens < 1:
        parser.error("--publish-min-tokens must be >= 1")
    inapplicable = static_errors(args) + retention_errors(args)
    if inapplicable:
        parser.error("; ".join(inapplicable))
    try:
        from prefixcache.sim import html_report, report  # rich and matplotlib: the 'sim' extra
    except ImportError as exc:
        parser.error(
            f"replay reports need the simulator extras ({exc.name} is missing): pip install 'prefixcache[sim]'"
        )
    try:
        cost = cost_model(args)
        tokenizer = load_tokenizer(args.tokenizer or "utf8")
        tenant_capacity, notes = capacities(args, cost)
    except ValueError as exc:
        parser.error(str(exc))

    def source() -> Iterable[Request]:
        return read_trace(args.trace, args.format, tokenizer, args.hashed_blocks)

    fleet = wants_fleet(args)
    if fleet and args.tenant_capacity is not None:
        parser.error("--tenant-capacity applies to a single-cache replay's HTML report, not a fleet's")
    summary = _summary(args, parser, source)
    if summary is None:
        return 2
    if args.codec is not None:
        assert cost is not None  # inputs.static_errors: --codec needs --capacity-bytes, which needs --model
        notes = [_codec_note(args, cost, summary)]
    if fleet:
        return run_fleet(args, parser, source, cost, summary, _replay_configs(args, cost, summary))
    show = not args.no_progress and not args.json and sys.stderr.isatty()
    try:
        configs = _replay_configs(args, cost, summary)
        results = replay(
            source,
            configs,
            trace_name=args.trace.name,
            warmup=args.warmup,
            include_output=args.include_output,
            optimal=not args.no_optimal,
            cost=cost,
            progress=lambda total, label: report.progress(total, label, show),
            summary=summary,
            metrics=_metrics_writer(args.metrics) if args.metrics is not None else None,
            engine=args.engine,
        )
    except ValueError as exc:  # a malformed trace names its file, line and field; --engine native, what it lacks
        print(f"prefixcache replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(report.to_json(results))
    else:
        report.render_table(results, notes=notes)
    if args.html is not None:
        html_report.write_html(results, args.html, tenant_capacity=tenant_capacity, notes=notes)
        if not args.json:
            print(f"HTML report: {args.html}")
    return 0


def _summary(
    args: argparse.Namespace, parser: argparse.ArgumentParser, source: Callable[[], Iterable[Request]]
) -> TraceSummary | None:
    """The trace's summary, or ``None`` after printing why it cannot be replayed (a
    malformed line); options the trace rules out, or an empty trace, are usage errors."""
    try:
        summary = summarize(source)
    except ValueError as exc:  # a malformed trace names its file, line and field
        print(f"prefixcache replay: {exc}", file=sys.stderr)
        return None
    errors = trace_errors(args, summary, str(args.trace)) + retention_trace_errors(args, summary)
    if errors:
        parser.error("; ".join(errors))
    return summary


def _replay_configs(args: argparse.Namespace, cost: CostModel | None, summary: TraceSummary) -> list[ReplayConfig]:
    """Every combination the flags list, in the order the table shows them. With
    ``--codec`` each byte capacity becomes, per codec, the tokens its frames hold at the
    block size replayed (the trace's own for a pre-hashed trace)."""
    block_sizes = args.block_size or [16]
    if args.codec is None:
        combos = itertools.product(args.mode, args.isolation, block_sizes, args.policy, args.capacity_tokens)
        return [
            cfg
            for mode, isolation, block_size, policy, capacity in combos
            for cfg in retention_configs(args, _cache_config(args, policy, capacity, block_size, isolation, mode), mode)
        ]
    assert cost is not None and cost.model.kv is not None
    kv, configs = cost.model.kv, []
    for mode, isolation, block_size, policy in itertools.product(args.mode, args.isolation, block_sizes, args.policy):
        block = summary.native_block_size or block_size
        for c in codec_capacities(args.capacity_bytes, args.codec, kv, block):
            cache = _cache_config(args, policy, c.tokens, block_size, isolation, mode)
            for cfg in retention_configs(args, cache, mode):
                configs.append(replace(cfg, codec=c.codec, stored_bytes=c.capacity_bytes))
    return configs


def _codec_note(args: argparse.Namespace, cost: CostModel, summary: TraceSummary) -> str:
    assert cost.model.kv is not None
    blocks = [summary.native_block_size] if summary.native_block_size else (args.block_size or [16])
    rows = [c for block in blocks for c in codec_capacities(args.capacity_bytes, args.codec, cost.model.kv, block)]
    return codec_note(cost.model.name, cost.model.kv, rows)


def _cache_config(
    args: argparse.Namespace, policy: str, capacity: float, block_size: int, isolation: str, mode: str
) -> CacheConfig:
    """One combination's cache. NOTE: where a list mixes configurations an option applies
    to with others (``--ttl`` with ``--mode tree,flat``), the others do not carry it, so
    their rows and JSON say what ran; an option that applies to none is refused earlier
    (``inputs.static_errors``). Shared isolation already shares every prefix: --publish
    applies to the others."""
    tree = mode == "tree"
    publish = args.publish is not None and isolation != "shared" and tree
    min_tokens = 256 if args.publish_min_tokens is None else args.publish_min_tokens
    return CacheConfig(
        policy=policy,
        capacity_tokens=cache_capacity(capacity),
        block_size=block_size,
        isolation=isolation,
        partial_blocks=args.partial_blocks and tree,
        ttl_seconds=args.ttl if tree else None,
        publish=PublishConfig(args.publish, min_tokens) if publish else None,
    )


def _metrics_writer(directory: Path) -> Callable[[ReplayConfig, bytes], None]:
    directory.mkdir(parents=True, exist_ok=True)

    def write(cfg: ReplayConfig, text: bytes) -> None:
        name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", cfg.label).strip("_")
        (directory / f"{name}.prom").write_bytes(text)

    return write
