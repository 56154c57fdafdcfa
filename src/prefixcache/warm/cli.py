"""``prefixcache warm PROMPTS``: store the KV of known prompts before traffic arrives.

Locally (``--config``: the settings ``serve`` reads) it opens the server's model, cache
and engine (``server.main.open_engine``) and prefills each prompt into the configured
tiers; with ``--vllm-url`` it sends each prompt to a server whose cache stores it
(``remote.py``). A rerun after an interruption skips what is already stored.

Exit status: 0 when every line was warmed or counted (``--skip-bad``); 1 on a bad line
without ``--skip-bad``, or a server that fails, after what was warmed is flushed; 130
when interrupted (Ctrl-C, SIGTERM), likewise flushed.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from prefixcache.engine.threads import serial_torch
from prefixcache.warm.inputs import BadLine, WarmInputError, WarmItem, count_lines, read_items
from prefixcache.warm.progress import Progress, Tally

__all__ = ["add_warm_parser", "run_warm"]

INTERRUPTED = 130


def add_warm_parser(sub: Any) -> None:
    warm = sub.add_parser("warm", help="prefill a file of prompts or chats into the cache's tiers before traffic")
    warm.add_argument("prompts", metavar="PROMPTS", help='JSONL: {"prompt": ...}, {"messages": [...]} or trace lines')
    warm.add_argument("--config", help="the TOML settings serve reads (default: $PREFIXCACHE_CONFIG, else defaults)")
    warm.add_argument("--model", help="as serve's --model; with --vllm-url: the served model (default: first listed)")
    warm.add_argument("--tenant", help="the tenant whose cache to warm (default in local mode: 'local')")
    warm.add_argument(
        "--public", action="store_true", help="store as declared public prefixes, reusable by every tenant"
    )
    warm.add_argument("--skip-bad", action="store_true", help="count bad lines and go on (default: stop at one)")
    warm.add_argument("--limit", type=int, help="warm at most this many lines, then stop (a rerun goes on)")
    warm.add_argument("--vllm-url", help="warm through this OpenAI-compatible URL (…/v1) instead of locally")
    warm.add_argument("--api-key", help="with --vllm-url: the API key (the gateway stamps its tenant)")


def run_warm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    if not Path(args.prompts).is_file():
        parser.error(f"{args.prompts}: no such file (warm reads a JSONL file of prompts or chats)")
    if args.vllm_url is not None:
        if args.tenant is not None or args.public or args.config is not None:
            parser.error(
                "with --vllm-url the tenant is the one the gateway stamps for --api-key, and the server's own "
                "settings apply: --tenant, --public and --config are for a local warm"
            )
        return _run(args, parser, _remote(args))
    serial_torch()  # NOTE: this thread loads the model; the engine's worker alone runs torch in parallel
    return _run(args, parser, _local(args, parser))


class _Target(Protocol):
    """A warm's destination: ``run`` over the items, then ``close`` (flushes what it stored)."""

    def run(self, items: Iterator[WarmItem | BadLine], tally: Tally, progress: Progress, skip_bad: bool) -> None: ...

    def close(self, tally: Tally) -> None: ...


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser, target: _Target) -> int:
    total = count_lines(args.prompts)
    progress = Progress(sys.stderr, min(total, args.limit) if total and args.limit else total)
    tally, code, started = Tally(), 0, time.monotonic()
    items: Iterator[WarmItem | BadLine] = read_items(args.prompts, skip_bad=args.skip_bad)
    if args.limit is not None:
        items = itertools.islice(items, args.limit)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        target.run(items, tally, progress, args.skip_bad)
    except KeyboardInterrupt:
        tally.interrupted, code = True, INTERRUPTED
    except (WarmInputError, RuntimeError) as exc:  # RuntimeError: WarmServerError, EngineError's kin
        progress.end()
        print(f"prefixcache warm: error: {exc}", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.end()
        target.close(tally)
    tally.seconds = time.monotonic() - started
    print("\n".join(tally.summary()), flush=True)
    return code


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # NOTE: SIGTERM ends the warm as Ctrl-C does: what was computed is flushed


class _Remote:
    def __init__(self, args: argparse.Namespace) -> None:
        from prefixcache.warm.remote import served_model

        self.url, self.key = args.vllm_url, args.api_key
        self.model = args.model or served_model(self.url, self.key)

    def run(self, items: Iterator[WarmItem | BadLine], tally: Tally, progress: Progress, skip_bad: bool) -> None:
        from prefixcache.warm.remote import warm_server

        warm_server(self.url, self.key, self.model, items, tally, progress.update, skip_bad=skip_bad)

    def close(self, tally: Tally) -> None:
        pass  # the server stores and flushes its own writes


def _remote(args: argparse.Namespace) -> _Target:
    from prefixcache.warm.remote import WarmServerError

    try:
        return _Remote(args)
    except WarmServerError as exc:
        print(f"prefixcache warm: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _local(args: argparse.Namespace, parser: argparse.ArgumentParser) -> _Target:
    from prefixcache.warm.setup import LocalWarm, WarmSetupError

    try:
        return LocalWarm.open(args.config, args.model, args.tenant, args.public)
    except WarmSetupError as exc:
        parser.error(str(exc))
