"""``prefixcache workload``: write seeded synthetic multi-tenant traffic (``workloads``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import write_jsonl


def add_workload_parser(sub: Any) -> None:
    p = sub.add_parser(
        "workload",
        help="write a deterministic synthetic multi-tenant trace (our JSONL)",
        description="Write seeded synthetic multi-tenant traffic -- chat sessions, RAG over a shared "
        "document pool, agents with long tool prompts, one-off scans -- in the project's JSONL trace format.",
    )
    p.add_argument("out", type=Path, help="output file (.jsonl, or .jsonl.gz)")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=3600.0, help="seconds the arrivals span")
    p.add_argument(
        "--emit",
        choices=("hash_ids", "tokens"),
        default="hash_ids",
        help="record prompts as block ids (compact) or token ids",
    )
    p.add_argument(
        "--max-turns",
        type=int,
        default=None,
        help="end a chat session after this many turns (default: sessions never end)",
    )
    p.add_argument("--block-size", type=int, default=16, help="block size of emitted hash_ids")


def run_workload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        spec = WorkloadSpec(
            requests=args.requests,
            tenants=args.tenants,
            seed=args.seed,
            duration_s=args.duration,
            emit=args.emit,
            block_size=args.block_size,
            max_turns=args.max_turns,
        )
    except ValueError as exc:
        parser.error(str(exc))
    n = write_jsonl(spec, args.out)
    print(f"wrote {n:,} requests to {args.out}")
    return 0
