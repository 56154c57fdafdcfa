"""How ``serve`` runs uvicorn (server/transport.py): a deadline on reading each request,
so half-open and slow-loris connections are closed, and no query string in the access log."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request

from engine_support import LiveServer
from prefixcache.api.transport import uvicorn_config
from prefixcache.settings import ServerSettings, Settings

DEADLINE = 0.5


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @app.get("/slow")
    async def slow() -> dict[str, bool]:
        await asyncio.sleep(3 * DEADLINE)  # generating longer than the read deadline is fine
        return {"done": True}

    return app


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    settings = Settings(server=ServerSettings(read_timeout_s=DEADLINE))
    config = uvicorn_config(_app(), settings, log_level="info", port=0, lifespan="off")
    server = LiveServer(None, config=config).start()
    yield server
    server.stop()


def _open(live: LiveServer) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


GUARD_S = 60.0  # a connection still open after it is one the server never closes


def _closed_within(sock: socket.socket, seconds: float = GUARD_S) -> float:
    """Seconds until the server closes ``sock`` (reads until EOF), failing past ``seconds``."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {seconds} s")
    finally:
        sock.close()
    return time.monotonic() - started


@pytest.mark.parametrize(
    "sent",
    [
        b"",
        b"GET /ech",
        b"POST /echo HTTP/1.1\r\nHost: x\r\n",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123",
    ],
    ids=["nothing", "half a request line", "half the headers", "a tenth of the body"],
)
def test_an_incomplete_request_is_closed_at_the_deadline(live: LiveServer, sent: bytes) -> None:
    sock = _open(live)
    sock.sendall(sent)
    assert _closed_within(sock) >= 0.8 * DEADLINE  # at its deadline, not before


def test_three_hundred_half_open_connections_are_all_closed(live: LiveServer) -> None:
    socks = [_open(live) for _ in range(300)]
    for sock in socks[::2]:
        sock.sendall(b"GET / HTTP/1.1\r\n")
    for sock in socks:
        _closed_within(sock)
    assert httpx.post(live.url + "/echo", content=b"still serving").json() == {"bytes": 13}


def test_complete_requests_and_slow_answers_are_not_cut(live: LiveServer) -> None:
    with httpx.Client(base_url=live.url) as client:
        assert client.get("/slow", timeout=10).json() == {"done": True}
        for size in (0, 1 << 16):  # keep-alive: each request on the connection has its own deadline
            assert client.post("/echo", content=b"x" * size).json() == {"bytes": size}
            time.sleep(0.6 * DEADLINE)
        assert client.post("/echo", content=b"y").json() == {"bytes": 1}


def test_the_access_log_never_shows_a_query_string(live: LiveServer) -> None:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")
    handler = Keep()
    access.addHandler(handler)
    try:
        httpx.get(live.url + "/?key=adm-secret-0123&x=1")
        httpx.post(live.url + "/echo?api_key=sk-secret", content=b"")
    finally:
        access.removeHandler(handler)
    assert len(lines) == 2, lines
    assert not any("secret" in line for line in lines), lines
    assert '"GET /?[redacted] HTTP/1.1" 404' in lines[0] and '"POST /echo?[redacted] HTTP/1.1" 200' in lines[1]
