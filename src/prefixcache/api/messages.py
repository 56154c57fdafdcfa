"""Anthropic's Messages API request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``),
validated; what the engine cannot do is refused by name, never ignored.

A request is a system prompt (text blocks), tools, and turns of content blocks; each
block (and each tool) may carry a ``cache_control`` breakpoint, which asks the cache to
keep the prompt's prefix up to the end of that block (``messages_prompt.py`` places it on
the prompt's tokens). The rules Anthropic's API enforces on breakpoints are enforced here
with its own 400s: at most ``MAX_BREAKPOINTS``, a ``ttl`` of ``5m`` or ``1h`` (``5m`` when
absent), type ``ephemeral``, never on an empty text block or a thinking block, and a
``1h`` breakpoint never after a ``5m`` one.

The model reads text only: image and document blocks are refused, and so is thinking.
Tools are rendered into the prompt as text; the answer is always text, so a
``tool_choice`` that demands a tool call (``any``, ``tool``) is refused rather than
answered without one.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from prefixcache.api.schemas import TokenCount, _unicode

__all__ = [
    "IMPLEMENTED",
    "INERT",
    "MAX_BREAKPOINTS",
    "MAX_STOP_SEQUENCES",
    "REFUSED",
    "CacheControl",
    "CountTokensRequest",
    "MessagesRequest",
    "TextBlock",
    "Tool",
    "ToolResultBlock",
    "ToolUseBlock",
    "Ttl",
    "Turn",
]

MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks in one request
MAX_STOP_SEQUENCES = 4  # the engine's (Anthropic allows more: refused, never cut)


class Ttl(enum.StrEnum):
    """How long a breakpoint's prefix is kept after its last use."""

    FIVE_MINUTES = "5m"
    ONE_HOUR = "1h"

    @property
    def seconds(self) -> int:
        return 300 if self is Ttl.FIVE_MINUTES else 3600


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def lifetime(self) -> Ttl:
        return Ttl(self.ttl)


# What each block type that the model cannot read is refused with.
_UNREADABLE = {
    "image": "image blocks are not supported: the model has no vision",
    "document": "document blocks are not supported: the model reads text only",
    "thinking": "thinking blocks are not supported: the model does not think (and cache_control cannot mark one)",
    "redacted_thinking": "redacted_thinking blocks are not supported: the model does not think",
}


def _readable(kinds: tuple[str, ...]) -> Any:
    """A check, before a content list is parsed, that names a block the model cannot read
    (clearer than a tagged union's error) and any type not in ``kinds``."""

    def check(value: Any) -> Any:
        for block in value if isinstance(value, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(kind, str):
                continue  # the union says what is wrong
            if kind in _UNREADABLE:
                raise ValueError(_UNREADABLE[kind])
            if kind not in kinds:
                raise ValueError(f"content block type {kind!r} is not supported here (only {', '.join(kinds)})")
        return value

    return BeforeValidator(check)


class _Block(BaseModel):
    # NOTE: fields a block may have that change nothing of its text (citations, a
    # tool_use's caller) are ignored; what the prompt renders is only what is declared.
    model_config = ConfigDict(extra="ignore", strict=True)

    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str

    _text = field_validator("text")(_unicode)

    @model_validator(mode="after")
    def _not_empty(self) -> TextBlock:
        if not self.text:
            if self.cache_control is not None:
                raise ValueError("cache_control cannot be set on an empty text block")
            raise ValueError("text content blocks must be non-empty")
        return self


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]

    _text = field_validator("id", "name")(_unicode)


ResultContent = Annotated[list[TextBlock], _readable(("text",))]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | ResultContent = ""
    is_error: bool = False

    _text = field_validator("tool_use_id", "content")(_unicode)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
_ROLE_BLOCKS: dict[str, tuple[type[_Block], ...]] = {
    "user": (TextBlock, ToolResultBlock),
    "assistant": (TextBlock, ToolUseBlock),
    "system": (TextBlock,),
}


class Turn(BaseModel):
    """One message of ``messages``: a string is one text block."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[Block], _readable(("text", "tool_use", "tool_result"))]

    _content = field_validator("content")(_unicode)

    @model_validator(mode="after")
    def _blocks_of_role(self) -> Turn:
        if isinstance(self.content, str):
            if not self.content:
                raise ValueError("text content blocks must be non-empty")
            return self
        if not self.content:
            raise ValueError(f"a {self.role} message needs at least one content block")
        allowed = _ROLE_BLOCKS[self.role]
        for block in self.content:
            if not isinstance(block, allowed):
                raise ValueError(f"a {block.type} block cannot be in a {self.role} message")
        return self

    @property
    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


def _client_tool(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (None, "custom"):
        raise ValueError(f"tool type {kind!r} is not supported: only client tools (type custom) are")
    return value


class Tool(BaseModel):
    """A client tool: its definition is rendered into the prompt as text."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    defer_loading: Literal[False] = False  # a deferred tool is not in the prompt: not supported

    _text = field_validator("name", "description")(_unicode)


class ToolChoice(BaseModel):
    """``auto`` and ``none`` are honoured (the answer is text, a tool call is never made);
    ``any`` and ``tool`` ask for a tool call, which this server never makes: refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["auto", "none"]
    disable_parallel_tool_use: bool = False  # no tool call is ever made: nothing to disable


def _choice(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("any", "tool"):
        raise ValueError(f"tool_choice {kind!r} is not supported: this server answers in text and never calls a tool")
    return value


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    user_id: Annotated[str, Field(max_length=256)] | None = None


# What this server does with every top-level field of Anthropic's Messages request.
# tests/test_messages_schema.py holds this table to the ``anthropic`` package's own
# parameters, so that a field it adds fails a test until it is placed here.
#
#   IMPLEMENTED  as Anthropic defines it
#   INERT        accepted, changes no answer (``metadata.user_id`` routes, never scopes)
#   _OFF         refused with a 400 that names it, unless set to a value asking nothing
IMPLEMENTED = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "cache_control",
    }
)
INERT = frozenset({"metadata", "service_tier", "user_profile_id", "workspace_id"})
_OFF: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}),
    "top_k": (None,),  # the engine samples by temperature and top_p only
    "container": (None,),
    "mcp_servers": (None, []),
    "context_management": (None,),
    "output_config": (None, {}),
    "diagnostics": (None,),
    "inference_geo": (None,),
    "speed": (None, "standard"),
}
REFUSED = frozenset(_OFF)


def _off(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or ""
    if not any(value == off and type(value) is type(off) for off in _OFF[name]):
        raise ValueError(f"{name} is not supported by this server")
    return value


Off = Annotated[Any, AfterValidator(_off)]


class CountTokensRequest(BaseModel):
    """What a prompt is made of: the body of ``/v1/messages/count_tokens``, and the
    prompt part of a Messages request."""

    # NOTE: fields that are no part of Anthropic's API are ignored (vendor extensions a
    # router may pass on, vLLM's); no lax coercion: "10" is not a number.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    messages: list[Turn] = Field(min_length=1)
    system: str | Annotated[list[TextBlock], _readable(("text",))] | None = None
    tools: list[Annotated[Tool, BeforeValidator(_client_tool)]] | None = None
    tool_choice: Annotated[ToolChoice, BeforeValidator(_choice)] | None = None
    cache_control: CacheControl | None = None  # a breakpoint on the request's last block
    thinking: Off = None
    context_management: Off = None
    mcp_servers: Off = None
    output_config: Off = None

    _system = field_validator("system")(_unicode)

    @model_validator(mode="after")
    def _breakpoints(self) -> CountTokensRequest:
        """Anthropic's limits on breakpoints, in prompt order (tools, system, messages)."""
        ttls = [c.lifetime for c in self.cache_controls()]
        if len(ttls) > MAX_BREAKPOINTS:
            raise ValueError(
                f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {len(ttls)}."
            )
        first_short = next((i for i, ttl in enumerate(ttls) if ttl is Ttl.FIVE_MINUTES), len(ttls))
        if Ttl.ONE_HOUR in ttls[first_short:]:
            raise ValueError("a cache_control with ttl '1h' cannot come after one with ttl '5m'")
        if self.messages[-1].role == "assistant":
            raise ValueError("prefill is not supported: the last message must not be the assistant's")
        return self

    def cache_controls(self) -> list[CacheControl]:
        """Every breakpoint, in prompt order (the request's own last)."""
        found = [t.cache_control for t in self.tools or ()]
        found += [b.cache_control for b in self.system] if isinstance(self.system, list) else []
        for turn in self.messages:
            for block in turn.blocks:
                found.append(block.cache_control)
                if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                    found += [b.cache_control for b in block.content]
        found.append(self.cache_control)
        return [c for c in found if c is not None]


Temperature = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]  # Anthropic's range
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


class MessagesRequest(CountTokensRequest):
    max_tokens: TokenCount
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None  # never a scope: the tenant comes from the key
    top_k: Off = None
    container: Off = None
    diagnostics: Off = None
    inference_geo: Off = None
    speed: Off = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        _unicode(value)
        if value is not None and (len(value) > MAX_STOP_SEQUENCES or any(not s for s in value)):
            raise ValueError(f"stop_sequences must be at most {MAX_STOP_SEQUENCES} non-empty strings on this server")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    @property
    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata is not None else None
