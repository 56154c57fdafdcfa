"""Anthropic's Messages API on the real model, driven by the official ``anthropic``
client: a two-turn chat whose second turn reads the first turn's breakpoint, a stream,
usage that adds up to the prompt, and every bad input as the client's typed error with
Anthropic's error type."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from prometheus_client import generate_latest

from engine_support import MODEL_ID, TEST_TIMEOUT_S, LiveServer, engine, model, tiered_cache
from prefixcache.server.app import create_app
from prefixcache.settings import AuthSettings, ServerSettings, Settings

pytestmark = pytest.mark.model  # the real model: seconds to load, minutes to run

KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}
KEY = "sk-acme-0123456789"
CC: Any = {"type": "ephemeral"}
SYSTEM = (
    "You are the support assistant of Fernwood Garden Tools. Answer in one short sentence. "
    "Refunds are accepted within 30 days of delivery with the receipt. Shipping takes 3 to 5 working days. "
) * 3
GREEDY: Any = {"temperature": 0}  # Anthropic's field, which this client's typed parameters no longer list


def settings() -> Settings:
    return Settings(
        server=ServerSettings(max_queue=32, request_timeout_s=TEST_TIMEOUT_S, max_body_bytes=1 << 20),
        auth=AuthSettings(api_keys=KEYS),
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    lm = model()
    cache = tiered_cache(lm, tmp_path_factory.mktemp("cache"), partial_blocks=True)
    eng = engine(lm, cache, max_queue=32)
    server = LiveServer(create_app(eng, settings(), cache), eng).start()
    yield server
    server.stop()
    eng.close()
    cache.close()


def client(live: LiveServer, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=key, max_retries=0, timeout=600)


def usage_total(u: Any) -> int:
    return int(u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens)


def count(live: LiveServer, **request: Any) -> int:
    answer = client(live).messages.count_tokens(model=MODEL_ID, **request)
    return int(answer.input_tokens)


def test_a_second_turn_reads_the_first_turns_breakpoint(live: LiveServer) -> None:
    c = client(live, "sk-globex-0123456789")
    system: Any = [{"type": "text", "text": SYSTEM, "cache_control": CC | {"ttl": "1h"}}]
    turns: Any = [{"role": "user", "content": [{"type": "text", "text": "Can I return a rake?", "cache_control": CC}]}]
    raw = c.messages.with_raw_response.create(
        model=MODEL_ID, max_tokens=10, system=system, messages=turns, extra_body=GREEDY
    )
    first = raw.parse()
    assert raw.headers["x-prefixcache-retention"] in ("requested", "retained", "capped")
    assert first.type == "message" and first.id.startswith("msg_") and first.role == "assistant"
    assert first.content[0].type == "text" and first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens")
    u1 = first.usage
    assert usage_total(u1) == count(live, system=system, messages=turns)
    assert u1.cache_read_input_tokens == 0 and u1.cache_creation_input_tokens > 0 and u1.input_tokens > 0
    assert u1.cache_creation is not None
    assert u1.cache_creation.ephemeral_1h_input_tokens > 0 and u1.cache_creation.ephemeral_5m_input_tokens > 0
    assert live.engine is not None and live.engine.wait_idle(60)

    turns = [
        {"role": "user", "content": "Can I return a rake?"},  # the breakpoint moves on: the text stays
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": [{"type": "text", "text": "And a spade?", "cache_control": CC}]},
    ]
    second = c.messages.create(model=MODEL_ID, max_tokens=10, system=system, messages=turns, extra_body=GREEDY)
    u2 = second.usage
    assert usage_total(u2) == count(live, system=system, messages=turns)
    # the first turn's breakpoint prefix (what it created) is read now, and more
    assert u2.cache_read_input_tokens >= u1.cache_creation_input_tokens
    assert u2.cache_creation_input_tokens > 0 and u2.cache_creation is not None
    assert u2.cache_creation.ephemeral_1h_input_tokens == 0  # the 1h breakpoint's prefix was read whole
    other = client(live).messages.create(model=MODEL_ID, max_tokens=10, system=system, messages=turns)
    assert other.usage.cache_read_input_tokens < u1.cache_creation_input_tokens  # another tenant's: not read


def test_a_stream_ends_with_the_answers_usage(live: LiveServer) -> None:
    c = client(live)
    turns: Any = [{"role": "user", "content": [{"type": "text", "text": "Name a garden tool.", "cache_control": CC}]}]
    plain = c.messages.create(model=MODEL_ID, max_tokens=8, messages=turns, extra_body=GREEDY)
    assert live.engine is not None and live.engine.wait_idle(60)
    with c.messages.stream(model=MODEL_ID, max_tokens=8, messages=turns, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    assert usage_total(final.usage) == usage_total(plain.usage) == count(live, messages=turns)
    assert final.usage.cache_read_input_tokens > 0  # the plain answer's prompt, stored


def test_the_raw_stream_is_anthropics_events_in_order(live: LiveServer) -> None:
    body = {"model": MODEL_ID, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", live.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=600) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    deltas = names.count("content_block_delta")
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_a_stop_sequence_is_named(live: LiveServer) -> None:
    c = client(live)
    turns: Any = [{"role": "user", "content": "Tell me about spades."}]
    plain = c.messages.create(model=MODEL_ID, max_tokens=24, messages=turns, extra_body=GREEDY)
    text = plain.content[0].text
    assert len(text) >= 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # greedy: the same answer meets it there (or before)
    cut = c.messages.create(model=MODEL_ID, max_tokens=24, messages=turns, stop_sequences=[stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def error_of(call: Any, kind: type[anthropic.APIStatusError]) -> str:
    with pytest.raises(kind) as raised:
        call()
    body: Any = raised.value.body
    assert body["type"] == "error"
    return str(body["error"]["type"])


def test_bad_input_is_the_clients_typed_error_with_anthropics_type(live: LiveServer) -> None:
    c = client(live)
    text = [{"type": "text", "text": "x", "cache_control": CC}]
    five: Any = [{"role": "user", "content": text * 5}]
    ten: Any = [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": CC | {"ttl": "10m"}}]}]
    empty: Any = [{"role": "user", "content": [{"type": "text", "text": "", "cache_control": CC}]}]
    for turns in (five, ten, empty):
        create = lambda t=turns: c.messages.create(model=MODEL_ID, max_tokens=4, messages=t)  # noqa: E731
        assert error_of(create, anthropic.BadRequestError) == "invalid_request_error"
    hi: Any = [{"role": "user", "content": "Hi"}]
    no_max = lambda: c.post("/v1/messages", cast_to=object, body={"model": MODEL_ID, "messages": hi})  # noqa: E731
    assert error_of(no_max, anthropic.BadRequestError) == "invalid_request_error"
    wrong_model = lambda: c.messages.create(model="claude-opus-4", max_tokens=4, messages=hi)  # noqa: E731
    assert error_of(wrong_model, anthropic.NotFoundError) == "not_found_error"
    bad_key = lambda: client(live, "sk-wrong").messages.create(model=MODEL_ID, max_tokens=4, messages=hi)  # noqa: E731
    assert error_of(bad_key, anthropic.AuthenticationError) == "authentication_error"
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    think = lambda: c.messages.create(model=MODEL_ID, max_tokens=2048, messages=hi, thinking=thinking)  # noqa: E731
    assert error_of(think, anthropic.BadRequestError) == "invalid_request_error"


def test_the_key_as_x_api_key_without_it_and_over_the_body_limit(live: LiveServer) -> None:
    body = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    ok = httpx.post(live.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=600)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    assert "x-prefixcache-retention" not in ok.headers  # nothing asked
    none = httpx.post(live.url + "/v1/messages", json=body, timeout=60)
    assert none.status_code == 401 and none.json()["error"]["type"] == "authentication_error"
    big = body | {"system": "x" * (2 << 20)}
    over = httpx.post(live.url + "/v1/messages", json=big, headers={"x-api-key": KEY}, timeout=60)
    assert over.status_code == 413 and over.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "the request body is over the limit of 1048576 bytes"},
    }
    chat = httpx.post(
        live.url + "/v1/chat/completions", json={"model": MODEL_ID}, headers={"authorization": "Bearer " + KEY}
    )
    assert chat.status_code == 400 and "error" in chat.json() and "type" not in chat.json()  # OpenAI's shape there


def test_without_a_cache_a_breakpoint_is_served_and_refused_in_a_header() -> None:
    eng = engine(model(), None)
    server = LiveServer(create_app(eng, settings(), None), eng).start()
    try:
        turns: Any = [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": CC}]}]
        raw = client(server).messages.with_raw_response.create(model=MODEL_ID, max_tokens=2, messages=turns)
        assert raw.headers["x-prefixcache-retention"] == "refused"
        answer = raw.parse()
        assert answer.usage.cache_read_input_tokens == 0 and usage_total(answer.usage) > 0
    finally:
        server.stop()
        eng.close()


def test_messages_are_counted_under_their_own_endpoint(live: LiveServer) -> None:
    client(live).messages.create(model=MODEL_ID, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert live.engine is not None and live.engine.wait_idle(60)
    text = generate_latest(live.config.app.state.server.registry).decode()
    assert 'endpoint="messages"' in text
