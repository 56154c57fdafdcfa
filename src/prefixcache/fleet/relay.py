"""What the router makes of a backend's answer, or of its failure to answer: it tries the
next backend only with what never started on this one, and tells the client the truth.

| what happened, before anything was streamed   | what the router does                       |
|-----------------------------------------------|--------------------------------------------|
| connection refused, or connecting timed out   | backend marked down; the next one is tried |
| 503 (a refusal before any work: ours is the   | the next one is tried; when none is left,  |
|   engine shutting down, vLLM's an overload)    |   the last 503 is relayed as it came       |
| 429 (queue or tenant's share full)            | relayed, with its Retry-After              |
| 504, 4xx, 2xx, any other status               | relayed as it came, reason and all         |
| no answer in time after the request was sent  | 504 (the backend may still be working)     |
| connection lost with no answer (the backend   | backend marked down; the next one is tried |
|   died or broke it)                            |   once; a second loss is a 502             |
| no backend up (none left to try)              | 503 ``no_backend``                         |

NOTE: a request that reached a backend still working on it is never sent to another: a
504 means the work ran to its deadline there, and running it again elsewhere would let
one heavy prompt hold every backend in turn while its client waits for all of them. A
lost connection is a backend that stopped (killed, restarted): its work is gone with it,
so the request goes on once (a request that itself kills backends takes at most two).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from prefixcache.api.errors import APIError
from prefixcache.fleet.backends import Backend
from prefixcache.fleet.stamping import hop_by_hop

__all__ = ["RETRY_STATUS", "Failed", "Held", "failed", "hold", "relay"]

RETRY_STATUS = frozenset({503})
HELD_BYTES = 1 << 16  # of a 503's body kept to relay it when no other backend is left
# The response headers a relay leaves out besides the hop-by-hop ones: the framing (the
# relay streams) and the backend's own server and date (the router's server sets them).
NOT_RELAYED = frozenset({b"content-length", b"date", b"server"})


@dataclass(frozen=True, slots=True)
class Failed:
    """A request a backend did not answer."""

    retry: bool  # nothing of it runs on the backend any more: the next one may take it
    down: bool  # the backend cannot be reached: out until its health checks pass
    error: APIError  # the client's answer when it is not retried
    lost: bool = False  # the connection broke with no answer: retried once per request


def failed(exc: httpx.HTTPError, backend: str) -> Failed:
    """What ``exc``, raised sending a request to ``backend``, means for that request."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        error = APIError(502, f"backend {backend} cannot be reached", "server_error", "bad_gateway")
        return Failed(retry=True, down=True, error=error)
    if isinstance(exc, httpx.PoolTimeout):  # the router's own connections are all busy
        error = APIError(503, "the router has no free connection to a backend", "server_error", "router_busy")
        return Failed(retry=False, down=False, error=error)
    if isinstance(exc, httpx.ReadTimeout):
        error = APIError(504, f"backend {backend} sent no answer in time", "timeout_error", "timeout")
        return Failed(retry=False, down=False, error=error)
    reason = f"backend {backend} failed before answering ({type(exc).__name__})"
    error = APIError(502, reason, "server_error", "bad_gateway")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return Failed(retry=True, down=True, error=error, lost=True)
    return Failed(retry=False, down=False, error=error)


@dataclass(frozen=True, slots=True)
class Held:
    """A backend's refusal kept while the next backend is tried, to relay when none is left."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    backend: str

    def response(self) -> Response:
        response = Response(self.body, status_code=self.status)
        _copy_headers(self.headers, response, self.backend)
        return response


async def hold(reply: httpx.Response, backend: Backend) -> Held:
    """``reply`` read (its first ``HELD_BYTES``) and closed."""
    body = b""
    try:
        async for chunk in reply.aiter_raw():
            body += chunk
            if len(body) >= HELD_BYTES:
                break
    except httpx.HTTPError:
        pass  # what came is what is relayed
    finally:
        await reply.aclose()
    return Held(reply.status_code, tuple(reply.headers.raw), body[:HELD_BYTES], backend.name)


def relay(reply: httpx.Response, backend: Backend, left: float) -> StreamingResponse:
    """Stream ``reply`` to the client, keeping ``backend``'s load current."""

    async def body() -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in reply.aiter_raw():
                if first:
                    backend.pending -= left
                    backend.generating += 1
                    first = False
                yield chunk
        finally:
            if first:
                backend.pending -= left
            else:
                backend.generating -= 1
            await reply.aclose()

    response = StreamingResponse(body(), status_code=reply.status_code)
    _copy_headers(tuple(reply.headers.raw), response, backend.name)
    return response


def _copy_headers(headers: tuple[tuple[bytes, bytes], ...], response: Response, backend: str) -> None:
    """Set the backend's end-to-end ``headers`` on ``response``, and which backend it was."""
    drop = hop_by_hop(headers) | NOT_RELAYED
    relayed = [(k.lower(), v) for k, v in headers if k.lower() not in drop]
    names = {k for k, _ in relayed}
    own = [(k, v) for k, v in response.raw_headers if k not in names]  # the framing Starlette set
    response.raw_headers = [*own, *relayed, (b"x-prefixcache-backend", backend.encode())]
