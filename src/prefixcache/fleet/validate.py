"""What the router checks of a request before it tokenizes, hashes or forwards it: the
same as the servers behind it, in the same words.

    client ──> BodyLimit (size, JSON depth) ──> auth ──> body check ──> tokenize, keys

The body check is a FastAPI dependency on the route, so that FastAPI parses and
validates the body exactly as it does on a server (``server/app.py`` declares the same
schemas), and the errors go through the same handlers (``api/errors.py``): every
body a server refuses, the router refuses first, with the same status and body, and
nothing a client sends reaches the tokenizer or the hashing unvalidated. The router's
OpenAPI document then describes the same bodies too.

How strict depends on who may get the request:

- ``SERVER``: the servers' own schemas (``ChatRequest``, ``CompletionRequest``, Anthropic's
  ``MessagesRequest`` and ``CountTokensRequest``), when
  any backend is a prefixcache server: any request may land on one, and a body it
  refuses is refused up front, where it costs no backend anything.
- ``OBJECT``: any JSON object, when every backend is vLLM. vLLM takes fields our
  servers refuse (``tools``, ``logprobs``, ``top_k``, guided decoding ...) and checks
  them itself; the servers' schema would refuse what vLLM serves. The router still
  keeps to what its own safety needs: a JSON object (the stamp replaces fields of it),
  no deeper than ``BodyLimit`` lets through, and token ids it can key
  (``check_vllm``, on every body a vLLM backend gets).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict

from prefixcache.api.errors import APIError
from prefixcache.api.messages import CountTokensRequest, MessagesRequest
from prefixcache.api.schemas import ChatRequest, CompletionRequest
from prefixcache.fleet.keys import TOKEN_LIMIT

__all__ = ["CHAT", "COMPLETIONS", "COUNT_TOKENS", "MESSAGES", "AnyObject", "Strictness", "body_check", "check_vllm"]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"  # Anthropic's
COUNT_TOKENS = "/v1/messages/count_tokens"


class Strictness(Enum):
    SERVER = "server"  # the servers' request schemas
    OBJECT = "object"  # a JSON object: vLLM checks its own fields

    @classmethod
    def of(cls, has_servers: bool) -> Strictness:
        return cls.SERVER if has_servers else cls.OBJECT


class AnyObject(BaseModel):
    """A JSON object, whatever its fields (a vLLM body)."""

    model_config = ConfigDict(extra="allow")


# NOTE: one function per schema, each with its body's type in its signature: FastAPI reads
# the body's schema from the annotation, so the dependency cannot be one generic function.
def _chat(body: ChatRequest) -> None:
    """The body of a chat completion, as a server validates it."""


def _completion(body: CompletionRequest) -> None:
    """The body of a text completion, as a server validates it."""


def _messages(body: MessagesRequest) -> None:
    """The body of an Anthropic Messages request, as a server validates it."""


def _count_tokens(body: CountTokensRequest) -> None:
    """The body of an Anthropic count_tokens request, as a server validates it."""


def _object(body: AnyObject) -> None:
    """Any JSON object."""


_CHECKS: dict[tuple[str, Strictness], Callable[..., None]] = {
    (CHAT, Strictness.SERVER): _chat,
    (COMPLETIONS, Strictness.SERVER): _completion,
    (MESSAGES, Strictness.SERVER): _messages,
    (COUNT_TOKENS, Strictness.SERVER): _count_tokens,
    (CHAT, Strictness.OBJECT): _object,
    (COMPLETIONS, Strictness.OBJECT): _object,
    (MESSAGES, Strictness.OBJECT): _object,
    (COUNT_TOKENS, Strictness.OBJECT): _object,
}


def body_check(path: str, strictness: Strictness) -> Callable[..., None]:
    """The dependency that validates the body of ``path`` (a route of ``_CHECKS``)."""
    return _CHECKS[(path, strictness)]


def check_vllm(body: Mapping[str, Any]) -> None:
    """Refuse (400) a completions prompt of token ids out of ``[0, 2**32)`` (one prompt or
    a batch of them), which no vocabulary holds and the router's keys cannot cover."""
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    for ids in prompts:
        if isinstance(ids, list) and any(_out_of_range(t) for t in ids):
            raise APIError(400, "token ids must lie in [0, 2**32)", param="prompt", code="invalid_value")


def _out_of_range(token: object) -> bool:
    return isinstance(token, int | float) and not isinstance(token, bool) and not 0 <= token < TOKEN_LIMIT
