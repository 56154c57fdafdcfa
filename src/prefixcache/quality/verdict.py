"""A gate's verdict, apart from its measurement (``reference.py`` and each gate's own):
the figures a way of serving scores over the evaluation set, the noise floor they are
judged against, the bars (``GateThresholds``), ``judge``, and ``GateStore``, the JSON
file that keeps figures by key (the blend gate's ``blend.gate.gate_key``, the codec
gate's ``codec_gate.codec_key``; both begin with the model's content fingerprint).

The bar is the model's own noise: a way of serving passes when its next-token KL from
the float32 full prefill, mean and max over the set, is no larger than a bfloat16 full
prefill's on the same set, and its top-1 agreement is at least 0.98 (``judge``). Figures
never depend on thresholds, so every read is judged again against the thresholds of the day.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FLOOR_DTYPE",
    "Check",
    "GateFigures",
    "GateReport",
    "GateStore",
    "GateThresholds",
    "ItemScore",
    "NoiseFloor",
    "cheapest_passing",
    "figures_from_json",
    "judge",
]

FLOOR_DTYPE = "bfloat16"
RECORD = "record"  # an entry's note beside its figures (GateStore.put)

log = logging.getLogger("prefixcache.quality")


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


class GateStore:
    """Gate figures in a small JSON file, by key, each with the noise floor it is judged
    against. Written whole to a temporary file and renamed.

        {"version": 2, "figures": {"<key>": {"plan": ..., "top1": ..., ...,
                                             "floor": {"dtype": "bfloat16", ...}}}}

    NOTE: format 1 (a bare object of figures by key, before the floor) is read as an
    empty store, with a warning: its figures are never judged, so a server measures them
    again (``gate_on_start``) or keeps the mode off. Writing drops them.

    A key is any string: the blend gate's are ``blend.gate.gate_key``'s, the codec
    gate's ``codec_gate.codec_key``'s. An entry may carry a ``record`` beside its figures (what the
    figures were measured on, the verdict of the day they were): for the people reading
    the file; a read judges the figures again and never trusts it."""

    VERSION = 2

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def get(self, key: str) -> GateFigures | None:
        entry = self._read().get(key)
        return figures_from_json(entry) if entry is not None else None

    def record(self, key: str) -> dict[str, Any] | None:
        """The record stored beside the figures of ``key`` (None: none, or no entry)."""
        entry = self._read().get(key)
        record = entry.get(RECORD) if entry is not None else None
        return dict(record) if isinstance(record, dict) else None

    def put(self, key: str, figures: GateFigures, record: dict[str, Any] | None = None) -> None:
        if figures.floor is None:
            raise ValueError(
                f"figures of {figures.plan} have no noise floor: measure them against a prepared set's floor"
            )
        entries = self._read()
        entries[key] = asdict(figures) | ({RECORD: record} if record is not None else {})
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
                "event=gate_store_old path=%s entries=%d: format 1, figures without the %s noise floor;"
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
    """Figures as ``GateStore`` writes them (``asdict``), the floor included, the record left out."""
    fields = dict(entry)
    fields.pop(RECORD, None)  # for people: never part of what is judged
    floor = fields.pop("floor", None)
    return GateFigures(**fields, floor=NoiseFloor(**floor) if floor is not None else None)


def cheapest_passing(reports: Iterable[GateReport]) -> GateReport | None:
    """The passing report with the least work (ties: the first given)."""
    best: GateReport | None = None
    for report in reports:
        if report.passed and (best is None or report.figures.work < best.figures.work):
            best = report
    return best
