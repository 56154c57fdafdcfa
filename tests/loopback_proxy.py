"""A loopback TCP proxy the tier tests put between a client and a real server, to make
that server slow (``delay``: every chunk of its replies held back) or stalled
(``stall()``: bytes read and swallowed, connections kept open): the cases only a
timeout or a circuit breaker ends."""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["LoopbackProxy"]


class LoopbackProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target_port``, replies held ``delay``
    seconds a chunk (0: at once) or until ``release()`` after ``hold()``, everything
    swallowed once ``stall()`` is called."""

    POLL = 0.05  # seconds: how often the threads look at the stop flag

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay = 0.0
        self.swallowed = 0  # the client's sends swallowed while stalled (a command each, on loopback)
        self._stalled = threading.Event()
        self._replying = threading.Event()  # cleared by ``hold()``: replies wait until ``release()``
        self._replying.set()
        self._stopped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(self.POLL)
        self.port: int = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._spawn(self._accept)

    def stall(self) -> None:
        self._stalled.set()

    def hold(self) -> None:
        """Keep every reply back until ``release()``: what a client waits for, it waits for
        as long as the test says."""
        self._replying.clear()

    def release(self) -> None:
        self._replying.set()

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=1.0)
            except OSError:  # the server is gone: the client sees its connection closed
                client.close()
                continue
            for sock in (client, upstream):
                sock.settimeout(self.POLL)
                self._sockets.append(sock)
            self._spawn(self._pump, client, upstream, False)
            self._spawn(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        while not self._stopped.is_set():
            try:
                data = src.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if self._stalled.is_set():
                self.swallowed += not reply
                continue
            if reply:
                self._replying.wait()
            if reply and self.delay:
                self._stopped.wait(self.delay)
            with contextlib.suppress(OSError):
                dst.sendall(data)

    def stop(self) -> None:
        self._stopped.set()
        self._replying.set()
        for thread in self._threads:
            thread.join(timeout=2)
        for sock in [self._listener, *self._sockets]:
            sock.close()
