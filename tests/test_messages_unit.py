"""Anthropic's Messages API without the model: the request schema (every field of the
``anthropic`` package's request placed, Anthropic's own 400s), the rendering of a request
into prompt tokens with its breakpoints as prefixes the next turn shares, the usage
arithmetic, and the error shape."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from anthropic.types import message_create_params as create_params
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from prefixcache.api.errors import APIError, anthropic_route, anthropic_type
from prefixcache.api.messages import _OFF, IMPLEMENTED, INERT, REFUSED, CountTokensRequest, MessagesRequest, Ttl
from prefixcache.api.messages_prompt import TOOLS_HEADER, Breakpoint, messages_prompt, render
from prefixcache.api.messages_usage import messages_usage
from prefixcache.cache.retention import RetainSpan
from prefixcache.engine import QueueFull, TenantBusy

MODEL = "m"
CC = {"type": "ephemeral"}
TOOL = {"name": "get_weather", "description": "The weather now.", "input_schema": {"type": "object"}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]} | fields


def refusal(fields: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as refused:
        MessagesRequest.model_validate(fields)
    return str(refused.value)


# ------------------------------------------------------------------ the schema


def test_every_anthropic_field_is_placed_once() -> None:
    kinds = (create_params.MessageCreateParamsStreaming, create_params.MessageCreateParamsNonStreaming)
    fields = {name for kind in kinds for name in kind.__required_keys__ | kind.__optional_keys__}
    # NOTE: temperature, top_p and top_k are Anthropic's (clients send them in the body), though
    # this client's typed parameters no longer list them
    unplaced = sorted(fields - IMPLEMENTED - INERT - REFUSED)
    assert not unplaced, f"Anthropic has fields messages.py does not place: {unplaced}"
    assert not (IMPLEMENTED & INERT or IMPLEMENTED & REFUSED or INERT & REFUSED)
    assert {"model", "messages", "max_tokens", "cache_control", "stream"} <= IMPLEMENTED


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_is_refused_by_name_unless_it_asks_nothing(name: str) -> None:
    assert f"{name} is not supported" in refusal(body(**{name: {"asks": "for something"}}))
    for off in _OFF[name]:
        MessagesRequest.model_validate(body(**{name: off}))


def test_a_valid_request_with_every_kind_of_block() -> None:
    request = MessagesRequest.model_validate(
        body(
            system=[{"type": "text", "text": "Be brief.", "cache_control": CC}],
            tools=[TOOL | {"cache_control": CC | {"ttl": "1h"}}],
            tool_choice={"type": "auto"},
            metadata={"user_id": "u-1"},
            stop_sequences=["\n\n"],
            temperature=0.5,
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]},
            ],
        )
    )
    assert request.user == "u-1" and request.stops == ("\n\n",)
    assert [c.lifetime for c in request.cache_controls()] == [Ttl.ONE_HOUR, Ttl.FIVE_MINUTES]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": CC}]}] * 5},
            "A maximum of 4 blocks with cache_control may be provided. Found 5.",
        ),
        ({"system": [{"type": "text", "text": "x", "cache_control": CC | {"ttl": "10m"}}]}, "'5m' or '1h'"),
        ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]}, "'ephemeral'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "", "cache_control": CC}]}]},
            "cache_control cannot be set on an empty text block",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "no vision"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "text only"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "cache_control": CC}]},
                    {"role": "user", "content": "Hi"},
                ]
            },
            "thinking blocks are not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
            "cannot be in a user message",
        ),
        (
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]},
            "prefill is not supported",
        ),
        (
            {
                "system": [
                    {"type": "text", "text": "a", "cache_control": CC},
                    {"type": "text", "text": "b", "cache_control": CC | {"ttl": "1h"}},
                ]
            },
            "ttl '1h' cannot come after",
        ),
        ({"tool_choice": {"type": "any"}}, "never calls a tool"),
        ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "never calls a tool"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only client tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking is not supported"),
        ({"top_k": 5}, "top_k is not supported"),
        ({"temperature": 1.5}, "less than or equal to 1"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"max_tokens": 0}, "greater than or equal to 1"),
        ({"max_tokens": "8"}, "valid integer"),
    ],
)
def test_bad_input_is_refused_with_anthropics_words(fields: dict[str, Any], says: str) -> None:
    assert says in refusal(body(**fields))


def test_max_tokens_is_required_but_not_to_count_tokens() -> None:
    fields = body()
    del fields["max_tokens"]
    assert "max_tokens" in refusal(fields)
    CountTokensRequest.model_validate(fields)


# ------------------------------------------------------------------ rendering


class Chars:
    """A chat template and tokenizer in one: each character is a token."""

    def tokenize_chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + (
            "<assistant>" if generation_prompt else ""
        )
        return [ord(c) for c in text]

    def tokenize_text(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def text_of(tokens: list[int]) -> str:
    return "".join(map(chr, tokens))


def conversation(mark: bool = True) -> dict[str, Any]:
    cc = {"cache_control": CC} if mark else {}
    return body(
        tools=[TOOL | ({"cache_control": CC | {"ttl": "1h"}} if mark else {})],
        system="You answer about the weather.",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "Be brief.", **cc}],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"b": 1, "a": 2}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "Sunny", **cc}]}
                ],
            },
        ],
    )


def test_breakpoints_end_where_their_blocks_end_and_never_change_the_prompt() -> None:
    marked = messages_prompt(Chars(), CountTokensRequest.model_validate(conversation()))
    plain = messages_prompt(Chars(), CountTokensRequest.model_validate(conversation(mark=False)))
    assert marked.tokens == plain.tokens and not plain.breakpoints
    text = text_of(marked.tokens)
    ends = [text_of(marked.tokens[: b.tokens]) for b in marked.breakpoints]
    assert [b.ttl for b in marked.breakpoints] == [Ttl.ONE_HOUR, Ttl.FIVE_MINUTES, Ttl.FIVE_MINUTES]
    assert ends[0].startswith("<system># Tools") and ends[0].endswith('Input schema: {"type":"object"}')
    assert ends[1].endswith("Weather in Paris?\n\nBe brief.")  # not the turn's close
    assert ends[2].endswith("Sunny") and not ends[2].endswith("</tool_result>")
    assert '{"a":2,"b":1}' in text  # sorted keys: the same text whatever order the client sent
    assert marked.spans() == tuple(RetainSpan(b.tokens, b.ttl.seconds) for b in marked.breakpoints)


def test_the_next_turn_starts_with_every_breakpoint_of_this_one() -> None:
    first = conversation()
    this = messages_prompt(Chars(), CountTokensRequest.model_validate(first))
    nxt = first | {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "Thanks"},
        ]
    }
    after = messages_prompt(Chars(), CountTokensRequest.model_validate(nxt))
    for b in this.breakpoints:
        assert after.tokens[: b.tokens] == this.tokens[: b.tokens]


def test_tools_come_first_then_the_system_text() -> None:
    parts = render(CountTokensRequest.model_validate(body(tools=[TOOL], system="Be brief.")))
    assert parts[0].role == "system" and parts[0].content.startswith(TOOLS_HEADER)
    assert parts[0].content.endswith("\n\nBe brief.")
    assert [p.role for p in parts] == ["system", "user"]


def test_the_requests_own_cache_control_marks_its_last_block() -> None:
    prompt = messages_prompt(Chars(), CountTokensRequest.model_validate(body(cache_control=CC | {"ttl": "1h"})))
    (b,) = prompt.breakpoints
    assert text_of(prompt.tokens[: b.tokens]).endswith("<user>Hi") and b.ttl is Ttl.ONE_HOUR


@functools.cache
def smollm2() -> Any:
    """SmolLM2's own tokenizer and chat template (converted with the model)."""
    from engine_support import MODELS_DIR
    from prefixcache.api.prompts import Tokenizer
    from prefixcache.engine.model import DEFAULT_MODEL, resolve_model
    from prefixcache.settings import ModelSettings

    resolve_model(DEFAULT_MODEL, MODELS_DIR)
    return Tokenizer(ModelSettings(name=DEFAULT_MODEL, models_dir=str(MODELS_DIR)))


@pytest.mark.model
def test_on_smollm2s_tokenizer_breakpoints_are_prefixes_the_next_turn_shares() -> None:
    tok = smollm2()
    first = conversation()
    # text a BPE merges across a cut: the breakpoint takes the shorter prefix
    first["messages"][0]["content"][0] = {"type": "text", "text": "Weather in Par", "cache_control": CC}
    first["messages"][0]["content"][1]["text"] = "is?"
    this = messages_prompt(tok, CountTokensRequest.model_validate(first))
    nxt = first | {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "Thanks"},
        ]
    }
    after = messages_prompt(tok, CountTokensRequest.model_validate(nxt))
    decode = tok._tok.decode
    for b in this.breakpoints:
        assert 0 < b.tokens < len(this.tokens)
        assert after.tokens[: b.tokens] == this.tokens[: b.tokens]
    texts = [decode(this.tokens[: b.tokens]) for b in this.breakpoints]
    assert texts[0].endswith('Input schema: {"type":"object"}')
    assert texts[1].endswith("Weather in") or texts[1].endswith("Weather in Par")  # never past the block
    assert texts[2].endswith("Weather in Par\n\nis?") and texts[3].endswith("Sunny")


# ------------------------------------------------------------------ usage


def test_usage_of_a_second_turn_that_read_the_first_turns_breakpoint() -> None:
    bps = [Breakpoint(100, Ttl.ONE_HOUR), Breakpoint(250, Ttl.FIVE_MINUTES)]
    u = messages_usage(prompt_tokens=260, cached_tokens=120, breakpoints=bps, output_tokens=7)
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens, u.input_tokens) == (120, 130, 10)
    assert (u.ephemeral_1h_input_tokens, u.ephemeral_5m_input_tokens) == (0, 130)
    first = messages_usage(prompt_tokens=110, cached_tokens=0, breakpoints=bps[:1], output_tokens=7)
    assert (first.cache_creation_input_tokens, first.ephemeral_1h_input_tokens, first.input_tokens) == (100, 100, 10)
    body_ = u.body()
    assert body_["cache_creation"] == {"ephemeral_5m_input_tokens": 130, "ephemeral_1h_input_tokens": 0}


breakpoint_lists = st.lists(st.builds(Breakpoint, st.integers(0, 600), st.sampled_from(list(Ttl))), max_size=5)


@given(st.integers(0, 500), st.integers(0, 600), breakpoint_lists, st.integers(0, 50))
def test_usage_adds_up_to_the_prompt(prompt: int, cached: int, bps: list[Breakpoint], output: int) -> None:
    u = messages_usage(prompt, cached, bps, output)
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == prompt
    assert u.ephemeral_5m_input_tokens + u.ephemeral_1h_input_tokens == u.cache_creation_input_tokens
    assert min(u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) >= 0
    assert u.cache_read_input_tokens == min(cached, prompt) and u.output_tokens == output
    last = min(max((b.tokens for b in bps), default=0), prompt)
    assert u.cache_creation_input_tokens == max(0, last - min(cached, prompt))
    for ttl, n in ((Ttl.FIVE_MINUTES, u.ephemeral_5m_input_tokens), (Ttl.ONE_HOUR, u.ephemeral_1h_input_tokens)):
        if all(b.ttl is not ttl for b in bps):
            assert n == 0


def test_usage_refuses_negative_counts() -> None:
    with pytest.raises(ValueError):
        messages_usage(10, -1, [], 0)


# ------------------------------------------------------------------ errors


def test_errors_on_anthropics_routes_are_in_its_shape() -> None:
    assert anthropic_route("/v1/messages") and anthropic_route("/v1/messages/count_tokens")
    assert not anthropic_route("/v1/messagesx") and not anthropic_route("/v1/chat/completions")
    statuses = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
    statuses |= {404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}
    statuses |= {503: "overloaded_error", 529: "overloaded_error", 502: "api_error", 405: "invalid_request_error"}
    assert {s: anthropic_type(s) for s in statuses} == statuses
    error = APIError(429, "slow down", "rate_limit_error", "queue_full", headers={"Retry-After": "2"})
    assert error.anthropic_body() == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    response = error.response(anthropic=True)
    assert response.status_code == 429 and response.headers["retry-after"] == "2"


def test_the_engines_queue_full_is_a_429_rate_limit_error_with_retry_after() -> None:
    for refusal_ in (QueueFull("the queue is full", retry_after=3), TenantBusy("over your share", retry_after=3)):
        response = APIError.of(refusal_).response(anthropic=True)
        assert response.status_code == 429 and response.headers["retry-after"] == "3"
        assert json.loads(response.body)["error"] == {"type": "rate_limit_error", "message": refusal_.message}
