"""The blend quality gate: a recompute plan is turned on for a model only if, over the
fixed evaluation set, its blended prefill stays close enough to a full prefill.

    eval set --prepare--> the set prepared (``quality.reference.prepare``: references,
                          the bfloat16 noise floor) and each item's prompt as segments,
                          every cached chunk prefilled alone once (BlendSet)
    plan --evaluate-->    GateFigures (top-1 agreement, KL mean/max, greedy EM, work,
                          and the floor they are judged against)
    figures + thresholds --judge--> GateReport (a Check per bar, passed or not)
    plans --choose_plan--> the cheapest passing plan, or None (the mode stays off)

The bar is the model's own noise (``quality.verdict.judge``). Figures depend on the
model (its weights by content: ``quality.reference.model_fingerprint``), the evaluation
set, the continuation length and the plan, never on thresholds, so ``GateStore`` keeps
figures under ``gate_key`` and every read is judged again against the bars of the day.
The machinery the codec gate shares lives in ``quality/``; this module is the blend's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.blend.plan import Epic, EpicBlend, Fresh, RecomputePlan, Reused, Segment
from prefixcache.blend.prefill import blend_prefill, prefill_chunk
from prefixcache.engine.model import LoadedModel
from prefixcache.quality.evalset import EvalSet
from prefixcache.quality.reference import GREEDY_STEPS, Prepared, PreparedItem, score_result
from prefixcache.quality.reference import prepare as prepare_reference
from prefixcache.quality.verdict import (
    GateFigures,
    GateReport,
    GateStore,
    GateThresholds,
    ItemScore,
    cheapest_passing,
    judge,
)

__all__ = [
    "BlendItem",
    "BlendSet",
    "choose_plan",
    "evaluate",
    "gate_key",
    "plan_name",
    "prepare",
    "run_gate",
    "score",
    "set_key",
]


def plan_name(plan: RecomputePlan) -> str:
    """The plan as the gate store keys it: a distinct name for each kind and setting."""
    if isinstance(plan, Epic):
        return f"epic(k={plan.k})"
    if isinstance(plan, EpicBlend):
        return f"epicblend(k={plan.k},r={plan.r:g},layer={plan.check_layer})"
    return f"cacheblend(r={plan.r:g},layer={plan.check_layer})"


def gate_key(model: str, eval_digest: str, steps: int, plan: RecomputePlan) -> str:
    """The store's key of a plan's figures: what they depend on, and nothing else (a
    server reads its gate with it without preparing the set). ``model`` is the weights'
    ``model_fingerprint``; ``eos`` names the greedy answers' rule (they end at the end of
    turn): figures measured under another rule are never read as these."""
    return f"{model}|eval={eval_digest}|steps={steps},eos|{plan_name(plan)}"


def set_key(prepared: Prepared, plan: RecomputePlan) -> str:
    return gate_key(prepared.model, prepared.eval_digest, prepared.steps, plan)


@dataclass(frozen=True, slots=True)
class BlendItem:
    """A prepared item and its prompt as blend segments (its chunks' KV cached alone)."""

    item: PreparedItem
    segments: tuple[Segment, ...]


@dataclass(frozen=True, slots=True)
class BlendSet:
    """The evaluation set prepared for the blend gate."""

    prepared: Prepared
    items: tuple[BlendItem, ...]


def prepare(loaded: LoadedModel, eval_set: EvalSet, steps: int = GREEDY_STEPS) -> BlendSet:
    """The references and the floor (``quality.reference.prepare``), then every cached
    chunk prefilled alone once, and each item's pieces as segments over that KV."""
    prepared = prepare_reference(loaded, eval_set, steps)
    kv = {name: prefill_chunk(loaded, tokens) for name, tokens in prepared.chunks.items()}
    items = []
    for item in prepared.items:
        segments: list[Segment] = []
        for piece in item.pieces:
            if piece.chunk is None:
                segments.append(Fresh(piece.tokens))
            else:
                end = piece.start + len(piece.tokens)
                segments.append(Reused(piece.tokens, kv[piece.chunk][:, :, :, piece.start : end], piece.start))
        items.append(BlendItem(item, tuple(segments)))
    return BlendSet(prepared, tuple(items))


def score(loaded: LoadedModel, item: BlendItem, plan: RecomputePlan, steps: int) -> ItemScore:
    return score_result(loaded, item.item, blend_prefill(loaded, item.segments, plan), steps)


def evaluate(loaded: LoadedModel, blend: BlendSet, plan: RecomputePlan) -> tuple[GateFigures, list[ItemScore]]:
    p = blend.prepared
    scores = [score(loaded, item, plan, p.steps) for item in blend.items]
    return GateFigures.of(plan_name(plan), scores, p.layers, p.floor), scores


def run_gate(
    loaded: LoadedModel,
    blend: BlendSet,
    plan: RecomputePlan,
    thresholds: GateThresholds | None = None,
    store: GateStore | None = None,
) -> GateReport:
    """The gate's verdict on one plan (figures from ``store`` when it has them)."""
    key = set_key(blend.prepared, plan)
    figures = store.get(key) if store is not None else None
    if figures is None:
        figures, _ = evaluate(loaded, blend, plan)
        if store is not None:
            store.put(key, figures)
    return judge(blend.prepared.model, figures, thresholds or GateThresholds())


def choose_plan(
    loaded: LoadedModel,
    blend: BlendSet,
    plans: Sequence[RecomputePlan],
    thresholds: GateThresholds | None = None,
    store: GateStore | None = None,
) -> tuple[RecomputePlan | None, tuple[GateReport, ...]]:
    """Gate every plan of the sweep; the cheapest passing one (least measured work), or
    None when none passes and the mode stays off for this model. All reports come back."""
    if not plans:
        raise ValueError("the sweep has no plans")
    reports = tuple(run_gate(loaded, blend, plan, thresholds, store) for plan in plans)
    best = cheapest_passing(reports)
    chosen = None if best is None else plans[reports.index(best)]
    return chosen, reports
