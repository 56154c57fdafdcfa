"""The OpenAPI document served at ``/openapi.json``: FastAPI's, built from the routes and
the pydantic request bodies, completed with what FastAPI cannot see from them:

- who may call a route: the schemes of its guard (``api_key``, a tenant's Bearer key;
  ``admin_key``, the operator's; or the dashboard's session cookie), found in the
  route's dependencies; none where the configuration opens it (local mode);
- the errors it answers, in OpenAI's shape (Anthropic's on its routes), with the statuses
  it really returns: a body that fails validation is a 400 here (``errors.py``), never
  FastAPI's 422;
- the media types that are not JSON: SSE for a streamed completion, Prometheus' text.

The document describes the API, never a deployment: no key, tenant or model name is in it,
so it is public, as OpenAI's own specification is (clients and fuzzers can read it
without a key; what it shows is in the docs and the source already).
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from prefixcache.api.auth import Auth
from prefixcache.api.errors import anthropic_route
from prefixcache.api.sessions import COOKIE
from prefixcache.settings import AuthSettings

__all__ = ["install_openapi", "openapi_document"]

_SCHEMES = {
    "api_key": {"type": "http", "scheme": "bearer", "description": "A tenant's API key (it names the tenant)."},
    "x_api_key": {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "A tenant's API key, as Anthropic's clients send it (Anthropic's routes).",
    },
    "admin_key": {"type": "http", "scheme": "bearer", "description": "The operator's admin key."},
    "dashboard_session": {
        "type": "apiKey",
        "in": "cookie",
        "name": COOKIE,
        "description": "The session cookie that POST /dashboard/login sets.",
    },
}
# Each guard of ``Auth``: the schemes that satisfy it (any one of them), and its refusals.
_GUARDS = {
    "tenant": (("api_key",), (401,)),
    "messages_tenant": (("api_key", "x_api_key"), (401,)),
    "admin": (("admin_key",), (401, 403)),
    "operator": (("admin_key",), (401, 403)),
    "dashboard": (("admin_key", "dashboard_session"), (401, 403)),
}

# NOTE: the statuses a handler raises itself (beyond its guard's and its body's), by
# route; the schema test fuzzes every route and fails on a status missing here.
_RAISES: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/chat/completions"): (404, 429, 503, 504),
    ("post", "/v1/completions"): (404, 429, 503, 504),
    ("post", "/v1/messages"): (404, 429, 503, 504),
    ("post", "/v1/messages/count_tokens"): (404,),
    ("post", "/admin/epoch"): (404, 409),
    ("post", "/admin/purge"): (409,),
    ("post", "/dashboard/login"): (401, 403, 429),  # the admin key is in the body; failures are throttled
    ("get", "/fleet/info"): (409,),
    ("get", "/fleet/snapshot"): (409,),
}
_MEDIA: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/chat/completions"): {"application/json": {"schema": {}}, "text/event-stream": {"schema": {}}},
    ("post", "/v1/completions"): {"application/json": {"schema": {}}, "text/event-stream": {"schema": {}}},
    ("post", "/v1/messages"): {"application/json": {"schema": {}}, "text/event-stream": {"schema": {}}},
    ("get", "/metrics"): {"text/plain": {"schema": {"type": "string"}}},
    ("get", "/fleet/info"): {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["name", "inc", "stream", "block_size", "model", "maxlen"],
                "properties": {
                    "name": {"type": "string"},
                    "inc": {"type": "string"},
                    "stream": {"type": "string"},
                    "block_size": {"type": "integer"},
                    "model": {"type": "string"},
                    "maxlen": {"type": "integer"},
                },
            }
        }
    },
    ("get", "/fleet/snapshot"): {"application/vnd.msgpack": {"schema": {"type": "string", "format": "binary"}}},
}
_ERRORS = {
    400: "Invalid request: malformed JSON or a bad parameter (`param` names it).",
    401: "No API key, or a wrong one.",
    403: "A tenant's key on an operator route, or the route is disabled in this configuration.",
    404: "The model is not served here.",
    409: "The prefix cache (on /fleet/*: publishing KV events) is disabled on this server.",
    413: "The request body is over the server's limit.",
    429: "The queue is full: retry after `Retry-After` seconds.",
    503: "The server is shutting down.",
    504: "The request timed out, in the queue or while generating.",
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

# Anthropic's routes answer errors in its shape (``errors.anthropic_route``).
_ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def install_openapi(app: FastAPI, auth: AuthSettings) -> None:
    """Serve ``openapi_document(app, auth)`` (built once, on the first request for it)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, auth)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def openapi_document(app: FastAPI, auth: AuthSettings) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["Error"] = copy.deepcopy(_ERROR_SCHEMA)
    schemas["AnthropicError"] = copy.deepcopy(_ANTHROPIC_ERROR_SCHEMA)
    components["securitySchemes"] = copy.deepcopy(_SCHEMES)
    for route in app.routes:
        if isinstance(route, APIRoute) and route.include_in_schema:
            for method in route.methods or ():
                operation = doc["paths"][route.path_format].get(method.lower())
                if operation is not None:
                    _complete(operation, route, method.lower(), auth)
    return doc


def _complete(operation: dict[str, Any], route: APIRoute, method: str, auth: AuthSettings) -> None:
    responses: dict[str, Any] = operation["responses"]
    responses.pop("422", None)
    statuses = set(_RAISES.get((method, route.path_format), ()))
    if route.body_field is not None:
        statuses |= {400, 413}
    for guard in _guards(route.dependant):
        if _open(guard, auth):
            continue
        schemes, refused = _GUARDS[guard]
        operation["security"] = [{scheme: []} for scheme in schemes]
        statuses |= set(refused)
    if (method, route.path_format) in _MEDIA:
        responses["200"]["content"] = copy.deepcopy(_MEDIA[(method, route.path_format)])
    error = "AnthropicError" if anthropic_route(route.path_format) else "Error"
    for status in sorted(statuses):
        responses[str(status)] = {
            "description": _ERRORS[status],
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}},
        }
    if "429" in responses:
        retry = {"required": True, "schema": {"type": "integer", "minimum": 1}, "description": "Seconds to wait."}
        responses["429"]["headers"] = {"Retry-After": retry}


def _open(guard: str, auth: AuthSettings) -> bool:
    """Whether ``guard`` lets anyone in, as ``Auth`` decides in local mode (no API keys):
    a tenant's routes always, the operator's when no admin key is set either."""
    return auth.local_mode and (guard in ("tenant", "messages_tenant") or not auth.admin_key)


def _guards(dependant: Dependant) -> list[str]:
    """The names of the ``Auth`` guards ``dependant`` depends on, however deep."""
    found = []
    for dep in dependant.dependencies:
        call = dep.call
        if isinstance(getattr(call, "__self__", None), Auth) and getattr(call, "__name__", "") in _GUARDS:
            found.append(call.__name__)  # type: ignore[union-attr]
        found += _guards(dep)
    return found
