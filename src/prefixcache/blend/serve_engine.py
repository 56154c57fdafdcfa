"""The engine with the blend mode: the exact prefix cache first, then cached chunks.

    request of an opted-in tenant
      ──> PrefixCache.match + load          exact prefix: cached_tokens, as for anyone
      ──> Blender.lookup(after the prefix)  chunks by hash, else by embedding + alignment
      ──> none found: prefill the rest as usual
          some found: blend_prefill([Reused prefix] + chunks + fresh, plan)
      ──> decode; the DoneEvent is a BlendedDone carrying the blend's account
      ──> store: into the prefix cache only the exact part (up to the first reused
          chunk: what follows was computed from approximate KV), then the lines that
          missed, each prefilled alone, into the cache as chunks

Every other tenant's requests, and every request while the model has not passed its
quality gate (``blender`` is None), take the plain engine's path; an opted-in tenant's
then end with ``Outcome.GATE_OFF``.

The blend mode is the engine's ``ServeMode`` (``engine/modes.py``): a ``_BlendTurn``
per opted-in request holds what the blend did, on the worker thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixcache.blend.prefill import blend_prefill, check_llama
from prefixcache.blend.serve import Blender, Lookup, account
from prefixcache.blend.serve_gate import GateStatus
from prefixcache.blend.serve_types import BlendConfig, BlendedDone, BlendUsage, Outcome
from prefixcache.cache import PrefixCache
from prefixcache.engine.kv import to_torch
from prefixcache.engine.model import LoadedModel, dtype_of
from prefixcache.engine.modes import EXACT, Turn
from prefixcache.engine.requests import DoneEvent, Request
from prefixcache.engine.runner import Prefill, Sequence
from prefixcache.engine.worker import Engine
from prefixcache.hashing import CacheContext

__all__ = ["BlendEngine", "BlendMode"]


@dataclass(eq=False)
class _BlendTurn:
    """One opted-in request: what the blend did for it (a ``Turn``)."""

    mode: BlendMode
    ctx: CacheContext
    gate_off: bool
    lookup: Lookup | None = None
    usage: BlendUsage | None = None
    exact: int | None = None  # blended: prompt tokens the prefix cache may store

    def prefill(self, seq: Sequence, tokens: list[int], prefix_kv: np.ndarray[Any, Any] | None) -> Prefill:
        # NOTE: a plain prefill runs in the engine's chunks; a blended one in one step
        blender, mode = self.mode.blender, self.mode
        if blender is None:
            return (yield from seq.prefill_steps(tokens, prefix_kv))[-1]
        prefix = 0 if prefix_kv is None else int(prefix_kv.shape[3])
        lookup = self.lookup = blender.lookup(self.ctx, tokens, prefix)
        if not lookup.found:
            return (yield from seq.prefill_steps(tokens, prefix_kv))[-1]
        kv = None if prefix_kv is None else to_torch(prefix_kv, dtype_of(mode.loaded.kv.dtype))
        segments = blender.segments(tokens, prefix, kv, lookup.found)
        result = blend_prefill(mode.loaded, segments, mode.config.plan)
        seq.cache, seq.length = result.cache, len(tokens)
        self.usage = account(mode.config, result, prefix, lookup.found, lookup)
        self.exact = lookup.found[0].start
        return result.logits

    def storable(self, length: int) -> int:
        # NOTE: blended, only the exact part: a later request must never be told that KV
        # computed from blended (approximate) KV is an exact cache hit
        return length if self.exact is None else min(self.exact, length)

    def stored(self, tokens: list[int]) -> None:
        blender = self.mode.blender
        if self.lookup is not None and self.lookup.store and blender is not None:
            blender.remember(self.ctx, tokens, self.lookup.store)

    def done(self, event: DoneEvent) -> DoneEvent:
        return BlendedDone(event.finish_reason, event.text, event.tokens, event.usage, self.account())

    def account(self) -> BlendUsage:
        if self.gate_off:
            return BlendUsage(Outcome.GATE_OFF)
        if self.usage is not None:
            return self.usage
        found = self.lookup
        if found is None:
            return BlendUsage(Outcome.NO_REUSE)
        return BlendUsage(
            Outcome.NO_REUSE, lookups_exact=found.exact, lookups_similar=found.similar, lookups_missed=found.missed
        )


@dataclass(frozen=True, eq=False)
class BlendMode:
    """The blend mode (a ``ServeMode``): opted-in tenants get a ``_BlendTurn``, every
    other tenant exact prefix caching. ``blender`` is None while the model has not
    passed its gate (``gate`` says why)."""

    loaded: LoadedModel
    config: BlendConfig
    blender: Blender | None
    gate: GateStatus

    def __post_init__(self) -> None:
        if self.blender is not None:
            check_llama(self.loaded.model)
            if not self.gate.passed:
                raise ValueError(f"the blend mode cannot run past a gate that did not pass: {self.gate.reason}")

    def open(self, request: Request, ctx: CacheContext) -> Turn:
        if not self.config.serves(request.tenant):
            return EXACT.open(request, ctx)
        return _BlendTurn(self, ctx, gate_off=self.blender is None)


class BlendEngine(Engine):
    """An ``Engine`` in the ``BlendMode``: its opted-in tenants reuse cached chunks
    beyond the exact prefix; ``blender`` is None while the model has not passed its
    gate (``gate`` says why)."""

    def __init__(
        self,
        loaded: LoadedModel,
        model_id: str,
        config: BlendConfig,
        blender: Blender | None,
        gate: GateStatus,
        cache: PrefixCache | None = None,
        **kwargs: Any,
    ) -> None:
        self.blend_mode = BlendMode(loaded, config, blender, gate)
        super().__init__(loaded, model_id, cache=cache, mode=self.blend_mode, **kwargs)

    @property
    def blend(self) -> BlendConfig:
        return self.blend_mode.config

    @property
    def blender(self) -> Blender | None:
        return self.blend_mode.blender

    @property
    def gate(self) -> GateStatus:
        return self.blend_mode.gate
