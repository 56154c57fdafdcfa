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

__all__ = ["chat_tokens"]

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
