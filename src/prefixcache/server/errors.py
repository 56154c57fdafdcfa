"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every
failure, the body size limit, and the handlers that turn FastAPI's own errors into
that shape.

An error body is always valid UTF-8 JSON: a message may repeat what the client sent (a
model's name), and JSON lets a client send a lone surrogate (``"\\ud800"``) that UTF-8
cannot encode; such text is written as its escape, never left to fail the encoding
(which would turn a 404 into a plain-text 500 and reset the connection)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.engine import EngineError

__all__ = ["APIError", "BodyLimit", "install_error_handlers"]

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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _encodable(text: str | None) -> str | None:
    """``text`` as UTF-8 can carry it: a lone surrogate becomes its escape, as text."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


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


def install_error_handlers(app: FastAPI) -> None:
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
        code = "not_found" if exc.status_code == 404 else None
        headers = dict(exc.headers or {})  # a 405 carries Allow
        return APIError(exc.status_code, str(exc.detail), code=code, headers=headers).response()
