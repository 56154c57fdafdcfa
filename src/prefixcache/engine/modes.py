"""How the engine serves one request past its exact cached prefix: a ``ServeMode``.

The engine owns the queues, the prefix cache's match and load, decoding and the store;
a mode decides, per request, only what differs between ways of serving:

    Job (job.py) ──> mode.open(request, ctx) ──> Turn
                    turn.prefill(seq, tokens, prefix_kv)   the prompt past the exact prefix, in steps
                    turn.storable(length)                  how much of it the prefix cache may keep
                    turn.stored(tokens)                    after the store: the mode's own stores
                    turn.done(event)                       the end event, with the mode's account

``EXACT`` is plain prefix caching (the engine's default); the blend mode
(``blend/serve_engine.py``) reuses cached chunks beyond the prefix. A turn lives on the
worker thread for one request, so it keeps that request's state without a lock.

A turn's prefill is a generator (``runner.Prefill``): the engine runs it a step at a
time, checking the request's deadline between steps and serving other requests in
between; ``Sequence.prefill_steps`` makes each step one chunk.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from prefixcache.engine.requests import DoneEvent, Request
from prefixcache.engine.runner import Prefill, Sequence
from prefixcache.hashing import CacheContext

__all__ = ["EXACT", "ExactMode", "ExactTurn", "ServeMode", "Turn"]


class Turn(Protocol):
    """One request's path through a mode."""

    def prefill(self, seq: Sequence, tokens: list[int], prefix_kv: np.ndarray[Any, Any] | None) -> Prefill:
        """Fill ``seq`` with the KV of the prompt ``tokens``, whose first
        ``prefix_kv.shape[3]`` positions the prefix cache loaded (None: none), in steps of
        bounded work; its value is the last position's logits.

        NOTE: ``prefix_kv`` must be consumed (copied) before the first step ends: it sits
        in a load buffer the engine reuses for the next request, and in tier memory that
        is pinned only while that step runs."""
        ...

    def storable(self, length: int) -> int:
        """Of the ``length`` tokens (prompt, then answer) whose KV ``seq`` holds, how many
        from the start the prefix cache may store as exact KV."""
        ...

    def stored(self, tokens: list[int]) -> None:
        """Called after the prefix cache's store (or after none) with the prompt tokens."""
        ...

    def done(self, event: DoneEvent) -> DoneEvent:
        """The request's end event as the caller gets it."""
        ...


class ServeMode(Protocol):
    """Opens a ``Turn`` for each request the engine serves."""

    def open(self, request: Request, ctx: CacheContext) -> Turn: ...


class ExactTurn:
    """Exact prefix caching: prefill what the cache did not hold, store it all."""

    def prefill(self, seq: Sequence, tokens: list[int], prefix_kv: np.ndarray[Any, Any] | None) -> Prefill:
        logits = yield from seq.prefill_steps(tokens, prefix_kv)
        return logits[-1]

    def storable(self, length: int) -> int:
        return length

    def stored(self, tokens: list[int]) -> None:
        return None

    def done(self, event: DoneEvent) -> DoneEvent:
        return event


class ExactMode:
    """The engine's default mode: every request an ``ExactTurn``."""

    _turn = ExactTurn()  # NOTE: stateless, so one serves every request

    def open(self, request: Request, ctx: CacheContext) -> Turn:
        return self._turn


EXACT = ExactMode()
