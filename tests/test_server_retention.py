"""OpenAI's ``prompt_cache_retention: "24h"`` on the real server and model (issue 41): the
prompt is retained, survives a flood of another tenant's prompts that evicts an
unretained one, and the response says what the retention got; a tenant whose cap is
zero is served without retention and told so in a header, never refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engine_support import MODEL_ID, TEST_TIMEOUT_S, LiveServer, engine, layout, model, tiered_cache
from prefixcache.config import RetentionConfig, TierConfig
from prefixcache.server.app import create_app
from prefixcache.server.retention import RETENTION_HEADER
from prefixcache.settings import AuthSettings, ServerSettings, Settings

pytestmark = pytest.mark.model

KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex", "sk-initech-0123456789": "initech"}
FRAMES = 48  # blocks of 16 tokens the memory tier holds: a few prompts' worth


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    lm = model()
    frame = layout(lm).stored_bytes(16, "raw") + 4096  # a block's payload and (more than) its header
    tiers = (TierConfig(kind="memory", capacity_bytes=FRAMES * frame),)
    retention = RetentionConfig(share=0.5, tenants={"initech": 0.0})
    cache = tiered_cache(lm, tmp_path_factory.mktemp("cache"), tiers=tiers, retention=retention)
    settings = Settings(
        server=ServerSettings(max_queue=32, request_timeout_s=TEST_TIMEOUT_S),
        auth=AuthSettings(api_keys=KEYS, admin_key="adm-0123456789"),
    )
    eng = engine(lm, cache, max_queue=32)
    server = LiveServer(create_app(eng, settings, cache), eng).start()
    yield server
    server.stop()
    eng.close()
    cache.close()


def chat(live: LiveServer, key: str, text: str, **extra: Any) -> tuple[Any, dict[str, str]]:
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=120)
    messages: Any = [{"role": "user", "content": text}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=messages, max_tokens=2, temperature=0, extra_body=extra or None
    )
    assert live.engine is not None and live.engine.wait_idle(60)
    return raw.parse(), dict(raw.headers)


def document(topic: str) -> str:
    return f"Notes on {topic}. " + " ".join(f"{topic} fact number {i} is worth keeping in mind." for i in range(12))


def test_a_24h_prompt_survives_a_flood_that_evicts_an_unretained_one(live: LiveServer) -> None:
    kept, lost = document("kept"), document("lost")
    _, headers = chat(live, "sk-acme-0123456789", kept, prompt_cache_retention="24h")
    assert headers[RETENTION_HEADER] in ("retained", "requested")  # the store may still run when it answers
    first_lost, plain = chat(live, "sk-acme-0123456789", lost, prompt_cache_retention="in_memory")
    assert RETENTION_HEADER not in plain
    shared = first_lost.usage.prompt_tokens_details.cached_tokens  # the template's start, as in ``kept``
    for i in range(12):  # another tenant's prompts: more than the memory tier holds
        chat(live, "sk-globex-0123456789", document(f"flood {i}"))
    again, _ = chat(live, "sk-acme-0123456789", kept)
    lost_again, _ = chat(live, "sk-acme-0123456789", lost)
    prompt = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= (prompt - 1) // 16 * 16 > 0
    assert lost_again.usage.prompt_tokens_details.cached_tokens == shared < (prompt - 1) // 16 * 16
    cache = live.engine.cache  # type: ignore[union-attr]
    acme = next(t for t in cache.stats().retention if t.tenant == "acme")
    assert 0 < acme.held[0] <= acme.caps[0]


def test_a_tenant_with_a_zero_cap_is_served_without_retention_and_told(live: LiveServer) -> None:
    answer, headers = chat(live, "sk-initech-0123456789", document("initech"), prompt_cache_retention="24h")
    assert answer.choices[0].message.content is not None
    assert headers[RETENTION_HEADER] == "refused"
    cache = live.engine.cache  # type: ignore[union-attr]
    initech = next(t for t in cache.stats().retention if t.tenant == "initech")
    assert initech.held[0] == 0 and initech.refused == 1  # counted, for /metrics


def test_an_unknown_retention_is_a_400_naming_the_values(live: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        chat(live, "sk-acme-0123456789", "hello", prompt_cache_retention="1h")
    assert "prompt_cache_retention" in str(refused.value) and "24h" in str(refused.value)
