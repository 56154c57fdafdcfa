"""OpenAI request bodies, validated; what the engine does not support is refused, not ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from prefixcache.engine.sampling import PENALTY_RANGE, SEED_RANGE

MAX_TOKENS_LIMIT = 1 << 20  # any larger value is refused as such, before the context check


def _integral(value: Any) -> Any:
    """JSON has one kind of number: ``16.0`` is the integer 16, as JSON Schema (and so the
    OpenAPI document) counts it; ``16.5`` stays a float and is refused, a string too."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# NOTE: after the bounds, so that they stay the document's minimum and maximum
_INTEGRAL = BeforeValidator(_integral)
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT), _INTEGRAL]


def _unicode(value: Any) -> Any:
    """Refuse text a tokenizer cannot encode: JSON allows a lone surrogate (``"\\ud800"``),
    UTF-8 does not."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else ():
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"not valid Unicode text (a lone surrogate at character {exc.start})") from None
    return value


# What this server does with every field of OpenAI's chat and completions requests.
# tests/test_server_fields.py holds this table to the schema the ``openai`` package ships,
# so that a field OpenAI adds fails a test until it is placed here.
#
#   IMPLEMENTED  as OpenAI defines it (``n``: 1 only; the penalties: engine/sampling.py)
#   INERT        accepted and without effect: by OpenAI's definition none changes the answer
#   _OFF         refused with a 400 that names it, unless set to a value that asks for
#                nothing (listed with it); never answered as if it had not asked
IMPLEMENTED = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stream_options",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "prompt_cache_retention",
    }
)
INERT = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key", "parallel_tool_calls"})
_OFF: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "moderation": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None, "medium"),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "prompt_cache_options": (None, {}),
}
REFUSED = frozenset(_OFF)
RETENTION_24H_S = 24 * 3600.0


def _off(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or ""
    value = _integral(value)
    if not any(value == off and type(value) is type(off) for off in _OFF[name]):
        raise ValueError(f"{name} is not supported by this server")
    return value


Off = Annotated[Any, AfterValidator(_off)]  # a field of ``_OFF``
_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", str: "string", list: "array", dict: "object"}


def _document_off(schema: dict[str, Any], model: type) -> None:
    """What the OpenAPI document says of an unsupported field: the values that ask for
    nothing, with their JSON types (``false`` is a boolean, never the integer 0)."""
    for name, prop in schema.get("properties", {}).items():
        if name in _OFF:
            offs = _OFF[name]
            prop.clear()
            prop["type"] = list(dict.fromkeys(_JSON_TYPES[type(off)] for off in offs))
            prop["enum"] = list(offs)
            prop["description"] = "Not supported: only a value that asks for nothing."


# presence_penalty and frequency_penalty as OpenAI bounds them; repetition_penalty (vLLM's
# and Hugging Face's, no OpenAI field) as vLLM does: finite and > 0. NaN and infinities,
# which Python's JSON parser takes, are refused as such.
Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


# NOTE: the validators below check what these schemas say, with clearer messages than a
# union's errors; the schemas are for the OpenAPI document (clients, and the schemathesis
# suite that fuzzes the server with it), so keep the two in step.
_STOP_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
            {"type": "null"},
        ]
    }
)
_PROMPT_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        ],
        "description": "One prompt: text, a list of one text, or token ids of the model's vocabulary.",
    }
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _Request(BaseModel):
    # NOTE: every OpenAI field is implemented, inert or refused (the table above); fields
    # that are no part of OpenAI's API are ignored (vendor extensions a router may pass on:
    # a client's cache_salt, kv_transfer_params), except repetition_penalty, implemented.
    # No lax coercion: "10" is not a number, "yes" is not a boolean.
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_document_off)

    model: str
    max_tokens: TokenCount | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: Annotated[int, Field(ge=1, le=1), _INTEGRAL] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, _STOP_SCHEMA] = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1]), _INTEGRAL] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    tools: Off = None
    tool_choice: Off = None
    functions: Off = None
    function_call: Off = None
    response_format: Off = None
    logprobs: Off = None
    top_logprobs: Off = None
    logit_bias: Off = None
    echo: Off = None
    best_of: Off = None
    suffix: Off = None
    audio: Off = None
    modalities: Off = None
    moderation: Off = None
    prediction: Off = None
    reasoning_effort: Off = None
    verbosity: Off = None
    web_search_options: Off = None
    service_tier: Off = None
    store: Off = None
    # "in_memory": the cache as it is; "24h": the prompt's blocks retained for 24 hours
    # (capped per tenant, ``cache/retention.py``)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: Off = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        _unicode(value)
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be at most 4 non-empty strings")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def retention_s(self) -> float | None:
        """How long the prompt is retained, as asked (None: the cache as it is)."""
        return RETENTION_24H_S if self.prompt_cache_retention == "24h" else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str

    _text = field_validator("text")(_unicode)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    _content = field_validator("content")(_unicode)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None

    def chat(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Request):
    prompt: Annotated[str | list[str] | list[Annotated[int, _INTEGRAL]], _PROMPT_SCHEMA]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str) and len(value) != 1:
            raise ValueError("one prompt per request (a list of several prompts is not supported)")
        if (isinstance(value, list) and not value) or value == "":
            raise ValueError("the prompt is empty")
        _unicode(value)
        return value


class EpochRequest(BaseModel):
    model: str


class PurgeRequest(BaseModel):
    tenant: str = Field(min_length=1)
    prompt: str | None = Field(default=None, min_length=1)  # purge only sequences that start with this text
    messages: list[Message] | None = Field(default=None, min_length=1)  # ... or with this chat (template)

    _text = field_validator("tenant", "prompt")(_unicode)  # the answer names the tenant


class LoginRequest(BaseModel):
    """The dashboard's login: the admin key in the body (never in a URL)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    key: str = Field(min_length=1, max_length=4096)

    _key = field_validator("key")(_unicode)  # compared as UTF-8 bytes
