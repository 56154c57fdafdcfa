"""One request's work as steps the worker runs one at a time, between other requests'.

    step 1:  [cancelled or past deadline? end]  match ─ load ─ first prefill chunk     (PREFILL)
    step k:  [cancelled or past deadline? end]  next prefill chunk                     (PREFILL)
    last:    last chunk ─ first token out                                              (DECODE next)
    then:    [check] up to ``decode_burst`` decode steps, checking before each          (DECODE)
    end:     end event (done, cancelled or 504) ─ insert prompt + answer with their KV  (DONE)

A step's work is bounded by one prefill chunk or one burst of decoding, so a request
past its deadline, or whose client left, stops within one step, and another request
never waits behind more than one step of this one. Everything here runs on the
engine's worker thread.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixcache.cache import PrefixCache
from prefixcache.engine.kv import SequenceKV
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
from prefixcache.engine.runner import Prefill, Sequence
from prefixcache.engine.sampling import TextStream, TokenCounts, sample
from prefixcache.hashing import CacheContext

__all__ = ["Job", "LoadBuffer", "Phase", "Runtime"]

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Where a job is: what its next step does."""

    WAITING = "waiting"  # not started
    PREFILL = "prefill"  # a chunk of its prompt
    DECODE = "decode"  # a burst of tokens
    DONE = "done"


class LoadBuffer:
    """A reusable destination for the cache's loads, on the worker thread.

    NOTE: a fresh array of tens of MB is a fresh mmap whose every page faults on the
    first write; one buffer kept by the worker pays that once. A load sits in it only
    until the first step of its job ends: that step copies it into the model's cache
    (``Turn.prefill``'s contract), so the next job's load may overwrite it."""

    def __init__(self, bytes_per_token: int, cap_bytes: int) -> None:
        self._per_token, self._cap = bytes_per_token, cap_bytes
        self._array: np.ndarray[Any, Any] | None = None  # grown on demand

    def get(self, tokens: int) -> np.ndarray[Any, Any] | None:
        """A buffer for ``tokens`` tokens of KV (None: too large, let the load allocate)."""
        need = tokens * self._per_token
        if need > self._cap:
            return None
        if self._array is None or self._array.nbytes < need:
            grain = 16 << 20  # grow in steps, so that a slowly longer history does not reallocate each turn
            self._array = np.empty(min(-(-need // grain) * grain, self._cap), dtype=np.uint8)
        return self._array


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
    buffer: LoadBuffer
    chunk_tokens: int  # prompt tokens per prefill step
    decode_burst: int  # tokens per decode step


class Job:
    """One request from its first step to its end (a ``scheduler.Work``)."""

    def __init__(self, runtime: Runtime, handle: Handle) -> None:
        self.handle = handle
        self.phase = Phase.WAITING
        self._rt = runtime
        self._seq: Sequence | None = None
        self._turn: Turn | None = None
        self._out: list[int] = []
        self._steps = self._serve()

    @property
    def tenant(self) -> str:
        return self.handle.request.tenant

    @property
    def tokens(self) -> int:
        return len(self.handle.request.tokens)

    def expired(self) -> bool:
        """Whether the deadline passed (a waiting job then ends unstarted, with its 504)."""
        return self._rt.clock() > self.handle.deadline

    def step(self) -> bool:
        """Run one step; True once the job has ended (its last event sent, its KV stored)."""
        try:
            self.phase = next(self._steps)
            return False
        except StopIteration:
            pass
        except RequestTimeout as exc:
            self._rt.stats.timed_out += 1
            self.handle.sink(ErrorEvent(exc))
            self._store()  # what was computed stays useful: a retry hits on it
        except EngineError as exc:
            self._rt.stats.failed += 1
            self.handle.sink(ErrorEvent(exc))
        except Exception as exc:  # a bug must not kill the worker: fail this request only
            log.exception("request %d failed", self.handle.id)
            self._rt.stats.failed += 1
            error = EngineError(f"internal error: {type(exc).__name__}")
            error.status, error.type = 500, "server_error"
            self.handle.sink(ErrorEvent(error))
        self.phase = Phase.DONE
        return True

    # ------------------------------------------------------------------ the steps

    def _serve(self) -> Generator[Phase, None, None]:
        rt, handle = self._rt, self.handle
        request, params = handle.request, handle.request.params
        start = rt.clock()
        queued = start - (handle.deadline - handle.timeout_s)
        turn = self._turn = rt.mode.open(request, rt.context(request.tenant))
        if handle.cancelled:  # gone while queued: no work, but still an end the caller can wait for
            rt.stats.cancelled += 1
            rt.stats.cancelled_queued += 1
            handle.sink(turn.done(DoneEvent("cancelled", "", (), Usage(len(request.tokens), 0, 0, {}, queued, 0.0))))
            return
        if start > handle.deadline:
            raise RequestTimeout("the request timed out while waiting in the queue")
        seq = self._seq = Sequence(rt.loaded, rt.chunk_tokens)
        steps, cached, tiers, logits = self._open(seq, turn)
        finish: str | None = None
        while logits is None:
            yield Phase.PREFILL
            if self._interrupted():
                finish = "cancelled"
                break
            logits = _advance(steps)
        prefill_s = rt.clock() - start
        stream = TextStream(rt.loaded.tokenizer, params.stop)
        if logits is not None:
            seed = params.seed if params.seed is not None else rt.rng.getrandbits(63)
            finish = yield from self._decode(seq, logits, stream, torch.Generator().manual_seed(seed))
        out = self._out
        tail = stream.flush()
        if tail:
            handle.sink(TokenEvent(out[-1] if out else -1, tail))
        usage = Usage(len(request.tokens), len(out), cached, tiers, queued, prefill_s)
        if finish == "cancelled":
            rt.stats.cancelled += 1
        else:
            rt.stats.completed += 1
        handle.sink(turn.done(DoneEvent(finish or "length", stream.text, tuple(out), usage)))
        self._store()

    def _open(self, seq: Sequence, turn: Turn) -> tuple[Prefill, int, dict[str, int], torch.Tensor | None]:
        """Match and load what the cache holds and run the prefill's first step: (its
        remaining steps, tokens reused, by tier, the logits when that step ended it)."""
        rt, tokens = self._rt, self.handle.request.tokens
        if rt.cache is None:
            steps = turn.prefill(seq, tokens, None)
            return steps, 0, {}, _advance(steps)
        with rt.cache.match(tokens, rt.context(self.tenant)) as match:
            usable, tiers, prefix = 0, {}, None
            if match.cached_tokens > 0:
                loaded = rt.cache.load(match, out=rt.buffer.get(match.cached_tokens))
                # NOTE: the last prompt token is always prefilled, since its logits start decoding.
                usable = max(0, min(int(loaded.tokens), len(tokens) - 1))
                if usable > 0:
                    tiers, prefix = _clip_tiers(dict(loaded.tier_tokens), usable), loaded.kv[:, :, :, :usable]
            steps = turn.prefill(seq, tokens, prefix)
            # NOTE: inside the match: the first step copies the load out of the reused
            # buffer and the pinned blocks (Turn.prefill's contract); later steps need neither
            return steps, usable, tiers, _advance(steps)

    def _decode(
        self, seq: Sequence, logits: torch.Tensor, stream: TextStream, generator: torch.Generator
    ) -> Generator[Phase, None, str]:
        """Sample and feed back tokens, ``decode_burst`` forwards a step; the finish reason.
        The first token goes out in the step that ended the prefill."""
        params, eos, out = self.handle.request.params, self._rt.loaded.eos_ids, self._out
        history = TokenCounts(self.handle.request.tokens)  # what the penalties count
        budget = 0
        while True:
            if self._interrupted():
                return "cancelled"
            token = sample(logits, params, generator, history)
            if token in eos:
                return "stop"
            out.append(token)
            self.handle.sink(TokenEvent(token, stream.push(token)))
            if stream.stopped:
                return "stop"
            if len(out) >= params.max_tokens:
                return "length"
            if budget == 0:
                yield Phase.DECODE
                budget = self._rt.decode_burst
                if self._interrupted():
                    return "cancelled"
            logits = seq.step(token)
            budget -= 1

    def _interrupted(self) -> bool:
        """Whether the caller left; past the deadline, raises ``RequestTimeout``."""
        if self.handle.cancelled:
            return True
        if self._rt.clock() > self.handle.deadline:
            seq, prompt = self._seq, len(self.handle.request.tokens)
            if seq is not None and seq.length < prompt:
                raise RequestTimeout(f"the request timed out while prefilling its prompt ({seq.length} of {prompt})")
            raise RequestTimeout(f"the request timed out after {len(self._out)} tokens")
        return False

    def _store(self) -> None:
        """Insert prompt + answer with their KV, so the next turn hits on the whole history
        (as much of it as the turn calls exact), then let the turn store its own. The last
        sampled token was never fed to the model, so it has no KV yet; a prefill cut
        short stores the prompt tokens it computed. The cache reads from the sequence's
        KV only the range it stores (the new blocks)."""
        seq, turn, request, cache = self._seq, self._turn, self.handle.request, self._rt.cache
        if seq is None or turn is None:
            return
        length = turn.storable(seq.length)
        if cache is not None and length > 0:
            tokens = (request.tokens + self._out)[:length]
            try:
                cache.insert(tokens, self._rt.context(request.tenant), kv=SequenceKV(seq.cache))
            except Exception:  # the answer is already out; a failed store costs a future hit only
                log.exception("storing the KV of request tokens failed")
        try:
            turn.stored(request.tokens)
        except Exception:  # the same: the answer is out
            log.exception("the serving mode's store after a request failed")


def _advance(steps: Prefill) -> torch.Tensor | None:
    """Run one step of ``steps``: its logits when it was the last, else None."""
    try:
        next(steps)
    except StopIteration as stop:
        logits: torch.Tensor = stop.value
        return logits
    return None


def _clip_tiers(tiers: dict[str, int], total: int) -> dict[str, int]:
    """Per-tier token counts cut to ``total``, taking from the slowest (last) tiers first."""
    excess = sum(tiers.values()) - total
    for name in reversed(list(tiers)):
        take = min(excess, tiers[name])
        tiers[name] -= take
        excess -= take
    return tiers
