"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every
failure, the limits on a body (its size, how deep its JSON nests), and the handlers that
turn FastAPI's own errors into that shape.

Anthropic's routes (``/v1/messages`` and below, ``anthropic_route``) answer the same
errors in Anthropic's shape instead, ``{"type": "error", "error": {"type", "message"}}``,
its type named by the status (``anthropic_type``): one ``APIError`` is raised either way,
and the path the client asked for picks the shape it is written in.

An error body is always valid UTF-8 JSON: a message may repeat what the client sent (a
model's name), and JSON lets a client send a lone surrogate (``"\\ud800"``) that UTF-8
cannot encode; such text is written as its escape, never left to fail the encoding
(which would turn a 404 into a plain-text 500 and reset the connection)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.engine import EngineError

__all__ = [
    "ANTHROPIC_PREFIX",
    "MAX_DEPTH",
    "APIError",
    "BodyLimit",
    "anthropic_route",
    "anthropic_type",
    "install_error_handlers",
    "too_deep",
]

# NOTE: far deeper than any OpenAI body (a chat's content part is 4 levels down), far
# shallower than the recursion of a JSON parser or of a validator walking the result.
MAX_DEPTH = 64
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1

ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error types by status; any other 4xx is an invalid request, any 5xx an api_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # ours: shutting down, or (the router) no backend up; a client retries
    504: "timeout_error",
    529: "overloaded_error",
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
        fields = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": {k: _encodable(v) for k, v in fields.items()}}

    def anthropic_body(self) -> dict[str, Any]:
        error = {"type": anthropic_type(self.status), "message": _encodable(self.message)}
        return {"type": "error", "error": error}

    def response(self, anthropic: bool = False) -> JSONResponse:
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def anthropic_route(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's routes, whose errors are in its shape."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _encodable(text: str | None) -> str | None:
    """``text`` as UTF-8 can carry it: a lone surrogate becomes its escape, as text."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def too_deep(raw: bytes, limit: int) -> bool:
    """Whether the arrays and objects of the JSON text ``raw`` nest more than ``limit``
    levels deep, read without parsing it: the brackets outside its strings, counted."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # too few brackets to nest deeper
        return False
    steps = _STEP[np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0)) > limit


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, whether it declares its length
    or not, and one nesting deeper than ``max_depth`` with 400, before any parser sees it."""

    def __init__(self, app: ASGIApp, limit: int, max_depth: int = MAX_DEPTH) -> None:
        self.app, self.limit, self.max_depth = app, limit, max_depth

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
        if too_deep(b"".join(m.get("body", b"") for m in chunks), self.max_depth):
            error = APIError(400, f"the request body nests deeper than {self.max_depth} levels", code="invalid_json")
            await error.response(anthropic_route(scope.get("path", "")))(scope, receive, send)
            return

        async def replay() -> Message:
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is over the limit of {self.limit} bytes", code="request_too_large")
        await error.response(anthropic_route(scope.get("path", "")))(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response(anthropic_route(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        anthropic = anthropic_route(request.url.path)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return APIError(400, "the request body is not valid JSON", code="invalid_json").response(anthropic)
        where = ".".join(loc) or "body"
        message = f"invalid {where}: {first.get('msg', 'invalid request')}"
        if anthropic:  # Anthropic's words: "messages.0.content.0.text: ...", no union branch names
            where = ".".join(p for p in loc if "[" not in p) or "body"
            message = f"{where}: {str(first.get('msg', 'invalid request')).removeprefix('Value error, ')}"
        return APIError(400, message, param=loc[0] if loc else None, code="invalid_value").response(anthropic)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        headers = dict(exc.headers or {})  # a 405 carries Allow
        error = APIError(exc.status_code, str(exc.detail), code=code, headers=headers)
        return error.response(anthropic_route(request.url.path))
