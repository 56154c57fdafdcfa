"""Children run as one service: started in order, each once the one before answers its
health check, and stopped together.

- Each child runs in a session of its own, so a terminal's Ctrl-C reaches the
  supervisor only, which then stops them itself (the last started first).
- Stopping is SIGTERM, then, after a grace period, SIGKILL to the child's whole
  process group: what it started and left behind (vLLM's engine core) goes too.
- A child that exits on its own, or is not ready in time, stops the others; the
  supervisor then prints the end of its log and returns 1.

The children are data (``Child``): ``prefixcache serve-vllm`` runs vLLM and the router
with it, and its tests run stand-ins.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Child", "supervise"]

GRACE_S = 45.0  # vLLM's connector flushes its queued writes on shutdown (flush_timeout_s, 30 s)
POLL_S = 0.5
TAIL_LINES = 40
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy


@dataclass(frozen=True, slots=True)
class Child:
    """A process the supervisor runs: ready once ``health`` answers 200 (and, when
    ``status`` is set, a JSON body whose ``status`` is that)."""

    name: str
    argv: tuple[str, ...]
    health: str
    status: str | None = None
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # added to the inherited environment
    unset: tuple[str, ...] = ()  # removed from the inherited environment
    ready_s: float = 900.0

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in base.items() if k not in self.unset} | dict(self.env)


def supervise(children: Sequence[Child], ready: Callable[[], None], logs: Path, grace_s: float = GRACE_S) -> int:
    """Start ``children`` in order, each once the one before is ready; call ``ready``;
    wait. 0 when stopped by SIGINT or SIGTERM, 1 when a child failed or exited."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    running: list[tuple[Child, subprocess.Popen[bytes], Path]] = []
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for child in children:
            log = logs / f"{child.name}.log"
            with log.open("wb") as out:  # new session: a terminal's Ctrl-C reaches us only, we stop them
                proc = subprocess.Popen(
                    child.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=child.environ(os.environ),
                    start_new_session=True,
                )
            running.append((child, proc, log))
            problem = _wait_ready(child, proc, stop)
            if problem is not None:
                return _failed(child, problem, log)
        if stop.is_set():
            return 0
        ready()
        while not stop.wait(POLL_S):
            for child, proc, log in running:
                if proc.poll() is not None:
                    return _failed(child, f"exited on its own with status {proc.returncode}", log)
        return 0
    finally:
        _stop_all([proc for _, proc, _ in running], grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_ready(child: Child, proc: subprocess.Popen[bytes], stop: threading.Event) -> str | None:
    deadline = time.monotonic() + child.ready_s
    while not stop.is_set():
        if proc.poll() is not None:
            return f"exited with status {proc.returncode} while starting"
        if _healthy(child):
            return None
        if time.monotonic() > deadline:
            return f"did not answer {child.health} in {child.ready_s:.0f} s"
        stop.wait(POLL_S)
    return None


def _healthy(child: Child) -> bool:
    try:
        with _OPENER.open(child.health, timeout=2) as reply:
            if reply.status != 200:
                return False
            body = json.loads(reply.read()) if child.status is not None else None
    except (OSError, ValueError):
        return False
    return child.status is None or (isinstance(body, dict) and body.get("status") == child.status)


def _failed(child: Child, problem: str, log: Path) -> int:
    lines = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
    print(f"prefixcache: {child.name} {problem}; the end of {log}:", file=sys.stderr)
    print("\n".join(f"  {line}" for line in lines), file=sys.stderr, flush=True)
    return 1


def _stop_all(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM to each (the last started first), SIGKILL to each process group left after ``grace_s``."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in reversed(procs):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(deadline - time.monotonic(), 0))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # and what it left behind
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
