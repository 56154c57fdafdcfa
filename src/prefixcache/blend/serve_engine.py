"""The engine with the blend mode: the exact prefix cache first, then cached chunks.

    request of an opted-in tenant
      ──> PrefixCache.match + load          exact prefix: cached_tokens, as for anyone
      ──> Blender.lookup(after the prefix)  chunks by hash, else by embedding + alignment
      ──> none found: prefill the rest as usual
          some found: blend_prefill([Reused prefix] + chunks + fresh, plan)
      ──> decode; the DoneEvent is a BlendedDone carrying the blend's account
      ──> store: into the prefix cache only the exact part (up to the first reused
          chunk: what follows was computed from approximate KV), then the lines that
          missed, each prefilled alone, into the chunk store

Every other tenant's requests, and every request while the model has not passed its
quality gate (``blender`` is None), take the plain engine's path; an opted-in tenant's
then end with ``Outcome.GATE_OFF``.

NOTE: the per-request state lives in ``_turn``, set and read by the worker thread only
(the engine serves one request at a time).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixcache.blend.prefill import blend_prefill, check_llama
from prefixcache.blend.serve import Blender, Lookup, account
from prefixcache.blend.serve_gate import GateStatus
from prefixcache.blend.serve_types import BlendConfig, BlendedDone, BlendUsage, Outcome
from prefixcache.cache import PrefixCache
from prefixcache.engine.kv import SequenceKV, to_torch
from prefixcache.engine.model import LoadedModel, dtype_of
from prefixcache.engine.requests import DoneEvent, Event, Handle, Request
from prefixcache.engine.runner import Sequence
from prefixcache.engine.worker import Engine
from prefixcache.hashing import CacheContext

__all__ = ["BlendEngine"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Turn:
    """What the blend did for the request being served."""

    gate_off: bool
    lookup: Lookup | None = None
    usage: BlendUsage | None = None
    exact: int | None = None  # blended: prompt tokens the prefix cache may store

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

    def tag(self, event: Event) -> Event:
        if not isinstance(event, DoneEvent):
            return event
        return BlendedDone(event.finish_reason, event.text, event.tokens, event.usage, self.account())


class BlendEngine(Engine):
    """An ``Engine`` whose opted-in tenants reuse cached chunks beyond the exact prefix;
    ``blender`` is None while the model has not passed its gate (``gate`` says why)."""

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
        if blender is not None:
            check_llama(loaded.model)
            if not gate.passed:
                raise ValueError(f"the blend mode cannot run past a gate that did not pass: {gate.reason}")
        super().__init__(loaded, model_id, cache=cache, **kwargs)
        self.blend = config
        self.blender = blender
        self.gate = gate
        self._turn: _Turn | None = None

    def _run(self, handle: Handle) -> None:
        if not self.blend.serves(handle.request.tenant):
            super()._run(handle)
            return
        turn = self._turn = _Turn(gate_off=self.blender is None)
        sink = handle.sink
        handle.sink = lambda event: sink(turn.tag(event))
        try:
            super()._run(handle)
        finally:
            handle.sink = sink
            self._turn = None

    def _prefill_after(
        self, seq: Sequence, request: Request, prefix_kv: np.ndarray[Any, Any] | None, tiers: dict[str, int]
    ) -> tuple[int, dict[str, int], torch.Tensor]:
        turn = self._turn
        if turn is None or self.blender is None:
            return super()._prefill_after(seq, request, prefix_kv, tiers)
        return self._blend(seq, request.tokens, self.context(request.tenant), turn, prefix_kv, tiers)

    def _blend(
        self,
        seq: Sequence,
        tokens: list[int],
        ctx: CacheContext,
        turn: _Turn,
        prefix_kv: np.ndarray[Any, Any] | None,
        tiers: dict[str, int],
    ) -> tuple[int, dict[str, int], torch.Tensor]:
        assert self.blender is not None
        prefix = 0 if prefix_kv is None else int(prefix_kv.shape[3])
        lookup = turn.lookup = self.blender.lookup(ctx, tokens, prefix)
        if not lookup.found:
            return prefix, tiers, seq.prefill(tokens, prefix_kv)[-1]
        kv = None if prefix_kv is None else to_torch(prefix_kv, dtype_of(self.loaded.kv.dtype))
        segments = self.blender.segments(tokens, prefix, kv, lookup.found)
        result = blend_prefill(self.loaded, segments, self.blend.plan)
        seq.cache, seq.length = result.cache, len(tokens)
        turn.usage = account(self.blend, result, prefix, lookup.found, lookup)
        turn.exact = lookup.found[0].start
        return prefix, tiers, result.logits

    def _store(self, request: Request, out: list[int], seq: Sequence) -> None:
        turn = self._turn
        if turn is None or turn.exact is None:
            super()._store(request, out, seq)
        elif self.cache is not None and turn.exact > 0:
            # NOTE: only the exact part: a later request must never be told that KV
            # computed from blended (approximate) KV is an exact cache hit
            try:
                kv = SequenceKV(seq.cache)
                self.cache.insert(request.tokens[: turn.exact], self.context(request.tenant), kv=kv)
            except Exception:  # the answer is already out; a failed store costs a future hit only
                log.exception("storing the exact part of a blended prompt failed")
        if turn is not None and turn.lookup is not None and turn.lookup.store and self.blender is not None:
            try:
                self.blender.remember(self.context(request.tenant), request.tokens, turn.lookup.store)
            except Exception:
                log.exception("storing the chunks of a prompt failed")
