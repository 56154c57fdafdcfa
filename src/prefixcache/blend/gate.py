"""The quality gate: a recompute plan is turned on for a model only if, over the fixed
evaluation set, its blended prefill stays close enough to a full prefill.

    eval set --prepare--> per item: segments (chunk KV cached alone), full-prefill
                          reference (next-token log-probs, greedy continuation)
    plan --evaluate-->    GateFigures (top-1 agreement, KL mean/max, greedy EM, work)
    figures + thresholds --judge--> GateReport (a Check per threshold, passed or not)
    plans --choose_plan--> the cheapest passing plan, or None (the mode stays off)

Figures depend on the model, the evaluation set, the continuation length and the plan,
never on thresholds, so ``GateStore`` keeps figures (JSON) and every read is judged
again against the thresholds of the day.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from prefixcache.blend.evalset import EvalSet, assemble
from prefixcache.blend.plan import Epic, EpicBlend, Fresh, RecomputePlan, Reused, Segment
from prefixcache.blend.prefill import BlendResult, blend_prefill, greedy_continue, prefill_chunk
from prefixcache.engine.chat import chat_frame
from prefixcache.engine.model import LoadedModel
from prefixcache.engine.runner import Sequence as FullPrefill

GREEDY_STEPS = 32

# NOTE: the KL bound is read through Pinsker's inequality, TV <= sqrt(KL / 2), and
# Jensen (sqrt is concave, so the mean TV over items is <= sqrt(mean KL / 2)). At
# 0.02 nats the mean total variation is <= 0.1: under the best coupling a token sampled
# from the blended next-token distribution equals the full prefill's sample at least 90 %
# of the time, the same bar the greedy-32 exact match sets for greedy decoding. Numerical
# noise between two full prefills is orders of magnitude below it.
DEFAULT_MAX_MEAN_KL = 0.02


@dataclass(frozen=True, slots=True)
class GateThresholds:
    min_top1: float = 0.98  # share of items whose next token (argmax) agrees with full prefill
    min_greedy_em: float = 0.90  # share of items whose greedy continuation is identical
    max_mean_kl: float = DEFAULT_MAX_MEAN_KL  # nats, KL(full || blended) of the next token

    def __post_init__(self) -> None:
        for name in ("min_top1", "min_greedy_em"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} is a share in [0, 1], got {value}")
        if not self.max_mean_kl >= 0.0:
            raise ValueError(f"max_mean_kl must be >= 0 nats, got {self.max_mean_kl}")


@dataclass(frozen=True, slots=True)
class ItemScore:
    id: str
    kind: str
    top1: bool
    kl: float  # nats
    greedy_match: bool
    length: int
    reused: int
    recomputed: int
    fresh: int
    token_layers: int


@dataclass(frozen=True, slots=True)
class GateFigures:
    """What a plan did over the evaluation set (thresholds apart)."""

    plan: str
    items: int
    top1: float
    greedy_em: float
    mean_kl: float
    max_kl: float
    reused: int  # tokens, summed over items
    recomputed: int
    fresh: int
    work: float  # (token, layer) pairs run / those of full prefills: 1.0 is no saving

    @staticmethod
    def of(plan: str, scores: Sequence[ItemScore], layers: int) -> GateFigures:
        if not scores:
            raise ValueError("no items were scored")
        n = len(scores)
        work = sum(s.token_layers for s in scores) / (layers * sum(s.length for s in scores))
        return GateFigures(
            plan=plan,
            items=n,
            top1=sum(s.top1 for s in scores) / n,
            greedy_em=sum(s.greedy_match for s in scores) / n,
            mean_kl=sum(s.kl for s in scores) / n,
            max_kl=max(s.kl for s in scores),
            reused=sum(s.reused for s in scores),
            recomputed=sum(s.recomputed for s in scores),
            fresh=sum(s.fresh for s in scores),
            work=work,
        )


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    value: float
    op: str  # ">=" or "<="
    limit: float
    passed: bool


@dataclass(frozen=True, slots=True)
class GateReport:
    model: str
    figures: GateFigures
    checks: tuple[Check, ...]

    @property
    def plan(self) -> str:
        return self.figures.plan

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def summary(self) -> str:
        marks = ", ".join(
            f"{c.name} {c.value:.4g} {c.op} {c.limit:g}: {'ok' if c.passed else 'FAIL'}" for c in self.checks
        )
        return f"{self.plan}: {'pass' if self.passed else 'fail'} ({marks}; work {self.figures.work:.0%})"


def judge(model: str, figures: GateFigures, thresholds: GateThresholds) -> GateReport:
    """Compare figures with thresholds; a figure exactly at its limit passes."""
    checks = (
        Check("top1", figures.top1, ">=", thresholds.min_top1, figures.top1 >= thresholds.min_top1),
        Check(
            "greedy_em",
            figures.greedy_em,
            ">=",
            thresholds.min_greedy_em,
            figures.greedy_em >= thresholds.min_greedy_em,
        ),
        Check("mean_kl", figures.mean_kl, "<=", thresholds.max_mean_kl, figures.mean_kl <= thresholds.max_mean_kl),
    )
    return GateReport(model, figures, checks)


def plan_name(plan: RecomputePlan) -> str:
    """The plan as the gate store keys it: a distinct name for each kind and setting."""
    if isinstance(plan, Epic):
        return f"epic(k={plan.k})"
    if isinstance(plan, EpicBlend):
        return f"epicblend(k={plan.k},r={plan.r:g},layer={plan.check_layer})"
    return f"cacheblend(r={plan.r:g},layer={plan.check_layer})"


def model_fingerprint(loaded: LoadedModel) -> str:
    """The model's folder name plus a digest of its config and weight files (names and
    sizes): new weights under the same name are a new model for the gate."""
    folder = Path(loaded.source)
    digest = hashlib.sha256(loaded.kv.dtype.encode())
    if (folder / "config.json").is_file():
        digest.update((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return f"{folder.name}@{digest.hexdigest()[:16]}"


# -- running the set ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PreparedItem:
    """One prompt, ready to blend, with what a full prefill of it gives."""

    id: str
    kind: str
    tokens: tuple[int, ...]
    segments: tuple[Segment, ...]
    reference: torch.Tensor  # [vocab] float64 log-probs of the next token, full prefill
    greedy: tuple[int, ...]  # the full prefill's greedy continuation


@dataclass(frozen=True, slots=True)
class Prepared:
    model: str
    eval_digest: str
    steps: int
    layers: int
    items: tuple[PreparedItem, ...]


def full_prefill(loaded: LoadedModel, tokens: Sequence[int]) -> tuple[torch.Tensor, FullPrefill]:
    """Next-token logits of a plain prefill, and the sequence holding its cache."""
    seq = FullPrefill(loaded)
    return seq.prefill(list(tokens))[0], seq


def prepare(loaded: LoadedModel, eval_set: EvalSet, steps: int = GREEDY_STEPS) -> Prepared:
    """Prefill every cached chunk alone once, assemble each item (a chat in the model's
    own template), and compute its full-prefill reference."""
    encode = _encoder(loaded)
    used = sorted({name for item in eval_set.items for name in item.cached})
    lines = {name: [encode(line) for line in eval_set.chunks[name]] for name in used}
    kv = {name: prefill_chunk(loaded, [t for line in lines[name] for t in line]) for name in used}
    items = []
    for item in eval_set.items:
        segments: list[Segment] = []
        for piece in assemble(item, lines, encode, lambda system: chat_frame(loaded.tokenizer, system)):
            if piece.chunk is None:
                segments.append(Fresh(piece.tokens))
            else:
                end = piece.start + len(piece.tokens)
                segments.append(Reused(piece.tokens, kv[piece.chunk][:, :, :, piece.start : end], piece.start))
        tokens = tuple(t for s in segments for t in s.tokens)
        logits, seq = full_prefill(loaded, tokens)
        greedy = greedy_continue(loaded, seq.cache, logits, steps)
        reference = torch.log_softmax(logits.double(), dim=-1)
        items.append(PreparedItem(item.id, item.kind, tokens, tuple(segments), reference, tuple(greedy)))
    return Prepared(model_fingerprint(loaded), eval_set.digest, steps, loaded.kv.layers, tuple(items))


def score(loaded: LoadedModel, item: PreparedItem, plan: RecomputePlan, steps: int) -> ItemScore:
    return score_result(loaded, item, blend_prefill(loaded, item.segments, plan), steps)


def score_result(loaded: LoadedModel, item: PreparedItem, result: BlendResult, steps: int) -> ItemScore:
    """Compare a blended prefill of ``item`` with its full-prefill reference (decodes
    ``steps`` tokens from the blended cache, which grows)."""
    blended = torch.log_softmax(result.logits.double(), dim=-1)
    kl = float((item.reference.exp() * (item.reference - blended)).sum().clamp_min(0.0))
    greedy = greedy_continue(loaded, result.cache, result.logits, steps)
    return ItemScore(
        id=item.id,
        kind=item.kind,
        top1=int(result.logits.argmax()) == item.greedy[0],
        kl=kl,
        greedy_match=tuple(greedy) == item.greedy,
        length=result.length,
        reused=result.reused,
        recomputed=result.recomputed,
        fresh=result.fresh,
        token_layers=result.token_layers,
    )


def evaluate(loaded: LoadedModel, prepared: Prepared, plan: RecomputePlan) -> tuple[GateFigures, list[ItemScore]]:
    scores = [score(loaded, item, plan, prepared.steps) for item in prepared.items]
    return GateFigures.of(plan_name(plan), scores, prepared.layers), scores


def gate_key(model: str, eval_digest: str, steps: int, plan: RecomputePlan) -> str:
    """The store's key of a plan's figures: what they depend on, and nothing else (a
    server reads its gate with it without preparing the set). ``eos`` names the greedy
    answers' rule (they end at the end of turn): figures measured under another rule are
    never read as these."""
    return f"{model}|eval={eval_digest}|steps={steps},eos|{plan_name(plan)}"


class GateStore:
    """Gate figures in a small JSON file, keyed by (model fingerprint, evaluation set,
    continuation length, plan). Written whole to a temporary file and renamed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @staticmethod
    def key(prepared: Prepared, plan: RecomputePlan) -> str:
        return gate_key(prepared.model, prepared.eval_digest, prepared.steps, plan)

    def get(self, key: str) -> GateFigures | None:
        entry = self._read().get(key)
        return GateFigures(**entry) if entry is not None else None

    def put(self, key: str, figures: GateFigures) -> None:
        entries = self._read()
        entries[key] = asdict(figures)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def _read(self) -> dict[str, dict[str, Any]]:
        if not self.path.is_file():
            return {}
        entries = json.loads(self.path.read_text())
        if not isinstance(entries, dict):
            raise ValueError(f"{self.path} is not a gate store (a JSON object of figures by key)")
        return entries


def run_gate(
    loaded: LoadedModel,
    prepared: Prepared,
    plan: RecomputePlan,
    thresholds: GateThresholds | None = None,
    store: GateStore | None = None,
) -> GateReport:
    """The gate's verdict on one plan (figures from ``store`` when it has them)."""
    key = GateStore.key(prepared, plan)
    figures = store.get(key) if store is not None else None
    if figures is None:
        figures, _ = evaluate(loaded, prepared, plan)
        if store is not None:
            store.put(key, figures)
    return judge(prepared.model, figures, thresholds or GateThresholds())


def cheapest_passing(reports: Iterable[GateReport]) -> GateReport | None:
    """The passing report with the least work (ties: the first given)."""
    best: GateReport | None = None
    for report in reports:
        if report.passed and (best is None or report.figures.work < best.figures.work):
            best = report
    return best


def choose_plan(
    loaded: LoadedModel,
    prepared: Prepared,
    plans: Sequence[RecomputePlan],
    thresholds: GateThresholds | None = None,
    store: GateStore | None = None,
) -> tuple[RecomputePlan | None, tuple[GateReport, ...]]:
    """Gate every plan of the sweep; the cheapest passing one (least measured work), or
    None when none passes and the mode stays off for this model. All reports come back."""
    if not plans:
        raise ValueError("the sweep has no plans")
    reports = tuple(run_gate(loaded, prepared, plan, thresholds, store) for plan in plans)
    best = cheapest_passing(reports)
    chosen = None if best is None else plans[reports.index(best)]
    return chosen, reports


def _encoder(loaded: LoadedModel) -> Callable[[str], tuple[int, ...]]:
    def encode(text: str) -> tuple[int, ...]:
        return tuple(loaded.tokenizer.encode(text, add_special_tokens=False))

    return encode


__all__ = [
    "DEFAULT_MAX_MEAN_KL",
    "GREEDY_STEPS",
    "Check",
    "GateFigures",
    "GateReport",
    "GateStore",
    "GateThresholds",
    "ItemScore",
    "Prepared",
    "PreparedItem",
    "cheapest_passing",
    "choose_plan",
    "evaluate",
    "gate_key",
    "judge",
    "model_fingerprint",
    "plan_name",
    "prepare",
    "run_gate",
    "score",
    "score_result",
]
