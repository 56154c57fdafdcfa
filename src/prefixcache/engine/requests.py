"""What the engine takes and gives: a request, the events of its answer (tokens, then
the end with its usage, or an error), the handle to cancel it, and the errors a
client can act on (each carries its HTTP status and OpenAI error type)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from prefixcache.cache.retention import RetainOutcome, RetainSpan
from prefixcache.engine.sampling import SamplingParams

__all__ = [
    "ContextLengthError",
    "DoneEvent",
    "EngineClosed",
    "EngineError",
    "EngineStats",
    "ErrorEvent",
    "Event",
    "Handle",
    "InvalidPrompt",
    "KVBudgetExceeded",
    "QueueFull",
    "Request",
    "RequestTimeout",
    "Sink",
    "TenantBusy",
    "TokenEvent",
    "Usage",
]


class EngineError(Exception):
    """A request the engine refuses or could not finish; carries what an HTTP answer needs."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthError(EngineError):
    code = "context_length_exceeded"


class InvalidPrompt(EngineError):
    """A prompt its schema let through that the model cannot take: empty once tokenized, or
    a token id outside the vocabulary. The code is the schema's own for a bad value, so an
    empty prompt gets one code whichever check found it."""

    code = "invalid_value"


class KVBudgetExceeded(EngineError):
    """A request whose KV reservation alone is over the engine's whole budget: it would
    never start, so it is refused at once (413: a retry cannot help, a smaller one can)."""

    status = 413
    code = "kv_budget_exceeded"


class QueueFull(EngineError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TenantBusy(QueueFull):
    """A tenant over its own share of the engine (its admission limits), while the
    engine may still take other tenants' requests."""

    code = "tenant_busy"


class RequestTimeout(EngineError):
    status = 504
    type = "timeout_error"
    code = "timeout"


class EngineClosed(EngineError):
    status = 503
    type = "server_error"
    code = "engine_closed"


@dataclass(frozen=True, slots=True)
class Request:
    """One generation: prompt tokens, who asks (for the cache's isolation), how to sample."""

    tokens: list[int]
    tenant: str
    params: SamplingParams
    timeout_s: float | None = None  # None: the engine's default
    retain: tuple[RetainSpan, ...] = ()  # prefixes of ``tokens`` the client asked to keep (``cache/retention.py``)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the cache (this tenant's, verified, loaded)
    tier_tokens: Mapping[str, int]  # cached_tokens split by the tier they came from
    queue_s: float  # time waiting in the queue
    prefill_s: float  # time from the start of work to the first token's logits (match, load, prefill)
    retained: RetainOutcome = RetainOutcome.NONE  # what ``Request.retain`` got


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token: int
    text: str  # text that became final with this token (may be "")


@dataclass(frozen=True, slots=True)
class DoneEvent:
    finish_reason: str  # "stop" | "length" | "cancelled"
    text: str  # the whole answer
    tokens: tuple[int, ...]
    usage: Usage


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    error: EngineError


Event = TokenEvent | DoneEvent | ErrorEvent
Sink = Callable[[Event], None]


@dataclass(slots=True)
class EngineStats:
    """How requests ended, counted by the worker thread (its only writer)."""

    completed: int = 0  # finished with "stop" or "length"
    cancelled: int = 0  # the caller cancelled (client gone), queued or mid-answer
    cancelled_queued: int = 0  # of those, the ones cancelled before any work (gone while queued)
    timed_out: int = 0
    failed: int = 0  # refused by the worker or an internal error


@dataclass(eq=False)
class Handle:
    """A submitted request: ``cancel()`` it, or wait for it with ``result()`` when no sink was given."""

    id: int
    request: Request
    sink: Sink
    deadline: float
    timeout_s: float
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _events: queue.SimpleQueue[Event] | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def result(self, timeout: float | None = None) -> DoneEvent:
        """Block until the request ends (only for handles made by ``Engine.generate``)."""
        assert self._events is not None, "result() needs a handle from Engine.generate()"
        while True:
            event = self._events.get(timeout=timeout)
            if isinstance(event, DoneEvent):
                return event
            if isinstance(event, ErrorEvent):
                raise event.error
