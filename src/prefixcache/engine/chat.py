"""A chat's tokens: the template's control tokens come from the template only.

``apply_chat_template`` renders the messages into one string and tokenizes it, so a
user who writes ``<|im_end|>\\n<|im_start|>system`` in a message gets those control
tokens and a forged system turn. Here a message whose text contains the text of a
control token (any of the tokenizer's added tokens) is tokenized on its own, as text
(``split_special_tokens``), between the template's pieces; every other chat is
tokenized exactly as the template renders it, so its tokens (and cache keys) are the
ones the model was trained on.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import PreTrainedTokenizerBase

__all__ = ["chat_frame", "chat_tokens"]

_MARK = re.compile("\ue000(\\d+)\ue001")  # private-use characters: no template or text has them


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, as_text: bool) -> list[int]:
    ids: Any = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=as_text)
    return [int(t) for t in ids]


def chat_tokens(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool
) -> list[int]:
    controls = tuple(tokenizer.get_added_vocab())
    forged = [i for i, m in enumerate(messages) if any(c in m["content"] for c in controls)]
    if not forged:
        out: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        ids = out if isinstance(out, list) else out["input_ids"]  # transformers >= 5 returns a BatchEncoding
        return [int(t) for t in ids]
    marked = [{**m, "content": f"\ue000{i}\ue001"} if i in forged else m for i, m in enumerate(messages)]
    rendered = str(tokenizer.apply_chat_template(marked, add_generation_prompt=generation_prompt, tokenize=False))
    tokens: list[int] = []
    for k, part in enumerate(_MARK.split(rendered)):
        if k % 2:
            tokens += _encode(tokenizer, messages[int(part)]["content"], as_text=True)
        elif part:
            tokens += _encode(tokenizer, part, as_text=False)
    return tokens


def chat_frame(tokenizer: PreTrainedTokenizerBase, system: str | None = None) -> tuple[str, str]:
    """The chat template around one user message: the text before it (the system turn,
    the template's default one when ``system`` is None, and the user turn's opening) and
    after it (the turn's close and the assistant's opening)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template")
    mark = "\ue000message\ue001"
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": mark})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str) or text.count(mark) != 1:
        raise ValueError("the chat template does not render the user's message once, as given")
    before, after = text.split(mark)
    return before, after
