"""The OpenAI-compatible HTTP front of an ``Engine``.

    client ──HTTP──> BodyLimit ──> auth (Bearer -> tenant) ──> route ──> Engine.submit(sink)
                                                                  <── events via the event loop

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE), Anthropic's
``POST /v1/messages`` (JSON or SSE) and ``POST /v1/messages/count_tokens`` (``messages.py``;
the key in ``x-api-key`` too, errors in Anthropic's shape), ``GET /v1/models``,
``GET /healthz``, the dashboard page at ``GET /``; behind the admin key ``GET /metrics``
and ``GET /dashboard/data`` (per-tenant figures: a tenant's key gets 403, so no tenant
sees another's), ``POST /admin/epoch``, ``POST /admin/purge``, ``GET /admin/stats``, and
(``[fleet]``) ``GET /fleet/info`` (``BackendInfo`` as JSON) and ``GET /fleet/snapshot``
(``Snapshot``, msgpack). The page logs in with ``POST /dashboard/login`` (the admin key in
the body, a session cookie back; see sessions.py) and out with ``POST /dashboard/logout``.
In local mode (no API keys, no admin key) everything is open.
Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, but on
Anthropic's routes (``api/errors.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any, Protocol

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prefixcache.api.apidoc import install_openapi
from prefixcache.api.auth import Auth
from prefixcache.api.errors import APIError, BodyLimit, install_error_handlers
from prefixcache.api.messages import CountTokensRequest, MessagesRequest
from prefixcache.api.prompts import prompt_tokens
from prefixcache.api.schemas import ChatRequest, CompletionRequest, EpochRequest, LoginRequest, PurgeRequest
from prefixcache.api.sessions import COOKIE, LoginThrottle, Sessions, TrustedProxies
from prefixcache.blend.metrics import BlendMetrics
from prefixcache.blend.serve_engine import BlendEngine
from prefixcache.blend.serve_gate import GateStatus
from prefixcache.cache import PrefixCache
from prefixcache.cache.epochbook import EpochNotKept
from prefixcache.cache.stats import CacheStats, to_json, top_tenants
from prefixcache.engine import Engine
from prefixcache.ops.collector import CacheCollector
from prefixcache.ops.dashboard import dashboard_data
from prefixcache.server.messages import Messages
from prefixcache.server.openai import COMPLETIONS_DEFAULT_MAX_TOKENS, Completions
from prefixcache.server.recording import RECENT_REQUESTS, Recorder
from prefixcache.settings import Settings

__all__ = ["EventPublisher", "PublisherFactory", "Server", "create_app"]

# NOTE: the page is inline HTML/CSS/JS and must load nothing from elsewhere; the policy makes that a rule.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

MSGPACK = "application/vnd.msgpack"
TOP_TENANTS = 20  # tenants listed by name in /admin/stats, as /metrics labels them


class EventPublisher(Protocol):
    """What the app asks of the publisher of this server's KV events (``[fleet]``;
    ``fleet.publisher.FleetPublisher``): start and stop it with the app, and answer a
    router's ``/fleet/info`` and ``/fleet/snapshot`` with what it says (msgspec structs).
    The server's wiring (``main.py``) builds it, so that the app imports nothing of ``fleet/``."""

    def start(self) -> object: ...

    def stop(self) -> None: ...

    def info(self) -> msgspec.Struct: ...

    def snapshot(self) -> msgspec.Struct: ...


# the cache it publishes and the registry its counters go to -> the publisher
PublisherFactory = Callable[[PrefixCache, CollectorRegistry], EventPublisher]


class Server:
    """The routes' state: the engine, the cache (None when disabled), auth, metrics."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        cache: PrefixCache | None,
        registry: CollectorRegistry,
        publisher: PublisherFactory | None = None,
    ):
        self.engine, self.settings, self.cache, self.registry = engine, settings, cache, registry
        self.model_id = engine.model_id
        self.created = int(time.time())
        self.sessions = Sessions(settings.auth.dashboard_session_s)
        self.proxies = TrustedProxies(settings.server.trusted_proxies)
        self.logins = LoginThrottle()
        self.auth = Auth(settings.auth, self.sessions)
        self.blend = BlendMetrics(registry)
        self.blend_engine = engine if isinstance(engine, BlendEngine) else None
        if self.blend_engine is not None:
            self._gate(self.blend_engine.gate)
        self.recorder = Recorder(registry, engine.model_id, cache, self.blend)
        self.completions = Completions(engine, self.recorder)
        self.messages = Messages(self.completions)
        self.fleet = publisher(cache, registry) if publisher is not None and cache is not None else None

    def _gate(self, gate: GateStatus) -> None:
        """Export the gate's verdict on the configured plan, and whether the mode is on."""
        if gate.report is not None:
            self.blend.record_gate(gate.report)
        self.blend.set_enabled(self.model_id, gate.plan if gate.passed else None)
        if not gate.passed:
            self.blend.enabled.labels(self.model_id, gate.plan).set(0.0)

    def need_fleet(self) -> EventPublisher:
        if self.fleet is None:
            raise APIError(409, "this server publishes no KV events (see [fleet] publish)", code="fleet_disabled")
        return self.fleet

    def stop_fleet(self) -> None:
        """Publish what the cache recorded last, then stop the publisher. Idempotent."""
        if self.fleet is not None:
            self.fleet.stop()

    def need_cache(self) -> PrefixCache:
        if self.cache is None:
            raise APIError(409, "the prefix cache is disabled on this server", code="cache_disabled")
        return self.cache


def create_app(
    engine: Engine,
    settings: Settings,
    cache: PrefixCache | None = None,
    registry: CollectorRegistry | None = None,
    shutdown: Callable[[], None] | None = None,
    publisher: PublisherFactory | None = None,
) -> FastAPI:
    """The ASGI app serving ``engine``; ``cache`` is what the admin routes act on.
    ``shutdown`` runs when the server stops gracefully, after the last request
    (``serve`` flushes the cache there: uvicorn then re-raises SIGTERM, which would end
    the process before any code after it runs). ``publisher`` builds the KV-event
    publisher the app starts and stops (``main.create_app`` passes the one ``[fleet]``
    asks for); without it ``/fleet/*`` answer 409."""
    if settings.fleet.publish and publisher is None:  # never a [fleet] that silently publishes nothing
        raise ValueError("fleet.publish = true needs the publisher: build the app with server.main.create_app")
    registry = registry if registry is not None else CollectorRegistry()
    server = Server(engine, settings, cache, registry, publisher)
    if cache is not None:
        registry.register(CacheCollector(cache))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if server.fleet is not None:
            server.fleet.start()
        yield
        if shutdown is not None:
            await asyncio.to_thread(shutdown)
        await asyncio.to_thread(server.stop_fleet)  # NOTE: after the cache's flush, whose tier moves it sends

    app = FastAPI(title="prefixcache", docs_url=None, redoc_url=None, openapi_url="/openapi.json", lifespan=lifespan)
    install_openapi(app, settings.auth)
    app.state.server = server
    _generation_routes(app, server)
    _messages_routes(app, server)
    _operator_routes(app, server)
    _fleet_routes(app, server)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.server.max_body_bytes)
    return app


def _generation_routes(app: FastAPI, server: Server) -> None:
    engine, auth, completions = server.engine, server.auth, server.completions

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest, tenant: str = Depends(auth.tenant)) -> Response:
        tokens = prompt_tokens(engine, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        default = server.settings.server.default_max_tokens
        return await completions.generate(request, body, tokens, tenant, max_tokens, default, chat=True)

    @app.post("/v1/completions")
    async def complete(request: Request, body: CompletionRequest, tenant: str = Depends(auth.tenant)) -> Response:
        tokens = prompt_tokens(engine, body)
        if not tokens:
            raise APIError(400, "the prompt is empty", code="invalid_value", param="prompt")
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        return await completions.generate(request, body, tokens, tenant, max_tokens, max_tokens, chat=False)

    @app.get("/v1/models")
    async def models(tenant: str = Depends(auth.tenant)) -> dict[str, Any]:
        card = {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "prefixcache"}
        return {"object": "list", "data": [card]}

    # NOTE: no queue depth here: /healthz answers anyone, and how many requests wait is
    # every tenant's load together (a tenant could watch the others'); /admin/stats has it
    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "model": server.model_id}


def _messages_routes(app: FastAPI, server: Server) -> None:
    """Anthropic's Messages API (``server/messages.py``)."""
    auth, messages = server.auth, server.messages

    @app.post("/v1/messages")
    async def create_message(
        request: Request, body: MessagesRequest, tenant: str = Depends(auth.messages_tenant)
    ) -> Response:
        return await messages.create(request, body, tenant)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, tenant: str = Depends(auth.messages_tenant)) -> dict[str, int]:
        return messages.count_tokens(body)


def _operator_routes(app: FastAPI, server: Server) -> None:
    engine, auth, recorder = server.engine, server.auth, server.recorder

    # NOTE: the routes that read or change the cache are plain functions, which FastAPI runs
    # in its thread pool: the cache's lock is held only to decide and to commit (never over
    # I/O), but even a short wait must not stall every stream on the event loop.
    @app.get("/metrics", dependencies=[Depends(auth.operator)])
    def metrics() -> Response:
        return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    page = resources.files("prefixcache.server").joinpath("static", "index.html").read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    async def dashboard_page() -> Response:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    def over_tls(request: Request) -> bool:
        peer = request.client.host if request.client else None
        return server.proxies.secure(request.url.scheme, peer, request.headers.get("x-forwarded-proto"))

    @app.post("/dashboard/login", status_code=204)
    def login(request: Request, body: LoginRequest) -> Response:
        peer = request.client.host if request.client else None
        client = server.proxies.client(peer, ",".join(request.headers.getlist("x-forwarded-for")))
        wait = server.logins.retry_after(client)
        if wait:  # NOTE: before the key is checked, so that a throttled guess learns nothing
            raise APIError(
                429,
                "Too many failed logins from this address; retry later.",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(wait)},
            )
        try:
            auth.admin_key(body.key, "The dashboard is for the operator")
        except APIError:
            server.logins.failed(client)
            raise
        response = Response(status_code=204)
        response.set_cookie(
            COOKIE,
            server.sessions.open(),
            max_age=int(server.sessions.ttl_s),
            path="/",
            secure=over_tls(request),  # sent back over TLS only, when it came that way
            httponly=True,  # no script reads it
            samesite="strict",  # no other site's page sends it
        )
        return response

    @app.post("/dashboard/logout", status_code=204)
    def logout(request: Request) -> Response:
        server.sessions.close(request.cookies.get(COOKIE))
        response = Response(status_code=204)
        response.delete_cookie(COOKIE, path="/", secure=over_tls(request), httponly=True, samesite="strict")
        return response

    @app.get("/dashboard/data", dependencies=[Depends(auth.dashboard)])
    def dashboard_json() -> dict[str, Any]:
        cache_stats = server.cache.stats() if server.cache is not None else None
        return dashboard_data(cache_stats, recorder.metrics, list(recorder.recent), RECENT_REQUESTS)

    @app.post("/admin/epoch", dependencies=[Depends(auth.admin)])
    def bump_epoch(body: EpochRequest) -> dict[str, Any]:
        if body.model != server.model_id:  # a typo would otherwise count an epoch of a model nobody serves
            raise APIError(404, f"The model `{body.model}` is not served here.", code="model_not_found", param="model")
        blender = server.blend_engine.blender if server.blend_engine is not None else None
        if blender is not None:
            blender.bump_epoch(engine.cache_model)
        try:
            epoch = server.need_cache().bump_epoch(engine.cache_model)
        except EpochNotKept as exc:  # NOTE: the bump holds here; a tier that outlives us did not keep it
            raise APIError(503, str(exc), "server_error", "epoch_not_kept") from None
        return {"model": body.model, "epoch": epoch}

    @app.post("/admin/purge", dependencies=[Depends(auth.admin)])
    def purge(body: PurgeRequest) -> dict[str, Any]:
        cache = server.need_cache()
        blender = server.blend_engine.blender if server.blend_engine is not None else None
        if body.prompt is None and body.messages is None:
            # NOTE: the blender counts the tenant's chunks before the cache's purge removes them
            chunks = {"removed_chunks": blender.purge(body.tenant)} if blender is not None else {}
            try:
                removed = cache.purge(body.tenant)
            except EpochNotKept as exc:  # NOTE: the purge holds here; a tier that outlives us did not keep it
                raise APIError(503, str(exc), "server_error", "purge_not_kept") from None
            return {"tenant": body.tenant, "removed_blocks": removed} | chunks
        if body.messages is not None:
            tokens = engine.tokenize_chat([{"role": m.role, "content": m.text()} for m in body.messages], False)
        else:
            tokens = engine.tokenize_text(body.prompt or "")
        ctx = engine.context(body.tenant)
        removed = cache.purge_prefix(tokens, ctx)
        chunk_tokens = {"removed_chunk_tokens": blender.purge_prefix(tokens, ctx)} if blender is not None else {}
        return {"tenant": body.tenant, "prefix_tokens": len(tokens), "removed_blocks": removed} | chunk_tokens

    @app.get("/admin/stats", dependencies=[Depends(auth.admin)])
    def stats() -> dict[str, Any]:
        return {
            "model": server.model_id,
            "queue_depth": engine.queue_depth(),
            "engine": dataclasses.asdict(engine.stats),
            "kv_memory": dataclasses.asdict(engine.kv_memory()),
            "prefill_seconds_per_token": recorder.prefill_rate.value,
            "cache": to_json(_bounded(server.cache.stats())) if server.cache is not None else None,
        }


def _fleet_routes(app: FastAPI, server: Server) -> None:
    """What a router asks a backend (behind the admin key, as the rest of the whole cache is)."""
    auth = server.auth

    @app.get("/fleet/info", dependencies=[Depends(auth.admin)])
    def fleet_info() -> Response:
        return Response(msgspec.json.encode(server.need_fleet().info()), media_type="application/json")

    @app.get("/fleet/snapshot", dependencies=[Depends(auth.admin)])
    def fleet_snapshot() -> Response:
        return Response(msgspec.msgpack.encode(server.need_fleet().snapshot()), media_type=MSGPACK)


def _bounded(stats: CacheStats) -> CacheStats:
    """The stats with their tenants bounded as /metrics bounds its labels (the top ones by
    prompt tokens, the rest summed under "other"), so that many tenants make no huge page."""
    return dataclasses.replace(stats, tenants=top_tenants(stats.tenants, TOP_TENANTS))
