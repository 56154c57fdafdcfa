"""The ``prefixcache audit-timing`` command: options, keys from the environment, the
report (text or JSON) and the exit status.

Exit status: 0 no leak (the control shows the cache, cross-tenant shows nothing),
1 a leak (cross-tenant differs, in two independent runs), 2 inconclusive (the control
shows nothing: the audit had no power) or a usage error, 3 the audit could not run
(server unreachable, a key refused, an answer that is not an OpenAI stream).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NOTE: the audit needs httpx (the serve extra); other commands must start without it
    from prefixcache.ops.audit import AuditResult, Level

__all__ = ["ATTACKER_VAR", "VICTIM_VAR", "add_audit_parser", "report", "run_audit_timing", "to_json"]

VICTIM_VAR = "PREFIXCACHE_AUDIT_VICTIM_KEY"  # one key, or several separated by commas
ATTACKER_VAR = "PREFIXCACHE_AUDIT_ATTACKER_KEY"
CANNOT_RUN = 3

VERDICTS = {
    "no leak": "no leak: the control shows the cache, and another tenant's prompts do not change the attacker's TTFT",
    "leak": "LEAK: the attacker's TTFT shows which prompts another tenant sent (confirmed by an independent run)",
    "inconclusive": "inconclusive: the control shows no cache hit either, so the audit could not see one across "
    "tenants (no cache, too short prompts for this server's cache, or too few samples)",
}


def add_audit_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "audit-timing",
        help="audit a server for prompt-cache timing leaks between tenants (KS test on time to first token)",
        description="Gu et al. (ICML 2025): a victim sends a fresh prompt P; the attacker then sends P (hit) or a "
        "fresh Q (miss), at random; a two-sample KS test compares the two groups' time to first token, for "
        "the attacker as its own victim (the control) and across tenants. Exit status: 0 no leak, 1 leak, "
        f"2 inconclusive (or a usage error), {CANNOT_RUN} the audit could not run.",
    )
    p.add_argument("url", help="the server's base URL (http://HOST:PORT or .../v1)")
    p.add_argument(
        "--victim-key",
        action="append",
        help=f"a victim tenant's API key (default ${VICTIM_VAR}); repeat for several victims, each sending P",
    )
    p.add_argument("--attacker-key", help=f"the attacker tenant's API key (default ${ATTACKER_VAR})")
    p.add_argument("--model", help="model to ask (default: the first of /v1/models)")
    p.add_argument("--samples", type=int, default=250, help="TTFTs per group and level (default 250)")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=1100,
        help="prompt length in words, about as many tokens (default 1100: OpenAI caches from 1,024 tokens)",
    )
    p.add_argument("--alpha", type=float, default=0.01, help="significance level (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the trials' order (default 0)")
    p.add_argument("--warmup", type=int, default=4, help="trials run first and discarded (default 4)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    p.add_argument(
        "--no-confirm",
        action="store_true",
        help="call a leak on one run's p < alpha (default: a second independent run must agree)",
    )
    endpoint = p.add_mutually_exclusive_group()
    endpoint.add_argument("--chat", dest="endpoint", action="store_const", const="chat", help="/v1/chat/completions")
    endpoint.add_argument(
        "--completions", dest="endpoint", action="store_const", const="completions", help="/v1/completions"
    )
    p.set_defaults(endpoint="chat")
    p.add_argument("--json", action="store_true", help="print the result as JSON (with every TTFT)")


def run_audit_timing(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str] | None = None,
    run: Callable[..., AuditResult] | None = None,
) -> int:
    from prefixcache.ops.audit import AuditConfig, AuditError, audit

    run = run or audit
    environ = os.environ if environ is None else environ
    victims = args.victim_key or [k.strip() for k in environ.get(VICTIM_VAR, "").split(",") if k.strip()]
    attacker = args.attacker_key or environ.get(ATTACKER_VAR, "")
    if not victims or not attacker:
        parser.error(f"audit-timing needs --victim-key (or ${VICTIM_VAR}) and --attacker-key (or ${ATTACKER_VAR})")
    try:
        config = AuditConfig(
            url=args.url,
            attacker_key=attacker,
            victim_keys=tuple(victims),
            model=args.model,
            samples=args.samples,
            prompt_words=args.prompt_tokens,
            alpha=args.alpha,
            seed=args.seed,
            endpoint=args.endpoint,
            warmup=args.warmup,
            confirm=not args.no_confirm,
            timeout_s=args.timeout,
        )
    except ValueError as exc:
        parser.error(f"audit-timing: {exc}")
    try:
        result = run(config, progress=None if args.json or not sys.stderr.isatty() else _progress)
    except AuditError as exc:
        print(f"audit-timing: {exc}", file=sys.stderr)
        return CANNOT_RUN
    print(json.dumps(to_json(result), indent=2) if args.json else report(result), end="\n" if args.json else "")
    return result.exit_code


def _progress(done: int, total: int) -> None:
    print(f"\r  trial {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)


def report(result: AuditResult) -> str:
    from prefixcache.ops.audit import HIT, MISS

    row = "  {:<26} {:>9}  {:>22}  {:>13}  {:>5}  {:>8}  {}"
    lines = [
        f"prefixcache audit-timing: {result.url}, model {result.model}, {result.endpoint} endpoint",
        f"  prompts of {result.prompt_words} random words, {result.samples} TTFTs per group, alpha {result.alpha:g}, "
        f"seed {result.seed}",
        row.format("level", "hit/miss", "median TTFT hit/miss", "cached hit/miss", "D", "p-value", "").rstrip(),
    ]
    for level in (result.control, result.cross):
        for i, run in enumerate(level.runs):
            lines.append(
                row.format(
                    _name(level) + (", again" if i else ""),
                    f"{len(run.hit)}/{len(run.miss)}",
                    f"{run.median_ms(HIT):.1f}/{run.median_ms(MISS):.1f} ms",
                    f"{_tokens(run.median_cached(HIT))}/{_tokens(run.median_cached(MISS))}",
                    f"{run.test.statistic:.3f}",
                    f"{run.test.p_value:.3g}",
                    "differ" if run.test.p_value < result.alpha else "same",
                )
            )
    lines.append(f"verdict: {VERDICTS[result.verdict]}")
    if result.cached_reveals:
        lines.append(
            "note: across tenants the attacker's usage.prompt_tokens_details.cached_tokens is larger for the "
            "victim's prompts, by more than half a prompt: the answer itself says what another tenant sent"
        )
    return "\n".join(lines) + "\n"


def _name(level: Level) -> str:
    if level.name != "cross-tenant" or level.victims == 1:
        return level.name
    return f"{level.name} ({level.victims} victims)"


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def to_json(result: AuditResult) -> dict[str, Any]:
    """The result as JSON: every field, the verdict, whether cached_tokens reveals another
    tenant's prompts (the report's note), and per run the medians."""
    from prefixcache.ops.audit import HIT, MISS

    out = dataclasses.asdict(result)
    out["verdict"], out["exit_code"] = result.verdict, result.exit_code
    out["cached_reveals"] = result.cached_reveals
    for name, level in (("control", result.control), ("cross", result.cross)):
        out[name]["detected"] = level.detected
        for run, plain in zip(level.runs, out[name]["runs"], strict=True):
            plain["median_ttft_ms"] = {HIT: run.median_ms(HIT), MISS: run.median_ms(MISS)}
            plain["median_cached_tokens"] = {HIT: run.median_cached(HIT), MISS: run.median_cached(MISS)}
    return out
