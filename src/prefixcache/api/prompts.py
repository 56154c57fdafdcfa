"""A request's prompt tokens, computed once for both sides: the server tokenizes with its
engine, the router with the same tokenizer loaded from ``[model]`` to predict them, and
both through ``prompt_tokens``: the same schemas, the same chat template, the same
handling of a prompt given as token ids. The router's keys are then the servers' keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from transformers import AutoTokenizer

from prefixcache.api.messages import CountTokensRequest
from prefixcache.api.messages_prompt import messages_prompt
from prefixcache.api.schemas import ChatRequest, CompletionRequest
from prefixcache.engine.chat import chat_tokens
from prefixcache.engine.model import resolve_model
from prefixcache.settings import ModelSettings

__all__ = ["Tokenizer", "Tokenizes", "prompt_tokens"]


class Tokenizes(Protocol):
    """What tokenizes a prompt: the server's ``Engine``, the router's ``Tokenizer``."""

    def tokenize_chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]: ...

    def tokenize_text(self, text: str) -> list[int]: ...


def prompt_tokens(tok: Tokenizes, body: ChatRequest | CompletionRequest) -> list[int]:
    """The prompt's tokens: a chat through its template, ending with the assistant's turn;
    a completion's text as it is (no special tokens added), or its token ids unchanged
    (the engine checks they are in the vocabulary)."""
    if isinstance(body, ChatRequest):
        return tok.tokenize_chat(body.chat())
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        return [int(t) for t in prompt]
    return tok.tokenize_text(prompt if isinstance(prompt, str) else str(prompt[0]))


class Tokenizer:
    """The router's ``(path, body) -> tokens`` for the generation routes (Anthropic's
    Messages rendered as ``messages_prompt`` renders it); a body the servers would refuse
    raises (the router then forwards it unscored, for the server to say why)."""

    def __init__(self, model: ModelSettings) -> None:
        self._tok: Any = AutoTokenizer.from_pretrained(str(resolve_model(model.name, Path(model.models_dir))))

    def tokenize_chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        return chat_tokens(self._tok, messages, generation_prompt)

    def tokenize_text(self, text: str) -> list[int]:
        return [int(t) for t in self._tok.encode(text, add_special_tokens=False)]

    def __call__(self, path: str, body: dict[str, Any]) -> list[int]:
        if path.endswith("/chat/completions"):
            return prompt_tokens(self, ChatRequest.model_validate(body))
        if path.endswith("/messages"):
            return messages_prompt(self, CountTokensRequest.model_validate(body), breakpoints=False).tokens
        return prompt_tokens(self, CompletionRequest.model_validate(body))
