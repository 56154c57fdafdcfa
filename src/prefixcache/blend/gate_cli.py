"""Running the blend gate on a model from the command line: the noise floor, then each
plan's figures and verdict, stored where a server's ``blend.gate_file`` reads them.

    .venv/bin/python -m prefixcache.blend.gate_cli [--store .prefixcache/blend-gate.json]
        [--eval-set tests/data/blend/eval.json] [--threads 2]
        [--plan 'cacheblend(r=15)' --plan 'epic(k=16)' ...]

A plan is named as the store names it (``plan_name``): ``epic(k=16)``,
``cacheblend(r=30)``, ``cacheblend(r=30,layer=2)``, ``epicblend(k=1,r=30)``. Each
plan's line is printed, and stored, as soon as it is measured; figures already in the
store are read back, not measured again.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from prefixcache.blend.gate import prepare, run_gate
from prefixcache.blend.plan import CacheBlend, Epic, EpicBlend, RecomputePlan
from prefixcache.engine.model import ModelError, load_model
from prefixcache.quality.evalset import load_eval_set
from prefixcache.quality.verdict import GateStore, GateThresholds, cheapest_passing

DEFAULT_PLANS = (
    "epic(k=0)",
    "epic(k=16)",
    "cacheblend(r=15)",
    "cacheblend(r=30)",
    "epicblend(k=1,r=30)",
    "cacheblend(r=50)",
    "cacheblend(r=75)",
    "cacheblend(r=90)",
)

_PLAN = re.compile(r"(epic|cacheblend|epicblend)\(([^)]*)\)")


def parse_plan(text: str) -> RecomputePlan:
    """A plan from its store name; a bad one is an error that shows the valid forms."""
    match = _PLAN.fullmatch(text.replace(" ", ""))
    forms = "epic(k=16), cacheblend(r=30[,layer=1]), epicblend(k=1,r=30[,layer=1])"
    if match is None:
        raise ValueError(f"plan {text!r}: expected one of {forms}")
    kind, body = match.groups()
    try:
        args = {key: float(value) for key, value in (pair.split("=") for pair in body.split(",") if pair)}
    except ValueError:
        raise ValueError(f"plan {text!r}: expected one of {forms}") from None
    wanted = {"epic": {"k"}, "cacheblend": {"r", "layer"}, "epicblend": {"k", "r", "layer"}}[kind]
    required = {"epic": {"k"}, "cacheblend": {"r"}, "epicblend": {"k", "r"}}[kind]
    if not required <= set(args) <= wanted:
        raise ValueError(f"plan {text!r}: expected one of {forms}")
    layer = int(args.get("layer", 1))
    if kind == "epic":
        return Epic(int(args["k"]))
    if kind == "cacheblend":
        return CacheBlend(args["r"], layer)
    return EpicBlend(int(args["k"]), args["r"], layer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--store", default=".prefixcache/blend-gate.json", help="the gate file (GateStore)")
    parser.add_argument("--eval-set", default="tests/data/blend/eval.json", help="the evaluation set")
    parser.add_argument("--models-dir", default=".prefixcache/models", help="where converted models live")
    parser.add_argument("--model", default=None, help="model name or folder (default: the server's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--plan", action="append", help=f"a plan to gate (repeatable; default: {DEFAULT_PLANS})")
    args = parser.parse_args(argv)
    plans = [parse_plan(text) for text in (args.plan or DEFAULT_PLANS)]
    torch.set_num_threads(args.threads)
    extra = {"name": args.model} if args.model else {}
    try:
        loaded = load_model(models_dir=Path(args.models_dir), device=args.device, **extra)
    except ModelError as exc:  # a model the engine cannot serve: the gate cannot measure it either
        parser.error(str(exc))
    eval_set = load_eval_set(args.eval_set)
    start = time.perf_counter()
    blend = prepare(loaded, eval_set)
    prepared, f = blend.prepared, blend.prepared.floor
    seconds = time.perf_counter() - start
    print(f"model {prepared.model}; evaluation set {eval_set.digest}, {f.items} items (prepared in {seconds:.0f} s)")
    print(
        f"noise floor: full prefill in {f.dtype} against float32: KL mean {f.mean_kl:.5f} max {f.max_kl:.5f} nats,"
        f" top-1 {f.top1:.1%}, greedy-32 EM {f.greedy_em:.1%}",
        flush=True,
    )
    store, thresholds = GateStore(args.store), GateThresholds()
    reports = []
    for plan in plans:
        start = time.perf_counter()
        report = run_gate(loaded, blend, plan, thresholds, store)
        reports.append(report)
        g = report.figures
        print(
            f"{report.plan:<34} {'PASS' if report.passed else 'fail'}  work {g.work:6.1%}  top-1 {g.top1:6.1%}"
            f"  greedy-32 EM {g.greedy_em:6.1%}  KL mean {g.mean_kl:.5f} max {g.max_kl:.5f}"
            f"  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    best = cheapest_passing(reports)
    print(f"cheapest passing plan: {best.plan if best else 'none (the blend mode stays off for this model)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
