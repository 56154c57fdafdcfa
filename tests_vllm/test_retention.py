"""Retention through vLLM (issue 41): a client asks ``prompt_cache_retention: "24h"`` of
``prefixcache route``; the router stamps it for the connector with the tenant's proof;
the connector retains what it saves. Then another tenant's flood evicts vLLM's own
prefix cache (a few blocks here) and fills the connector's memory tier: the retained
prompt still loads from the tier, the unretained one of the same tenant is gone. Both
are measured in the same run, by what vLLM reports cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI
from test_connector import BLOCK, MODEL, prompt
from test_route import stop, wait_up
from test_serve import SERVE, free_port

from prefixcache.identity import SECRET_ENV

SECRET = "retention-test-secret-0123456789"
KEYS = {"sk-keeper-0123456789": "keeper", "sk-flooder-0123456789": "flooder"}
KEEPER, FLOODER = list(KEYS)
FRAME = BLOCK * 30 * 2 * 3 * 64 * 4 + 4096  # SmolLM2's float32 KV of one block, and its header
TIER_FRAMES = 12  # the connector's memory tier: a few prompts
VLLM_BLOCKS = 24  # vLLM's own KV cache: what one flood of a few prompts evicts


@pytest.fixture(scope="module")
def route(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("retention")
    vllm_port, route_port, events = free_port(), free_port(), free_port()
    transfer = {
        "kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "prefixcache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cache": {
                "isolation": "namespace",
                "tiers": [{"kind": "memory", "capacity_bytes": TIER_FRAMES * FRAME, "write": "through"}],
                "retention": {"share": 0.5},
            }
        },
    }
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}", "topic": "kv"}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", SECRET_ENV: SECRET}
    vllm_log = tmp / "vllm.log"
    vllm = subprocess.Popen(
        [
            *SERVE,
            *("--model", MODEL, "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048"),
            *("--enforce-eager", "--enable-prefix-caching", "--num-gpu-blocks-override", str(VLLM_BLOCKS)),
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
        + ", ".join(f'"{k}" = "{t}"' for k, t in KEYS.items())
        + "}\n"
        + f'tenant_secret = "{SECRET}"\n'
        + '[cache]\nisolation = "namespace"\n'
        + f'[model]\nname = "{MODEL}"\nid = "smollm2"\n'
    )
    route_log = tmp / "route.log"
    router = None
    try:
        wait_up(f"http://127.0.0.1:{vllm_port}/health", vllm, vllm_log)
        router = subprocess.Popen(
            [
                *(sys.executable, "-m", "prefixcache.cli", "route", "--config", str(settings)),
                *("--port", str(route_port), "--block-size", str(BLOCK), "--model-id", "smollm2"),
                *("--vllm-backend", f"http://127.0.0.1:{vllm_port}=tcp://127.0.0.1:{events},topic=kv"),
            ],
            stdout=route_log.open("w"),
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != SECRET_ENV},
        )
        wait_up(f"http://127.0.0.1:{route_port}/healthz", router, route_log, 120)
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{route_port}/healthz").json()["status"] != "ok":
            assert time.monotonic() < deadline, route_log.read_text()[-4000:]
            time.sleep(0.5)
        yield f"http://127.0.0.1:{route_port}"
    finally:
        if router is not None:
            stop(router)
        stop(vllm)


def cached(base: str, key: str, text: str, **extra: object) -> int:
    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=600)
    reply = client.completions.create(
        model="smollm2", prompt=text, max_tokens=1, temperature=0, extra_body=extra or None
    )
    details = reply.usage.prompt_tokens_details
    return details.cached_tokens if details else 0


def test_a_retained_prompt_survives_a_flood_that_evicts_an_unretained_one(route: str) -> None:
    kept, lost = prompt("Kept", 6, "What did the keeper keep?"), prompt("Lost", 6, "What was lost?")
    assert cached(route, KEEPER, kept, prompt_cache_retention="24h") == 0
    assert cached(route, KEEPER, lost) == 0
    assert cached(route, KEEPER, lost) >= 3 * BLOCK  # vLLM's own cache, before the flood
    for i in range(8):  # another tenant's prompts: more blocks than vLLM and the tier hold
        cached(route, FLOODER, prompt(f"Flood {i}", 6, "What came in?"))
    after_kept, after_lost = cached(route, KEEPER, kept), cached(route, KEEPER, lost)
    print(f"after the flood: retained prompt {after_kept} cached tokens, unretained {after_lost}")
    assert after_kept >= 3 * BLOCK  # loaded from the connector's tier: vLLM's own blocks were evicted
    assert after_lost == 0


def test_anthropics_messages_reach_vllm_through_the_router_and_a_breakpoint_retains(route: str) -> None:
    """``/v1/messages`` to vLLM's own Messages API: an answer in Anthropic's shape, with
    usage; a ``cache_control`` breakpoint is a retention the connector keeps (the flood
    above would otherwise have taken it)."""
    client = anthropic.Anthropic(base_url=route, api_key=KEEPER, max_retries=0, timeout=600)
    text = prompt("Messages", 6, "What did the messenger bring?")
    block: Any = {"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    first = client.messages.create(model="smollm2", max_tokens=2, messages=[{"role": "user", "content": [block]}])
    assert first.type == "message" and first.role == "assistant" and first.usage.input_tokens > 0
    for i in range(8):
        cached(route, FLOODER, prompt(f"Wave {i}", 6, "What came in?"))
    again = client.messages.create(model="smollm2", max_tokens=2, messages=[{"role": "user", "content": [block]}])
    read = again.usage.cache_read_input_tokens or 0
    print(f"messages through vLLM: {read} of {again.usage.input_tokens + read} prompt tokens read after the flood")
    assert read >= 3 * BLOCK
