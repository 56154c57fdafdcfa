"""The engine: per-tenant queues, I/O workers for the prefix cache, and one worker
thread whose step loop prefills in turn and decodes every running request in one batch.

    submit() ──> Scheduler.admit ──> per-tenant queues ──> up to max_active jobs in flight
                 (TenantBusy, QueueFull)                       │
                                                               v
    I/O workers:    match + load the cached prefix  ──> the job is ready (or it waits
                    for a prompt being prefilled that holds more of its own: ``inflight.py``)
    worker thread:  a step: one forward that decodes every running job and carries the
                    next prefill chunks of ready jobs (tenants in turn); events ─> sink
    I/O workers:    after the end: insert prompt + answer with KV

What happens past the exact prefix (how the rest is prefilled, what is stored, what
the end event says) is the engine's ``ServeMode`` (``modes.py``): exact prefix caching
by default, the blend mode in ``blend/serve_engine.py``. Who gets a slot and whose
chunk runs next is the scheduler's (``scheduler.py``); a job's steps are ``job.py``;
the loop is ``loop.py``; the batch's KV is ``batch.py``.

A caller gets a ``Handle`` at once and its tokens through a ``sink`` callback, called
from the worker thread (the server hands them to its event loop). A full queue is a
``QueueFull``, a tenant over its admission limits a ``TenantBusy``, both with a retry
hint; a request whose KV reservation alone is over the engine's ``kv_budget`` a
``KVBudgetExceeded`` (``memory.py``); a request waits and runs at most ``timeout_s``
and stops within one step of it (``RequestTimeout``); ``Handle.cancel()`` (client gone)
stops it at its next step, or ends it unstarted when it is still queued;
``Engine.stats`` counts how requests ended.
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from prefixcache.cache import PrefixCache
from prefixcache.engine.cacheio import IO_PER_TENANT, IO_WORKERS, CacheIO
from prefixcache.engine.chat import chat_tokens
from prefixcache.engine.job import Job, Runtime
from prefixcache.engine.loop import StepLoop
from prefixcache.engine.memory import KVMemory, reservation
from prefixcache.engine.model import LoadedModel
from prefixcache.engine.modes import EXACT, ServeMode
from prefixcache.engine.requests import (
    ContextLengthError,
    EngineClosed,
    EngineError,
    EngineStats,
    ErrorEvent,
    Event,
    Handle,
    InvalidPrompt,
    KVBudgetExceeded,
    Request,
    Sink,
)
from prefixcache.engine.scheduler import Admission, Order, Scheduler, SchedulerConfig
from prefixcache.hashing import CacheContext

# NOTE: a smaller chunk shortens what another request waits behind a long prompt (one
# chunk's forward at most) but slows that prompt's own prefill (more, smaller forwards
# over a growing cache). Measured on a CPU, this size costs a long prompt little against
# one forward, while a chunk stays a small part of that prompt's prefill even deep into
# the context; much smaller chunks cost the long prompt markedly more.
PREFILL_CHUNK_TOKENS = 256
# NOTE: without batching (``batch_decode=False``), decode steps between two prefill chunks
# while prompts wait: more of them speed the running answers and slow the first token of
# the waiting ones. With batching, every step carries both.
DECODE_BURST = 2


class Engine:
    """Serves ``Request``s on one model, several at a time in turn, with an optional prefix cache.

    ``cache`` is a ``PrefixCache`` whose ``kv_layout`` matches the model (or None:
    every prompt is prefilled in full). ``model_id`` is the name clients use; cache keys
    carry ``cache_model``, that name with the weights' fingerprint (``LoadedModel.key``),
    so ``cache.bump_epoch(engine.cache_model)`` invalidates its blocks. ``mode`` serves each
    request past its exact prefix (default: exact prefix caching). ``max_active``
    requests are in flight at once (each holds its KV): a step is one forward of all
    decoding requests and up to ``prefill_chunk_tokens`` prompt tokens of the ready ones,
    tenants in turn (``batch_decode``; off, for comparisons: a chunk alone, then
    ``decode_burst`` steps of one forward per decoding request); ``admission`` limits
    each tenant's share (default: none); ``order`` is which waiting request gets a free slot;
    ``kv_budget`` bounds the bytes of KV the requests in flight reserve together (their
    worst case, ``memory.py``; default: no bound), a request waiting for memory holding
    back the ones after it.
    The cache's match, load and stores run on ``io_workers`` threads, at most
    ``io_per_tenant`` of them on one tenant's (``cacheio.py``).
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
        mode: ServeMode = EXACT,
        *,
        max_active: int = 2,
        admission: Admission | None = None,
        order: Order = Order.FAIR,
        kv_budget: int | None = None,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        decode_burst: int = DECODE_BURST,
        batch_decode: bool = True,
        io_workers: int = IO_WORKERS,
        io_per_tenant: int = IO_PER_TENANT,
    ) -> None:
        if prefill_chunk_tokens < 1 or decode_burst < 1:
            raise ValueError(
                f"prefill_chunk_tokens and decode_burst must be >= 1, got {prefill_chunk_tokens}, {decode_burst}"
            )
        self.loaded = loaded
        self.model_id = model_id
        self.cache_model = loaded.key(model_id)  # NOTE: by content: other weights under this name never hit
        self.cache = cache
        self.mode = mode
        self.timeout_s = timeout_s
        self._clock = clock
        self.stats = EngineStats()
        self.scheduler: Scheduler[Job] = Scheduler(
            SchedulerConfig(max_queue, max_active, order, admission or Admission(), kv_budget), clock
        )
        self._runtime = Runtime(
            loaded,
            cache,
            mode,
            self.context,
            self.stats,
            clock,
            rng or random.Random(),
            prefill_chunk_tokens,
        )
        self._io = CacheIO(self.scheduler.poke, share=cache is not None, workers=io_workers, per_tenant=io_per_tenant)
        self._loop = StepLoop(
            loaded,
            self.scheduler,
            self._io,
            lambda: self._count(-1),
            batched=batch_decode,
            chunk_tokens=prefill_chunk_tokens,
            decode_steps=decode_burst,
        )
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pending = 0  # submitted and not yet finished (stored included)
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
            why = f" ({self.loaded.limit})" if self.loaded.limit else ""
            raise ContextLengthError(
                f"This model's maximum context length is {self.context_length} tokens{why}. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param="messages",
            )

    def check_budget(self, prompt_tokens: int, max_tokens: int) -> None:
        """A request that could never start under the KV budget, as the error a client can act on."""
        budget = self.scheduler.config.kv_budget
        need = reservation(self.loaded.kv, self.context_length, prompt_tokens + max_tokens)
        if budget is None or need <= budget:
            return
        per_token = reservation(self.loaded.kv, self.context_length, 1)
        raise KVBudgetExceeded(
            f"This request reserves {need} bytes of KV memory ({prompt_tokens} prompt tokens + {max_tokens} "
            f"max_tokens, {per_token} bytes a token), more than this server's whole KV memory budget of {budget} "
            f"bytes (admission.kv_memory_bytes). A request of at most {budget // per_token} tokens, prompt and "
            "max_tokens together, fits: reduce max_tokens or the prompt."
        )

    def kv_memory(self) -> KVMemory:
        """The KV budget and what the requests in flight reserve of it now (for stats)."""
        return KVMemory(self.scheduler.config.kv_budget, self.scheduler.reserved)

    def submit(self, request: Request, sink: Sink) -> Handle:
        """Queue ``request``; raises ``TenantBusy``, ``QueueFull``, ``ContextLengthError``,
        ``KVBudgetExceeded`` or ``EngineClosed``."""
        if self._closed:
            raise EngineClosed("the engine is shutting down")
        if not request.tokens:
            raise InvalidPrompt("the prompt is empty", param="prompt")
        vocab = self.vocab_size
        if min(request.tokens) < 0 or max(request.tokens) >= vocab:
            raise InvalidPrompt(f"token ids must be in [0, {vocab})", param="prompt")
        self.check_length(len(request.tokens), request.params.max_tokens)
        self.check_budget(len(request.tokens), request.params.max_tokens)
        self.start()
        timeout = self.timeout_s if request.timeout_s is None else request.timeout_s
        handle = Handle(next(self._ids), request, sink, self._clock() + timeout, timeout)
        self._count(+1)
        try:
            self.scheduler.admit(Job(self._runtime, handle))
        except EngineError:
            self._count(-1)
            raise
        self._loop.stage_started()  # NOTE: its match and load overlap the step running now
        return handle

    def generate(self, request: Request) -> Handle:
        """Submit with a sink that ``Handle.result()`` reads (for scripts and tests)."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        handle = self.submit(request, events.put)
        handle._events = events
        return handle

    def queue_depth(self) -> int:
        """Requests waiting for a slot (not those in flight)."""
        return self.scheduler.waiting

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
        """Refuse new requests, end the queued ones, finish those in flight, stop the thread."""
        self._closed = True
        for job in self.scheduler.close():
            job.handle.sink(ErrorEvent(EngineClosed("the engine is shutting down")))
            self._count(-1)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._io.close(timeout)

    def context(self, tenant: str) -> CacheContext:
        """The cache context of ``tenant``'s requests on this engine's model."""
        return CacheContext(tenant=tenant, model=self.cache_model, tokenizer=self.model_id)

    # ------------------------------------------------------------------ worker

    def _work(self) -> None:
        self._loop.run()
