"""``prefixcache route``: an OpenAI-compatible proxy (and Anthropic's Messages API, to our
servers' and vLLM's ``/v1/messages``) that sends each request where its prefill is cheapest.

    client ──> BodyLimit (size, JSON depth) ──> auth (the servers' API keys -> tenant)
    ──> body check (validate: the servers' schemas) ──> tokenize (the model's chat
    template) ──> keys (fleet.keys) ──> index.matched (own + public namespace only)
    ──> Scorer.choose ──> stamp (stamping) ──> forward, streaming ──> backend

A body the servers would refuse is refused here first, in their words (``validate``).
The tenant is the router's own (``auth.tenant``), and what it forwards names no other
(``stamping``): a vLLM backend gets the tenant's ``cache_salt`` and the connector's
claim in place of the client's; a prefixcache server gets the body without them, the
client's key, which it checks again, and the tenant header with the gateway's proof.
Only what never started on a backend is tried on the next one (``relay``); once bytes
have gone to the client a failure ends the stream, as it would without a router. Which
backend served is in the ``x-prefixcache-backend`` response header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from prefixcache.api.apidoc import install_openapi
from prefixcache.api.auth import Auth
from prefixcache.api.errors import APIError, BodyLimit, install_error_handlers
from prefixcache.api.sessions import Sessions, TrustedProxies
from prefixcache.fleet.backends import DOWN_AFTER, Backend, BackendError, fetch_info
from prefixcache.fleet.index import GlobalIndex
from prefixcache.fleet.keys import TokenRangeError, chain_keys, root_key, token_bytes
from prefixcache.fleet.relay import RETRY_STATUS, Held, failed, hold, relay
from prefixcache.fleet.route_metrics import RouteCollector
from prefixcache.fleet.scoring import BackendView, Routing, Scorer, affinity_of
from prefixcache.fleet.stamping import NO_SECRET, Stamper
from prefixcache.fleet.validate import CHAT, COMPLETIONS, COUNT_TOKENS, MESSAGES, Strictness, body_check, check_vllm
from prefixcache.fleet.zmq import VllmSource
from prefixcache.settings import Settings
from prefixcache.tenancy import PUBLIC

__all__ = ["RouteConfig", "Router", "create_router"]

log = logging.getLogger("prefixcache.route")

HEALTH_EVERY_S = 1.0
HEALTH_TIMEOUT = httpx.Timeout(2.0)
FORWARD_TIMEOUT = httpx.Timeout(connect=2.0, read=300.0, write=30.0, pool=30.0)

Tokenize = Callable[[str, dict[str, Any]], list[int]]  # (path, body) -> prompt tokens


@dataclass(frozen=True, slots=True)
class RouteConfig:
    backends: tuple[str, ...]
    redis_url: str
    routing: Routing = Routing.COST
    scorer: Scorer = field(default_factory=Scorer)
    vllm: tuple[VllmSource, ...] = ()  # vLLM backends, followed on their own publishers
    tenant_secret: bytes | None = field(default=None, repr=False)  # default: settings' auth.tenant_secret


class Router:
    """The router's state: backends, the index, the scorer, its metrics."""

    def __init__(self, config: RouteConfig, settings: Settings, tokenize: Tokenize, registry: CollectorRegistry):
        if not config.backends and not config.vllm:
            raise ValueError("route needs at least one --backend URL or --vllm-backend")
        self.config, self.settings, self.tokenize = config, settings, tokenize
        secret = config.tenant_secret or settings.auth.tenant_secret.encode() or None
        if config.vllm and secret is None:
            raise ValueError(NO_SECRET)
        self.stamper = Stamper.of(settings, secret)
        self.auth = Auth.at_gateway(settings.auth, Sessions(settings.auth.dashboard_session_s))
        self.proxies = TrustedProxies(settings.server.trusted_proxies)  # whose X-Forwarded-* the router believes
        self.shared_mode = settings.cache.isolation == "shared"
        self.index = GlobalIndex(rank=config.scorer.credit)
        self.redis = redis.Redis.from_url(config.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        key = settings.auth.admin_key
        self.backends = [Backend(url.rstrip("/"), key) for url in config.backends]
        self.backends += [Backend(v.url, source=v, salts=self.stamper.salts) for v in config.vllm]
        self.turn = 0
        self.registry = registry
        self.strictness = Strictness.of(bool(config.backends))
        self.transport: httpx.AsyncHTTPTransport | None = None
        self.client: httpx.AsyncClient | None = None  # over ``transport``
        self.requests = Counter(
            "prefixcache_route_requests_total", "Requests forwarded, by backend", ["backend"], registry=registry
        )
        self.retries = Counter(
            "prefixcache_route_retries_total", "Requests sent again after a backend failed", registry=registry
        )
        self.overlap = Counter(
            "prefixcache_route_overlap_blocks_total", "Prompt blocks the chosen backend held", registry=registry
        )
        Gauge("prefixcache_route_backends_up", "Backends taking requests", registry=registry).set_function(
            lambda: sum(b.up for b in self.backends)
        )
        Gauge("prefixcache_route_index_blocks", "Distinct blocks in the index", registry=registry).set_function(
            lambda: self.index.stats().blocks
        )
        registry.register(RouteCollector(lambda: self.backends, self.index, config.scorer))

    # ------------------------------------------------------------------ health

    async def check(self, backend: Backend) -> None:
        """One health check (and, until it is known, the backend's info). A check that
        passes is logged at DEBUG; the first that fails, and a backend going down or
        coming back, at WARNING or INFO."""
        try:
            if backend.source is not None:
                if backend.info is None:
                    backend.attach(backend.source.info(), self.index, self.redis)
            elif backend.info is None or not backend.up:
                info = await asyncio.to_thread(fetch_info, backend.url, backend.admin_key)
                if backend.info is not None and info.name != backend.info.name:
                    raise BackendError(f"{backend.url} changed its name to {info.name!r}")
                backend.attach(info, self.index, self.redis)
            status = await self.probe(backend.url + backend.health_path)
            if status != 200:
                raise BackendError(f"{backend.health_path} answered {status}")
        except (BackendError, httpx.HTTPError) as exc:
            why = str(exc) or type(exc).__name__
            level = logging.WARNING if backend.up else logging.DEBUG  # a down backend fails every second
            log.log(level, "event=route_health_failed backend=%s why=%s", backend.name, why)
            backend.failures += 1
            if backend.failures >= DOWN_AFTER or backend.info is None:
                backend.mark_down(self.index, why)
            return
        log.debug("event=route_health_ok backend=%s", backend.name)
        if not backend.up:
            log.info("event=route_backend_up backend=%s url=%s", backend.name, backend.url)
        backend.failures, backend.up = 0, True

    async def probe(self, url: str) -> int:
        """The status ``GET url`` answers.

        NOTE: straight to the transport, below httpx's client, which logs every request
        it sends at INFO: a line per backend every second. ``check`` logs its own."""
        assert self.transport is not None
        request = httpx.Request("GET", url, extensions={"timeout": HEALTH_TIMEOUT.as_dict()})
        response = await self.transport.handle_async_request(request)
        try:
            await response.aread()  # read to the end, so that the connection is kept for the next
        finally:
            await response.aclose()
        return response.status_code

    async def watch(self) -> None:
        while True:
            await asyncio.gather(*(self.check(b) for b in self.backends))
            await asyncio.sleep(HEALTH_EVERY_S)

    # ------------------------------------------------------------------ choice

    def namespace(self, tenant: str, vllm: bool = False) -> str:
        """Where ``tenant``'s own blocks are keyed: its cache namespace, and on vLLM, whose
        own cache the gateway salts per tenant in every isolation mode, always its name
        (``vllm_events`` credits a salted chain there)."""
        return tenant if vllm or not self.shared_mode else PUBLIC

    def chains(self, tenant: str, tokens: Sequence[int], model: str, block_size: int) -> list[list[bytes]]:
        """The key chains ``tenant`` may reuse: its namespace's, the public one, and with
        vLLM backends in shared isolation its salted vLLM chains."""
        names = dict.fromkeys([self.namespace(tenant), PUBLIC, *([tenant] if self.config.vllm else [])])
        return [chain_keys(root_key(n, model), tokens, block_size) for n in names]

    def tokens(self, path: str, body: dict[str, Any]) -> list[int]:
        """The prompt tokens of a validated ``body``, as the servers compute them; none
        (routed on load alone, for the backend to answer) when they cannot be computed
        or keyed (token ids out of ``[0, 2**32)``, which the backend refuses itself)."""
        try:
            tokens = self.tokenize(path, body)
            token_bytes(tokens)
        except (TokenRangeError, ValueError, TypeError, KeyError):
            return []
        return tokens

    def expect(self, backend: Backend, tenant: str, tokens: Sequence[int]) -> None:
        """Count the prompt's blocks on ``backend`` until its events arrive (``GlobalIndex.expect``)."""
        info = backend.info
        if info is not None and tokens:
            ns = self.namespace(tenant, vllm=backend.source is not None)
            self.index.expect(backend.name, chain_keys(root_key(ns, info.model), tokens, info.block_size))

    def rank(
        self, tenant: str, tokens: Sequence[int], exclude: set[str], affinity: bytes | None = None
    ) -> list[tuple[Backend, int, int]]:
        """Backends up and not excluded, best first by the configured routing, each with
        the prompt blocks it holds and those it would have left to prefill (``affinity``:
        the request's, ``scoring.affinity_of``)."""
        live = [b for b in self.backends if b.up and b.info is not None and b.url not in exclude]
        if not live:
            return []
        turn, self.turn = self.turn, self.turn + 1
        live = live[turn % len(live) :] + live[: turn % len(live)]  # ties rotate
        info = live[0].info
        assert info is not None
        blocks = len(tokens) // info.block_size
        matched = self.index.matched(self.chains(tenant, tokens, info.model, info.block_size), [b.name for b in live])
        scorer = self.config.scorer
        views = [BackendView(b.name, matched[b.name], scorer.load(b.pending, b.generating)) for b in live]
        order: list[tuple[Backend, int, int]] = []
        while views:
            best = scorer.choose(self.config.routing, blocks, views, 0, affinity)
            i = next(i for i, v in enumerate(views) if v.name == best.backend)
            order.append((live[i], best.overlap, blocks - best.overlap))
            del views[i], live[i]
        return order


def create_router(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router.transport = httpx.AsyncHTTPTransport()
        router.client = httpx.AsyncClient(transport=router.transport, timeout=FORWARD_TIMEOUT)
        await asyncio.gather(*(router.check(b) for b in router.backends))
        watcher = asyncio.create_task(router.watch())
        try:
            yield
        finally:
            watcher.cancel()
            for b in router.backends:
                b.close()
            await router.client.aclose()
            router.redis.close()

    app = FastAPI(title="prefixcache route", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_openapi(app, router.settings.auth)  # the servers' document, of the routes the router serves
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=router.settings.server.max_body_bytes)  # the servers' own limits
    auth = router.auth

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        up = [b.name for b in router.backends if b.up]
        return {"status": "ok" if up else "no_backend", "backends_up": up}

    @app.get("/metrics", dependencies=[Depends(auth.admin)])
    def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request, tenant: str = Depends(auth.tenant)) -> Response:
        return await forward(request, "/v1/models", b"", None, [], tenant)

    @app.post(CHAT, dependencies=[Depends(body_check(CHAT, router.strictness))])
    async def chat(request: Request, tenant: str = Depends(auth.tenant)) -> Response:
        return await route(request, CHAT, tenant)

    @app.post(COMPLETIONS, dependencies=[Depends(body_check(COMPLETIONS, router.strictness))])
    async def complete(request: Request, tenant: str = Depends(auth.tenant)) -> Response:
        return await route(request, COMPLETIONS, tenant)

    # Anthropic's Messages API: routed as a chat is, on the prompt as the servers render it
    # (``api/messages_prompt``); its key may come as x-api-key, its errors in its shape.
    @app.post(MESSAGES, dependencies=[Depends(body_check(MESSAGES, router.strictness))])
    async def messages(request: Request, tenant: str = Depends(auth.messages_tenant)) -> Response:
        return await route(request, MESSAGES, tenant)

    @app.post(COUNT_TOKENS, dependencies=[Depends(body_check(COUNT_TOKENS, router.strictness))])
    async def count_tokens(request: Request, tenant: str = Depends(auth.messages_tenant)) -> Response:
        raw = await request.body()
        return await forward(request, COUNT_TOKENS, raw, json.loads(raw), [], tenant)

    async def route(request: Request, path: str, tenant: str) -> Response:
        raw = await request.body()
        body = json.loads(raw)  # an object the body check validated, nested no deeper than BodyLimit lets through
        affinity = affinity_of(tenant, _affinity_key(path, body))  # a hint: the cache's scope is the tenant's
        return await forward(request, path, raw, body, router.tokens(path, body), tenant, affinity)

    async def forward(
        request: Request,
        path: str,
        raw: bytes,
        body: dict[str, Any] | None,
        tokens: list[int],
        tenant: str,
        affinity: bytes | None = None,
    ) -> Response:
        """Send the request to the best backend up; to the next only what never started
        on it (``relay``). The method is the client's own, never rewritten."""
        assert router.client is not None
        tried: set[str] = set()
        held: Held | None = None  # the last 503, relayed if no other backend is left
        lost = False  # a backend already dropped this request's connection (relay.failed)
        # NOTE: the client as the router knows it: the peer, or behind a proxy it trusts
        # (server.trusted_proxies) the address that proxy saw; what else a client wrote is dropped
        peer, said = request.client.host if request.client is not None else None, request.headers
        client = router.proxies.client(peer, said.get("x-forwarded-for")) or None
        secure = router.proxies.secure(request.url.scheme, peer, said.get("x-forwarded-proto"))
        while True:
            order = router.rank(tenant, tokens, tried, affinity)
            if not order:
                if held is not None:
                    return held.response()
                raise APIError(503, "no backend is available", code="no_backend")
            if tried:
                router.retries.inc()
            backend, overlap, left = order[0]
            tried.add(backend.url)
            vllm = backend.source is not None
            headers = router.stamper.headers(request.headers.raw, tenant, vllm, client, "https" if secure else "http")
            content: bytes | None = None
            if body is not None:
                if vllm:
                    check_vllm(body)
                content, added = router.stamper.body(raw, body, tenant, vllm)
                headers |= added
            outgoing = router.client.build_request(request.method, backend.url + path, content=content, headers=headers)
            backend.pending += left
            try:
                reply = await router.client.send(outgoing, stream=True)
            except httpx.HTTPError as exc:
                backend.pending -= left
                failure = failed(exc, backend.name)
                if failure.down:
                    backend.mark_down(router.index, f"forward: {type(exc).__name__}")
                if not failure.retry or (failure.lost and lost):
                    raise failure.error from None
                lost = lost or failure.lost
                continue
            if reply.status_code in RETRY_STATUS:
                backend.pending -= left
                held = await hold(reply, backend)
                continue
            router.requests.labels(backend.name).inc()
            router.expect(backend, tenant, tokens)
            router.overlap.inc(overlap)
            backend.sent += 1
            return relay(reply, backend, left)

    return app


def _affinity_key(path: str, body: dict[str, Any]) -> object:
    """The client's affinity hint: OpenAI's ``prompt_cache_key``, Anthropic's
    ``metadata.user_id`` (one end user's conversations go to one backend on ties)."""
    if path != MESSAGES:
        return body.get("prompt_cache_key")
    metadata = body.get("metadata")
    return metadata.get("user_id") if isinstance(metadata, dict) else None
