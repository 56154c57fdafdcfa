"""The production path as the tests start it: ``vllm serve`` with the connector (its KV
events published) and ``prefixcache route`` in front, the gateway's secret shared by
both. Each test module says what differs: the connector's cache, vLLM's KV size, the
router's keys."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_connector import BLOCK, MODEL
from test_serve import SERVE, free_port

from prefixcache.identity import SECRET_ENV


@dataclass(frozen=True)
class Gateway:
    route: str  # the router's URL (what clients call)
    vllm: str  # vLLM's own URL (what clients must never reach)
    tmp: Path


def wait_up(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} did not answer in {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def gateway(
    tmp: Path,
    *,
    keys: Mapping[str, str],
    secret: str,
    cache: Mapping[str, Any],
    vllm_flags: Sequence[str],
    route_settings: str = "",
) -> Iterator[Gateway]:
    """vLLM with the connector (``cache``: its cache settings; ``vllm_flags``: how much KV
    vLLM keeps), then the router with ``keys``; both stopped at the end."""
    vllm_port, route_port, events = free_port(), free_port(), free_port()
    transfer = {
        "kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "prefixcache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cache": dict(cache)},
    }
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}", "topic": "kv"}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", SECRET_ENV: secret}
    vllm_log = tmp / "vllm.log"
    vllm = subprocess.Popen(
        [
            *SERVE,
            *("--model", MODEL, "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048"),
            *("--enforce-eager", "--enable-prefix-caching", *vllm_flags),
            *("--enable-prompt-tokens-details", "--port", str(vllm_port)),
            *("--kv-transfer-config", json.dumps(transfer), "--kv-events-config", json.dumps(kv_events)),
        ],
        stdout=vllm_log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    settings = tmp / "route.toml"
    settings.write_text(
        "[auth]\napi_keys = {"
        + ", ".join(f'"{k}" = "{t}"' for k, t in keys.items())
        + "}\n"
        + f'tenant_secret = "{secret}"\n'
        + route_settings
        + '[cache]\nisolation = "namespace"\n'
        + f'[model]\nname = "{MODEL}"\nid = "smollm2"\n'
    )
    route_log = tmp / "route.log"
    route = None
    try:
        wait_up(f"http://127.0.0.1:{vllm_port}/health", vllm, vllm_log)
        route = subprocess.Popen(
            [
                *(sys.executable, "-m", "prefixcache.cli", "route", "--config", str(settings)),
                *("--port", str(route_port), "--block-size", str(BLOCK), "--model-id", "smollm2"),
                *("--vllm-backend", f"http://127.0.0.1:{vllm_port}=tcp://127.0.0.1:{events},topic=kv"),
            ],
            stdout=route_log.open("w"),
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != SECRET_ENV},  # the router reads its own settings
        )
        wait_up(f"http://127.0.0.1:{route_port}/healthz", route, route_log, 120)
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{route_port}/healthz").json()["status"] != "ok":
            assert time.monotonic() < deadline, route_log.read_text()[-4000:]
            time.sleep(0.5)
        yield Gateway(f"http://127.0.0.1:{route_port}", f"http://127.0.0.1:{vllm_port}", tmp)
    finally:
        if route is not None:
            stop(route)
        stop(vllm)
