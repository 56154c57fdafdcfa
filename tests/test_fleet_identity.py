"""The gateway owns the tenant (design invariant 11): what ``prefixcache route`` forwards,
read where it lands, on real HTTP. A recording backend stands in for vLLM (its
``/health``, a ZMQ endpoint nobody publishes on) or for a prefixcache server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from engine_support import LiveServer
from prefixcache.cli import main
from prefixcache.fleet import router as router_module
from prefixcache.fleet.router import RouteConfig, Router, create_router
from prefixcache.fleet.stamping import route_secret
from prefixcache.fleet.wire import BackendInfo, Snapshot, stream_key
from prefixcache.fleet.zmq import VllmSource
from prefixcache.identity import PARAMS_KEY, PROOF_HEADER, SECRET_ENV, tenant_proof, tenant_salt
from prefixcache.settings import AuthSettings, Settings, describe, load_settings
from redis_server import RedisServer, free_port
from support import wait_for

BS = 4
MODEL = "m"
SECRET = "a-tenant-secret-of-32-characters"
KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
VICTIM = {"cache_salt": "victims-salt", "kv_transfer_params": {PARAMS_KEY: "victim", "tenant": "victim"}}
SNEAKY = {"x-prefixcache-tenant": "victim", "X-Prefixcache-Backend": "b", "x-tenant": "victim"}


class Recorder:
    """A backend that answers every chat with 200 and keeps what it was sent."""

    def __init__(self, vllm: bool) -> None:
        self.seen: list[tuple[bytes, dict[str, str]]] = []
        app = FastAPI()

        @app.get("/health")
        @app.get("/healthz")
        def health() -> dict[str, str]:
            return {}

        @app.get("/fleet/info")
        def info() -> Response:
            body = BackendInfo("server", "inc", stream_key("prefixcache:fleet", "server"), BS, MODEL, 100)
            return Response(msgspec.json.encode(body), media_type="application/json")

        @app.get("/fleet/snapshot")
        def snapshot() -> Response:
            return Response(msgspec.msgpack.encode(Snapshot("inc", 0, [])))

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            self.seen.append((await request.body(), {k.lower(): v for k, v in request.headers.items()}))
            return JSONResponse({"choices": []})

        self.live = LiveServer(app).start()
        self.vllm = vllm

    def source(self) -> VllmSource:
        return VllmSource.parse(f"{self.live.url}=tcp://127.0.0.1:{free_port()}", BS, MODEL)

    @property
    def body(self) -> dict[str, Any]:
        got: dict[str, Any] = json.loads(self.seen[-1][0])
        return got


def serve(router: Router) -> LiveServer:
    app = create_router(router)
    return LiveServer(app, config=uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")).start()


def tokenize(path: str, body: dict[str, Any]) -> list[int]:
    return [ord(c) for c in body["messages"][-1]["content"]]


@pytest.fixture
def vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Recorder, Router, str]]:
    monkeypatch.setattr(router_module, "HEALTH_EVERY_S", 3600.0)
    backend = Recorder(vllm=True)
    settings = Settings(auth=AuthSettings(api_keys=KEYS, tenant_secret=SECRET))
    config = RouteConfig((), "redis://127.0.0.1:1/0", vllm=(backend.source(),))
    router = Router(config, settings, tokenize, CollectorRegistry())
    live = serve(router)
    wait_for(lambda: all(b.up for b in router.backends))
    yield backend, router, live.url
    live.stop()
    backend.live.stop()


def send(url: str, body: object, key: str = "sk-acme", headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"} | (headers or {})
    return httpx.post(f"{url}/v1/chat/completions", content=content, headers=head, timeout=10)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "temperature": 0.5} | extra


# ---------------------------------------------------------------------- vLLM backends


@pytest.mark.parametrize(
    "claim",
    [
        VICTIM,
        {"kv_transfer_params": {PARAMS_KEY: "victim"}},
        {"kv_transfer_params": {"tenant": "victim"}},
        {"cache_salt": tenant_salt(SECRET.encode(), "globex")},  # another tenant's real salt
        {},
    ],
)
def test_vllm_gets_the_authenticated_tenants_salt_and_claim_only(
    vllm: tuple[Recorder, Router, str], claim: dict[str, Any]
) -> None:
    backend, _router, url = vllm
    reply = send(url, chat_body(**claim), headers=SNEAKY)
    assert reply.status_code == 200
    raw, headers = backend.seen[-1]
    salt = tenant_salt(SECRET.encode(), "acme")
    assert backend.body == chat_body(cache_salt=salt, kv_transfer_params={PARAMS_KEY: "acme"})
    assert b"victim" not in raw and tenant_salt(SECRET.encode(), "globex").encode() not in raw
    assert "acme" not in salt
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(raw)
    assert not any(k.startswith("x-prefixcache-") for k in headers) and "x-tenant" not in headers
    assert "authorization" not in headers  # a tenant's key is the router's business, never vLLM's


def test_a_media_items_client_set_name_never_reaches_vllm(vllm: tuple[Recorder, Router, str]) -> None:
    """vLLM keys a media item by a content part's ``uuid`` instead of its bytes: a client
    that names its image after another one would be served that image's KV."""
    backend, _router, url = vllm
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [{"type": "text", "text": "what is this?"}, image | {"uuid": "someone-elses-image"}, "odd part"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    assert send(url, chat_body(messages=messages)).status_code == 200
    sent = backend.body["messages"]
    assert sent[0] == messages[0] and sent[1]["content"] == [parts[0], image, "odd part"]
    assert b"someone-elses-image" not in backend.seen[-1][0]


def test_two_tenants_get_two_salts_and_a_tenant_always_its_own(vllm: tuple[Recorder, Router, str]) -> None:
    backend, _router, url = vllm
    salts = []
    for key in ("sk-acme", "sk-globex", "sk-acme", "sk-globex"):
        assert send(url, chat_body(**VICTIM), key=key).status_code == 200
        salts.append((backend.body["cache_salt"], backend.body["kv_transfer_params"][PARAMS_KEY]))
    acme, globex = salts[0], salts[1]
    assert acme != globex and salts == [acme, globex, acme, globex]
    assert acme[1] == "acme" and globex[1] == "globex" and acme[0] != globex[0]


@pytest.mark.parametrize("content", [b"[1, 2]", b'"text"', b"null", b"not json", b'{"model": ', b""])
def test_a_body_that_is_not_a_json_object_never_reaches_vllm(
    vllm: tuple[Recorder, Router, str], content: bytes
) -> None:
    backend, _router, url = vllm
    reply = send(url, content)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert backend.seen == []


def test_a_trusted_gateways_tenant_header_is_used_and_passed_on_as_authenticated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(router_module, "HEALTH_EVERY_S", 3600.0)
    backend = Recorder(vllm=True)
    settings = Settings(auth=AuthSettings(api_keys=KEYS, tenant_secret=SECRET, tenant_header="X-Tenant"))
    router = Router(
        RouteConfig((), "redis://127.0.0.1:1/0", vllm=(backend.source(),)), settings, tokenize, CollectorRegistry()
    )
    live = serve(router)
    try:
        wait_for(lambda: all(b.up for b in router.backends))
        # with a secret, the router believes the header only with the gateway's proof ...
        forged = send(live.url, chat_body(), headers={"x-tenant": "initech"})
        assert forged.status_code == 401 and forged.json()["error"]["code"] == "invalid_tenant_proof"
        wrong = {"x-tenant": "initech", PROOF_HEADER: tenant_proof(SECRET.encode(), "globex")}
        assert send(live.url, chat_body(), headers=wrong).status_code == 401 and backend.seen == []
        proven = {"x-tenant": "initech", PROOF_HEADER: tenant_proof(SECRET.encode(), "initech")}
        assert send(live.url, chat_body(), headers=proven).status_code == 200
        salt = tenant_salt(SECRET.encode(), "initech")
        assert backend.body["cache_salt"] == salt and backend.body["kv_transfer_params"] == {PARAMS_KEY: "initech"}
        assert "x-tenant" not in backend.seen[-1][1]  # ... and vLLM gets the tenant in the body's stamp only
        assert router.stamper.salts[salt] == "initech"  # its chains on vLLM are credited to it from now on
    finally:
        live.stop()
        backend.live.stop()


def test_a_router_with_vllm_backends_and_no_secret_refuses_to_start() -> None:
    source = VllmSource.parse("http://h=tcp://h:1", BS, MODEL)
    with pytest.raises(ValueError, match=r"auth\.tenant_secret"):
        Router(RouteConfig((), "redis://127.0.0.1:1/0", vllm=(source,)), Settings(), tokenize, CollectorRegistry())


# ---------------------------------------------------------------------- prefixcache servers


def test_a_server_gets_neither_the_clients_fields_nor_a_salt(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(router_module, "HEALTH_EVERY_S", 3600.0)
    backend = Recorder(vllm=False)
    settings = Settings(auth=AuthSettings(api_keys=KEYS, tenant_header="X-Tenant"))
    router = Router(RouteConfig((backend.live.url,), redis_server.url), settings, tokenize, CollectorRegistry())
    live = serve(router)
    try:
        wait_for(lambda: all(b.up for b in router.backends))
        assert send(live.url, chat_body(**VICTIM), headers=SNEAKY).status_code == 200
        raw, headers = backend.seen[-1]
        assert backend.body == chat_body() and b"victim" not in raw
        assert not any(k.startswith("x-prefixcache-") for k in headers)
        # tenant_header is set and no secret backs a client's: the router (the gateway) names
        # the tenant of the key it authenticated, never the client's own header (issue #39)
        assert headers["x-tenant"] == "acme"
        assert headers["authorization"] == "Bearer sk-acme"  # the server authenticates it again
        assert send(live.url, chat_body()).status_code == 200
        assert backend.seen[-1][0] == json.dumps(chat_body()).encode()  # nothing to strip: the client's bytes
        sent = len(backend.seen)
        refused = send(live.url, b"[1, 2]")  # refused as the server would refuse it, before it is forwarded
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_value"
        assert len(backend.seen) == sent
    finally:
        live.stop()
        backend.live.stop()
        redis.Redis.from_url(redis_server.url).close()


# ---------------------------------------------------------------------- the secret


def test_the_secret_is_validated_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    short = "short-secret-15b"[:15]
    with pytest.raises(ValueError) as caught:
        load_settings(env={"PREFIXCACHE_AUTH_TENANT_SECRET": short})
    assert "auth.tenant_secret" in str(caught.value) and short not in str(caught.value)
    settings = load_settings(env={"PREFIXCACHE_AUTH_TENANT_SECRET": SECRET, SECRET_ENV: "x"})  # not a setting
    assert settings.auth.tenant_secret == SECRET and route_secret(settings, {}) == SECRET.encode()
    assert SECRET not in repr(settings) and SECRET not in str(describe(settings))
    assert route_secret(Settings(), {SECRET_ENV: SECRET}) == SECRET.encode() and route_secret(Settings(), {}) is None
    with pytest.raises(ValueError) as caught:
        route_secret(Settings(), {SECRET_ENV: short})
    assert SECRET_ENV in str(caught.value) and short not in str(caught.value)


@pytest.mark.parametrize(
    ("toml", "env", "says"),
    [
        ("", {}, "auth.tenant_secret"),  # none at all
        ('[auth]\ntenant_secret = "tooshort-secret"\n', {}, "auth.tenant_secret"),
        ("", {"PREFIXCACHE_AUTH_TENANT_SECRET": "tooshort-secret"}, "auth.tenant_secret"),
        ("", {SECRET_ENV: "tooshort-secret"}, SECRET_ENV),
    ],
)
def test_route_with_vllm_backends_needs_a_valid_secret(
    toml: str,
    env: dict[str, str],
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("PREFIXCACHE_CONFIG", "PREFIXCACHE_AUTH_TENANT_SECRET", SECRET_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "route.toml"
    config.write_text(toml)
    with pytest.raises(SystemExit) as caught:
        main(["route", "--config", str(config), "--vllm-backend", "http://h:8000=tcp://h:5557"])
    out = capsys.readouterr()
    assert caught.value.code == 2 and says in out.err
    assert "tooshort-secret" not in out.err + out.out


def test_route_refuses_an_open_address_with_no_api_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``route --host 0.0.0.0`` is checked as ``serve --host`` is: the router's own address,
    not the servers' ``server.host`` in the settings file it reads (issue #39)."""
    monkeypatch.delenv("PREFIXCACHE_CONFIG", raising=False)
    config = tmp_path / "route.toml"
    config.write_text('[server]\nhost = "127.0.0.1"\n')
    argv = ["route", "--config", str(config), "--backend", "http://h:8000", "--redis", "redis://h:6379/0"]
    with pytest.raises(SystemExit) as caught:
        main([*argv, "--host", "0.0.0.0"])
    assert caught.value.code == 2 and "allow_open_access" in capsys.readouterr().err
