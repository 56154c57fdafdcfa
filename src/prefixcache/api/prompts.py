"""A request's prompt tokens, as the servers behind the router compute them: the same
schemas, the same chat template, the same tokenizer (loaded from ``[model]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from prefixcache.api.schemas import ChatRequest, CompletionRequest
from prefixcache.engine.chat import chat_tokens
from prefixcache.engine.model import resolve_model
from prefixcache.server.settings import ModelSettings

__all__ = ["Tokenizer"]


class Tokenizer:
    """``(path, body) -> tokens`` for the two generation routes; a body the servers
    would refuse raises (the router then forwards it unscored, for the server to say why)."""

    def __init__(self, model: ModelSettings) -> None:
        self._tok: Any = AutoTokenizer.from_pretrained(str(resolve_model(model.name, Path(model.models_dir))))

    def __call__(self, path: str, body: dict[str, Any]) -> list[int]:
        if path.endswith("/chat/completions"):
            return chat_tokens(self._tok, ChatRequest.model_validate(body).chat(), True)
        prompt = CompletionRequest.model_validate(body).prompt
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            return [int(t) for t in prompt]
        text = prompt if isinstance(prompt, str) else str(prompt[0])
        return [int(t) for t in self._tok.encode(text, add_special_tokens=False)]
