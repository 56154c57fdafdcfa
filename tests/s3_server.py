"""Test helpers for the object-store tier: a real S3 API server (moto in server mode, a
subprocess on a loopback port) and a TCP proxy in front of it that can delay every
byte, so that a slow endpoint (not only a dead one) can be tested.

The tests and benchmarks reach it through the same client code a user runs against AWS
(``storage/s3.py``): only the endpoint differs. Everything listens on 127.0.0.1 only,
every wait is bounded, and ``stop()`` ends what ``start()`` began.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from loopback_proxy import LoopbackProxy
from redis_server import free_port

HAS_MOTO = importlib.util.find_spec("moto") is not None and importlib.util.find_spec("flask") is not None
START_TIMEOUT = 20.0  # seconds a moto server gets to answer (its first import is slow)
# Credentials moto accepts without checking (auth is off unless a test turns it on).
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/data.json", timeout=0.5) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


class MotoServer:
    """One ``moto.server`` process (state in memory: a kill loses every object);
    ``start()`` again after ``kill()`` reuses the port. ``auth_after`` turns on moto's
    IAM checks after that many unauthenticated calls (``INITIAL_NO_AUTH_ACTION_COUNT``)."""

    def __init__(self, workdir: Path, port: int | None = None, auth_after: int | None = None) -> None:
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.auth_after = auth_after
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        env = {**os.environ, **ENV}
        if self.auth_after is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(self.auth_after)
        log = (self.workdir / f"moto-{self.port}.log").open("ab")
        with log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}; see {log.name}")
            if _answers(self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto server did not answer within {START_TIMEOUT} s")

    def reset(self) -> None:
        """Forget every bucket and object (moto's own reset call): a clean server per test."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=5):
            pass

    def kill(self) -> None:
        """SIGKILL, as a crash would: connections reset, every object lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None


class DelayingProxy(LoopbackProxy):
    """A proxy to an S3 API server whose replies arrive ``delay`` seconds late a chunk:
    an endpoint under load or far away. Requests go through undelayed."""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"
