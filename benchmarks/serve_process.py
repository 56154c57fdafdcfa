"""A ``prefixcache serve`` process for a benchmark that measures the real server: started
from a settings file, waited for, stopped with SIGTERM (the graceful stop a user's
process manager sends)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_process(settings: Callable[[int], str], tmp: Path, start_s: float = 300) -> Iterator[str]:
    """``prefixcache serve`` with the settings ``settings(port)`` writes; its URL."""
    port = free_port()
    config = tmp / f"{port}.toml"
    config.write_text(settings(port))
    log = (tmp / f"{port}.log").open("wb")
    serve = [sys.executable, "-m", "prefixcache.cli", "serve", "--config", str(config)]
    proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited; see {log.name}:\n{Path(log.name).read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
