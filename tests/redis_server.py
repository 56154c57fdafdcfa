"""Test helpers for the Redis tier: a real ``redis-server`` on a loopback port, and a TCP proxy
that can stall, so that a slow Redis (not only a dead one) can be tested.

Everything listens on 127.0.0.1 only, every wait is bounded, and ``stop()`` ends what
``start()`` began (the tests call it from fixtures, so a failing test stops it too).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from loopback_proxy import LoopbackProxy

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
START_TIMEOUT = 5.0  # seconds a redis-server gets to answer PING


def free_port() -> int:
    """A loopback port nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ping(port: int, timeout: float = 0.2) -> bool:
    """Whether a Redis on ``port`` answers PING (raw RESP: no client state to clean up)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process without persistence; ``start()`` again after ``kill()`` reuses the port."""

    def __init__(self, workdir: Path, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.workdir), *self.extra]
        log = (self.workdir / f"redis-{self.port}.log").open("ab")
        with log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {log.name}")
            if ping(self.port):
                return self
            time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {START_TIMEOUT} s")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def pause(self) -> None:
        """SIGSTOP: the process stays, its sockets stay open, and nothing answers (a stalled host)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None


class StallingProxy(LoopbackProxy):
    """A proxy to a Redis that forwards until ``stall()``, then swallows bytes: to the
    client a Redis that stopped responding (a GC pause, a saturated network), the case
    only a read timeout ends."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"
