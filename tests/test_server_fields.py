"""Every field of OpenAI's chat and completions requests, as the ``openai`` package ships
their schema, is implemented, inert (changes no answer), or refused by name with a 400
when it asks for anything: none is silently ignored, and a field a newer ``openai`` adds
fails here until schemas.py places it. The penalties' ranges are checked here too."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel, ValidationError

from prefixcache.api.schemas import _OFF, IMPLEMENTED, INERT, REFUSED, ChatRequest, CompletionRequest


def openai_fields(module: Any) -> set[str]:
    """The fields of one endpoint's request: every key of its streaming and non-streaming
    TypedDicts (``stream`` is only in those)."""
    kinds = (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming)
    return {name for kind in kinds for name in kind.__required_keys__ | kind.__optional_keys__}


CHAT, COMPLETION = openai_fields(chat_params), openai_fields(completion_params)
ENDPOINTS: list[tuple[type[BaseModel], dict[str, Any], set[str]]] = [
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, CHAT),
    (CompletionRequest, {"model": "m", "prompt": "Hi"}, COMPLETION),
]
ASKS = {"asks": "for something"}  # a value that is off for no field
INERT_VALUES = {"user": "u-1", "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "k"}
INERT_VALUES |= {"parallel_tool_calls": False}


def test_every_openai_field_is_placed_once() -> None:
    assert len(CHAT) > 30 and len(COMPLETION) > 15 and {"model", "stream", "presence_penalty"} <= CHAT & COMPLETION
    unplaced = sorted((CHAT | COMPLETION) - IMPLEMENTED - INERT - REFUSED)
    assert not unplaced, f"OpenAI has fields schemas.py does not place (implement, INERT or _OFF): {unplaced}"
    assert not (IMPLEMENTED & INERT or IMPLEMENTED & REFUSED or INERT & REFUSED)
    assert not (IMPLEMENTED | INERT | REFUSED) - (CHAT | COMPLETION), "a listed field OpenAI no longer has"


@pytest.mark.parametrize(("model", "base", "fields"), ENDPOINTS, ids=["chat", "completions"])
def test_implemented_fields_are_the_schemas_own(model: type[BaseModel], base: dict[str, Any], fields: set[str]) -> None:
    missing = sorted(name for name in fields & IMPLEMENTED if name not in model.model_fields)
    assert not missing


@pytest.mark.parametrize(("model", "base", "fields"), ENDPOINTS, ids=["chat", "completions"])
def test_every_refused_field_is_refused_by_name_unless_off(
    model: type[BaseModel], base: dict[str, Any], fields: set[str]
) -> None:
    for name in sorted(fields & REFUSED):
        with pytest.raises(ValidationError) as refused:
            model.model_validate(base | {name: ASKS})
        error = refused.value.errors()[0]
        assert error["loc"] == (name,) and "not supported" in error["msg"], (name, error)
        for off in _OFF[name]:
            assert getattr(model.model_validate(base | {name: off}), name) == off


@pytest.mark.parametrize(("model", "base", "fields"), ENDPOINTS, ids=["chat", "completions"])
def test_inert_fields_are_accepted(model: type[BaseModel], base: dict[str, Any], fields: set[str]) -> None:
    for name in sorted(fields & INERT):
        model.model_validate(base | {name: INERT_VALUES[name]})


def test_the_document_says_which_values_a_refused_field_takes() -> None:
    prop = ChatRequest.model_json_schema()["properties"]
    assert prop["modalities"] == {
        "type": ["null", "array"],
        "enum": [None, ["text"]],
        "description": "Not supported: only a value that asks for nothing.",
    }
    assert prop["logprobs"]["type"] == ["null", "boolean", "integer"]
    assert prop["presence_penalty"]["minimum"] == -2 and prop["presence_penalty"]["maximum"] == 2


# JSON as Python's parser reads it: NaN and Infinity are numbers there.
PENALTIES_BAD = [
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 1e308),
    ("frequency_penalty", math.nan),
    ("presence_penalty", math.inf),
    ("frequency_penalty", -math.inf),
    ("presence_penalty", "0.5"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
]


@pytest.mark.parametrize(("field", "value"), PENALTIES_BAD, ids=[f"{f}={v!r}" for f, v in PENALTIES_BAD])
def test_penalties_out_of_range_are_refused_by_name(field: str, value: Any) -> None:
    for model, base, _ in ENDPOINTS:
        body = json.loads(json.dumps(base | {field: value}))  # through JSON, as the server reads it
        with pytest.raises(ValidationError) as refused:
            model.model_validate(body)
        assert refused.value.errors()[0]["loc"] == (field,)


def test_penalties_in_range_are_taken() -> None:
    body = ChatRequest.model_validate(
        ENDPOINTS[0][1] | {"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 1.3}
    )
    assert (body.presence_penalty, body.frequency_penalty, body.repetition_penalty) == (-2.0, 2.0, 1.3)
    defaults = CompletionRequest.model_validate(ENDPOINTS[1][1])
    assert (defaults.presence_penalty, defaults.frequency_penalty, defaults.repetition_penalty) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize(("model", "base", "fields"), ENDPOINTS, ids=["chat", "completions"])
def test_prompt_cache_retention_takes_the_apis_values_and_refuses_others_by_name(
    model: type[BaseModel], base: dict[str, Any], fields: set[str]
) -> None:
    """Issue 41: ``in_memory`` is what the cache does for every prompt, ``24h`` retains the
    prompt for a day; any other value is a 400 naming the field and its values."""
    assert model.model_validate(base | {"prompt_cache_retention": "in_memory"}).retention_s is None
    assert model.model_validate(base | {"prompt_cache_retention": "24h"}).retention_s == 24 * 3600
    assert model.model_validate(base).retention_s is None
    for bad in ("1h", "24H", "", 24, True, {"ttl": "24h"}):
        with pytest.raises(ValidationError) as refused:
            model.model_validate(json.loads(json.dumps(base | {"prompt_cache_retention": bad})))
        error = refused.value.errors()[0]
        assert error["loc"] == ("prompt_cache_retention",)
        assert "'in_memory' or '24h'" in error["msg"]
