"""The served OpenAPI document, and schemathesis run against it: every operation, with
bounded, derandomized examples, on the fast stand-in model. No answer may be a 5xx, and
every answer must be one the document describes (status, media type, body, headers).
Each thing that run found has its own test here too."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
import torch
from fastapi import FastAPI
from fastapi.routing import APIRoute
from schemathesis import BaseSchema, Case, Config

from engine_support import LiveServer
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.engine import Engine
from prefixcache.server.app import create_app
from prefixcache.settings import AuthSettings, ServerSettings, Settings
from standin import STANDIN_ID, standin

pytestmark = pytest.mark.model  # the stand-in takes SmolLM2's converted tokenizer

KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}
TENANT, ADMIN = "sk-acme-0123456789", "adm-0123456789"
# NOTE: a short context bounds every answer to a few dozen tokens, so that a test's time
# is set by its requests, not by how many tokens a generated max_tokens asks for.
CONTEXT = 64
EXAMPLES = 30  # per operation, in the fuzzing phase; the coverage phase adds its boundary cases


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    # NOTE: one intra-op thread: the stand-in's matrices are too small to share, and on a
    # busy machine the threads' spinning costs several times the work (15 ms a token, not 100).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = dataclasses.replace(standin(), context_length=CONTEXT)
    tiers = (TierConfig(kind="memory", capacity_bytes=16 << 20),)
    cache = PrefixCache(CacheConfig(block_size=16, kv_layout=loaded.kv, tiers=tiers))
    settings = Settings(
        server=ServerSettings(max_queue=64, request_timeout_s=60.0, default_max_tokens=4),
        auth=AuthSettings(api_keys=KEYS, admin_key=ADMIN),
    )
    engine = Engine(loaded, STANDIN_ID, cache=cache, max_queue=64, timeout_s=60.0)
    server = LiveServer(create_app(engine, settings, cache), engine).start()
    yield server
    server.stop()
    engine.close()
    cache.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def api(live: LiveServer) -> BaseSchema:
    """The document as the server serves it, with the keys its security schemes name."""
    config = Config.from_dict(
        {
            "seed": 20240601,
            "generation": {"max-examples": EXAMPLES, "deterministic": True, "database": "none"},
            "auth": {"openapi": {"api_key": {"bearer": TENANT}, "admin_key": {"bearer": ADMIN}}},
            "request-timeout": 30.0,
            # Every check but one: a schema-valid request may still be refused, for a prompt
            # over the context or a token id beyond the vocabulary, which no schema can say.
            "checks": {"positive_data_acceptance": {"enabled": False}},
        }
    )
    return schemathesis.openapi.from_url(live.url + "/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api")


@pytest.fixture(autouse=True)
def _node_id(request: pytest.FixtureRequest) -> None:
    # NOTE: schemathesis' lazy schema (4.32) reads and writes the test item's ``_nodeid``,
    # which pytest 9.2 no longer has: give it one (it only names the subtests).
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@schema.parametrize()
def test_every_operation_answers_as_documented_and_never_5xx(case: Case[Any]) -> None:
    body = case.body
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(body, dict) and isinstance(model, str) and len(model) % 4 != 1:
        body["model"] = STANDIN_ID  # so that most bodies reach the engine; the others get a 404
    # NOTE: Content-Length belongs to the transport: a generated one ("f73f") is refused by
    # uvicorn's HTTP parser before the app, in plain text no document describes; httpx
    # sends the true one.
    for name in [h for h in case.headers or {} if h.lower() == "content-length"]:
        del case.headers[name]  # type: ignore[union-attr]
    case.call_and_validate()


def test_the_document_lists_every_route_the_app_serves(live: LiveServer) -> None:
    doc = httpx.get(live.url + "/openapi.json").json()  # public: no key
    app = live.server.config.app
    assert isinstance(app, FastAPI)
    served = {
        (method.lower(), route.path)
        for route in app.routes
        if isinstance(route, APIRoute) and route.path != "/"  # the dashboard's HTML page
        for method in route.methods or ()
    }
    assert {(method, path) for path, operations in doc["paths"].items() for method in operations} == served


def test_the_document_names_who_may_call_and_holds_no_secret(live: LiveServer) -> None:
    response = httpx.get(live.url + "/openapi.json")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert not any(secret in response.text for secret in [*KEYS, ADMIN])
    doc = response.json()
    schemes = doc["components"]["securitySchemes"]
    assert schemes["api_key"]["scheme"] == schemes["admin_key"]["scheme"] == "bearer"
    paths = doc["paths"]
    assert paths["/v1/chat/completions"]["post"]["security"] == [{"api_key": []}]
    assert paths["/admin/purge"]["post"]["security"] == [{"admin_key": []}]
    assert paths["/dashboard/data"]["get"]["security"] == [{"admin_key": []}, {"dashboard_session": []}]
    assert "security" not in paths["/healthz"]["get"]
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["429"]["headers"]["Retry-After"]["required"]


def test_in_local_mode_the_document_asks_for_no_key() -> None:
    engine = Engine(standin(), STANDIN_ID)
    paths = create_app(engine, Settings()).openapi()["paths"]  # no keys: everything is open
    operations = [op for path, ops in paths.items() if path != "/dashboard/login" for op in ops.values()]
    assert not any("security" in op or "401" in op["responses"] for op in operations)
    with_admin = Settings(auth=AuthSettings(admin_key=ADMIN))  # tenants' routes open, the operator's not
    paths = create_app(engine, with_admin).openapi()["paths"]
    assert "security" not in paths["/v1/completions"]["post"]
    assert paths["/admin/stats"]["get"]["security"] == [{"admin_key": []}]


def test_the_document_says_which_values_a_body_takes(live: LiveServer) -> None:
    schemas = httpx.get(live.url + "/openapi.json").json()["components"]["schemas"]
    chat, completion = schemas["ChatRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert chat["tools"]["enum"] == [None, []] and chat["tools"]["type"] == ["null", "array"]
    assert chat["logprobs"]["enum"] == [None, False, 0] and completion["echo"]["type"] == ["null", "boolean"]
    assert chat["stop"]["anyOf"][1] == {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}
    assert [option.get("maxItems") for option in completion["prompt"]["anyOf"]] == [None, 1, None]


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def call(live: LiveServer, path: str, body: Any, key: str = TENANT) -> httpx.Response:
    return httpx.post(live.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": STANDIN_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} | extra


def test_a_wrong_method_is_a_405_that_names_the_allowed_ones(live: LiveServer) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for method, path, allowed in [("TRACE", "/admin/stats", "GET"), ("PUT", "/v1/chat/completions", "POST")]:
        response = httpx.request(method, live.url + path, headers=admin)
        error_of(response, 405)
        assert response.headers["allow"] == allowed  # RFC 9110: a 405 carries Allow


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n", "seed"])
def test_an_integral_json_number_is_an_integer_and_a_fraction_is_not(live: LiveServer, field: str) -> None:
    whole = 1.0 if field == "n" else 2.0  # JSON (and the document's "integer") has no other 2
    answered = call(live, "/v1/chat/completions", chat(**{field: whole}))
    assert answered.status_code == 200, answered.text
    assert error_of(call(live, "/v1/chat/completions", chat(**{field: whole + 0.5})), 400)["param"] == field


def test_token_ids_and_off_values_may_be_written_as_whole_floats(live: LiveServer) -> None:
    body = {"model": STANDIN_ID, "prompt": [1.0, 2.0, 3.0], "max_tokens": 1, "logprobs": 0.0, "best_of": 1.0}
    answered = call(live, "/v1/completions", body)
    assert answered.status_code == 200 and answered.json()["usage"]["prompt_tokens"] == 3, answered.text
    assert error_of(call(live, "/v1/completions", body | {"prompt": [1.5]}), 400)["param"] == "prompt"


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([5, 1 << 20], "token ids must be in [0, "),  # past the vocabulary: only the engine knows its size
        ([-1, 5], "token ids must be in [0, "),
        ([""], "the prompt is empty"),  # a list of one text, empty once tokenized
        ("", "the prompt is empty"),  # the schema's own refusals, for the same code
        ([], "the prompt is empty"),
    ],
    ids=["past the vocabulary", "negative", "one empty text", "empty text", "no token"],
)
def test_a_prompt_the_model_cannot_take_has_the_code_of_a_bad_value(live: LiveServer, prompt: Any, says: str) -> None:
    error = error_of(call(live, "/v1/completions", {"model": STANDIN_ID, "prompt": prompt, "max_tokens": 1}), 400)
    assert (error["code"], error["param"], error["type"]) == ("invalid_value", "prompt", "invalid_request_error")
    assert says in error["message"]


def test_include_usage_is_a_boolean(live: LiveServer) -> None:
    refused = call(live, "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": "yes"}))
    assert error_of(refused, 400)["param"] == "stream_options"
    streamed = call(live, "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True}))
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 1
