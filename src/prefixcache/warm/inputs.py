"""What ``prefixcache warm`` reads: one prompt per line, as the request body the server
would get for it.

Formats (told apart line by line by their keys)::

    {"prompt": "Summarize: ..."}                        a completion (text, or token ids)
    {"messages": [{"role": "system", "content": ...}]}  a chat, rendered by the server's template
    {"timestamp": 0.0, "tenant": ..., "tokens": [...]}  a line of our trace format (``sim/traces.py``)
    {"timestamp": 0.0, "tenant": ..., "text": "..."}    the same with text

A line becomes the body of ``/v1/completions`` or ``/v1/chat/completions`` and is
validated by the server's own schemas (``api/schemas.py``), so that warm renders and
tokenizes it exactly as a request with that body (``api/prompts.prompt_tokens``): a
later request starting the same way then finds the same keys.

A trace line's tenant and model are not used (warm stores for ``--tenant`` or as
public prefixes). Lines that carry no text, only hashes of blocks (Mooncake, Bailian,
our ``hash_ids``), are refused: a block id says which requests shared a prefix, not
what its tokens were, so there is nothing to prefill; warm names the formats it can.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from prefixcache.api.schemas import ChatRequest, CompletionRequest
from prefixcache.sim.tracefile import TraceError, load_json, numbered_lines

__all__ = ["FORMATS", "BadLine", "WarmInputError", "WarmItem", "count_lines", "read_items"]

FORMATS = (
    '{"prompt": "..."} (a completion)',
    '{"messages": [...]} (a chat)',
    'a prefixcache trace line with "tokens" or "text" (sim/traces.py)',
)
_HASHED = {"hash_ids", "input_length", "chat_id", "parent_chat_id"}  # Mooncake, Bailian, ours pre-hashed
_TRACE_KEYS = {"timestamp", "tenant", "model", "endpoint", "session", "output_length", "output_tokens"}


class WarmInputError(ValueError):
    """A line warm cannot use: ``"PATH:LINE: what is wrong"``."""


@dataclass(frozen=True, slots=True)
class WarmItem:
    """One prompt to warm: its 1-based line and the request body it stands for."""

    line: int
    body: ChatRequest | CompletionRequest

    @property
    def chat(self) -> bool:
        return isinstance(self.body, ChatRequest)

    def payload(self, model: str) -> dict[str, Any]:
        """The JSON body of the request that warms this prompt on a server serving ``model``."""
        data = self.body.model_dump(mode="json", exclude_unset=True)
        return data | {"model": model, "max_tokens": 1, "temperature": 0.0, "stream": False}


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that is not a prompt warm can use (yielded instead of raised with ``skip_bad``)."""

    line: int
    error: WarmInputError


def _hashed_error(where: str) -> WarmInputError:
    return WarmInputError(
        f"{where}: this line names blocks by hash ids (a Mooncake, Bailian or pre-hashed trace): it has no "
        "text to prefill. warm reads " + "; ".join(FORMATS)
    )


def _body(data: dict[str, Any], where: str) -> ChatRequest | CompletionRequest:
    keys = set(data)
    if keys & _HASHED:
        raise _hashed_error(where)
    if "messages" in keys and "prompt" in keys:
        raise WarmInputError(f"{where}: give one of 'prompt' and 'messages', not both")
    if "messages" in keys:
        fields: dict[str, Any] = {"messages": data["messages"]}
        schema: type[ChatRequest | CompletionRequest] = ChatRequest
    elif "prompt" in keys:
        fields, schema = {"prompt": data["prompt"]}, CompletionRequest
    elif keys & {"tokens", "text"} and keys & _TRACE_KEYS:
        if "tokens" in keys and "text" in keys:
            raise WarmInputError(f"{where}: a trace line gives one of 'tokens' and 'text', not both")
        fields, schema = {"prompt": data.get("tokens", data.get("text"))}, CompletionRequest
    else:
        raise WarmInputError(f"{where}: no prompt in this line (keys {sorted(keys)}). warm reads " + "; ".join(FORMATS))
    try:
        return schema.model_validate({"model": "-", **fields})
    except ValidationError as exc:
        problem = exc.errors()[0]
        place = ".".join(str(p) for p in problem["loc"])
        raise WarmInputError(f"{where}: field '{place}': {problem['msg']}") from None


def read_items(path: str | Path, *, skip_bad: bool = False) -> Iterator[WarmItem | BadLine]:
    """The prompts of ``path`` (``.gz`` too), one per non-blank line. A line warm cannot use
    raises ``WarmInputError`` naming the file and line, or with ``skip_bad`` is yielded as a
    ``BadLine`` for the caller to count. A file that does not exist raises at once."""
    path = Path(path)
    if not path.is_file():
        raise WarmInputError(f"{path}: no such file (warm reads a JSONL file of prompts or chats)")
    try:
        for lineno, raw in numbered_lines(path):
            where = f"{path}:{lineno}"
            try:
                yield WarmItem(lineno, _body(load_json(raw, where), where))
            except (WarmInputError, TraceError) as exc:
                error = exc if isinstance(exc, WarmInputError) else WarmInputError(str(exc))
                if not skip_bad:
                    raise error from None
                yield BadLine(lineno, error)
    except TraceError as exc:  # a damaged gzip stream: no line after it can be read
        raise WarmInputError(str(exc)) from None


def count_lines(path: str | Path) -> int | None:
    """The non-blank lines of ``path`` (what the progress bar counts to); None when unreadable."""
    try:
        return sum(1 for _ in numbered_lines(Path(path)))
    except (OSError, TraceError):
        return None
