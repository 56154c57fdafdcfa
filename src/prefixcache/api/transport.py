"""How uvicorn runs the app: one place for the connection's deadlines and the access log.

- **Read deadline.** uvicorn times out an idle keep-alive connection, but not one that
  opens and sends nothing, or half a request line, or a body a byte a minute: each holds
  a socket and a slot forever (a slow-loris). ``ReadDeadline`` gives every request
  ``server.read_timeout_s`` to arrive in full (head and body), counted from the moment the
  connection is ready for it; past that the connection is closed. A response being
  generated is never cut: only reading the request is timed.
- **No secret in a log line.** The access log names the path but never its query string
  (a key pasted into a URL stays out of the log); request headers are never logged.
- **A stop is a success.** SIGINT or SIGTERM stops the server as uvicorn does (no new
  requests, the running ones finish, the lifespan's shutdown flushes the cache); then
  ``Server.run`` returns instead of raising the signal again (``Server``).
- **Forwarding headers are the app's to judge.** uvicorn's own proxy support (on by
  default, trusting 127.0.0.1) is off: the client's address and scheme stay the peer's,
  and only ``server.trusted_proxies`` makes ``X-Forwarded-*`` believed (sessions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixcache.settings import Settings

__all__ = ["ReadDeadline", "RedactQuery", "Server", "uvicorn_config"]

log = logging.getLogger("prefixcache.serve")


class ReadDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading each request."""

    read_timeout_s = 30.0  # set per server by ``uvicorn_config`` (a subclass per config)
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        waiting_after = self.cycle  # the request read so far (None on a new connection)
        self._deadline = self.loop.call_later(self.read_timeout_s, self._expire, waiting_after)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, waiting_after: Any) -> None:
        self._deadline = None
        read_in_full = self.cycle is not None and self.cycle is not waiting_after and not self.cycle.more_body
        if read_in_full or self.transport.is_closing():
            return
        log.debug("closing a connection that sent no complete request in %.0f s", self.read_timeout_s)
        self.transport.close()


class RedactQuery(logging.Filter):
    """Drop the query string from uvicorn's access log lines (their third argument)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            path, _, _ = args[2].partition("?")
            record.args = (*args[:2], path + "?[redacted]", *args[3:])
        return True


class Server(uvicorn.Server):
    """uvicorn's server, stopped by SIGINT or SIGTERM as uvicorn stops it, that then returns.

    NOTE: uvicorn raises a captured signal again once it has shut down, so that a program
    embedding it dies of the signal as it would have without it. For ``serve`` the stop
    was asked for and is done: the raised SIGINT became a ``CancelledError`` and a
    ``KeyboardInterrupt`` traceback (asyncio's runner cancels its task on SIGINT), SIGTERM
    an exit by signal, and ``make serve`` reported an error. ``stopped_by`` keeps which
    signal stopped it.
    """

    stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
            yield
            return
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        if self.stopped_by is None:
            self.stopped_by = sig
        self.handle_exit(sig, frame)  # a second SIGINT forces the exit, as in uvicorn


def uvicorn_config(app: Any, settings: Settings, log_level: str = "info", **extra: Any) -> uvicorn.Config:
    """The uvicorn configuration ``serve`` runs ``app`` with; ``extra`` overrides (tests
    listen on port 0)."""
    log_config: dict[str, Any] = copy.deepcopy(LOGGING_CONFIG)
    log_config.setdefault("filters", {})["redact_query"] = {"()": RedactQuery}
    log_config["loggers"]["uvicorn.access"]["filters"] = ["redact_query"]  # before any handler
    protocol = type("ReadDeadline", (ReadDeadline,), {"read_timeout_s": settings.server.read_timeout_s})
    where: dict[str, Any] = {"host": settings.server.host, "port": settings.server.port}
    return uvicorn.Config(
        app,
        **(where | extra),
        http=protocol,
        proxy_headers=False,
        log_level=log_level,
        log_config=log_config,
    )
