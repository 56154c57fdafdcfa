"""Prompt text to token ids, for trace records that carry ``text`` instead of ``tokens``.

Apart from the reader because the choice of tokenizer is the user's (the command line's
``--tokenizer``), and the HuggingFace one an optional dependency.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the reader needs to turn a ``text`` field into token ids."""

    @property
    def name(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids: no dependency, and two texts share a token prefix
    exactly as far as they share a byte prefix, which is all prefix caching looks at."""

    name: str = "utf8"

    def encode(self, text: str) -> list[int]:
        # NOTE: surrogatepass, so that a lone surrogate (valid in JSON strings) still
        # tokenizes instead of failing the line.
        return list(text.encode("utf-8", "surrogatepass"))


class _HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer loaded from a ``tokenizer.json``."""

    def __init__(self, name: str, backend: Any) -> None:
        self.name = name
        self._backend = backend

    def encode(self, text: str) -> list[int]:
        # NOTE: special tokens are added (e.g. BOS), as a serving engine does; they are the
        # same at the start of every prompt, so they shift all prefixes alike.
        return list(self._backend.encode(text).ids)


def load_tokenizer(name: str) -> Tokenizer:
    """``"utf8"``, or the path of a HuggingFace ``tokenizer.json`` (or of a folder holding one)."""
    if name == "utf8":
        return ByteTokenizer()
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.suffix != ".json" and not path.exists():
        raise ValueError(f"unknown tokenizer {name!r}; accepted: 'utf8' or the path of a HuggingFace tokenizer.json")
    if not path.is_file():
        raise ValueError(f"tokenizer file {str(path)!r} does not exist")
    try:
        hf = importlib.import_module("tokenizers")
    except ImportError:
        raise ValueError(f"tokenizer {name!r} needs the tokenizers package: pip install tokenizers") from None
    try:
        backend = hf.Tokenizer.from_file(str(path))
    except Exception as exc:  # NOTE: the Rust binding raises a plain Exception on a bad file
        raise ValueError(f"cannot load tokenizer {str(path)!r}: {exc}") from exc
    return _HFTokenizer(str(path), backend)
