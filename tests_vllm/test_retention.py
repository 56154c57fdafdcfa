"""Retention through vLLM (issue 41): a client asks ``prompt_cache_retention: "24h"`` of
``prefixcache route``; the router stamps it for the connector with the tenant's proof;
the connector retains what it saves. Then another tenant's flood evicts vLLM's own
prefix cache (a few blocks here) and fills the connector's memory tier: the retained
prompt still loads from the tier, the unretained one of the same tenant is gone. Both
are measured in the same run, by what vLLM reports cached.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from gateway_support import gateway
from openai import OpenAI
from test_connector import BLOCK, prompt

SECRET = "retention-test-secret-0123456789"
KEYS = {"sk-keeper-0123456789": "keeper", "sk-flooder-0123456789": "flooder"}
KEEPER, FLOODER = list(KEYS)
FRAME = BLOCK * 30 * 2 * 3 * 64 * 4 + 4096  # SmolLM2's float32 KV of one block, and its header
TIER_FRAMES = 12  # the connector's memory tier: a few prompts
VLLM_BLOCKS = 24  # vLLM's own KV cache: what one flood of a few prompts evicts


@pytest.fixture(scope="module")
def route(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = {
        "isolation": "namespace",
        "tiers": [{"kind": "memory", "capacity_bytes": TIER_FRAMES * FRAME, "write": "through"}],
        "retention": {"share": 0.5},
    }
    flags = ("--num-gpu-blocks-override", str(VLLM_BLOCKS))
    with gateway(tmp_path_factory.mktemp("retention"), keys=KEYS, secret=SECRET, cache=cache, vllm_flags=flags) as g:
        yield g.route


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
