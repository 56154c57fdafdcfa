"""The OpenAI-compatible generation routes' work: sampling parameters from the body, a
request submitted to the engine, and its answer as one JSON object or as SSE chunks.

    client ──> route ──> Completions.generate ──> Engine.submit(sink)
                                  <── events via the event loop ──> JSON | SSE

A client that disconnects cancels its request at once, queued or mid-answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.api.errors import APIError
from prefixcache.api.schemas import _Request
from prefixcache.blend.serve_types import BlendedDone
from prefixcache.cache.retention import RetainSpan
from prefixcache.engine import DoneEvent, Engine, EngineError, ErrorEvent, Event, Handle, SamplingParams, TokenEvent
from prefixcache.engine import Request as EngineRequest
from prefixcache.server.recording import Endpoint, Recorder
from prefixcache.server.retention import asked

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "Began", "Completions"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class Began:
    """A request that began: its first event, and its end when the answer is whole (not
    streamed); ``arrived`` and ``ttft`` for its record."""

    handle: Handle
    events: asyncio.Queue[Event]
    first: Event
    done: DoneEvent | None
    arrived: float
    ttft: float

    @property
    def left_queued(self) -> bool:
        """A stream whose client left before any work: dropped unprefilled."""
        return isinstance(self.first, DoneEvent) and self.first.finish_reason == "cancelled"


class Completions:
    """Chat and text completions on one engine; every finished request is recorded."""

    def __init__(self, engine: Engine, recorder: Recorder) -> None:
        self.engine = engine
        self.recorder = recorder
        self.model_id = engine.model_id

    def _params(self, body: _Request, max_tokens: int | None, prompt_tokens: int, default: int) -> SamplingParams:
        if body.model != self.model_id:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.model_id}`.",
                code="model_not_found",
                param="model",
            )
        if max_tokens is None:  # not asked for: the default, cut to what the context leaves
            max_tokens = max(1, min(default, self.engine.context_length - prompt_tokens))
        return SamplingParams(
            max_tokens,
            body.temperature,
            body.top_p,
            body.stops,
            body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
        )

    async def start(
        self, tokens: list[int], tenant: str, params: SamplingParams, retain: tuple[RetainSpan, ...] = ()
    ) -> tuple[Handle, asyncio.Queue[Event]]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
                loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            handle = self.engine.submit(EngineRequest(tokens, tenant, params, retain=retain), sink)
        except EngineError as exc:
            raise APIError.of(exc) from None
        return handle, events

    async def generate(
        self,
        request: Request,
        body: _Request,
        tokens: list[int],
        tenant: str,
        max_tokens: int | None,
        default_max: int,
        chat: bool,
    ) -> Response:
        params = self._params(body, max_tokens, len(tokens), default_max)
        seconds = body.retention_s
        retention = asked(self.engine, tenant, [RetainSpan(len(tokens), seconds)] if seconds else [])
        began = await self.begin(request, tokens, tenant, params, retention.spans, body.stream)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        done, arrived, ttft = began.done, began.arrived, began.ttft
        if done is None:
            if began.left_queued:
                return Response(status_code=499)  # the client left while queued: dropped unprefilled
            handle, events, first = began.handle, began.events, began.first
            chunks = self._stream(request, handle, events, first, rid, chat, body.include_usage, tenant, arrived, ttft)
            headers = {"Cache-Control": "no-cache"} | retention.headers()
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        if done.finish_reason == "cancelled":
            return Response(status_code=499)  # nobody is listening any more
        self.recorder.record(tenant, _endpoint(chat), done, arrived, ttft)
        return JSONResponse(self._completion(rid, chat, done), headers=retention.headers(done.usage.retained))

    async def begin(
        self,
        request: Request,
        tokens: list[int],
        tenant: str,
        params: SamplingParams,
        retain: tuple[RetainSpan, ...],
        stream: bool,
    ) -> Began:
        """Submit, wait for the first event, and (not ``stream``) for the end; an error
        before the answer began is raised as the route's APIError.

        NOTE: the watcher cancels the request the moment the client leaves, queued or
        mid-answer; the engine then ends it with a "cancelled" DoneEvent. A streaming
        response takes over watching once it starts (Starlette listens for the disconnect)."""
        arrived = time.monotonic()
        handle, events = await self.start(tokens, tenant, params, retain)
        watcher = asyncio.create_task(self.watch(request, handle))
        try:
            first = await events.get()
            if isinstance(first, ErrorEvent):
                raise APIError.of(first.error)
            ttft = time.monotonic() - arrived
            done = None if stream else await self.wait(handle, events, first)
        except asyncio.CancelledError:
            handle.cancel()
            raise
        finally:
            watcher.cancel()
        return Began(handle, events, first, done, arrived, ttft)

    async def watch(self, request: Request, handle: Handle) -> None:
        """Cancel ``handle`` when the client disconnects (the body is read, so the next
        message the server has for this request is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        handle.cancel()

    async def wait(self, handle: Handle, events: asyncio.Queue[Event], event: Event) -> DoneEvent:
        """The final event (a "cancelled" one when the client went away)."""
        while not isinstance(event, DoneEvent):
            if isinstance(event, ErrorEvent):
                raise APIError.of(event.error)
            event = await events.get()
        return event

    async def _stream(
        self,
        request: Request,
        handle: Handle,
        events: asyncio.Queue[Event],
        event: Event,
        rid: str,
        chat: bool,
        include_usage: bool,
        tenant: str,
        arrived: float,
        ttft: float,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        try:
            if chat:
                yield _sse(self._chunk(rid, created, chat, {"role": "assistant", "content": ""}, None))
            while True:
                if isinstance(event, TokenEvent):
                    if event.text:
                        delta = {"content": event.text} if chat else event.text
                        yield _sse(self._chunk(rid, created, chat, delta, None))
                elif isinstance(event, ErrorEvent):  # after the stream began: report it in-band
                    yield _sse(APIError.of(event.error).body())
                    break
                else:
                    self.recorder.record(tenant, _endpoint(chat), event, arrived, ttft)
                    yield _sse(self._chunk(rid, created, chat, {} if chat else "", event.finish_reason))
                    if include_usage:
                        final = self._chunk(rid, created, chat, None, None) | {"usage": _usage(event)}
                        final["choices"] = []
                        yield _sse(final)
                    break
                event = await events.get()
            yield "data: [DONE]\n\n"
        finally:
            handle.cancel()  # a no-op when it finished; stops the work when the client went away

    def _chunk(self, rid: str, created: int, chat: bool, delta: Any, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = delta if delta is not None else {}
        else:
            choice["text"] = delta or ""
            choice["logprobs"] = None
        kind = "chat.completion.chunk" if chat else "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": self.model_id, "choices": [choice]}

    def _completion(self, rid: str, chat: bool, done: DoneEvent) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": done.text}
        else:
            choice["text"], choice["logprobs"] = done.text, None
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_id,
            "choices": [choice],
            "usage": _usage(done),
        }


def _usage(done: DoneEvent) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens`` counts exact prefix-cache hits only. A request of
    a tenant opted into the blend mode also gets, in ``prompt_tokens_details``, the
    prompt tokens whose KV came from cached chunks: ``blend_reused_tokens`` (kept) and
    ``blend_recomputed_tokens`` (run again by the recompute plan)."""
    u = done.usage
    details: dict[str, Any] = {"cached_tokens": u.cached_tokens}
    if isinstance(done, BlendedDone):
        details |= {"blend_reused_tokens": done.blend.reused, "blend_recomputed_tokens": done.blend.recomputed}
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": details,
    }


def _endpoint(chat: bool) -> Endpoint:
    return Endpoint.CHAT if chat else Endpoint.COMPLETIONS


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
