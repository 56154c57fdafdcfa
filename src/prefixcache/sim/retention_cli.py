"""``prefixcache replay``'s retention flags: ``--retention`` and ``--retention-share``.

Lists, as the other flags: ``--retention off,auto:50,auto:90 --retention-share 0.25,1``
replays every combination (``off`` once: the share is a cap on retention), each next to
the same optimum. See ``sim/retention.py`` for the forms and the trace's field.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from prefixcache.config import CacheConfig, RetentionConfig
from prefixcache.sim.fleet_cli import wants_fleet
from prefixcache.sim.inputs import parse_list
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.retention import FORMS, RETENTION_OFF, RetentionMode, RetentionSpec, parse_retention
from prefixcache.sim.summary import TraceSummary

__all__ = ["add_retention_flags", "retention_configs", "retention_errors", "retention_trace_errors"]

_DEFAULT_SHARE = RetentionConfig().share


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError("a share of the cache from 0 to 1")
    return value


def add_retention_flags(p: Any) -> None:
    p.add_argument(
        "--retention",
        default=[RETENTION_OFF],
        type=lambda t: parse_list(t, parse_retention, "--retention"),
        help=f"tree mode: retain each prompt after its access, charged to its tenant; comma-separated: {FORMS}. "
        "off (default) ignores the trace's retention; trace uses each line's 'retention' (seconds); auto:P retains "
        "a session's prompt for the P-th percentile of its own inter-turn gaps so far (5 minutes before its first "
        "gap; Mooncake's conversations are derived from the prefix chain); auto:P:N the same from a session's N-th "
        "turn on, nothing before. Runs the Python engine (the compiled "
        "kernel does not model retention)",
    )
    p.add_argument(
        "--retention-share",
        default=None,
        type=lambda t: parse_list(t, _share, "--retention-share"),
        metavar="S",
        help=f"with --retention: the share of the cache retention may hold, split among the tenants that retain "
        f"(the cache's [retention] share; comma-separated; default {_DEFAULT_SHARE:g})",
    )


def _on(args: argparse.Namespace) -> list[RetentionSpec]:
    return [spec for spec in args.retention if spec.on]


def retention_errors(args: argparse.Namespace) -> list[str]:
    """What the other flags rule out."""
    on, errors = _on(args), []
    if args.retention_share is not None and not on:
        errors.append("--retention-share caps retention: add --retention trace or auto:P")
    if not on:
        return errors
    if set(args.mode) == {"flat"}:
        errors.append("--retention applies to tree mode only (flat mode has no clock, no tenants), and --mode is flat")
    if args.engine == "native":
        errors.append(
            "--engine native cannot replay --retention: the compiled kernel does not model retention; "
            "use --engine python or auto"
        )
    if wants_fleet(args):
        errors.append("--retention applies to a single-cache replay, not a fleet's (--backends)")
    return errors


def retention_trace_errors(args: argparse.Namespace, summary: TraceSummary) -> list[str]:
    """``--retention trace`` on a trace none of whose lines asks a retention."""
    if any(spec.mode is RetentionMode.TRACE for spec in args.retention) and summary.requests and not summary.retained:
        return [
            f"--retention trace: no line of {args.trace} carries a retention ('retention' seconds or "
            "'prompt_cache_retention'); use --retention auto:P"
        ]
    return []


def retention_configs(args: argparse.Namespace, cache: CacheConfig, mode: str) -> list[ReplayConfig]:
    """``cache`` in ``mode`` under each retention the flags list (with each share); ``off``
    once, with the cache's default caps (which nothing then uses)."""
    shares = args.retention_share or [_DEFAULT_SHARE]
    out: list[ReplayConfig] = []
    for spec in args.retention:
        variants = [RetentionConfig()] if not spec.on else [RetentionConfig(share=s) for s in shares]
        if spec.on and mode != "tree":
            continue
        for caps in variants:
            cfg = ReplayConfig(replace(cache, retention=caps), mode, retention=spec)
            if cfg not in out:
                out.append(cfg)
    return out
