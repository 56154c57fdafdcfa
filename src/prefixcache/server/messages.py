"""Anthropic's Messages API on the engine: a request rendered to prompt tokens with its
breakpoints (``api/messages_prompt.py``), submitted with their retention, and its answer
as one message or as Anthropic's server-sent events.

    client ──> /v1/messages ──> messages_prompt ──> retention.asked ──> Engine.submit
                                     <── events ──> message JSON | SSE events

The engine is driven as the OpenAI routes drive it (``Completions``: the submit, the
watcher that cancels a request whose client left, the wait for its end); what differs
is only the shape of the answer and of its usage (``api/messages_usage.py``).

A stream's events, in Anthropic's order::

    message_start (usage: the prompt as input)   content_block_start   ping
    content_block_delta (text_delta) ...          content_block_stop
    message_delta (stop_reason; usage, cumulative: the read/creation split)   message_stop

NOTE: the engine tells how much of the prompt came from the cache only at the end, so
``message_start`` counts the whole prompt as ``input_tokens``, and ``message_delta``
carries the final figures (cumulative totals, which Anthropic's SDK writes over the
start's). An error after the stream began is an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.api.errors import APIError
from prefixcache.api.messages import CountTokensRequest, MessagesRequest
from prefixcache.api.messages_prompt import Prompt, messages_prompt
from prefixcache.api.messages_usage import messages_usage
from prefixcache.engine import DoneEvent, Engine, ErrorEvent, Event, Handle, SamplingParams, TokenEvent
from prefixcache.server.openai import Completions
from prefixcache.server.recording import Endpoint
from prefixcache.server.retention import asked

__all__ = ["Messages", "stop_reason"]

Decode = Callable[[Sequence[int]], str]


def stop_reason(done: DoneEvent, stops: Sequence[str], decode: Decode) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished answer. The engine
    ends on a stop sequence before it, without it in the text: the sequence is the one
    the whole answer's text holds where the text ends."""
    if done.finish_reason == "length":
        return "max_tokens", None
    if stops:
        whole = decode(done.tokens)
        for stop in stops:
            if whole.startswith(stop, len(done.text)):
                return "stop_sequence", stop
    return "end_turn", None


class Messages:
    """``/v1/messages`` and ``/v1/messages/count_tokens`` on the engine ``completions`` drives."""

    def __init__(self, completions: Completions) -> None:
        self.completions = completions
        self.engine: Engine = completions.engine
        self.model_id = completions.model_id

    def _decode(self, tokens: Sequence[int]) -> str:
        return str(self.engine.loaded.tokenizer.decode(list(tokens), skip_special_tokens=True))

    def _served(self, model: str) -> None:
        if model != self.model_id:
            raise APIError(404, f"model: {model} (this server serves {self.model_id})", code="model_not_found")

    def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        self._served(body.model)
        return {"input_tokens": len(messages_prompt(self.engine, body, breakpoints=False).tokens)}

    async def create(self, request: Request, body: MessagesRequest, tenant: str) -> Response:
        self._served(body.model)
        prompt = messages_prompt(self.engine, body)
        retention = asked(self.engine, tenant, prompt.spans())
        params = SamplingParams(body.max_tokens, body.temperature, body.top_p, body.stops)
        completions = self.completions
        began = await completions.begin(request, prompt.tokens, tenant, params, retention.spans, body.stream)
        done, arrived, ttft = began.done, began.arrived, began.ttft
        rid = "msg_" + uuid.uuid4().hex[:24]
        if done is None:
            if began.left_queued:
                return Response(status_code=499)
            answer = _Answer(self, rid, body, prompt, tenant, arrived, ttft)
            stream = answer.events(began.handle, began.events, began.first)
            headers = {"Cache-Control": "no-cache"} | retention.headers()
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        if done.finish_reason == "cancelled":
            return Response(status_code=499)
        completions.recorder.record(tenant, Endpoint.MESSAGES, done, arrived, ttft)
        message = _Answer(self, rid, body, prompt, tenant, arrived, ttft).message(done)
        return JSONResponse(message, headers=retention.headers(done.usage.retained))


@dataclass(frozen=True, slots=True)
class _Answer:
    """One answer's shapes: the whole message, or its stream of events."""

    messages: Messages
    rid: str
    body: MessagesRequest
    prompt: Prompt
    tenant: str
    arrived: float
    ttft: float

    def usage(self, done: DoneEvent) -> dict[str, Any]:
        u = done.usage
        return messages_usage(u.prompt_tokens, u.cached_tokens, self.prompt.breakpoints, u.completion_tokens).body()

    def _head(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.messages.model_id,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
        }

    def message(self, done: DoneEvent) -> dict[str, Any]:
        stop = stop_reason(done, self.body.stops, self.messages._decode)
        content = [{"type": "text", "text": done.text}] if done.text else []
        return self._head(content, stop) | {"usage": self.usage(done)}

    async def events(self, handle: Handle, events: asyncio.Queue[Event], event: Event) -> AsyncIterator[str]:
        usage = {"input_tokens": len(self.prompt.tokens), "output_tokens": 0}
        start = self._head([], (None, None)) | {"usage": usage}
        yield _sse("message_start", {"type": "message_start", "message": start})
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        yield _sse("content_block_start", block)
        yield _sse("ping", {"type": "ping"})
        try:
            while True:
                if isinstance(event, TokenEvent):
                    if event.text:
                        text = {"type": "text_delta", "text": event.text}
                        yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": text})
                elif isinstance(event, ErrorEvent):  # after the stream began: in-band
                    yield _sse("error", APIError.of(event.error).anthropic_body())
                    return
                else:
                    if event.finish_reason == "cancelled":
                        return  # the client left: nobody reads what would follow
                    self.messages.completions.recorder.record(
                        self.tenant, Endpoint.MESSAGES, event, self.arrived, self.ttft
                    )
                    reason, sequence = stop_reason(event, self.body.stops, self.messages._decode)
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                    delta: dict[str, str | None] = {"stop_reason": reason, "stop_sequence": sequence}
                    yield _sse("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage(event)})
                    yield _sse("message_stop", {"type": "message_stop"})
                    return
                event = await events.get()
        finally:
            handle.cancel()  # a no-op when it finished; stops the work when the client went away


def _sse(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
