"""The quality gates' evaluation set: prompts whose reusable parts were cached alone,
and how each prompt is assembled from them. The blend gate reuses those parts at new
positions; the codec gate serves each prompt's cached prefix through a codec's frames.

The file is JSON (``tests/data/blend/eval.json``)::

    {"version": 1,
     "chunks": {"<name>": ["<line>", ...], ...},      text cached alone, line by line
     "items": [{"id": "...", "kind": "reordered_rag",
                "system": "...",                        optional: a chat, see below
                "cached": ["<name>", ...],              chunks prefilled alone first
                "prompt": [{"text": "..."},             fresh: prefilled in the prompt
                           {"chunk": "<name>"},         all of a cached chunk
                           {"chunk": "<name>", "lines": [a, b]}]}]}   its lines a..b-1

A chunk's tokens are its lines encoded one by one and laid end to end, so a slice of
lines is a slice of the chunk's tokens and of its cached KV (``original_start`` is the
slice's first token). The full prefill the gate compares against runs the very same
tokens: any difference comes from the blend, never from tokenization.

An item with a ``system`` message is a chat: its prompt parts are the user's message,
framed by the model's own chat template (the system turn, the user turn's opening, and
after the message the close and the assistant's opening, as a server would send it).
The frame's two texts are fresh parts; a model with no chat template cannot run them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("reordered_rag", "edited_document", "edited_query", "shifted_system")
VERSION = 1

Encode = Callable[[str], Sequence[int]]
Frame = Callable[[str], tuple[str, str]]  # system message -> chat text before, after the user's


class EvalSetError(ValueError):
    """The evaluation file does not follow the schema; the message says where."""


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ChunkPart:
    name: str
    lines: tuple[int, int] | None = None  # lines a..b-1 of the chunk; None: all of it


Part = TextPart | ChunkPart


@dataclass(frozen=True, slots=True)
class EvalItem:
    id: str
    kind: str
    cached: tuple[str, ...]
    prompt: tuple[Part, ...]
    system: str | None = None  # a chat: the prompt is the user's message after this system turn


@dataclass(frozen=True, slots=True)
class EvalSet:
    chunks: Mapping[str, tuple[str, ...]]
    items: tuple[EvalItem, ...]
    digest: str  # of the file's bytes: a gate result is only valid for the set it ran on

    def of_kind(self, *kinds: str) -> EvalSet:
        """The items of the given kinds only (same chunks, a digest of its own)."""
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown item kinds {unknown}; valid: {list(KINDS)}")
        items = tuple(item for item in self.items if item.kind in kinds)
        return EvalSet(self.chunks, items, _sub_digest(self.digest, [item.id for item in items]))

    def subset(self, ids: Sequence[str]) -> EvalSet:
        """The items with these ids, in the order given."""
        by_id = {item.id: item for item in self.items}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ValueError(f"no items {missing} in the evaluation set")
        return EvalSet(self.chunks, tuple(by_id[i] for i in ids), _sub_digest(self.digest, list(ids)))


@dataclass(frozen=True, slots=True)
class Piece:
    """One run of an assembled prompt: fresh tokens, or tokens ``start..end`` of a chunk."""

    tokens: tuple[int, ...]
    chunk: str | None = None
    start: int = 0


def load_eval_set(path: str | Path) -> EvalSet:
    """Read and validate the evaluation file; an ``EvalSetError`` names the bad field."""
    raw = Path(path).read_bytes()
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise EvalSetError(f"{path}: not JSON: {e}") from None
    return parse_eval_set(doc, digest=hashlib.sha256(raw).hexdigest()[:16], where=str(path))


def parse_eval_set(doc: Any, digest: str = "", where: str = "eval set") -> EvalSet:
    """Validate a decoded evaluation document."""
    _expect(isinstance(doc, dict), where, "must be an object with version, chunks and items")
    _expect(doc.get("version") == VERSION, where, f"version must be {VERSION}, got {doc.get('version')!r}")
    extra = sorted(set(doc) - {"version", "chunks", "items"})
    _expect(not extra, where, f"unknown keys {extra}")
    chunks = _chunks(doc.get("chunks"), f"{where}: chunks")
    raw_items = doc.get("items")
    _expect(isinstance(raw_items, list) and bool(raw_items), where, "items must be a non-empty list")
    items = tuple(_item(raw, chunks, f"{where}: items[{i}]") for i, raw in enumerate(raw_items))
    ids = [item.id for item in items]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    _expect(not dupes, where, f"duplicate item ids {dupes}")
    return EvalSet(chunks, items, digest or hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16])


def assemble(
    item: EvalItem, chunks: Mapping[str, Sequence[Sequence[int]]], encode: Encode, frame: Frame | None = None
) -> list[Piece]:
    """The prompt of ``item`` as pieces; ``chunks`` holds each chunk's lines, encoded.
    A chat item needs ``frame``, the model's chat template around a user message."""
    parts: tuple[Part, ...] = item.prompt
    if item.system is not None:
        if frame is None:
            raise EvalSetError(f"item {item.id} is a chat: assembling it needs the model's chat template")
        before, after = frame(item.system)
        parts = (TextPart(before), *parts, TextPart(after))
    pieces: list[Piece] = []
    for part in parts:
        if isinstance(part, TextPart) and not part.text:
            continue
        if isinstance(part, TextPart):
            pieces.append(Piece(tuple(encode(part.text))))
            continue
        lines = chunks[part.name]
        a, b = part.lines if part.lines is not None else (0, len(lines))
        start = sum(len(line) for line in lines[:a])
        tokens = tuple(t for line in lines[a:b] for t in line)
        pieces.append(Piece(tokens, part.name, start))
    return pieces


def _chunks(raw: Any, where: str) -> dict[str, tuple[str, ...]]:
    _expect(isinstance(raw, dict) and bool(raw), where, "must be a non-empty object of name -> list of lines")
    out: dict[str, tuple[str, ...]] = {}
    for name, lines in raw.items():
        ok = isinstance(lines, list) and bool(lines) and all(isinstance(x, str) and x for x in lines)
        _expect(ok, f"{where}.{name}", "must be a non-empty list of non-empty strings")
        out[name] = tuple(lines)
    return out


def _item(raw: Any, chunks: Mapping[str, tuple[str, ...]], where: str) -> EvalItem:
    _expect(isinstance(raw, dict), where, "must be an object")
    item_id = raw.get("id")
    _expect(isinstance(item_id, str) and bool(item_id), where, "needs a non-empty string id")
    where = f"{where} ({item_id})"
    extra = sorted(set(raw) - {"id", "kind", "system", "cached", "prompt"})
    _expect(not extra, where, f"unknown keys {extra}")
    _expect(raw.get("kind") in KINDS, where, f"kind must be one of {list(KINDS)}, got {raw.get('kind')!r}")
    system = raw.get("system")
    _expect(system is None or (isinstance(system, str) and bool(system)), where, "system must be a non-empty string")
    cached = raw.get("cached")
    _expect(isinstance(cached, list) and all(isinstance(c, str) for c in cached), where, "cached must list names")
    unknown = sorted(set(cached) - set(chunks))
    _expect(not unknown, where, f"cached names {unknown} are not in chunks")
    prompt = raw.get("prompt")
    _expect(isinstance(prompt, list) and bool(prompt), where, "prompt must be a non-empty list of parts")
    parts = tuple(_part(p, chunks, set(cached), f"{where}: prompt[{i}]") for i, p in enumerate(prompt))
    _expect(any(isinstance(p, ChunkPart) for p in parts), where, "the prompt reuses no cached chunk")
    return EvalItem(item_id, raw["kind"], tuple(cached), parts, system)


def _part(raw: Any, chunks: Mapping[str, tuple[str, ...]], cached: set[str], where: str) -> Part:
    _expect(isinstance(raw, dict) and len({"text", "chunk"} & set(raw)) == 1, where, "needs either text or chunk")
    if "text" in raw:
        _expect(set(raw) == {"text"}, where, f"a text part has only text, got keys {sorted(raw)}")
        _expect(isinstance(raw["text"], str) and bool(raw["text"]), where, "text must be a non-empty string")
        return TextPart(raw["text"])
    name = raw["chunk"]
    _expect(set(raw) <= {"chunk", "lines"}, where, f"a chunk part has chunk and lines only, got keys {sorted(raw)}")
    _expect(name in cached, where, f"chunk {name!r} is not in this item's cached list {sorted(cached)}")
    if "lines" not in raw:
        return ChunkPart(name)
    lines = raw["lines"]
    n = len(chunks[name])
    ok = isinstance(lines, list) and len(lines) == 2 and all(isinstance(x, int) for x in lines)
    _expect(ok and 0 <= lines[0] < lines[1] <= n, where, f"lines must be [a, b] with 0 <= a < b <= {n}, got {lines!r}")
    return ChunkPart(name, (lines[0], lines[1]))


def _expect(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise EvalSetError(f"{where}: {what}")


def _sub_digest(digest: str, ids: list[str]) -> str:
    return hashlib.sha256(json.dumps([digest, ids]).encode()).hexdigest()[:16]
