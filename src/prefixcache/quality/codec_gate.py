"""The codec gate's verdicts, and the server's start check on its tiers' codecs.

    gate-codec ──> GateStore (codec_gate_file): figures + floor by (model fingerprint, codec),
                   the fingerprint of the weights by content (reference.model_fingerprint)
    serve: model loaded ──> every tier whose codec is not "raw"
        ──> codec_key(fingerprint, codec) ──> figures? ──> judge (today's thresholds)
              passed:            one INFO line, go on
              failed or absent:  refuse to start (what failed, by how much, the command)
                                 unless [server] allow_ungated_codecs: one WARNING line, go on

A lossy codec changes the KV every hit is served from, so it is allowed for a model
only once measured on it: ``raw`` is the bytes the model computed and needs no gate.
The figures are judged again on every read, as the blend gate's are, so a stricter
bar of the day applies to old figures too. An unreadable file (corrupt, another format)
is read as empty: every lossy codec is then ungated, never passed by accident.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prefixcache.quality.verdict import GateFigures, GateReport, GateStore, GateThresholds, judge

__all__ = [
    "GATE_COMMAND",
    "LOSSLESS",
    "CodecGateRefused",
    "CodecStart",
    "CodecVerdict",
    "check_codecs",
    "codec_key",
    "decide_codecs",
    "read_codec_figures",
]

LOSSLESS = "raw"  # the frame holds the model's own bytes: nothing to gate
GATE_COMMAND = "prefixcache gate-codec"

log = logging.getLogger("prefixcache.quality")

Status = Literal["passed", "failed", "absent"]


class CodecGateRefused(ValueError):
    """A tier's codec has not passed the gate for the served model, and no override."""


def codec_key(model: str, codec: str) -> str:
    """The store's key of a codec's figures for a model (``reference.model_fingerprint``:
    the weights by content, so a fine-tune of the same size is never its base).

    NOTE: unlike ``gate_key`` it names neither the evaluation set nor the continuation
    length: a server checks its tiers without the set at hand. Both are kept in the
    entry's record, and ``gate-codec`` prints them; measuring again overwrites."""
    return f"{model}|codec={codec}"


@dataclass(frozen=True, slots=True)
class CodecVerdict:
    """One lossy codec the tiers use, for one model: its stored verdict and why."""

    codec: str
    tiers: tuple[str, ...]  # the tiers storing frames in this codec
    status: Status
    report: GateReport | None  # None: no figures (absent)
    reason: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True, slots=True)
class CodecStart:
    """The start check's outcome: ``start`` says whether the server goes on."""

    model: str
    verdicts: tuple[CodecVerdict, ...]  # lossy codecs only, in the tiers' order
    allow_ungated: bool
    store: str
    note: str = ""  # why the store was read as empty, when it was
    name: str = "MODEL"  # the model as gate-codec --model takes it (the server's model.name)

    @property
    def ungated(self) -> tuple[CodecVerdict, ...]:
        return tuple(v for v in self.verdicts if not v.passed)

    @property
    def start(self) -> bool:
        return self.allow_ungated or not self.ungated

    def message(self) -> str:
        """What failed and by how much, and the command that measures it."""
        lines = [f"tier codecs not passed by the quality gate for model {self.model} ({self.store}):"]
        lines += [f"  {v.codec} (tiers {', '.join(v.tiers)}): {v.reason}" for v in self.ungated]
        if self.note:
            lines.append(f"  note: {self.note}")
        codecs = ",".join(v.codec for v in self.ungated)
        lines.append(
            f"measure: {GATE_COMMAND} --model {self.name} --codecs {codecs} --out {self.store}; use codec = 'raw' on"
            " those tiers; or set [server] allow_ungated_codecs = true to serve them anyway (logged)"
        )
        return "\n".join(lines)


def read_codec_figures(store: GateStore, model: str, codecs: Iterable[str]) -> tuple[dict[str, GateFigures], str]:
    """The stored figures of each codec for ``model``, and a note when the file could
    not be read (then none: an unreadable gate passes nothing)."""
    found: dict[str, GateFigures] = {}
    try:
        for codec in codecs:
            figures = store.get(codec_key(model, codec))
            if figures is not None:
                found[codec] = figures
    except (OSError, ValueError, TypeError, KeyError) as exc:
        note = f"{store.path} is not a readable gate store, read as empty ({type(exc).__name__}: {exc})"
        log.warning("event=codec_gate_store_unreadable path=%s error=%r: read as empty", store.path, str(exc))
        return {}, note
    return found, ""


def decide_codecs(
    model: str,
    tiers: Iterable[tuple[str, str]],
    figures: dict[str, GateFigures],
    *,
    thresholds: GateThresholds | None = None,
    allow_ungated: bool = False,
    store: str = "",
    note: str = "",
    name: str = "MODEL",
) -> CodecStart:
    """The verdict on every lossy codec among ``tiers`` ((label, codec) pairs), from
    ``figures`` (by codec, for ``model``): pure, the server's log and refusal aside."""
    used: dict[str, list[str]] = {}
    for label, codec in tiers:
        if codec != LOSSLESS:
            used.setdefault(codec, []).append(label)
    bar = thresholds or GateThresholds()
    verdicts = tuple(_verdict(model, codec, tuple(labels), figures.get(codec), bar) for codec, labels in used.items())
    return CodecStart(model, verdicts, allow_ungated, store, note, name)


def check_codecs(
    model: str,
    tiers: Iterable[tuple[str, str]],
    path: str | Path,
    *,
    allow_ungated: bool = False,
    thresholds: GateThresholds | None = None,
    name: str = "MODEL",
) -> CodecStart:
    """Read the gate file, decide, and log: one line per lossy codec; raise
    ``CodecGateRefused`` when one has not passed and the operator did not override."""
    tiers = list(tiers)
    store = GateStore(path)
    codecs = sorted({codec for _, codec in tiers if codec != LOSSLESS})
    figures, note = read_codec_figures(store, model, codecs) if codecs else ({}, "")
    outcome = decide_codecs(
        model, tiers, figures, thresholds=thresholds, allow_ungated=allow_ungated, store=str(path), note=note, name=name
    )
    for v in outcome.verdicts:
        if v.passed:
            log.info(
                "event=codec_gate_passed model=%s codec=%s tiers=%s: %s", model, v.codec, ",".join(v.tiers), v.reason
            )
        elif outcome.allow_ungated:
            log.warning(
                "event=codec_gate_overridden model=%s codec=%s tiers=%s status=%s: serving it anyway"
                " ([server] allow_ungated_codecs = true): %s",
                model,
                v.codec,
                ",".join(v.tiers),
                v.status,
                v.reason,
            )
    if not outcome.start:
        raise CodecGateRefused(outcome.message())
    return outcome


def _verdict(
    model: str, codec: str, tiers: tuple[str, ...], figures: GateFigures | None, bar: GateThresholds
) -> CodecVerdict:
    if figures is None:
        return CodecVerdict(codec, tiers, "absent", None, f"never measured for {model}")
    report = judge(model, figures, bar)
    if report.passed:
        return CodecVerdict(codec, tiers, "passed", report, report.summary())
    return CodecVerdict(codec, tiers, "failed", report, _by_how_much(report))


def _by_how_much(report: GateReport) -> str:
    """The failed checks, each with its value against its limit (a ratio where it reads)."""
    parts = []
    for c in report.checks:
        if c.passed:
            continue
        ratio = f", {c.value / c.limit:.2g}x the limit" if c.op == "<=" and c.limit > 0 else ""
        parts.append(f"{c.name} {c.value:.4g} (needs {c.op} {c.limit:.4g}{ratio})")
    return f"failed: {'; '.join(parts)} over {report.figures.items} items"
