"""The pieces the gateway's strictness rests on, without a server: token ids the keys
cannot hold, the JSON depth limit, error bodies that always encode, and what a vLLM
backend is never sent."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from prefixcache.api.errors import MAX_DEPTH, APIError, too_deep
from prefixcache.fleet.keys import TokenRangeError, chain_keys, root_key, token_bytes
from prefixcache.fleet.relay import failed
from prefixcache.fleet.validate import check_vllm


@pytest.mark.parametrize("tokens", [[-1], [1 << 32], [1 << 63], [1 << 64], [1, -(1 << 64)], [5, (1 << 70)]])
def test_a_token_id_the_keys_cannot_hold_is_a_token_range_error(tokens: list[int]) -> None:
    with pytest.raises(TokenRangeError, match=r"\[0, 2\*\*32\)"):
        chain_keys(root_key("t", "m"), tokens, 1)
    with pytest.raises(ValueError):  # what callers that catch ValueError already handle
        token_bytes(tokens)


def test_the_edges_of_the_range_are_keys() -> None:
    assert token_bytes([0, (1 << 32) - 1]) == b"\0\0\0\0\xff\xff\xff\xff"
    assert len(chain_keys(root_key("t", "m"), [0, (1 << 32) - 1], 1)) == 2


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("raw", "deep"),
    [
        (nested(MAX_DEPTH), False),
        (nested(MAX_DEPTH + 1), True),
        (b'{"a":' * 1000 + b"1" + b"}" * 1000, True),
        (json.dumps({"text": "[{" * 5000}).encode(), False),  # brackets inside a string are text
        (json.dumps({"text": '\\"[' * 5000}).encode(), False),  # ... escaped quotes too
        (json.dumps([["x"] * 3] * 2000).encode(), False),  # many brackets, nested two deep
        (b"", False),
    ],
)
def test_the_depth_limit_counts_nesting_outside_strings(raw: bytes, deep: bool) -> None:
    assert too_deep(raw, MAX_DEPTH) is deep


@pytest.mark.parametrize("text", ["\ud800", "a\udfffb", "\ud83d", "caf\u00e9 \U0001f600"])
def test_an_error_body_is_always_utf8_json(text: str) -> None:
    response = APIError(404, f"The model `{text}` does not exist.", param=text, code="model_not_found").response()
    error = json.loads(bytes(response.body).decode("utf-8"))["error"]
    assert error["code"] == "model_not_found" and "does not exist" in error["message"]
    assert text in error["message"] or text.encode("utf-8", "backslashreplace").decode() in error["message"]


@pytest.mark.parametrize("prompt", [[-1], [1, 1 << 32], [1 << 64], [[1, 2], [3, -5]], [0.5, -1.0], [float(1 << 40)]])
def test_vllm_never_gets_token_ids_out_of_range(prompt: Any) -> None:
    with pytest.raises(APIError) as caught:
        check_vllm({"model": "m", "prompt": prompt})
    assert caught.value.status == 400 and caught.value.param == "prompt"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [0, 1, (1 << 32) - 1]},
        {"prompt": [[1, 2], [3]]},
        {"prompt": "text"},
        {"prompt": ["one", "two"]},
        {"prompt": []},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"prompt": [True, None, "x"]},  # not token ids: vLLM says what is wrong with them
    ],
)
def test_anything_else_goes_to_vllm_for_it_to_judge(body: dict[str, Any]) -> None:
    check_vllm(body)


@pytest.mark.parametrize(
    ("exc", "retry", "down", "lost", "status"),
    [
        (httpx.ConnectError("refused"), True, True, False, 502),
        (httpx.ConnectTimeout("slow"), True, True, False, 502),
        (httpx.RemoteProtocolError("closed"), True, True, True, 502),  # the backend stopped: once more elsewhere
        (httpx.ReadError("reset"), True, True, True, 502),
        (httpx.ReadTimeout("late"), False, False, False, 504),  # still working there: never again elsewhere
        (httpx.PoolTimeout("busy"), False, False, False, 503),
    ],
)
def test_what_a_failed_send_means_for_the_request(
    exc: httpx.HTTPError, retry: bool, down: bool, lost: bool, status: int
) -> None:
    got = failed(exc, "b1")
    assert (got.retry, got.down, got.lost, got.error.status) == (retry, down, lost, status)
