"""``prefixcache serve`` stopped as an operator stops it: Ctrl-C (SIGINT), SIGTERM, and
Ctrl-C on ``make serve`` (the signal reaches make's whole process group). Each time: the
cache's flush line, exit 0, no traceback; and the start lines are short and hold no
secret of the config (an API key, a Redis tier's password)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine_support import MODELS_DIR, model
from redis_server import free_port

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
KEY, PASSWORD = "sk-stop-K3Y-0123", "pw-St0P-5678"
CONFIG = f"""
[auth]
api_keys = {{ "{KEY}" = "acme" }}
[[cache.tiers]]
kind = "memory"
capacity_bytes = 16777216
write = "through"
[[cache.tiers]]
kind = "disk"
capacity_bytes = 16777216
path = "cache"
[[cache.tiers]]
kind = "redis"
capacity_bytes = 16777216
url = "redis://user:{PASSWORD}@127.0.0.1:1/0"
"""


def start(command: list[str], workdir: Path, port: int) -> subprocess.Popen[str]:
    """``command`` in a process group of its own, SIGINT at its default (as a terminal's
    Ctrl-C finds a foreground job), up once /healthz answers."""
    (workdir / "prefixcache.toml").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env |= {"PREFIXCACHE_SERVER_PORT": str(port), "PREFIXCACHE_MODEL_MODELS_DIR": str(MODELS_DIR)}
    proc = subprocess.Popen(
        command,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[1])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not come up")


def stop(proc: subprocess.Popen[str], sig: int) -> tuple[int, str]:
    """Send ``sig`` to the process group; the exit status and stderr."""
    os.killpg(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, err


def check_log(err: str) -> None:
    assert "event=cache_flushed" in err, err[-3000:]
    # NOTE: the configured Redis at port 1 is unreachable on purpose: the tier and the epoch
    # book say so at start (a warning); no other line names an error
    unexpected = [line for line in err.splitlines() if "Error" in line and "127.0.0.1:1." not in line]
    assert "Traceback" not in err and not unexpected, err[-3000:]
    started = [line for line in err.splitlines() if "event=serve_" in line or "event=tier_opened" in line]
    kinds = {line.split("event=")[1].split()[0] for line in started}
    assert {"serve_auth", "serve_tier", "serve_model", "serve_restart", "serve_ready"} <= kinds, started
    assert all(len(line) <= 160 for line in started), [line for line in started if len(line) > 160]
    assert "url=redis://user:***@127.0.0.1:1/0" in err and "mode=api_keys keys=1 tenants=1" in err, started
    assert KEY not in err and PASSWORD not in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_cleanly_on_a_signal(sig: int, tmp_path: Path) -> None:
    model()  # converted once for the whole test session (the server reads MODELS_DIR)
    port = free_port()
    proc = start([str(BIN / "prefixcache"), "serve", "--config", "prefixcache.toml"], tmp_path, port)
    status, err = stop(proc, sig)
    assert status == 0, err[-3000:]
    check_log(err)


def test_make_serve_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    """Ctrl-C reaches make and the server together. The server flushes and exits 0, so make
    reports no error (no ``make: *** [serve] Interrupt``). NOTE: GNU make itself then
    always dies of the SIGINT it received, whatever its child's status (it raises the
    signal on itself once its children are gone), so a shell sees 130: no recipe
    changes that, and it is how a script learns its user interrupted it."""
    model()
    port = free_port()
    # -o: the venv is this one, as installed (no reinstall because pyproject.toml changed)
    command = ["make", "-f", str(ROOT / "Makefile"), "-o", ".venv/.installed-test", "serve", f"BIN={BIN}"]
    proc = start(command, tmp_path, port)
    status, err = stop(proc, signal.SIGINT)
    assert status in (0, -signal.SIGINT), err[-3000:]
    assert "make: ***" not in err, err[-3000:]
    check_log(err)
