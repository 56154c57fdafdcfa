"""The router as strict as the server: a server on the fast stand-in model (serving as
SmolLM2's id, so that the server's own bad-input list applies as it is), the router in
front of it, and every hostile input sent to both. The router must answer each with the
server's status and body (it validates with the server's schemas and relays what only
the server can judge), never a 5xx; schemathesis then fuzzes the router's document."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
import torch
import uvicorn
from prometheus_client import CollectorRegistry
from schemathesis import BaseSchema, Case, Config

from engine_support import MODEL_ID, MODELS_DIR, LiveServer
from prefixcache.api.prompts import Tokenizer
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.engine import Engine
from prefixcache.fleet.router import RouteConfig, Router, create_router
from prefixcache.identity import PROOF_HEADER, tenant_proof
from prefixcache.server.main import create_app
from prefixcache.settings import AuthSettings, FleetSettings, ModelSettings, ServerSettings, Settings
from redis_server import RedisServer
from standin import standin
from support import wait_for
from test_server import ADMIN, BAD, KEYS, UNSUPPORTED, chat_body, post

pytestmark = [pytest.mark.model, pytest.mark.redis]  # the stand-in takes SmolLM2's tokenizer

TENANT_KEY = next(iter(KEYS))
SECRET = "a-tenant-secret-of-32-characters"
CONTEXT = 64  # short answers: a test's time is its requests'
EXAMPLES = 20  # per operation, in schemathesis' fuzzing phase


@dataclasses.dataclass
class Pair:
    server: LiveServer
    router: LiveServer
    route: Router


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    loaded = dataclasses.replace(standin(), context_length=CONTEXT)
    tiers = (TierConfig(kind="memory", capacity_bytes=16 << 20),)
    cache = PrefixCache(CacheConfig(block_size=16, kv_layout=loaded.kv, tiers=tiers))
    settings = Settings(  # the servers' and the router's, as one settings file is
        server=ServerSettings(max_queue=64, request_timeout_s=60.0, default_max_tokens=4, max_body_bytes=1 << 20),
        auth=AuthSettings(api_keys=KEYS, admin_key=ADMIN, tenant_header="X-Org", tenant_secret=SECRET),
        fleet=FleetSettings(publish=True, redis_url=redis.url, name="b1"),
        model=ModelSettings(models_dir=str(MODELS_DIR)),
    )
    engine = Engine(loaded, MODEL_ID, cache=cache, max_queue=64, timeout_s=60.0)
    server = LiveServer(create_app(engine, settings, cache), engine)
    server.config.lifespan = "on"  # the fleet publisher starts with the app
    server.start()
    route = Router(RouteConfig((server.url,), redis.url), settings, Tokenizer(settings.model), CollectorRegistry())
    app = create_router(route)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", proxy_headers=False)
    router = LiveServer(app, config=config).start()
    wait_for(lambda: all(b.up for b in route.backends), 30)
    yield Pair(server, router, route)
    router.stop()
    server.stop()
    engine.close()
    cache.close()
    redis.stop()
    torch.set_num_threads(threads)


def deep(depth: int) -> bytes:
    return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def completion(prompt: Any) -> bytes:
    return json.dumps({"model": MODEL_ID, "prompt": prompt, "max_tokens": 1}).encode()


HOSTILE = [
    ("chat", "nested 1,000 deep", deep(1000)),
    ("chat", "an object nested 1,000 deep", b'{"a":' * 1000 + b"1" + b"}" * 1000),
    ("completions", "token id -1", completion([5, -1])),
    ("completions", "token id 2**32", completion([5, 1 << 32])),
    ("completions", "token id 2**64", completion([5, 1 << 64])),
    ("completions", "token id -2**64", completion([-(1 << 64)])),
    ("completions", "token id 1e300", b'{"model": "%s", "prompt": [1e300], "max_tokens": 1}' % MODEL_ID.encode()),
    ("chat", "an empty body", b""),
    ("completions", "an empty body", b""),
    ("chat", "a list", b"[1, 2]"),
    ("chat", "a string", b'"text"'),
    ("chat", "null", b"null"),
    ("completions", "a number", b"1"),
    ("completions", "not UTF-8", b'{"model": "\xff\xfe"}'),
    ("chat", "a lone surrogate in model", json.dumps(chat_body(model="gpt-\ud800")).encode()),
    ("chat", "a lone surrogate in model, streaming", json.dumps(chat_body(model="\udfff", stream=True)).encode()),
    ("completions", "a lone surrogate in model", json.dumps({"model": "a\ud800b", "prompt": "Hi"}).encode()),
]


def path_of(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def same(pair: Pair, path: str, body: Any) -> httpx.Response:
    """``body`` sent to the server and to the router: the same status and body, a 4xx."""
    direct, routed = post(pair.server, path, body), post(pair.router, path, body)
    assert 400 <= direct.status_code < 500, direct.text
    assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())
    return routed


@pytest.mark.parametrize(("name", "body", "status", "code"), BAD, ids=[b[0] for b in BAD])
def test_the_servers_bad_input_list_gets_the_servers_answers(
    pair: Pair, name: str, body: Any, status: int, code: str
) -> None:
    routed = same(pair, "/v1/chat/completions", body)
    assert routed.status_code == status and routed.json()["error"]["code"] == code


@pytest.mark.parametrize(("path", "field", "value"), UNSUPPORTED, ids=[f"{u[0]}:{u[1]}" for u in UNSUPPORTED])
def test_unsupported_fields_are_refused_by_name_as_the_server_does(
    pair: Pair, path: str, field: str, value: Any
) -> None:
    body = chat_body() if "chat" in path else {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2}
    assert same(pair, path, body | {field: value}).json()["error"]["param"] == field


@pytest.mark.parametrize(("kind", "name", "body"), HOSTILE, ids=[f"{h[0]}:{h[1]}" for h in HOSTILE])
def test_hostile_bodies_get_the_servers_answers_and_keep_the_connection(
    pair: Pair, kind: str, name: str, body: bytes
) -> None:
    path = path_of(kind)
    same(pair, path, body)
    for live in (pair.server, pair.router):  # one keep-alive connection: refused, then served
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {TENANT_KEY}"}, timeout=60) as http:
            refused = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert 400 <= refused.status_code < 500 and refused.json()["error"]["message"]
            assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_a_lone_surrogate_in_a_model_is_a_json_404_everywhere(pair: Pair) -> None:
    for live in (pair.server, pair.router):
        for path, body in [
            ("/v1/chat/completions", chat_body(model="x\ud800")),
            ("/v1/chat/completions", chat_body(model="x\ud800", stream=True)),
            ("/v1/completions", {"model": "x\ud800", "prompt": "Hi", "max_tokens": 1}),
        ]:
            response = post(live, path, json.dumps(body).encode())
            assert response.status_code == 404 and response.headers["content-type"] == "application/json"
            assert (
                response.json()["error"]["code"] == "model_not_found"
                and "\\ud800" in response.json()["error"]["message"]
            )
    epoch = post(pair.server, "/admin/epoch", json.dumps({"model": "\ud800"}).encode(), key=ADMIN)
    assert epoch.status_code == 404 and epoch.json()["error"]["code"] == "model_not_found"


def test_the_method_is_never_rewritten(pair: Pair) -> None:
    for live in (pair.server, pair.router):
        refused = httpx.get(live.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {TENANT_KEY}"})
        assert refused.status_code == 405 and refused.headers["allow"] == "POST"
    empty = httpx.post(pair.router.url + "/v1/completions", headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert empty.status_code == 400  # an empty POST is a POST: its body is what is wrong


def test_the_server_believes_the_routers_tenant_header_and_no_one_elses(pair: Pair) -> None:
    key = {"Authorization": f"Bearer {TENANT_KEY}"}
    forged = post(pair.server, "/v1/chat/completions", chat_body(), headers={"X-Org": "initech"})
    assert forged.status_code == 401 and forged.json()["error"]["code"] == "invalid_tenant_proof"
    proof = {"X-Org": "initech", PROOF_HEADER: tenant_proof(SECRET.encode(), "initech")}
    routed = httpx.post(pair.router.url + "/v1/chat/completions", json=chat_body(), headers=key | proof, timeout=60)
    assert routed.status_code == 200, routed.text  # the router re-stamps it, and the server believes it
    stats = httpx.get(pair.server.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert "initech" in stats["cache"]["tenants"]


# ---------------------------------------------------------------------- schemathesis, through the router


@pytest.fixture(scope="module")
def api(pair: Pair) -> BaseSchema:
    config = Config.from_dict(
        {
            "seed": 20240602,
            "generation": {"max-examples": EXAMPLES, "deterministic": True, "database": "none"},
            "auth": {"openapi": {"api_key": {"bearer": TENANT_KEY}, "admin_key": {"bearer": ADMIN}}},
            "request-timeout": 30.0,
            # as for the server: a schema-valid request may still be refused (a prompt over the context)
            "checks": {"positive_data_acceptance": {"enabled": False}},
        }
    )
    return schemathesis.openapi.from_url(pair.router.url + "/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api")


@pytest.fixture(autouse=True)
def _node_id(request: pytest.FixtureRequest) -> None:
    if not hasattr(request.node, "_nodeid"):  # see test_server_schema.py
        request.node._nodeid = request.node.nodeid


@schema.parametrize()
def test_the_router_answers_as_documented_and_never_5xx(case: Case[Any]) -> None:
    body = case.body
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(body, dict) and isinstance(model, str) and len(model) % 4 != 1:
        body["model"] = MODEL_ID  # so that most bodies reach the engine; the others get a 404
    for name in [h for h in case.headers or {} if h.lower() == "content-length"]:
        del case.headers[name]  # type: ignore[union-attr]
    case.call_and_validate()


def test_the_routers_document_has_the_servers_bodies(pair: Pair) -> None:
    routed = httpx.get(pair.router.url + "/openapi.json").json()
    served = httpx.get(pair.server.url + "/openapi.json").json()
    for name in ("ChatRequest", "CompletionRequest"):
        assert routed["components"]["schemas"][name] == served["components"]["schemas"][name]
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert routed["paths"][path]["post"]["requestBody"] == served["paths"][path]["post"]["requestBody"]
        assert routed["paths"][path]["post"]["security"] == [{"api_key": []}]


def test_nothing_the_fuzzing_sent_left_the_fleet_down(pair: Pair) -> None:
    assert all(b.up for b in pair.route.backends)
    assert httpx.get(pair.router.url + "/healthz").json()["status"] == "ok"
