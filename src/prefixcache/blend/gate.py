"""The quality gate: a recompute plan is turned on for a model only if, over the fixed
evaluation set, its blended prefill stays close enough to a full prefill.

    eval set --prepare--> per item: segments (chunk KV cached alone), float32 full-prefill
                          reference (next-token log-probs, greedy continuation);
                          the noise floor: a bfloat16 full prefill of every item, scored
                          against that reference as a plan is (NoiseFloor)
    plan --evaluate-->    GateFigures (top-1 agreement, KL mean/max, greedy EM, work,
                          and the floor they are judged against)
    figures + thresholds --judge--> GateReport (a Check per bar, passed or not)
    plans --choose_plan--> the cheapest passing plan, or None (the mode stays off)

The bar is the model's own noise: a plan passes when its next-token KL from the float32
full prefill, mean and max over the set, is no larger than a bfloat16 full prefill's on
the same set, and its top-1 agreement is at least 0.98 (``judge``).

Figures depend on the model, the evaluation set, the continuation length and the plan,
never on thresholds, so ``GateStore`` keeps figures (JSON, each with its floor) and every
read is judged again against the thresholds of the day. The figures, the bars, ``judge``
and the store live in ``verdict.py``; this module measures.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixcache.blend.evalset import EvalSet, assemble
from prefixcache.blend.plan import Fresh, RecomputePlan, Reused, Segment
from prefixcache.blend.prefill import BlendResult, blend_prefill, greedy_continue, prefill_chunk

# NOTE: the verdict's names stay importable from here, where the gate's users found them
from prefixcache.blend.verdict import (
    FLOOR_DTYPE,
    Check,
    GateFigures,
    GateReport,
    GateStore,
    GateThresholds,
    ItemScore,
    NoiseFloor,
    cheapest_passing,
    figures_from_json,
    gate_key,
    judge,
    plan_name,
)
from prefixcache.engine.chat import chat_frame
from prefixcache.engine.kv import cut_cache, fill_cache
from prefixcache.engine.model import LoadedModel, dtype_of
from prefixcache.engine.runner import Sequence as FullPrefill

GREEDY_STEPS = 32

log = logging.getLogger("prefixcache.blend")


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
    floor: NoiseFloor  # a bfloat16 full prefill of the same items against the reference


def full_prefill(loaded: LoadedModel, tokens: Sequence[int]) -> tuple[torch.Tensor, FullPrefill]:
    """Next-token logits of a plain prefill, and the sequence holding its cache."""
    seq = FullPrefill(loaded)
    return seq.prefill(list(tokens))[0], seq


def prepare(loaded: LoadedModel, eval_set: EvalSet, steps: int = GREEDY_STEPS) -> Prepared:
    """Prefill every cached chunk alone once, assemble each item (a chat in the model's
    own template), compute its float32 full-prefill reference, and the noise floor: the
    same items prefilled in full in bfloat16, scored against that reference."""
    encode = _encoder(loaded)
    reference = in_dtype(loaded, "float32")
    low = in_dtype(loaded, FLOOR_DTYPE)
    used = sorted({name for item in eval_set.items for name in item.cached})
    lines = {name: [encode(line) for line in eval_set.chunks[name]] for name in used}
    kv = {name: prefill_chunk(loaded, [t for line in lines[name] for t in line]) for name in used}
    items = []
    floor: list[ItemScore] = []
    for item in eval_set.items:
        segments: list[Segment] = []
        for piece in assemble(item, lines, encode, lambda system: chat_frame(loaded.tokenizer, system)):
            if piece.chunk is None:
                segments.append(Fresh(piece.tokens))
            else:
                end = piece.start + len(piece.tokens)
                segments.append(Reused(piece.tokens, kv[piece.chunk][:, :, :, piece.start : end], piece.start))
        tokens = tuple(t for s in segments for t in s.tokens)
        logits, seq = full_prefill(reference, tokens)
        greedy = greedy_continue(reference, seq.cache, logits, steps)
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        ready = PreparedItem(item.id, item.kind, tokens, tuple(segments), log_probs, tuple(greedy))
        items.append(ready)
        floor.append(score_result(reference, ready, full_prefill_as_blend(reference, low, tokens), steps))
    noise = NoiseFloor.of(FLOOR_DTYPE, floor)
    log.info(
        "event=blend_gate_floor items=%d dtype=%s kl_mean=%.5f kl_max=%.5f top1=%.3f greedy_em=%.3f",
        noise.items,
        noise.dtype,
        noise.mean_kl,
        noise.max_kl,
        noise.top1,
        noise.greedy_em,
    )
    return Prepared(model_fingerprint(loaded), eval_set.digest, steps, loaded.kv.layers, tuple(items), noise)


def in_dtype(loaded: LoadedModel, dtype: str) -> LoadedModel:
    """``loaded`` with its weights in ``dtype``: itself when they already are, else a copy
    (the served model is never touched)."""
    if loaded.kv.dtype == dtype:
        return loaded
    model: Any = copy.deepcopy(loaded.model)
    model.to(dtype_of(dtype))
    return dataclasses.replace(loaded, model=model, kv=dataclasses.replace(loaded.kv, dtype=dtype))


def full_prefill_as_blend(reference: LoadedModel, low: LoadedModel, tokens: Sequence[int]) -> BlendResult:
    """A full prefill by ``low`` (no reuse), as a result ``score_result`` compares like a
    plan's: next-token logits in float32, its cache cast to ``reference``'s dtype.
    NOTE: decoding then runs in ``reference``, as it does after a blend: only the
    prefill differs from the reference's, so the floor is the prefill's noise alone."""
    logits, seq = full_prefill(low, tokens)
    n = len(tokens)
    cache = fill_cache(cut_cache(seq.cache, n), reference.model.config, reference.device, dtype_of(reference.kv.dtype))
    return BlendResult(logits.float(), cache, 0, 0, n, n * reference.kv.layers)


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
    return GateFigures.of(plan_name(plan), scores, prepared.layers, prepared.floor), scores


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
    "FLOOR_DTYPE",
    "GREEDY_STEPS",
    "Check",
    "GateFigures",
    "GateReport",
    "GateStore",
    "GateThresholds",
    "ItemScore",
    "NoiseFloor",
    "Prepared",
    "PreparedItem",
    "cheapest_passing",
    "choose_plan",
    "evaluate",
    "figures_from_json",
    "full_prefill_as_blend",
    "gate_key",
    "in_dtype",
    "judge",
    "model_fingerprint",
    "plan_name",
    "prepare",
    "run_gate",
    "score",
    "score_result",
]
