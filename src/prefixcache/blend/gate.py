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
read is judged again against the thresholds of the day.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
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
from prefixcache.engine.kv import cut_cache, fill_cache
from prefixcache.engine.model import LoadedModel, dtype_of
from prefixcache.engine.runner import Sequence as FullPrefill

GREEDY_STEPS = 32
FLOOR_DTYPE = "bfloat16"

log = logging.getLogger("prefixcache.blend")


@dataclass(frozen=True, slots=True)
class GateThresholds:
    """The gate's bars. By default a plan passes on two: top-1 agreement, and a KL no
    larger than the model's own bfloat16 noise (``floor_factor`` times the floor's).

    NOTE: the divergence is the next token's KL(float32 full || plan), and both its mean
    and its max over the set are held to the floor's. The mean is the typical item (by
    Pinsker and Jensen, the mean total variation is <= sqrt(mean KL / 2)); the max is
    the worst one: a plan that is exact on most items but breaks one passes a test of
    the mean alone, never one of the max. KL and not greedy exact match, because a
    32-token greedy answer flips wherever two tokens are near-tied at any step: bfloat16
    itself changes some (on SmolLM2, 6 of the evaluation set's 27), so an exact-match
    bar sits at or below the noise it is meant to stay above. Greedy EM stays measured
    and an operator may still set a bar on it (``min_greedy_em``), or a ceiling on the
    mean KL in nats (``max_mean_kl``); by default neither binds."""

    min_top1: float = 0.98  # share of items whose next token (argmax) agrees with full prefill
    min_greedy_em: float = 0.0  # share of items whose greedy continuation is identical
    max_mean_kl: float = math.inf  # nats, an absolute ceiling on the mean KL(full || blended)
    floor_factor: float = 1.0  # KL mean and max at most this times the bfloat16 floor's; inf: unchecked

    def __post_init__(self) -> None:
        for name in ("min_top1", "min_greedy_em"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} is a share in [0, 1], got {value}")
        if not self.max_mean_kl >= 0.0:
            raise ValueError(f"max_mean_kl must be >= 0 nats, got {self.max_mean_kl}")
        if not self.floor_factor >= 0.0:
            raise ValueError(f"floor_factor must be >= 0, got {self.floor_factor}")


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
class NoiseFloor:
    """How far a full prefill in ``dtype`` (no reuse; decoded in float32 from its cache)
    lands from the float32 full prefill, on the same items and by the same measures as
    a plan: the divergence that serving in that precision is taken to cost."""

    dtype: str
    items: int
    top1: float
    greedy_em: float
    mean_kl: float  # nats, KL(float32 full || full in dtype) of the next token
    max_kl: float

    @staticmethod
    def of(dtype: str, scores: Sequence[ItemScore]) -> NoiseFloor:
        if not scores:
            raise ValueError("no items were scored")
        n = len(scores)
        return NoiseFloor(
            dtype=dtype,
            items=n,
            top1=sum(s.top1 for s in scores) / n,
            greedy_em=sum(s.greedy_match for s in scores) / n,
            mean_kl=sum(s.kl for s in scores) / n,
            max_kl=max(s.kl for s in scores),
        )


@dataclass(frozen=True, slots=True)
class GateFigures:
    """What a plan did over the evaluation set (thresholds apart), and the noise floor
    measured on the same set (None: figures from before the floor, which never pass)."""

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
    floor: NoiseFloor | None = None

    @staticmethod
    def of(plan: str, scores: Sequence[ItemScore], layers: int, floor: NoiseFloor | None = None) -> GateFigures:
        q = NoiseFloor.of(plan, scores)  # the same measures over the same items
        work = sum(s.token_layers for s in scores) / (layers * sum(s.length for s in scores))
        return GateFigures(
            plan=plan,
            items=q.items,
            top1=q.top1,
            greedy_em=q.greedy_em,
            mean_kl=q.mean_kl,
            max_kl=q.max_kl,
            reused=sum(s.reused for s in scores),
            recomputed=sum(s.recomputed for s in scores),
            fresh=sum(s.fresh for s in scores),
            work=work,
            floor=floor,
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
            f"{c.name} {c.value:.4g} {c.op} {c.limit:.4g}: {'ok' if c.passed else 'FAIL'}" for c in self.checks
        )
        floor = self.figures.floor
        bar = (
            f"{floor.dtype} floor KL mean {floor.mean_kl:.4g}, max {floor.max_kl:.4g}"
            if floor is not None
            else "no noise floor: figures from before it, measure them again"
        )
        verdict = "pass" if self.passed else "fail"
        return f"{self.plan}: {verdict} ({marks}; work {self.figures.work:.0%}; {bar})"


def judge(model: str, figures: GateFigures, thresholds: GateThresholds) -> GateReport:
    """Compare figures with thresholds; a figure exactly at its limit passes. Figures
    without a noise floor fail their KL checks (limit NaN): never judged on a missing bar."""
    t = thresholds
    f = figures
    checks = [
        Check("top1", f.top1, ">=", t.min_top1, f.top1 >= t.min_top1),
        Check("mean_kl/floor", f.mean_kl, "<=", *_floor_limit(f, "mean_kl", t.floor_factor)),
        Check("max_kl/floor", f.max_kl, "<=", *_floor_limit(f, "max_kl", t.floor_factor)),
    ]
    if t.min_greedy_em > 0.0:
        checks.append(Check("greedy_em", f.greedy_em, ">=", t.min_greedy_em, f.greedy_em >= t.min_greedy_em))
    if t.max_mean_kl < math.inf:
        checks.append(Check("mean_kl", f.mean_kl, "<=", t.max_mean_kl, f.mean_kl <= t.max_mean_kl))
    return GateReport(model, figures, tuple(checks))


def _floor_limit(figures: GateFigures, measure: str, factor: float) -> tuple[float, bool]:
    """The limit of one KL figure under the floor, and whether the figure is within it."""
    value: float = getattr(figures, measure)
    if factor == math.inf:
        return math.inf, True
    if figures.floor is None:
        return math.nan, False
    limit = factor * float(getattr(figures.floor, measure))
    return limit, value <= limit


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


def gate_key(model: str, eval_digest: str, steps: int, plan: RecomputePlan) -> str:
    """The store's key of a plan's figures: what they depend on, and nothing else (a
    server reads its gate with it without preparing the set). ``eos`` names the greedy
    answers' rule (they end at the end of turn): figures measured under another rule are
    never read as these."""
    return f"{model}|eval={eval_digest}|steps={steps},eos|{plan_name(plan)}"


class GateStore:
    """Gate figures in a small JSON file, keyed by (model fingerprint, evaluation set,
    continuation length, plan), each with the noise floor it is judged against. Written
    whole to a temporary file and renamed.

        {"version": 2, "figures": {"<key>": {"plan": ..., "top1": ..., ...,
                                             "floor": {"dtype": "bfloat16", ...}}}}

    NOTE: format 1 (a bare object of figures by key, before the floor) is read as an
    empty store, with a warning: its figures are never judged, so a server measures them
    again (``gate_on_start``) or keeps the mode off. Writing drops them."""

    VERSION = 2

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @staticmethod
    def key(prepared: Prepared, plan: RecomputePlan) -> str:
        return gate_key(prepared.model, prepared.eval_digest, prepared.steps, plan)

    def get(self, key: str) -> GateFigures | None:
        entry = self._read().get(key)
        return figures_from_json(entry) if entry is not None else None

    def put(self, key: str, figures: GateFigures) -> None:
        if figures.floor is None:
            raise ValueError(f"figures of {figures.plan} have no noise floor: measure them with prepare and evaluate")
        entries = self._read()
        entries[key] = asdict(figures)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        doc = {"version": self.VERSION, "figures": entries}
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def _read(self) -> dict[str, dict[str, Any]]:
        if not self.path.is_file():
            return {}
        doc = json.loads(self.path.read_text())
        if not isinstance(doc, dict):
            raise ValueError(f"{self.path} is not a gate store (a JSON object with version and figures)")
        if "version" not in doc:
            log.warning(
                "event=blend_gate_store_old path=%s entries=%d: format 1, figures without the %s noise floor;"
                " ignored (never judged), measure them again",
                self.path,
                len(doc),
                FLOOR_DTYPE,
            )
            return {}
        if doc["version"] != self.VERSION or not isinstance(doc.get("figures"), dict):
            raise ValueError(f"{self.path}: gate store version {doc['version']!r}, this reads {self.VERSION}")
        entries: dict[str, dict[str, Any]] = doc["figures"]
        return entries


def figures_from_json(entry: dict[str, Any]) -> GateFigures:
    """Figures as ``GateStore`` writes them (``asdict``), the floor included."""
    fields = dict(entry)
    floor = fields.pop("floor", None)
    return GateFigures(**fields, floor=NoiseFloor(**floor) if floor is not None else None)


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
