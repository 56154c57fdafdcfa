"""OpenAI request bodies, validated; what the engine does not support is refused, not ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from prefixcache.engine.sampling import SEED_RANGE

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


# Fields of OpenAI's API this server does not implement, with the values that ask for
# nothing: a request that sets one to anything else is refused with a 400 naming it,
# never answered as if it had not asked.
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
}


def _off(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or ""
    value = _integral(value)
    if not any(value == off and type(value) is type(off) for off in _OFF[name]):
        raise ValueError(f"{name} is not supported by this server")
    return value


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", str: "string", list: "array", dict: "object"}


def _only_off(name: str) -> WithJsonSchema:
    """What the OpenAPI document says of an unsupported field: the values that ask for
    nothing, with their JSON types (``false`` is a boolean, never the integer 0)."""
    offs = _OFF[name]
    types = list(dict.fromkeys(_JSON_TYPES[type(off)] for off in offs))
    return WithJsonSchema(
        {"type": types, "enum": list(offs), "description": "Not supported: only a value that asks for nothing."}
    )


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
    # NOTE: unknown fields are accepted and ignored, as OpenAI-compatible servers do
    # (user, metadata, ...), except the ones of ``_OFF``, refused when they ask for
    # something; and no lax coercion: "10" is not a number, "yes" is not a boolean.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: TokenCount | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: Annotated[int, Field(ge=1, le=1), _INTEGRAL] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, _STOP_SCHEMA] = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1]), _INTEGRAL] | None = None
    tools: Annotated[Any, _only_off("tools")] = None
    tool_choice: Annotated[Any, _only_off("tool_choice")] = None
    functions: Annotated[Any, _only_off("functions")] = None
    function_call: Annotated[Any, _only_off("function_call")] = None
    response_format: Annotated[Any, _only_off("response_format")] = None
    logprobs: Annotated[Any, _only_off("logprobs")] = None
    top_logprobs: Annotated[Any, _only_off("top_logprobs")] = None
    logit_bias: Annotated[Any, _only_off("logit_bias")] = None

    _unsupported = field_validator(
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "logprobs",
        "top_logprobs",
        "logit_bias",
    )(_off)

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
    echo: Annotated[Any, _only_off("echo")] = None
    best_of: Annotated[Any, _only_off("best_of")] = None
    suffix: Annotated[Any, _only_off("suffix")] = None

    _unsupported_here = field_validator("echo", "best_of", "suffix")(_off)

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

    _prompt = field_validator("prompt")(_unicode)


class LoginRequest(BaseModel):
    """The dashboard's login: the admin key in the body (never in a URL)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    key: str = Field(min_length=1, max_length=4096)

    _key = field_validator("key")(_unicode)  # compared as UTF-8 bytes
