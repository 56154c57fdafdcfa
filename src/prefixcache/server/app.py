"""The OpenAI-compatible HTTP front of an ``Engine``.

    client ──HTTP──> BodyLimit ──> auth (Bearer -> tenant) ──> route ──> Engine.submit(sink)
                                                                  <── events via the event loop

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE),
``GET /v1/models``, ``GET /healthz``, the dashboard page at ``GET /``; behind the admin
key ``GET /metrics`` and ``GET /dashboard/data`` (per-tenant figures: a tenant's key
gets 403, so no tenant sees another's), ``POST /admin/epoch``, ``POST /admin/purge``,
``GET /admin/stats``. In local mode (no API keys, no admin key) everything is open.
Every error is OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.engine import DoneEvent, Engine, EngineError, ErrorEvent, Event, Handle, SamplingParams, TokenEvent
from prefixcache.engine import Request as EngineRequest
from prefixcache.ops.dashboard import dashboard_data
from prefixcache.ops.metrics import CacheCollector, PrefillRate, ServingMetrics, tier_level
from prefixcache.server.schemas import ChatRequest, CompletionRequest, EpochRequest, PurgeRequest, _Request
from prefixcache.server.settings import Settings

log = logging.getLogger(__name__)

LOCAL_TENANT = "local"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RECENT_REQUESTS = 20  # kept for the dashboard's token-source strips
STRIP_LEVELS = ("L0", "L1", "L2")  # the page's colours; slower tiers are drawn as L2
# NOTE: the page is inline HTML/CSS/JS and must load nothing from elsewhere; the policy makes that a rule.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",  # the page may be opened as /?key=...
    "Cache-Control": "no-cache",
}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class APIError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    @classmethod
    def of(cls, exc: EngineError) -> APIError:
        headers = {"Retry-After": str(exc.retry_after)} if hasattr(exc, "retry_after") else None
        return cls(exc.status, exc.message, exc.type, exc.code, exc.param, headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, whether it declares its length or not."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks: list[Message] = []
        size = 0
        while True:  # buffer the body (bounded by the limit) so that an overrun is refused before any work
            message = await receive()
            chunks.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay() -> Message:
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is over the limit of {self.limit} bytes", code="request_too_large")
        await error.response()(scope, receive, send)


class Server:
    """Routes and their state: the engine, the cache (may be None), auth, metrics."""

    def __init__(self, engine: Engine, settings: Settings, cache: Any | None, registry: CollectorRegistry) -> None:
        self.engine, self.settings, self.cache, self.registry = engine, settings, cache, registry
        self.model_id = engine.model_id
        self.created = int(time.time())
        self.metrics = ServingMetrics(registry)
        self.prefill_rate = PrefillRate()
        self.tier_levels = _tier_levels(cache)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)

    # ------------------------------------------------------------------ auth

    def _key(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def tenant(self, request: Request) -> str:
        """The caller's tenant, from its API key (never from the body)."""
        auth = self.settings.auth
        tenant: str | None = LOCAL_TENANT
        if not auth.local_mode:
            key = self._key(request)
            tenant = _lookup(auth.api_keys, key) if key is not None else None
        if tenant is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        if auth.tenant_header:  # set by a gateway the operator trusts (configured explicitly)
            tenant = request.headers.get(auth.tenant_header) or tenant
        return tenant

    def admin(self, request: Request) -> None:
        auth = self.settings.auth
        if not auth.admin_key:
            if auth.local_mode:
                return  # local mode: no keys at all, the admin routes are as open as the rest
            raise APIError(403, "admin routes are disabled: set [auth] admin_key", code="admin_disabled")
        key = self._key(request)
        if key is None or not hmac.compare_digest(key.encode(), auth.admin_key.encode()):
            raise APIError(401, "Incorrect admin key provided.", code="invalid_api_key")

    def operator(self, request: Request) -> None:
        """Guard the per-tenant figures (/metrics, /dashboard/data): the admin key only.
        A tenant's own key is recognised and refused with 403, no key or a wrong one is 401."""
        auth = self.settings.auth
        if auth.local_mode and not auth.admin_key:
            return  # a developer's machine: one tenant, nothing to hide from anyone
        key = self._key(request)
        if key is None:
            raise APIError(401, "This route needs the admin key as a Bearer token.", code="invalid_api_key")
        if auth.admin_key and hmac.compare_digest(key.encode(), auth.admin_key.encode()):
            return
        if _lookup(auth.api_keys, key) is not None:
            raise APIError(
                403,
                "Per-tenant figures are for the operator: this route needs the admin key, not a tenant's API key.",
                type_="permission_error",
                code="admin_key_required",
            )
        if not auth.admin_key:
            raise APIError(403, "metrics are disabled: set [auth] admin_key", code="admin_disabled")
        raise APIError(401, "Incorrect admin key provided.", code="invalid_api_key")

    # ------------------------------------------------------------------ generation

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
        return SamplingParams(max_tokens, body.temperature, body.top_p, body.stops, body.seed)

    async def _start(
        self, tokens: list[int], tenant: str, params: SamplingParams
    ) -> tuple[Handle, asyncio.Queue[Event]]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
                loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            handle = self.engine.submit(EngineRequest(tokens, tenant, params), sink)
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
        arrived = time.monotonic()
        handle, events = await self._start(tokens, tenant, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        # NOTE: the watcher cancels the request the moment the client leaves, queued or
        # mid-answer; the engine then ends it with a "cancelled" DoneEvent. A streaming
        # response takes over watching once it starts (Starlette listens for the disconnect).
        watcher = asyncio.create_task(self._watch(request, handle))
        try:
            first = await events.get()
            if isinstance(first, ErrorEvent):
                raise APIError.of(first.error)
            ttft = time.monotonic() - arrived
            done = None if body.stream else await self._wait(handle, events, first)
        except asyncio.CancelledError:
            handle.cancel()
            raise
        finally:
            watcher.cancel()
        if done is None:
            if isinstance(first, DoneEvent) and first.finish_reason == "cancelled":
                return Response(status_code=499)  # the client left while queued: dropped unprefilled
            chunks = self._stream(request, handle, events, first, rid, chat, body.include_usage, tenant, arrived, ttft)
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if done.finish_reason == "cancelled":
            return Response(status_code=499)  # nobody is listening any more
        self._record(tenant, chat, done, arrived, ttft)
        return JSONResponse(self._completion(rid, chat, done))

    async def _watch(self, request: Request, handle: Handle) -> None:
        """Cancel ``handle`` when the client disconnects (the body is read, so the next
        message the server has for this request is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        handle.cancel()

    async def _wait(self, handle: Handle, events: asyncio.Queue[Event], event: Event) -> DoneEvent:
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
                    self._record(tenant, chat, event, arrived, ttft)
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

    def _record(self, tenant: str, chat: bool, done: DoneEvent, arrived: float, ttft: float) -> None:
        usage = done.usage
        levels: dict[str, int] = {}  # tier name -> level (L0 fastest), as /metrics and the page name them
        for name, n in usage.tier_tokens.items():
            level = self.tier_levels.get(name, name)
            levels[level] = levels.get(level, 0) + n
        if sum(levels.values()) == usage.cached_tokens:  # else record_request below logs the mismatch
            self.recent.append(
                {
                    "tenant": tenant,
                    "model": self.model_id,
                    "prompt_tokens": usage.prompt_tokens,
                    "segments": _segments(levels, usage.prompt_tokens, usage.cached_tokens),
                }
            )
        try:
            computed = usage.prompt_tokens - usage.cached_tokens
            rate = self.prefill_rate.observe(usage.prefill_s, computed) if usage.cached_tokens == 0 else None
            if rate is not None:
                self.metrics.set_prefill_seconds_per_token(rate)
            self.metrics.record_request(
                tenant,
                self.model_id,
                "chat" if chat else "completions",
                usage.prompt_tokens,
                usage.cached_tokens,
                levels,
                usage.queue_s,
                ttft,
                time.monotonic() - arrived,
                usage.prefill_s,
            )
        except ValueError:  # metrics must never fail a request
            log.exception("recording metrics failed")


def _lookup(keys: Any, key: str) -> str | None:
    """The tenant of ``key``, comparing against every configured key in constant time."""
    found: str | None = None
    for candidate, tenant in keys.items():
        if hmac.compare_digest(candidate.encode(), key.encode()):
            found = tenant
    return found


def _tier_levels(cache: Any | None) -> dict[str, str]:
    """Tier name -> level (``L0`` device, ``L1`` host RAM, ``L2`` disk and Redis)."""
    tiers = getattr(getattr(cache, "config", None), "tiers", None) or ()
    return {tier.label: tier_level(tier.kind) for tier in tiers}


def _segments(levels: Mapping[str, int], prompt_tokens: int, cached_tokens: int) -> list[list[Any]]:
    """Where a prompt's tokens came from, in prompt order: ``[["L0", 96], ["L1", 32], ["computed", 70]]``.

    NOTE: tiers are prefix-closed (design invariant 4): a block's ancestors sit in its
    tier or a faster one, so along a loaded prefix the tiers only get slower and the
    sources can be listed fastest first without knowing each block's position."""
    folded: dict[str, int] = {}
    for level, n in sorted(levels.items(), key=lambda item: _level_rank(item[0])):
        source = level if level in STRIP_LEVELS else STRIP_LEVELS[-1]
        folded[source] = folded.get(source, 0) + n
    segments: list[list[Any]] = [[source, n] for source, n in folded.items() if n]
    if prompt_tokens > cached_tokens:
        segments.append(["computed", prompt_tokens - cached_tokens])
    return segments


def _level_rank(level: str) -> int:
    return int(level[1:]) if level[:1] == "L" and level[1:].isdigit() else 1 << 30


def _usage(done: DoneEvent) -> dict[str, Any]:
    u = done.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def create_app(
    engine: Engine, settings: Settings, cache: Any | None = None, registry: CollectorRegistry | None = None
) -> FastAPI:
    """The ASGI app serving ``engine``; ``cache`` is what the admin routes act on."""
    registry = registry if registry is not None else CollectorRegistry()
    server = Server(engine, settings, cache, registry)
    if cache is not None:
        registry.register(CacheCollector(cache))
    app = FastAPI(title="prefixcache", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    _routes(app, server)
    _errors(app)
    app.add_middleware(BodyLimit, limit=settings.server.max_body_bytes)
    return app


def _routes(app: FastAPI, server: Server) -> None:
    engine = server.engine

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest, tenant: str = Depends(server.tenant)) -> Response:
        tokens = engine.tokenize_chat(body.chat())
        max_tokens = body.max_completion_tokens or body.max_tokens
        default = server.settings.server.default_max_tokens
        return await server.generate(request, body, tokens, tenant, max_tokens, default, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest, tenant: str = Depends(server.tenant)) -> Response:
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            tokens = [int(t) for t in prompt]  # the engine checks they are in the vocabulary
        else:
            tokens = engine.tokenize_text(prompt if isinstance(prompt, str) else str(prompt[0]))
        if not tokens:
            raise APIError(400, "the prompt is empty", param="prompt")
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        return await server.generate(request, body, tokens, tenant, max_tokens, max_tokens, chat=False)

    @app.get("/v1/models")
    async def models(tenant: str = Depends(server.tenant)) -> dict[str, Any]:
        card = {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "prefixcache"}
        return {"object": "list", "data": [card]}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "model": server.model_id, "queue_depth": engine.queue_depth()}

    # NOTE: the routes that read or change the cache are plain functions, which FastAPI runs
    # in its thread pool: the cache's lock may be held by the worker through a load or a
    # store (tens of ms), and waiting for it must not stall every stream on the event loop.
    @app.get("/metrics", dependencies=[Depends(server.operator)])
    def metrics() -> Response:
        return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    page = _page()

    @app.get("/", include_in_schema=False)
    async def dashboard_page() -> Response:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    @app.get("/dashboard/data", dependencies=[Depends(server.operator)])
    def dashboard_json() -> dict[str, Any]:
        cache_stats = server.cache.stats() if server.cache is not None else {}
        return dashboard_data(cache_stats, server.metrics, list(server.recent), limit=RECENT_REQUESTS)

    @app.post("/admin/epoch", dependencies=[Depends(server.admin)])
    def bump_epoch(body: EpochRequest) -> dict[str, Any]:
        cache = _need_cache(server)
        return {"model": body.model, "epoch": cache.bump_epoch(body.model)}

    @app.post("/admin/purge", dependencies=[Depends(server.admin)])
    def purge(body: PurgeRequest) -> dict[str, Any]:
        cache = _need_cache(server)
        if body.prompt is None and body.messages is None:
            return {"tenant": body.tenant, "removed_blocks": cache.purge(body.tenant)}
        if body.messages is not None:
            tokens = engine.tokenize_chat([{"role": m.role, "content": m.text()} for m in body.messages], False)
        else:
            tokens = engine.tokenize_text(body.prompt or "")
        removed = cache.purge_prefix(tokens, engine.context(body.tenant))
        return {"tenant": body.tenant, "prefix_tokens": len(tokens), "removed_blocks": removed}

    @app.get("/admin/stats", dependencies=[Depends(server.admin)])
    def stats() -> dict[str, Any]:
        cache_stats = server.cache.stats() if server.cache is not None else None
        return {
            "model": server.model_id,
            "queue_depth": engine.queue_depth(),
            "engine": dataclasses.asdict(engine.stats),
            "prefill_seconds_per_token": server.prefill_rate.value,
            "cache": cache_stats,
        }


def _page() -> str:
    """The dashboard page, shipped as package data (``server/static/index.html``)."""
    return resources.files("prefixcache.server").joinpath("static", "index.html").read_text(encoding="utf-8")


def _need_cache(server: Server) -> Any:
    if server.cache is None:
        raise APIError(409, "the prefix cache is disabled on this server", code="cache_disabled")
    return server.cache


def _errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
        where = ".".join(loc) or "body"
        message = f"invalid {where}: {first.get('msg', 'invalid request')}"
        return APIError(400, message, param=loc[0] if loc else None, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(
            exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
        ).response()
