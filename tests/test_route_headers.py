"""Headers at the gateway: what a client sends reaches a backend only through the
router's allowlist, the router sets the forwarding headers itself, and a server in
trusted-gateway mode believes a tenant header only with the gateway's proof."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from engine_support import LiveServer
from prefixcache.api.auth import Auth
from prefixcache.api.errors import APIError
from prefixcache.api.sessions import Sessions
from prefixcache.fleet import router as router_module
from prefixcache.fleet.router import RouteConfig, Router, create_router
from prefixcache.fleet.stamping import Stamper
from prefixcache.fleet.wire import BackendInfo, Snapshot, stream_key
from prefixcache.fleet.zmq import VllmSource
from prefixcache.identity import PROOF_HEADER, tenant_proof
from prefixcache.settings import AuthSettings, ServerSettings, Settings
from redis_server import RedisServer, free_port
from support import wait_for

SECRET = "a-tenant-secret-of-32-characters"
KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
HEADER = "X-Org"  # the configured auth.tenant_header
BS, MODEL = 4, "m"


class Echo:
    """A backend that keeps the raw headers of every chat request it gets."""

    def __init__(self) -> None:
        self.seen: list[list[tuple[bytes, bytes]]] = []
        app = FastAPI()

        @app.get("/health")
        @app.get("/healthz")
        def health() -> dict[str, str]:
            return {}

        @app.get("/fleet/info")
        def info() -> Response:
            body = BackendInfo("echo", "inc", stream_key("prefixcache:fleet", "echo"), BS, MODEL, 100)
            return Response(msgspec.json.encode(body), media_type="application/json")

        @app.get("/fleet/snapshot")
        def snapshot() -> Response:
            return Response(msgspec.msgpack.encode(Snapshot("inc", 0, [])))

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            self.seen.append(list(request.headers.raw))
            return JSONResponse({"choices": []})

        self.live = LiveServer(app).start()

    @property
    def headers(self) -> dict[bytes, bytes]:
        last = self.seen[-1]
        assert len({k for k, _ in last}) == len(last), last  # no header twice
        return dict(last)


def tokenize(path: str, body: dict[str, object]) -> list[int]:
    return [1, 2, 3, 4, 5]


def start(
    backend: Echo, redis_url: str | None, backend_key: str = "", proxies: tuple[str, ...] = (), secret: str = SECRET
) -> tuple[Router, LiveServer]:
    auth = AuthSettings(api_keys=KEYS, tenant_header=HEADER, tenant_secret=secret, backend_key=backend_key)
    settings = Settings(auth=auth, server=ServerSettings(trusted_proxies=proxies))
    if redis_url is not None:
        config = RouteConfig((backend.live.url,), redis_url)
    else:
        source = VllmSource.parse(f"{backend.live.url}=tcp://127.0.0.1:{free_port()}", BS, MODEL)
        config = RouteConfig((), "redis://127.0.0.1:1/0", vllm=(source,))
    router = Router(config, settings, tokenize, CollectorRegistry())
    app = create_router(router)
    # NOTE: as ``prefixcache route`` runs it: no X-Forwarded-* believed, from any address
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", proxy_headers=False)
    live = LiveServer(app, config=config).start()
    wait_for(lambda: all(b.up for b in router.backends))
    return router, live


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Iterator[Echo]:
    monkeypatch.setattr(router_module, "HEALTH_EVERY_S", 3600.0)
    backend = Echo()
    yield backend
    backend.live.stop()


# What a careless or hostile client sends, as raw header lines (a name twice is sent twice).
HOSTILE: list[tuple[bytes, bytes]] = [
    (b"Authorization", b"Bearer sk-acme"),
    (b"Accept", b"application/json"),
    (b"Accept-Encoding", b"br"),
    (b"User-Agent", b"caf\xe9-client/1.0"),  # not ASCII: passed on as the bytes it was
    (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    (b"X-Request-Id", b"req-1"),
    (b"Cookie", b"pc_session=stolen"),
    (b"X-Tenant", b"victim"),
    (b"x-prefixcache-tenant", b"victim"),
    (b"X-Prefixcache-Backend", b"b"),
    (PROOF_HEADER.encode(), b"pcp1-forged"),
    (b"Connection", b"keep-alive, x-foo, tracestate"),
    (b"x-foo", b"hop"),
    (b"tracestate", b"named=by-connection"),
    (b"Keep-Alive", b"timeout=5"),
    (b"TE", b"trailers"),
    (b"Upgrade", b"h2c"),
    (b"Proxy-Authorization", b"Basic eDp5"),
    (b"X-Forwarded-For", b"6.6.6.6"),
    (b"X-Forwarded-Proto", b"https"),
    (b"X-Forwarded-Host", b"evil.example"),
    (b"Forwarded", b"for=6.6.6.6"),
]
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}).encode()


def send(url: str, headers: list[tuple[bytes, bytes]]) -> httpx.Response:
    headers = [(b"Content-Type", b"application/json"), *headers]
    return httpx.post(f"{url}/v1/chat/completions", content=BODY, headers=headers, timeout=10)


def test_a_server_gets_the_allowlist_the_key_and_the_proven_tenant(echo: Echo, redis_server: RedisServer) -> None:
    _router, live = start(echo, redis_server.url)
    try:
        assert send(live.url, HOSTILE).status_code == 200
        got = echo.headers
        assert set(got) == {
            b"host",  # these three are the router's own connection's
            b"content-length",
            b"connection",
            b"content-type",
            b"accept",
            b"accept-encoding",
            b"user-agent",
            b"traceparent",
            b"x-request-id",
            b"authorization",
            b"x-forwarded-for",
            b"x-forwarded-proto",
            b"x-org",
            PROOF_HEADER.encode(),
        }
        assert got[b"connection"] == b"keep-alive"  # the client's (naming x-foo and tracestate) stayed behind
        assert got[b"user-agent"] == b"caf\xe9-client/1.0" and got[b"authorization"] == b"Bearer sk-acme"
        assert got[b"x-forwarded-for"] == b"127.0.0.1" and got[b"x-forwarded-proto"] == b"http"
        assert got[b"accept-encoding"] == b"br"  # the relay passes the bytes on as they come: the client's choice
        assert got[b"x-org"] == b"acme" and got[PROOF_HEADER.encode()] == tenant_proof(SECRET.encode(), "acme").encode()
    finally:
        live.stop()


def test_a_vllm_backend_gets_neither_key_nor_tenant_header(echo: Echo) -> None:
    _router, live = start(echo, None)
    try:
        assert send(live.url, HOSTILE).status_code == 200
        got = echo.headers
        assert not {b"authorization", b"x-org", PROOF_HEADER.encode(), b"cookie", b"x-tenant"} & set(got)
        assert got[b"x-forwarded-for"] == b"127.0.0.1" and got[b"x-request-id"] == b"req-1"
    finally:
        live.stop()


def test_behind_a_trusted_proxy_the_router_names_the_client_that_proxy_saw(echo: Echo) -> None:
    _router, live = start(echo, None, proxies=("127.0.0.0/8",))
    try:
        chain = [(b"Authorization", b"Bearer sk-acme"), (b"X-Forwarded-For", b"6.6.6.6, 203.0.113.7")]
        chain.append((b"X-Forwarded-Proto", b"https"))
        assert send(live.url, chain).status_code == 200
        got = echo.headers  # the right-most hop the trusted proxy appended; the client's own word dropped
        assert got[b"x-forwarded-for"] == b"203.0.113.7" and got[b"x-forwarded-proto"] == b"https"
    finally:
        live.stop()


def test_a_vllm_backend_gets_the_routers_own_key_never_the_clients(echo: Echo) -> None:
    _router, live = start(echo, None, backend_key="vllm-key-of-the-router")
    try:
        assert send(live.url, HOSTILE).status_code == 200
        assert echo.headers[b"authorization"] == b"Bearer vllm-key-of-the-router"
    finally:
        live.stop()


def test_the_clients_tenant_header_is_believed_only_with_a_proof(echo: Echo, redis_server: RedisServer) -> None:
    _router, live = start(echo, redis_server.url)
    try:
        key = (b"Authorization", b"Bearer sk-acme")
        for forged in ([(b"X-Org", b"globex")], [(b"X-Org", b"globex"), (PROOF_HEADER.encode(), b"pcp1-0")]):
            refused = send(live.url, [key, *forged])
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_tenant_proof"
        assert echo.seen == []
        # a gateway in front of the router, holding the secret, may name the tenant
        proof = tenant_proof(SECRET.encode(), "initech").encode()
        assert send(live.url, [key, (b"X-Org", b"initech"), (PROOF_HEADER.encode(), proof)]).status_code == 200
        assert echo.headers[b"x-org"] == b"initech" and echo.headers[PROOF_HEADER.encode()] == proof
    finally:
        live.stop()


def test_without_a_secret_the_router_takes_the_tenant_from_the_key_never_the_clients_header(
    echo: Echo, redis_server: RedisServer
) -> None:
    """The servers' settings name a tenant header and no secret (a documented server mode:
    only the gateway reaches them). The router is that gateway: the key of globex with
    ``X-Org: acme`` reaches the backend as globex, and the router names it so (issue #39)."""
    _router, live = start(echo, redis_server.url, secret="")
    try:
        for forged in (b"acme", b"", b"globex, acme"):
            sent = send(live.url, [(b"Authorization", b"Bearer sk-globex"), (b"X-Org", forged)])
            assert sent.status_code == 200
            assert echo.headers[b"x-org"] == b"globex" and PROOF_HEADER.encode() not in echo.headers
        assert send(live.url, [(b"X-Org", b"acme")]).status_code == 401  # no key: no tenant at all
    finally:
        live.stop()


def test_route_warns_of_a_tenant_header_no_secret_backs() -> None:
    from prefixcache.fleet.cli import route_warnings

    trusting = Settings(auth=AuthSettings(api_keys=KEYS, tenant_header=HEADER))
    assert any("tenant_secret" in line and HEADER in line for line in route_warnings(trusting))
    proven = Settings(auth=AuthSettings(api_keys=KEYS, tenant_header=HEADER, tenant_secret=SECRET))
    assert route_warnings(proven) == []


def test_without_the_clients_choice_the_backend_is_asked_for_no_compression() -> None:
    stamper = Stamper(None, [], "")
    headers = stamper.headers([(b"content-type", b"application/json")], "acme", False, "10.0.0.1", "https")
    assert headers == {
        b"content-type": b"application/json",
        b"accept-encoding": b"identity",  # the relay passes bytes on as they come: never gzip nobody asked for
        b"x-forwarded-for": b"10.0.0.1",
        b"x-forwarded-proto": b"https",
    }


# ---------------------------------------------------------------------- the server's side


def tenant_of(auth: Auth, headers: list[tuple[bytes, bytes]]) -> str:
    return auth.tenant(Request({"type": "http", "method": "POST", "path": "/", "headers": headers}))


def test_a_server_in_trusted_gateway_mode_believes_the_header_only_with_the_proof() -> None:
    settings = AuthSettings(api_keys=KEYS, tenant_header=HEADER, tenant_secret=SECRET)
    auth = Auth(settings, Sessions(60))
    key = (b"authorization", b"Bearer sk-acme")
    assert tenant_of(auth, [key]) == "acme"  # no header: the key's tenant
    proof = tenant_proof(SECRET.encode(), "initech").encode()
    assert tenant_of(auth, [key, (b"x-org", b"initech"), (PROOF_HEADER.encode(), proof)]) == "initech"
    name = "m\u00fcller"  # a name beyond ASCII, as the router sends it (UTF-8)
    utf8 = [key, (b"x-org", name.encode()), (PROOF_HEADER.encode(), tenant_proof(SECRET.encode(), name).encode())]
    assert tenant_of(auth, utf8) == name
    for forged in (
        [(b"x-org", b"initech")],
        [(b"x-org", b"initech"), (PROOF_HEADER.encode(), tenant_proof(SECRET.encode(), "acme").encode())],
        [
            (b"x-org", b"initech"),
            (PROOF_HEADER.encode(), tenant_proof(b"another-secret-of-32-characters!", "initech").encode()),
        ],
    ):
        with pytest.raises(APIError) as caught:
            tenant_of(auth, [key, *forged])
        assert caught.value.status == 401 and caught.value.code == "invalid_tenant_proof"
    with pytest.raises(APIError) as caught:  # the header never replaces the key
        tenant_of(auth, [(b"x-org", b"initech"), (PROOF_HEADER.encode(), proof)])
    assert caught.value.code == "invalid_api_key"
    # without a secret the operator vouches that only the gateway reaches the server
    trusting = Auth(AuthSettings(api_keys=KEYS, tenant_header=HEADER), Sessions(60))
    assert tenant_of(trusting, [key, (b"x-org", b"initech")]) == "initech"
