"""``prefixcache gate-codec``: measure each KV codec against raw on a model, judge it
against the model's bfloat16 noise floor, and store the figures where a server's
``[server] codec_gate_file`` reads them.

    prefixcache gate-codec [--model NAME] [--codecs bf16,int8,int4]
        [--out .prefixcache/codec-gate.json] [--eval-set tests/data/blend/eval.json]
        [--threads 2] [--limit N]

Each codec is measured again on every run (no figures are read back: the store's key
names the model and the codec, not the set, so a run on another set must not pass for
this one) and stored, with a record of what it ran on, as soon as it is measured.
Exit status 0 when every codec asked for passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DEFAULT_OUT = ".prefixcache/codec-gate.json"
DEFAULT_CODECS = "bf16,int8,int4"


def add_gate_codec_parser(sub: Any) -> None:
    gate = sub.add_parser("gate-codec", help="measure KV codecs against raw on a model: the codec quality gate")
    gate.add_argument("--model", default=None, help="model name or folder (default: the server's, SmolLM2)")
    gate.add_argument("--codecs", default=DEFAULT_CODECS, help=f"comma-separated codecs (default {DEFAULT_CODECS})")
    gate.add_argument(
        "--out", default=DEFAULT_OUT, help=f"the gate file, [server] codec_gate_file (default {DEFAULT_OUT})"
    )
    gate.add_argument("--eval-set", default="tests/data/blend/eval.json", help="the gates' evaluation set")
    gate.add_argument("--models-dir", default=".prefixcache/models", help="where converted models live")
    gate.add_argument("--device", default="cpu")
    gate.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    gate.add_argument("--limit", type=int, default=None, help="the first N items only (a quick look; partial figures)")


def run_gate_codec(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # NOTE: torch, transformers and the codecs load here, not when `prefixcache` starts
    import torch

    from prefixcache.engine.model import ModelError, load_model
    from prefixcache.quality.codec_gate import codec_key
    from prefixcache.quality.codecs import BLOCK_TOKENS, CACHED_SHARE, evaluate_codec
    from prefixcache.quality.evalset import load_eval_set
    from prefixcache.quality.reference import prepare
    from prefixcache.quality.verdict import GateStore, GateThresholds, judge
    from prefixcache.storage import codec as frames

    known: tuple[str, ...] = tuple(frames.CODECS)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in known]
    if not codecs or unknown:
        parser.error(f"--codecs: unknown {unknown or 'none given'}; valid: {', '.join(known)}")
    if args.threads < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--threads and --limit must be >= 1")
    torch.set_num_threads(args.threads)
    extra = {"name": args.model} if args.model else {}
    try:
        loaded = load_model(models_dir=Path(args.models_dir), device=args.device, **extra)
    except ModelError as exc:  # a model the engine cannot serve: the gate cannot measure it either
        parser.error(str(exc))
    eval_set = load_eval_set(args.eval_set)
    if args.limit is not None:
        eval_set = eval_set.subset([item.id for item in eval_set.items[: args.limit]])
        if args.out == DEFAULT_OUT:
            print(f"note: --limit {args.limit} stores figures of a partial set where a server reads its gate")
    start = time.perf_counter()
    prepared = prepare(loaded, eval_set)
    f = prepared.floor
    lengths = [len(item.tokens) for item in prepared.items]
    print(
        f"model {prepared.model}; evaluation set {eval_set.digest}, {f.items} items of {min(lengths)}-{max(lengths)}"
        f" tokens, {CACHED_SHARE:.0%} cached in {BLOCK_TOKENS}-token blocks (prepared in"
        f" {time.perf_counter() - start:.0f} s)"
    )
    print(
        f"noise floor: full prefill in {f.dtype} against float32: KL mean {f.mean_kl:.5f} max {f.max_kl:.5f} nats,"
        f" top-1 {f.top1:.1%}, greedy-32 EM {f.greedy_em:.1%}",
        flush=True,
    )
    store, thresholds = GateStore(args.out), GateThresholds()
    passed = True
    for name in codecs:
        start = time.perf_counter()
        figures, runs = evaluate_codec(loaded, prepared, name)
        report = judge(prepared.model, figures, thresholds)
        error = sum(run.kv_rel_error for run in runs) / len(runs)
        record = {
            "verdict": "pass" if report.passed else "fail",
            "summary": report.summary(),
            "eval_set": str(args.eval_set),
            "eval_digest": eval_set.digest,
            "steps": prepared.steps,
            "cached_share": CACHED_SHARE,
            "block_tokens": BLOCK_TOKENS,
            "kv_rel_error": error,
            "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        store.put(codec_key(prepared.model, name), figures, record)
        passed = passed and report.passed
        print(
            f"{name:<6} {'PASS' if report.passed else 'fail'}  top-1 {figures.top1:6.1%}"
            f"  greedy-32 EM {figures.greedy_em:6.1%}  KL mean {figures.mean_kl:.5f} max {figures.max_kl:.5f}"
            f"  KV rel. error {error:.2e}  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        print(f"       {report.summary()}", flush=True)
    print(f"stored in {args.out}")
    return 0 if passed else 1
