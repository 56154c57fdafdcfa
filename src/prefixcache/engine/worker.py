"""The engine: a bounded request queue served by one worker thread.

    submit() ──> [ queue (max_queue) ] ──> worker thread:
                                            match -> load -> prefill suffix -> decode ─> events ─> sink
                                            (after the last event) insert prompt + answer with KV

What happens past the exact prefix (how the rest is prefilled, what is stored, what
the end event says) is the engine's ``ServeMode`` (``modes.py``): exact prefix caching
by default, the blend mode in ``blend/serve_engine.py``.

A caller gets a ``Handle`` at once and its tokens through a ``sink`` callback, called
from the worker thread (the server hands them to its event loop). A full queue is a
``QueueFull`` with a retry hint; a request waits and runs at most ``timeout_s``;
``Handle.cancel()`` (client gone) stops it at the next token, or before it starts when
it is still queued; ``Engine.stats`` counts how requests ended.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from prefixcache.cache import PrefixCache
from prefixcache.engine.chat import chat_tokens
from prefixcache.engine.kv import SequenceKV
from prefixcache.engine.model import LoadedModel
from prefixcache.engine.modes import EXACT, ServeMode, Turn
from prefixcache.engine.requests import (
    ContextLengthError,
    DoneEvent,
    EngineClosed,
    EngineError,
    EngineStats,
    ErrorEvent,
    Event,
    Handle,
    QueueFull,
    Request,
    RequestTimeout,
    Sink,
    TokenEvent,
    Usage,
)
from prefixcache.engine.runner import Sequence
from prefixcache.engine.sampling import TextStream, sample
from prefixcache.hashing import CacheContext

log = logging.getLogger(__name__)

LOAD_BUFFER_BYTES = 128 << 20  # loads up to this size reuse one buffer; larger ones get a fresh array


class Engine:
    """Serves ``Request``s on one model, one at a time, with an optional prefix cache.

    ``cache`` is a ``PrefixCache`` whose ``kv_layout`` matches the model (or None:
    every prompt is prefilled in full). ``model_id`` names the model in cache keys,
    so ``cache.bump_epoch(model_id)`` invalidates its blocks. ``mode`` serves each
    request past its exact prefix (default: exact prefix caching).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        model_id: str,
        cache: PrefixCache | None = None,
        max_queue: int = 64,
        timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        load_buffer_bytes: int = LOAD_BUFFER_BYTES,
        mode: ServeMode = EXACT,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.loaded = loaded
        self.model_id = model_id
        self.cache = cache
        self.mode = mode
        self.timeout_s = timeout_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._queue: queue.Queue[Handle | None] = queue.Queue(maxsize=max_queue)
        self._ids = itertools.count(1)
        self._busy_s = 1.0  # a running estimate of one request's service seconds, for Retry-After
        self._thread: threading.Thread | None = None
        self._closed = False
        self.stats = EngineStats()
        self._pending = 0  # submitted and not yet finished (stored included)
        self._load_cap = load_buffer_bytes
        self._load_buffer: np.ndarray[Any, Any] | None = None  # grown on demand, touched once
        self._settled = threading.Condition()

    # ------------------------------------------------------------------ front door

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def vocab_size(self) -> int:
        embeddings: Any = self.loaded.model.get_input_embeddings()
        return int(embeddings.weight.shape[0])

    def tokenize_chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        """The chat template's tokens for ``messages``, ending with the assistant's turn
        (without it: the prefix that later conversations starting this way share). Control
        tokens come from the template only, never from a message's text (``chat.py``)."""
        return chat_tokens(self.loaded.tokenizer, messages, generation_prompt)

    def tokenize_text(self, text: str) -> list[int]:
        return [int(t) for t in self.loaded.tokenizer.encode(text, add_special_tokens=False)]

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        """The model's context limit, as the error a client can act on."""
        if prompt_tokens + max_tokens > self.context_length:
            raise ContextLengthError(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param="messages",
            )

    def submit(self, request: Request, sink: Sink) -> Handle:
        """Queue ``request``; raises ``QueueFull``, ``ContextLengthError`` or ``EngineClosed``."""
        if self._closed:
            raise EngineClosed("the engine is shutting down")
        if not request.tokens:
            raise EngineError("the prompt is empty", param="prompt")
        vocab = self.vocab_size
        if min(request.tokens) < 0 or max(request.tokens) >= vocab:
            raise EngineError(f"token ids must be in [0, {vocab})", param="prompt")
        self.check_length(len(request.tokens), request.params.max_tokens)
        self.start()
        timeout = self.timeout_s if request.timeout_s is None else request.timeout_s
        handle = Handle(next(self._ids), request, sink, self._clock() + timeout, timeout)
        self._count(+1)
        try:
            self._queue.put_nowait(handle)
        except queue.Full:
            self._count(-1)
            waiting = self._queue.qsize() + 1
            # a place in the queue frees when the running request ends: within one service time
            raise QueueFull(
                f"the server is busy ({waiting} requests waiting); retry later", max(1, math.ceil(self._busy_s))
            ) from None
        return handle

    def generate(self, request: Request) -> Handle:
        """Submit with a sink that ``Handle.result()`` reads (for scripts and tests)."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        handle = self.submit(request, events.put)
        handle._events = events
        return handle

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every submitted request has finished, its KV stored too (which happens
        after its answer went out); False on timeout. For tests and admin scripts that need
        the cache settled."""
        with self._settled:
            return self._settled.wait_for(lambda: self._pending == 0, timeout)

    def _count(self, delta: int) -> None:
        with self._settled:
            self._pending += delta
            if self._pending == 0:
                self._settled.notify_all()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="prefixcache-engine", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new requests, cancel queued ones, finish the current one, stop the thread."""
        self._closed = True
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                break
            if pending is not None:
                pending.sink(ErrorEvent(EngineClosed("the engine is shutting down")))
                self._count(-1)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------ worker

    def _work(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            started = self._clock()
            try:
                self._run(handle)
            except RequestTimeout as exc:
                self.stats.timed_out += 1
                handle.sink(ErrorEvent(exc))
            except EngineError as exc:
                self.stats.failed += 1
                handle.sink(ErrorEvent(exc))
            except Exception as exc:  # a bug must not kill the worker: fail this request only
                log.exception("request %d failed", handle.id)
                self.stats.failed += 1
                error = EngineError(f"internal error: {type(exc).__name__}")
                error.status, error.type = 500, "server_error"
                handle.sink(ErrorEvent(error))
            self._count(-1)
            self._busy_s = 0.8 * self._busy_s + 0.2 * (self._clock() - started)

    def context(self, tenant: str) -> CacheContext:
        """The cache context of ``tenant``'s requests on this engine's model."""
        return CacheContext(tenant=tenant, model=self.model_id, tokenizer=self.model_id)

    def _run(self, handle: Handle) -> None:
        request, params = handle.request, handle.request.params
        start = self._clock()
        queued = start - (handle.deadline - handle.timeout_s)
        turn = self.mode.open(request, self.context(request.tenant))
        if handle.cancelled:  # gone while queued: no work, but still an end the caller can wait for
            self.stats.cancelled += 1
            self.stats.cancelled_queued += 1
            usage = Usage(len(request.tokens), 0, 0, {}, queued, 0.0)
            handle.sink(turn.done(DoneEvent("cancelled", "", (), usage)))
            return
        if start > handle.deadline:
            raise RequestTimeout("the request timed out while waiting in the queue")
        seq = Sequence(self.loaded)
        cached, tiers, logits = self._prefill(seq, request, turn)
        prefill_s = self._clock() - start
        generator = torch.Generator().manual_seed(params.seed if params.seed is not None else self._rng.getrandbits(63))
        stream = TextStream(self.loaded.tokenizer, params.stop)
        eos = self.loaded.eos_ids
        out: list[int] = []
        finish = "length"
        while len(out) < params.max_tokens:
            if handle.cancelled:
                finish = "cancelled"
                break
            if self._clock() > handle.deadline:
                self._store(request, out, seq, turn)
                raise RequestTimeout(f"the request timed out after {len(out)} tokens")
            token = sample(logits, params, generator)
            if token in eos:
                finish = "stop"
                break
            out.append(token)
            handle.sink(TokenEvent(token, stream.push(token)))
            if stream.stopped:
                finish = "stop"
                break
            if len(out) < params.max_tokens:
                logits = seq.step(token)
        tail = stream.flush()
        if tail:
            handle.sink(TokenEvent(out[-1] if out else -1, tail))
        usage = Usage(len(request.tokens), len(out), cached, tiers, queued, prefill_s)
        if finish == "cancelled":
            self.stats.cancelled += 1
        else:
            self.stats.completed += 1
        handle.sink(turn.done(DoneEvent(finish, stream.text, tuple(out), usage)))
        self._store(request, out, seq, turn)

    def _prefill(self, seq: Sequence, request: Request, turn: Turn) -> tuple[int, dict[str, int], torch.Tensor]:
        """Prefill what the cache does not hold (``turn`` prefills it); returns (tokens
        reused, by tier, last logits)."""
        tokens = request.tokens
        if self.cache is None:
            return 0, {}, turn.prefill(seq, tokens, None)
        with self.cache.match(tokens, self.context(request.tenant)) as match:
            if match.cached_tokens == 0:
                return 0, {}, turn.prefill(seq, tokens, None)
            loaded = self.cache.load(match, out=self._buffer(match.cached_tokens))
            # NOTE: the last prompt token is always prefilled, since its logits start decoding.
            usable = min(int(loaded.tokens), len(tokens) - 1)
            if usable <= 0:
                return 0, {}, turn.prefill(seq, tokens, None)
            # NOTE: inside the match: the load may sit in the worker's reused buffer
            tiers = _clip_tiers(dict(loaded.tier_tokens), usable)
            return usable, tiers, turn.prefill(seq, tokens, loaded.kv[:, :, :, :usable])

    def _buffer(self, tokens: int) -> np.ndarray[Any, Any] | None:
        """A reusable destination for a load of ``tokens`` (None: let the load allocate).

        NOTE: a fresh array of tens of MB is a fresh mmap whose every page faults on the
        first write (~100 ms for 2,048 tokens of SmolLM2); one buffer kept by the worker
        thread pays that once. It is free again as soon as ``fill_cache`` returns, since
        the model's cache copies the KV into its own tensors."""
        need = tokens * self.loaded.kv.bytes_per_token
        if need > self._load_cap:
            return None
        if self._load_buffer is None or self._load_buffer.nbytes < need:
            grain = 16 << 20  # grow in steps, so that a slowly longer history does not reallocate each turn
            self._load_buffer = np.empty(min(-(-need // grain) * grain, self._load_cap), dtype=np.uint8)
        return self._load_buffer

    def _store(self, request: Request, out: list[int], seq: Sequence, turn: Turn) -> None:
        """Insert prompt + answer with their KV, so the next turn hits on the whole history
        (as much of it as ``turn`` calls exact), then let ``turn`` store its own. The last
        sampled token was never fed to the model, so it has no KV yet. The cache reads
        from the sequence's KV only the range it stores (the new blocks)."""
        length = turn.storable(seq.length)
        if self.cache is not None and length > 0:
            tokens = (request.tokens + out)[:length]
            try:
                self.cache.insert(tokens, self.context(request.tenant), kv=SequenceKV(seq.cache))
            except Exception:  # the answer is already out; a failed store costs a future hit only
                log.exception("storing the KV of request tokens failed")
        try:
            turn.stored(request.tokens)
        except Exception:  # the same: the answer is out
            log.exception("the serving mode's store after a request failed")


def _clip_tiers(tiers: dict[str, int], total: int) -> dict[str, int]:
    """Per-tier token counts cut to ``total``, taking from the slowest (last) tiers first."""
    excess = sum(tiers.values()) - total
    for name in reversed(list(tiers)):
        take = min(excess, tiers[name])
        tiers[name] -= take
        excess -= take
    return tiers
