"""Turning the blend mode on for a server's model: only past its quality gate.

    [blend] plan, thresholds, eval_set, gate_file
      ──> key (the weights' content fingerprint, eval set digest, steps, plan) ──> GateStore figures
            none: measured now if gate_on_start, else the mode stays off
      ──> judge(figures, thresholds) ──> passed: a Blender (chunks in the cache, fallback)
                                         failed: None (exact prefix caching only)

The verdict is taken once, when the server starts, and logged; the server exports it
as ``prefixcache_blend_gate_*`` and ``prefixcache_blend_enabled``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prefixcache.blend.ann import AnnConfig, ChunkIndex
from prefixcache.blend.chunks import Chunks
from prefixcache.blend.embed import Embedder
from prefixcache.blend.gate import evaluate, gate_key, plan_name, prepare
from prefixcache.blend.serve import Blender
from prefixcache.blend.serve_types import BlendConfig
from prefixcache.cache import PrefixCache
from prefixcache.engine.arch import serving
from prefixcache.engine.model import LoadedModel
from prefixcache.quality.evalset import EvalSetError, load_eval_set
from prefixcache.quality.reference import model_fingerprint
from prefixcache.quality.verdict import GateReport, GateStore, judge

__all__ = ["GateStatus", "blend_unserved", "open_blender", "read_gate"]

log = logging.getLogger("prefixcache.blend")


@dataclass(frozen=True, slots=True)
class GateStatus:
    """The gate's verdict on the configured plan for the served model."""

    model: str  # the served model id (the metrics' label)
    plan: str
    report: GateReport | None  # None: no figures were ever measured for this key
    reason: str

    @property
    def passed(self) -> bool:
        return self.report is not None and self.report.passed


def read_gate(config: BlendConfig, loaded: LoadedModel, model_id: str) -> GateStatus:
    """The stored figures of the configured plan, judged against today's thresholds."""
    plan = plan_name(config.plan)
    try:
        eval_set = load_eval_set(config.eval_set)
    except OSError as exc:
        raise ValueError(f"blend.eval_set: cannot read {config.eval_set} ({exc.strerror})") from None
    except EvalSetError as exc:
        raise ValueError(f"blend.eval_set: {exc}") from None
    key = gate_key(model_fingerprint(loaded), eval_set.digest, config.gate_steps, config.plan)
    store = GateStore(config.gate_file)
    try:
        figures = store.get(key)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"blend.gate_file: {config.gate_file} is not a gate store ({exc})") from None
    if figures is None and config.gate_on_start:
        log.info("event=blend_gate_run plan=%s items=%d (no stored figures: measuring)", plan, len(eval_set.items))
        figures, _ = evaluate(loaded, prepare(loaded, eval_set, config.gate_steps), config.plan)
        store.put(key, figures)
    if figures is None:
        reason = f"no gate figures for {key} in {config.gate_file} (set blend.gate_on_start = true to measure them)"
        return GateStatus(model_id, plan, None, reason)
    report = judge(model_id, figures, config.thresholds)
    return GateStatus(model_id, plan, report, report.summary())


def blend_unserved(model_config: object) -> str | None:
    """Why blend cannot serve this model whatever its gate says, or None.

    NOTE: blend's recompute (``prefill.py``) runs every layer as full attention over the
    reused chunks: a sliding-window layer would see past its window there."""
    if any(w is not None for w in serving(model_config).windows):
        return "the model has sliding-window layers, which blend's recompute does not model"
    return None


def open_blender(
    config: BlendConfig, loaded: LoadedModel, model_id: str, cache: PrefixCache | None
) -> tuple[Blender | None, GateStatus]:
    """The gate's verdict, and a ``Blender`` when it passed (None: exact caching only).
    Chunks are blocks of ``cache`` (``chunks``): no cache (``server.cache = false``) or
    one without tiers holds none, so the mode stays off, said so in the log."""
    status = read_gate(config, loaded, model_id)
    unserved = blend_unserved(loaded.model.config)
    if status.passed and unserved is not None:
        status = GateStatus(status.model, status.plan, None, f"{unserved}; gate: {status.reason}")
    if status.passed and (cache is None or not cache.config.tiers):
        reason = "no cache with tiers (server.cache, cache.tiers): chunks are blocks of the cache"
        status = GateStatus(status.model, status.plan, None, f"{reason}; gate: {status.reason}")
    if not status.passed:
        log.warning(
            "event=blend_off model=%s plan=%s opted_in=%d reason=%r: exact prefix caching only",
            model_id,
            status.plan,
            len(config.tenants),
            status.reason,
        )
        return None, status
    assert cache is not None
    chunks = Chunks(cache, max_chunk_tokens=config.max_chunk_tokens)
    embedder = index = None
    if config.fallback:
        embedder = Embedder.load(device=str(loaded.device))
        index = ChunkIndex(AnnConfig(dim=embedder.dim))
    log.info(
        "event=blend_on model=%s plan=%s tenants=%s gate=%r",
        model_id,
        status.plan,
        sorted(config.tenants),
        status.reason,
    )
    return Blender(config, loaded, chunks, embedder, index), status
