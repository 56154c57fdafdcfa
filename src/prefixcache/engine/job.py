"""One request's work, from its slot to its stored KV, as the engine's threads see it.

    I/O worker:   lookup()            match + load what the cache holds          (STAGING)
    worker:       chunk()             [cancelled or past deadline? end]
                                      the chunk of the prompt to run this step;   (PREFILL)
                  prefilled(logits)   it ran (in one forward with the batch's
                                      step); the last samples the first token ──> (DECODE: the loop gives it a row)
    I/O worker:   store_prompt(kv)    insert the prompt's KV (others may wait for it)
    worker:       fed() / decoded()   the token it feeds the batch, then the
                                      logits the batch step gave it              (DECODE)
    worker:       ended               the end event (done, cancelled, 504) went  (DONE)
    I/O worker:   store(kv)           insert prompt + answer with their KV

A prefill call is bounded by one chunk and a decode by one token, so a request past
its deadline, or whose client left, stops within one step, and no request waits behind
more than a chunk of another's prefill. The cache's match, load and insert run on the
I/O workers (``cacheio.py``), never on the worker's step loop.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from prefixcache.cache import PrefixCache, Stamp
from prefixcache.cache.kv import KVSource
from prefixcache.cache.retention import RetainOutcome
from prefixcache.engine.memory import reservation
from prefixcache.engine.model import LoadedModel
from prefixcache.engine.modes import ServeMode, Turn
from prefixcache.engine.requests import (
    DoneEvent,
    EngineError,
    EngineStats,
    ErrorEvent,
    Handle,
    RequestTimeout,
    TokenEvent,
    Usage,
)
from prefixcache.engine.runner import Chunk, Prefill, Sequence, advance
from prefixcache.engine.sampling import TextStream, TokenCounts, sample
from prefixcache.hashing import CacheContext

__all__ = ["Job", "Phase", "Runtime", "Staged"]

log = logging.getLogger(__name__)

# retention outcomes, the least first: several spans report the least any got
_RETAIN_RANK = [RetainOutcome.REFUSED, RetainOutcome.FAILED, RetainOutcome.CAPPED, RetainOutcome.RETAINED]


class Phase(enum.Enum):
    """Where a job is: what its next step does."""

    WAITING = "waiting"  # queued for a slot
    STAGING = "staging"  # has a slot; an I/O worker matches and loads its prefix
    PREFILL = "prefill"  # a chunk of its prompt per step
    DECODE = "decode"  # a row of the batch, a token per step
    DONE = "done"  # its end event went out; its store may still run


@dataclass(frozen=True, eq=False)
class Runtime:
    """What the jobs of one engine share."""

    loaded: LoadedModel
    cache: PrefixCache | None
    mode: ServeMode
    context: Callable[[str], CacheContext]
    stats: EngineStats
    clock: Callable[[], float]
    rng: random.Random
    chunk_tokens: int  # prompt tokens per prefill step


@dataclass(frozen=True, eq=False)
class Staged:
    """What the cache held for a job's prompt, loaded into memory the job owns."""

    prefix: np.ndarray[Any, Any] | None = None  # [layers, 2, H, cached, D]
    cached: int = 0
    tiers: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class _Decoding:
    """A decoding job's sampling state."""

    stream: TextStream
    generator: torch.Generator
    history: TokenCounts
    token: int  # sampled, to be fed to the model at the next step


class Job:
    """One request from its slot to its stored KV (a ``scheduler.Work``)."""

    def __init__(self, runtime: Runtime, handle: Handle) -> None:
        self.handle = handle
        self.phase = Phase.WAITING
        self.row: int | None = None  # its row in the batch while decoding (the loop's)
        self.staged: Staged | None = None  # written by an I/O worker: the job is ready
        self._rt = runtime
        self._context = runtime.context(handle.request.tenant)
        self._turn: Turn | None = None
        self._seq: Sequence | None = None
        self._steps: Prefill | None = None
        self._pending: Chunk | None = None  # the chunk its prefill yielded, not yet run
        self._decoding: _Decoding | None = None
        self._out: list[int] = []
        self._started = 0.0  # when its work began (staging, or its first step)
        self._prefill_s = 0.0
        self._stored = False  # whether the end leaves KV worth storing
        self._since: Stamp | None = None  # taken before its match: a purge or bump after it voids its stores
        self._final: DoneEvent | ErrorEvent | None = None  # the end event, until sent
        # what its retention got: set by the I/O worker that stores the prompt (without a
        # cache there is nothing to retain in)
        asked = RetainOutcome.REQUESTED if runtime.cache is not None else RetainOutcome.REFUSED
        self._retained = asked if handle.request.retain else RetainOutcome.NONE

    @property
    def tenant(self) -> str:
        return self.handle.request.tenant

    @property
    def context(self) -> CacheContext:
        return self._context

    @property
    def prompt(self) -> list[int]:
        return self.handle.request.tokens

    @property
    def tokens(self) -> int:
        return len(self.handle.request.tokens)

    @property
    def kv_bytes(self) -> int:
        """The KV memory it reserves while in flight: its worst case (``memory.py``)."""
        request, loaded = self.handle.request, self._rt.loaded
        return reservation(loaded.kv, loaded.context_length, len(request.tokens) + request.params.max_tokens)

    @property
    def sequence(self) -> Sequence:
        assert self._seq is not None, "no sequence before the first prefill step"
        return self._seq

    @property
    def storable(self) -> bool:
        """Whether its end left KV that the store should keep."""
        return self._stored

    def expired(self) -> bool:
        """Whether the deadline passed (a waiting job then ends unstarted, with its 504)."""
        return self._rt.clock() > self.handle.deadline

    def ready(self) -> bool:
        """Whether a prefill step can run now (staged, not yet decoding or done)."""
        return self.staged is not None and self.phase in (Phase.STAGING, Phase.PREFILL)

    # ------------------------------------------------------------------ I/O workers

    def lookup(self) -> Staged:
        """Match and load the prompt's cached prefix into memory of its own (a failure is a miss)."""
        rt, tokens = self._rt, self.handle.request.tokens
        self._started = self._started or rt.clock()
        if rt.cache is None or self.handle.cancelled or self.expired():
            return Staged()
        if self._since is None:
            self._since = rt.cache.stamp()
        try:
            with rt.cache.match(tokens, self.context) as match:
                if match.cached_tokens > 0:
                    loaded = rt.cache.load(match)  # a fresh array: it outlives the match
                    # NOTE: the last prompt token is always prefilled, since its logits start decoding
                    usable = max(0, min(int(loaded.tokens), len(tokens) - 1))
                    if usable > 0:
                        tiers = _clip_tiers(dict(loaded.tier_tokens), usable)
                        return Staged(loaded.kv[:, :, :, :usable], usable, tiers)
        except Exception:  # a lookup that failed costs this request its hit, nothing more
            log.exception("matching or loading the prefix of request %d failed", self.handle.id)
        return Staged()

    def store_prompt(self, kv: KVSource, length: int) -> None:
        """Insert the prompt's KV as soon as it is computed (the answer's comes at the end),
        so that requests waiting for the same prefix hit on it."""
        turn, cache = self._turn, self._rt.cache
        if turn is None or cache is None:
            return
        length = turn.storable(min(length, len(self.handle.request.tokens)))
        if length > 0:
            try:
                cache.insert(self.handle.request.tokens[:length], self.context, kv=kv, since=self._since)
            except Exception:  # a store that failed costs a hit only
                log.exception("storing the prompt KV of request %d failed", self.handle.id)
        self._retain(cache)

    def _retain(self, cache: PrefixCache) -> None:
        """Retain the spans the client asked for, once the prompt is stored; the outcome is
        the least any span got (refused, then capped)."""
        request = self.handle.request
        if not request.retain:
            return
        got = []
        try:
            for span in request.retain:
                got.append(cache.retain(request.tokens[: span.tokens], self.context, span.seconds).outcome)
        except Exception:  # a retention that failed costs this prompt its retention only
            log.exception("retaining the prompt of request %d failed", self.handle.id)
            got.append(RetainOutcome.FAILED)
        self._retained = min(got, key=_RETAIN_RANK.index)

    def store(self, kv: KVSource | None, length: int) -> None:
        """Insert prompt + answer with their KV (``length`` positions of ``kv``), so the
        next turn hits on the whole history (as much of it as the turn calls exact), then
        let the turn store its own. The cache reads from ``kv`` only the new blocks."""
        turn, request, cache = self._turn, self.handle.request, self._rt.cache
        if turn is None:
            return
        length = turn.storable(length)
        if cache is not None and kv is not None and length > 0:
            tokens = (request.tokens + self._out)[:length]
            try:
                cache.insert(tokens, self.context, kv=kv, since=self._since)
            except Exception:  # the answer is already out; a failed store costs a future hit only
                log.exception("storing the KV of request %d failed", self.handle.id)
        if cache is not None and self._retained is RetainOutcome.REQUESTED:
            self._retain(cache)  # its prompt's store never ran (it ended in its prefill)
        try:
            turn.stored(request.tokens)
        except Exception:  # the same: the answer is out
            log.exception("the serving mode's store after request %d failed", self.handle.id)

    # ------------------------------------------------------------------ worker: prefill

    def prefill(self) -> None:
        """One prefill step run alone (``chunk``, its forward, ``prefilled``)."""
        chunk = self.chunk()
        if chunk is None:
            return
        try:
            logits = chunk.run()
        except Exception as exc:
            return self.fail(exc)
        self.prefilled(logits)

    def chunk(self) -> Chunk | None:
        """The chunk of the prompt to run at this step (the loop runs it, alone or in one
        forward with others, and hands its logits to ``prefilled``). None when there is
        none: the job left PREFILL (it decodes, or it ended: cancelled, past its deadline,
        failed), or its mode ran a step of its own (it stays PREFILL)."""
        try:
            if self._steps is None:
                if not self._open():
                    return None
                assert self._steps is not None
                return self._took(advance(self._steps))
            if self._interrupted():
                self.end("cancelled")
                return None
            if self._pending is not None:
                return self._pending
            return self._took(advance(self._steps))
        except Exception as exc:
            self.fail(exc)
            return None

    def prefilled(self, logits: torch.Tensor) -> None:
        """The chunk ``chunk`` gave ran: its logits. The prefill moves on to its next chunk,
        or, after the last, the first token is out and the job is DECODE (or DONE)."""
        assert self._steps is not None and self._pending is not None, "no chunk is running"
        self._pending = None
        try:
            self._took(advance(self._steps, logits))
        except Exception as exc:
            self.fail(exc)

    def _open(self) -> bool:
        """The first step: the mode's turn and the prefill's steps; False when the job ended."""
        rt, handle, request = self._rt, self.handle, self.handle.request
        self._started = self._started or rt.clock()
        turn = self._turn = rt.mode.open(request, self.context)
        if handle.cancelled:  # gone while queued: no work, but still an end the caller can wait for
            rt.stats.cancelled += 1
            rt.stats.cancelled_queued += 1
            usage = Usage(len(request.tokens), 0, 0, {}, self._queued(), 0.0)
            self._final = turn.done(DoneEvent("cancelled", "", (), usage))
            self._done(stored=False)
            return False
        if rt.clock() > handle.deadline:
            raise RequestTimeout("the request timed out while waiting in the queue")
        staged = self.staged or Staged()
        self._seq = Sequence(rt.loaded, rt.chunk_tokens)
        self._steps = turn.prefill(self._seq, request.tokens, staged.prefix)
        self.staged = Staged(None, staged.cached, staged.tiers)  # NOTE: the first step consumes the prefix
        self.phase = Phase.PREFILL
        return True

    def _took(self, step: Chunk | torch.Tensor | None) -> Chunk | None:
        """What the prefill's step gave: a chunk to run (kept until it ran), or its end."""
        if not isinstance(step, torch.Tensor):
            self._pending = step
            return step
        rt, params = self._rt, self.handle.request.params
        self._prefill_s = rt.clock() - self._started
        seed = params.seed if params.seed is not None else rt.rng.getrandbits(63)
        self._decoding = _Decoding(
            TextStream(rt.loaded.tokenizer, params.stop),
            torch.Generator().manual_seed(seed),
            TokenCounts(self.handle.request.tokens),  # what the penalties count
            0,
        )
        self.phase = Phase.DECODE
        self._next(step)
        return None

    # ------------------------------------------------------------------ worker: decode

    def fed(self) -> int | None:
        """The token to feed at the next batch step; None when the job ended instead
        (its client left or its deadline passed)."""
        try:
            if self._interrupted():
                self.end("cancelled")
                return None
        except RequestTimeout as exc:
            self.fail(exc)
            return None
        assert self._decoding is not None
        return self._decoding.token

    def decoded(self, logits: torch.Tensor) -> None:
        """The logits the batch step gave for the fed token: sample the next one."""
        try:
            self._next(logits)
        except Exception as exc:
            self.fail(exc)

    def _next(self, logits: torch.Tensor) -> None:
        decoding, params, out = self._decoding, self.handle.request.params, self._out
        assert decoding is not None
        token = sample(logits, params, decoding.generator, decoding.history)
        if token in self._rt.loaded.eos_ids:
            return self.end("stop")
        out.append(token)
        self.handle.sink(TokenEvent(token, decoding.stream.push(token)))
        if decoding.stream.stopped:
            return self.end("stop")
        if len(out) >= params.max_tokens:
            return self.end("length")
        decoding.token = token

    # ------------------------------------------------------------------ worker: the end

    def end(self, finish: str) -> None:
        """End: done, or cancelled mid-answer (the event goes out with ``send_end``)."""
        rt, request, turn = self._rt, self.handle.request, self._turn
        assert turn is not None
        stream = self._decoding.stream if self._decoding is not None else None
        tail = stream.flush() if stream is not None else ""
        if tail:
            self.handle.sink(TokenEvent(self._out[-1] if self._out else -1, tail))
        staged = self.staged or Staged()
        usage = Usage(
            len(request.tokens),
            len(self._out),
            staged.cached,
            staged.tiers,
            self._queued(),
            self._prefill_s,
            self._retained,
        )
        if finish == "cancelled":
            rt.stats.cancelled += 1
        else:
            rt.stats.completed += 1
        text = stream.text if stream is not None else ""
        self._final = turn.done(DoneEvent(finish, text, tuple(self._out), usage))
        self._done(stored=True)

    def fail(self, exc: Exception) -> None:
        """End with an error event; a timeout keeps what was computed (a retry hits on it)."""
        stats = self._rt.stats
        if isinstance(exc, RequestTimeout):
            stats.timed_out += 1
            self._final = ErrorEvent(exc)
            return self._done(stored=True)
        if not isinstance(exc, EngineError):  # a bug must not kill the worker: fail this request only
            log.error("request %d failed", self.handle.id, exc_info=exc)
            error = EngineError(f"internal error: {type(exc).__name__}")
            error.status, error.type = 500, "server_error"
            exc = error
        stats.failed += 1
        self._final = ErrorEvent(exc)
        self._done(stored=False)

    def send_end(self) -> None:
        """Send the end event (the loop does, once the store is queued)."""
        final, self._final = self._final, None
        if final is not None:
            self.handle.sink(final)

    def _done(self, stored: bool) -> None:
        self.phase = Phase.DONE
        self._stored = stored and self._seq is not None
        if self._steps is not None:
            self._steps.close()

    def _queued(self) -> float:
        return (self._started or self._rt.clock()) - (self.handle.deadline - self.handle.timeout_s)

    def _interrupted(self) -> bool:
        """Whether the caller left; past the deadline, raises ``RequestTimeout``."""
        if self.handle.cancelled:
            return True
        if self._rt.clock() > self.handle.deadline:
            seq, prompt = self._seq, len(self.handle.request.tokens)
            if seq is not None and self.phase is Phase.PREFILL:
                raise RequestTimeout(f"the request timed out while prefilling its prompt ({seq.length} of {prompt})")
            raise RequestTimeout(f"the request timed out after {len(self._out)} tokens")
        return False


def _clip_tiers(tiers: dict[str, int], total: int) -> dict[str, int]:
    """Per-tier token counts cut to ``total``, taking from the slowest (last) tiers first."""
    excess = sum(tiers.values()) - total
    for name in reversed(list(tiers)):
        take = min(excess, tiers[name])
        tiers[name] -= take
        excess -= take
    return tiers
