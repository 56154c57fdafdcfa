"""A Messages request as prompt tokens, and its ``cache_control`` breakpoints as token
prefixes of that prompt.

The model's chat template knows roles and text only, so everything else is rendered
as text into the turns, in Anthropic's prompt order (tools, then system, then messages)::

    system turn      TOOLS_HEADER, each tool (name, description, JSON schema), then the
                     system text blocks
    each message     its blocks; a tool_use as <tool_use id= name=>{input}</tool_use>,
                     a tool_result as <tool_result tool_use_id=>...</tool_result>

The rendering is a pure function of what the client sent, never of its breakpoints, with
JSON written with sorted keys: a conversation's next request renders its earlier turns
to the same text, so its prompt starts with the same tokens (the earlier answer's turn
aside, which the template closes after the answer).

A breakpoint on a block is the prompt's first N tokens, N the number of tokens the turns
up to and including that block (the block's turn cut after it) share with the whole
prompt: where the cut falls inside what the tokenizer would merge across it, the shorter
prefix, never a token that covers text past the block (not even the turn's close).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixcache.api.messages import CountTokensRequest, TextBlock, Tool, ToolResultBlock, ToolUseBlock, Ttl
from prefixcache.cache.retention import RetainSpan

__all__ = [
    "SEP",
    "TOOLS_HEADER",
    "Breakpoint",
    "ChatTokenizer",
    "Fragment",
    "Part",
    "Prompt",
    "messages_prompt",
    "render",
]

# NOTE: a breakpoint's turn is cut after its block and ends with this private-use
# character, which no template writes and no text of ours holds: the prompt's tokens it
# shares then stop at the block's end (or before, where a token spans the cut), never
# run on into the template's close of the turn.
_CUT = "\ue000"
SEP = "\n\n"  # between blocks of one turn (and between tools)
TOOLS_HEADER = (
    "# Tools\n\nYou may call the tools below. To call one, answer with a tool_use block: "
    '<tool_use id="ID" name="NAME">{"argument": "value"}</tool_use>. '
    "Its result comes back in a tool_result block."
)


class ChatTokenizer(Protocol):
    """What renders a chat through the model's template: the server's ``Engine``, the
    router's ``prompts.Tokenizer`` (which predicts the servers' tokens with it)."""

    def tokenize_chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Fragment:
    """A piece of a turn's text; ``marks``: the breakpoints that end with it."""

    text: str
    marks: tuple[Ttl, ...] = ()


@dataclass(frozen=True, slots=True)
class Part:
    """One turn of the chat the template renders."""

    role: str
    fragments: tuple[Fragment, ...]

    @property
    def content(self) -> str:
        return "".join(f.text for f in self.fragments)

    def message(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """The prompt's first ``tokens`` tokens, kept for ``ttl``."""

    tokens: int
    ttl: Ttl


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: list[int]
    breakpoints: tuple[Breakpoint, ...]  # in prompt order

    def spans(self) -> tuple[RetainSpan, ...]:
        """The breakpoints as the engine's retention spans: one per prefix (the longest
        ttl asked for it), empty prefixes left out."""
        longest: dict[int, int] = {}
        for b in self.breakpoints:
            if b.tokens > 0:
                longest[b.tokens] = max(longest.get(b.tokens, 0), b.ttl.seconds)
        return tuple(RetainSpan(tokens=n, seconds=s) for n, s in sorted(longest.items()))


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _marks(*controls: Any) -> tuple[Ttl, ...]:
    return tuple(c.lifetime for c in controls if c is not None)


def _tool(tool: Tool) -> str:
    lines = [f"## {tool.name}", *([tool.description] if tool.description else [])]
    return "\n".join([*lines, f"Input schema: {_json(tool.input_schema)}"])


def _block(block: TextBlock | ToolUseBlock | ToolResultBlock) -> list[Fragment]:
    """A block's fragments: one, or a tool_result's open tag with its first text block, each
    further text block, and its close tag (so that a breakpoint on any of them ends there)."""
    if isinstance(block, TextBlock):
        return [Fragment(block.text, _marks(block.cache_control))]
    if isinstance(block, ToolUseBlock):
        head = f"<tool_use id={_json(block.id)} name={_json(block.name)}>"
        return [Fragment(f"{head}{_json(block.input)}</tool_use>", _marks(block.cache_control))]
    error = ' is_error="true"' if block.is_error else ""
    head, tail = f"<tool_result tool_use_id={_json(block.tool_use_id)}{error}>", "</tool_result>"
    if isinstance(block.content, str):
        return [Fragment(head + block.content + tail, _marks(block.cache_control))]
    inner = [Fragment((SEP if i else head) + b.text, _marks(b.cache_control)) for i, b in enumerate(block.content)]
    if not inner:
        return [Fragment(head + tail, _marks(block.cache_control))]
    return [*inner, Fragment(tail, _marks(block.cache_control))]


def _joined(groups: Sequence[list[Fragment]]) -> tuple[Fragment, ...]:
    """The fragments of several blocks of one turn, ``SEP`` between blocks."""
    out: list[Fragment] = []
    for i, group in enumerate(groups):
        first, *rest = group
        out += [Fragment(SEP + first.text, first.marks) if i else first, *rest]
    return tuple(out)


def render(body: CountTokensRequest) -> list[Part]:
    """The turns the chat template renders (see the module doc)."""
    system: list[list[Fragment]] = []
    for i, tool in enumerate(body.tools or ()):
        text = (TOOLS_HEADER + SEP if i == 0 else "") + _tool(tool)
        system.append([Fragment(text, _marks(tool.cache_control))])
    if isinstance(body.system, str) and body.system:
        system.append([Fragment(body.system)])
    elif isinstance(body.system, list):
        system += [[Fragment(b.text, _marks(b.cache_control))] for b in body.system]
    parts = [Part("system", _joined(system))] if system else []
    parts += [Part(turn.role, _joined([_block(b) for b in turn.blocks])) for turn in body.messages]
    if body.cache_control is not None:  # the request's own breakpoint: on its last block
        last = parts[-1]
        *head, end = last.fragments
        parts[-1] = Part(last.role, (*head, Fragment(end.text, (*end.marks, body.cache_control.lifetime))))
    return parts


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def messages_prompt(tok: ChatTokenizer, body: CountTokensRequest, breakpoints: bool = True) -> Prompt:
    """The prompt's tokens (ending with the assistant's turn) and, unless ``breakpoints``
    is False, each breakpoint's prefix of them (module doc)."""
    parts = render(body)
    tokens = tok.tokenize_chat([p.message() for p in parts])
    found: list[Breakpoint] = []
    for i, part in enumerate(parts if breakpoints else ()):
        for k, fragment in enumerate(part.fragments):
            if fragment.marks:
                end = Part(part.role, (*part.fragments[: k + 1], Fragment(_CUT)))
                n = _shared(tok.tokenize_chat([p.message() for p in parts[:i]] + [end.message()], False), tokens)
                found += [Breakpoint(n, ttl) for ttl in fragment.marks]
    return Prompt(tokens, tuple(found))
