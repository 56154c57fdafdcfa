"""Streaming readers for request traces: Mooncake FAST'25, Alibaba Bailian, and our JSONL.

A trace can be larger than memory, so every reader yields one ``Request`` per line and
keeps nothing behind. A ``.gz`` file (recognised by its magic bytes, whatever its name)
is decompressed on the fly. A malformed line is a ``TraceError`` that names the file,
the 1-based line and the field, never a bare ``KeyError`` and never a skipped row: a
replay that silently drops requests reports hit rates of a workload nobody sent.

Formats (``fmt=``; ``"auto"`` looks at the keys of the first non-empty line):

``mooncake``  Mooncake FAST'25 (Moonshot AI): ``timestamp`` (ms), ``input_length``,
              ``output_length``, ``hash_ids`` (prefix ids of 512-token blocks,
              ``len(hash_ids) == ceil(input_length / 512)``). Tenant and model "default".
``bailian``   Alibaba Qwen "KVCache in the wild": ``chat_id``, ``parent_chat_id``,
              ``timestamp`` (s), ``input_length``, ``output_length``, ``type``, ``turn``,
              ``hash_ids`` (16-token blocks). Tenant and model "default", ``type`` becomes
              the endpoint, ``str(chat_id)`` the session.
``jsonl``     ours, documented below.

Our JSONL: one JSON object per line, timestamps non-decreasing::

    {"timestamp": 0.25, "tenant": "acme", "model": "llama-3-8b", "endpoint": "chat",
     "session": "acme/chat-03", "tokens": [128000, 9906, 1917], "output_tokens": [40, 1097]}

=================  ========  ===========================================================
field              required  meaning
=================  ========  ===========================================================
``timestamp``      yes       seconds since the trace start, a number >= 0
``tenant``         yes       non-empty string
``model``          yes       non-empty string
``endpoint``       no        string, default ""
``session``        no        string naming a conversation, default none
``tokens``         one of    prompt token ids, integers in [0, 2**32)
``text``           one of    prompt text, tokenized with the tokenizer given to the reader
``hash_ids``       one of    prefix block ids (integers >= 0; id i names block i and every
                             block before it), with ``block_size`` (integer >= 1)
``input_length``   no/yes    prompt tokens; defaults to the number of tokens; required with
                             ``hash_ids``, where ``(len(hash_ids) - 1) * block_size <
                             input_length <= len(hash_ids) * block_size``
``output_length``  no        generated tokens, integer >= 0; defaults to
                             ``len(output_tokens)``, else 0
``output_tokens``  no        generated token ids
=================  ========  ===========================================================

Exactly one of ``tokens``, ``text`` and ``hash_ids`` is given; ``null`` counts as absent
for optional fields. An unknown key is an error (a misspelt ``endpont`` would otherwise
quietly become ``""``). In the third-party formats unknown keys are ignored.
"""

from __future__ import annotations

import gzip
import importlib
import io
import json
import math
import zlib
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

FORMATS = ("mooncake", "bailian", "jsonl")
MOONCAKE_BLOCK_SIZE = 512
BAILIAN_BLOCK_SIZE = 16
_NATIVE_BLOCK_SIZES: Mapping[str, int | None] = {
    "mooncake": MOONCAKE_BLOCK_SIZE,
    "bailian": BAILIAN_BLOCK_SIZE,
    "jsonl": None,
}
_MAX_TOKEN = 2**32  # token ids are hashed as uint32 (hashing.token_bytes)
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace, in the units the replay uses (seconds, tokens)."""

    timestamp: float  # seconds since trace start
    tenant: str  # "default" when the format has none
    model: str  # "default" when none
    endpoint: str  # "" when none
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    tokens: tuple[int, ...] | None = None  # real token ids
    hash_ids: tuple[int, ...] | None = None  # prefix block ids (each names the block AND all before it)
    block_size: int | None = None  # native block size of hash_ids
    output_tokens: tuple[int, ...] | None = None
    session: str | None = None


class TraceError(ValueError):
    """A malformed trace line: ``"PATH:LINE: field 'NAME': what is wrong"`` (or
    ``"PATH:LINE: invalid JSON: ..."``)."""


def native_block_size(fmt: str) -> int | None:
    """The block size a format's ``hash_ids`` are cut at; ``None`` for ours (per record)."""
    try:
        return _NATIVE_BLOCK_SIZES[fmt]
    except KeyError:
        raise ValueError(f"unknown trace format {fmt!r}; valid: {', '.join(FORMATS)}") from None


# ---------------------------------------------------------------------------- tokenizers


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


# ---------------------------------------------------------------------------- reading lines


def _open(path: Path) -> gzip.GzipFile | io.BufferedReader:
    with path.open("rb") as probe:
        magic = probe.read(2)
    if magic == _GZIP_MAGIC:
        return gzip.open(path, "rb")
    return path.open("rb")


def _lines(path: Path) -> Generator[tuple[int, bytes], None, None]:
    """Non-blank lines with their 1-based numbers (blank lines count: they are lines an
    editor shows). A damaged gzip stream is a ``TraceError`` at the line it broke in."""
    with _open(path) as stream:
        lines = iter(stream)
        lineno = 0
        while True:
            try:
                line = next(lines)
            except StopIteration:
                return
            except (OSError, EOFError, zlib.error) as exc:
                raise TraceError(f"{path}:{lineno + 1}: invalid gzip data: {exc}") from exc
            lineno += 1
            if line.strip():
                yield lineno, line


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _load(line: bytes, where: str) -> dict[str, Any]:
    try:
        data = json.loads(line, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TraceError(f"{where}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: invalid JSON: expected an object, got {_show(data)}")
    return data


# ---------------------------------------------------------------------------- field checks


def _show(value: Any) -> str:
    """A value as it appears in the JSON, shortened for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Row:
    """One parsed line and where it came from, so that every check can name its place."""

    __slots__ = ("data", "where")

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def error(self, name: str, what: str) -> TraceError:
        return TraceError(f"{self.where}: field {name!r}: {what}")

    def required(self, name: str) -> Any:
        if name not in self.data:
            raise self.error(name, "missing")
        return self.data[name]

    def optional(self, name: str) -> Any:
        """The value, or ``None`` when absent or ``null``."""
        return self.data.get(name)


def _is_int(value: Any) -> bool:
    return type(value) is int  # NOTE: excludes bool (true is not a length)


def _int(row: _Row, name: str, value: Any, minimum: int = 0) -> int:
    if not _is_int(value) or value < minimum:
        raise row.error(name, f"must be an integer >= {minimum}, got {_show(value)}")
    result: int = value
    return result


def _timestamp(row: _Row, value: Any) -> float:
    if (type(value) is not float and not _is_int(value)) or not math.isfinite(value) or value < 0:
        raise row.error("timestamp", f"must be a number >= 0, got {_show(value)}")
    return float(value)


def _str(row: _Row, name: str, value: Any, nonempty: bool = False) -> str:
    if not isinstance(value, str) or (nonempty and not value):
        kind = "a non-empty string" if nonempty else "a string"
        raise row.error(name, f"must be {kind}, got {_show(value)}")
    return value


def _ids(row: _Row, name: str, value: Any, limit: int | None = None) -> tuple[int, ...]:
    """A list of integers >= 0 (and < ``limit``), checked with C-speed builtins first:
    a Mooncake row holds thousands of ids."""
    if type(value) is not list:
        raise row.error(name, f"must be a list of integers, got {_show(value)}")
    ok = all(_is_int(x) for x in value) and (not value or min(value) >= 0)
    if ok and limit is not None and value and max(value) >= limit:
        ok = False
    if not ok:
        top = f" and < {limit}" if limit is not None else ""
        for i, item in enumerate(value):
            if not _is_int(item) or item < 0 or (limit is not None and item >= limit):
                raise row.error(name, f"item {i} must be an integer >= 0{top}, got {_show(item)}")
    return tuple(value)


# ---------------------------------------------------------------------------- formats


Parser = Callable[[_Row, Tokenizer | None], Request]


def _parse_mooncake(row: _Row, tokenizer: Tokenizer | None) -> Request:
    timestamp = _timestamp(row, row.required("timestamp")) / 1000.0  # ms -> s
    input_length = _int(row, "input_length", row.required("input_length"))
    output_length = _int(row, "output_length", row.required("output_length"))
    hash_ids = _ids(row, "hash_ids", row.required("hash_ids"))
    expected = -(-input_length // MOONCAKE_BLOCK_SIZE)
    if len(hash_ids) != expected:
        raise row.error(
            "hash_ids",
            f"has {len(hash_ids)} ids; input_length {input_length} needs ceil({input_length}/512) = {expected}",
        )
    return Request(
        timestamp=timestamp,
        tenant="default",
        model="default",
        endpoint="",
        input_length=input_length,
        output_length=output_length,
        hash_ids=hash_ids,
        block_size=MOONCAKE_BLOCK_SIZE,
    )


def _parse_bailian(row: _Row, tokenizer: Tokenizer | None) -> Request:
    chat_id = row.required("chat_id")
    if not (_is_int(chat_id) or (isinstance(chat_id, str) and chat_id)):
        raise row.error("chat_id", f"must be an integer or a non-empty string, got {_show(chat_id)}")
    for name in ("parent_chat_id", "turn"):  # unused, but a wrong type means a wrong file
        value = row.optional(name)
        if value is not None and not _is_int(value) and not isinstance(value, str):
            raise row.error(name, f"must be an integer or a string, got {_show(value)}")
    kind = row.optional("type")
    endpoint = "" if kind is None else _str(row, "type", kind)
    # NOTE: no length check here, unlike Mooncake: the upstream FAQ says the last input
    # block may hold padding replaced by output tokens, and the files are not here to
    # confirm that len(hash_ids) == ceil(input_length / 16) holds on every row.
    return Request(
        timestamp=_timestamp(row, row.required("timestamp")),
        tenant="default",
        model="default",
        endpoint=endpoint,
        input_length=_int(row, "input_length", row.required("input_length")),
        output_length=_int(row, "output_length", row.required("output_length")),
        hash_ids=_ids(row, "hash_ids", row.required("hash_ids")),
        block_size=BAILIAN_BLOCK_SIZE,
        session=str(chat_id),
    )


_JSONL_FIELDS = (
    "timestamp",
    "tenant",
    "model",
    "endpoint",
    "session",
    "tokens",
    "text",
    "hash_ids",
    "block_size",
    "input_length",
    "output_length",
    "output_tokens",
)
_PROMPT_SOURCES = ("tokens", "text", "hash_ids")


def _parse_jsonl(row: _Row, tokenizer: Tokenizer | None) -> Request:
    unknown = sorted(row.data.keys() - set(_JSONL_FIELDS))
    if unknown:
        raise row.error(unknown[0], f"unknown field; valid: {', '.join(_JSONL_FIELDS)}")
    timestamp = _timestamp(row, row.required("timestamp"))
    tenant = _str(row, "tenant", row.required("tenant"), nonempty=True)
    model = _str(row, "model", row.required("model"), nonempty=True)
    endpoint = row.optional("endpoint")
    session = row.optional("session")
    tokens, hash_ids, block_size, input_length = _jsonl_prompt(row, tokenizer)
    output_tokens, output_length = _jsonl_output(row)
    return Request(
        timestamp=timestamp,
        tenant=tenant,
        model=model,
        endpoint="" if endpoint is None else _str(row, "endpoint", endpoint),
        input_length=input_length,
        output_length=output_length,
        tokens=tokens,
        hash_ids=hash_ids,
        block_size=block_size,
        output_tokens=output_tokens,
        session=None if session is None else _str(row, "session", session, nonempty=True),
    )


def _jsonl_prompt(
    row: _Row, tokenizer: Tokenizer | None
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None, int | None, int]:
    """(tokens, hash_ids, block_size, input_length) from whichever prompt field is given."""
    given = [name for name in _PROMPT_SOURCES if row.optional(name) is not None]
    if not given:
        raise row.error("tokens", "missing; give exactly one of tokens, text, or hash_ids with block_size")
    if len(given) > 1:
        raise row.error(given[1], f"conflicts with {given[0]!r}; give exactly one of tokens, text, hash_ids")
    if given[0] == "hash_ids":
        return _jsonl_hash_ids(row)
    if row.optional("block_size") is not None:
        raise row.error("block_size", "is only valid with hash_ids")
    tokens = _ids(row, "tokens", row.data["tokens"], _MAX_TOKEN) if given[0] == "tokens" else _tokenize(row, tokenizer)
    input_length = row.optional("input_length")
    if input_length is not None and _int(row, "input_length", input_length) != len(tokens):
        raise row.error("input_length", f"is {input_length} but the prompt has {len(tokens)} tokens")
    return tokens, None, None, len(tokens)


def _tokenize(row: _Row, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    text = _str(row, "text", row.data["text"])
    if tokenizer is None:
        raise row.error("text", "needs a tokenizer: pass tokenizer=load_tokenizer('utf8') or a tokenizer.json path")
    try:
        ids = tokenizer.encode(text)
    except ValueError as exc:
        raise row.error("text", f"tokenizer {tokenizer.name!r} failed: {exc}") from exc
    return _ids(row, "text", list(ids), _MAX_TOKEN)


def _jsonl_hash_ids(row: _Row) -> tuple[None, tuple[int, ...], int, int]:
    hash_ids = _ids(row, "hash_ids", row.data["hash_ids"])
    block_size = _int(row, "block_size", row.required("block_size"), minimum=1)
    input_length = _int(row, "input_length", row.required("input_length"))
    lo, hi = (len(hash_ids) - 1) * block_size, len(hash_ids) * block_size
    if not lo < input_length <= hi:
        raise row.error(
            "input_length",
            f"is {input_length}, but {len(hash_ids)} blocks of {block_size} hold more than {lo} and at most {hi}",
        )
    return None, hash_ids, block_size, input_length


def _jsonl_output(row: _Row) -> tuple[tuple[int, ...] | None, int]:
    raw_tokens = row.optional("output_tokens")
    raw_length = row.optional("output_length")
    tokens = None if raw_tokens is None else _ids(row, "output_tokens", raw_tokens, _MAX_TOKEN)
    if raw_length is None:
        return tokens, 0 if tokens is None else len(tokens)
    length = _int(row, "output_length", raw_length)
    if tokens is not None and length != len(tokens):
        raise row.error("output_length", f"is {length} but output_tokens has {len(tokens)} tokens")
    return tokens, length


_PARSERS: Mapping[str, Parser] = {
    "mooncake": _parse_mooncake,
    "bailian": _parse_bailian,
    "jsonl": _parse_jsonl,
}


# ---------------------------------------------------------------------------- detection


def _guess(data: dict[str, Any], where: str) -> str:
    """Which format a record's keys belong to: each has a key the others lack."""
    keys = data.keys()
    if "chat_id" in keys:
        return "bailian"
    if keys & {"tenant", "model", "tokens", "text", "block_size"}:
        return "jsonl"
    if "hash_ids" in keys and "input_length" in keys:
        return "mooncake"
    raise TraceError(
        f"{where}: cannot detect the trace format from the keys {sorted(keys)}; pass fmt= one of {', '.join(FORMATS)}"
    )


def _first_record(path: Path) -> tuple[str, dict[str, Any]] | None:
    """(where, record) of the first non-empty line, or ``None`` for an empty trace."""
    lines = _lines(path)
    try:
        for lineno, line in lines:
            where = f"{path}:{lineno}"
            return where, _load(line, where)
        return None
    finally:
        lines.close()  # closes the file now, not when the generator is collected


def detect_format(path: str | Path) -> str:
    """The format of a trace, from the keys of its first non-empty line."""
    path = Path(path)
    first = _first_record(path)
    if first is None:
        raise TraceError(f"{path}: empty trace; cannot detect its format")
    return _guess(first[1], first[0])


# ---------------------------------------------------------------------------- reading


def read_trace(path: str | Path, fmt: str = "auto", tokenizer: Tokenizer | None = None) -> Iterator[Request]:
    """The requests of a trace, one line at a time.

    The format name and (for ``"auto"``) the first line are checked now; every later
    line when the iterator reaches it. An empty trace yields nothing.
    """
    path = Path(path)
    if fmt != "auto" and fmt not in _PARSERS:
        raise ValueError(f"unknown trace format {fmt!r}; valid: auto, {', '.join(FORMATS)}")
    if not path.is_file():
        raise FileNotFoundError(f"no trace file {str(path)!r}")
    if fmt == "auto":
        first = _first_record(path)
        if first is None:
            return iter(())
        fmt = _guess(first[1], first[0])
    return _read(path, _PARSERS[fmt], tokenizer)


def _read(path: Path, parse: Parser, tokenizer: Tokenizer | None) -> Iterator[Request]:
    previous: tuple[float, Any] | None = None  # (seconds, the value as written)
    for lineno, line in _lines(path):
        row = _Row(_load(line, f"{path}:{lineno}"), f"{path}:{lineno}")
        request = parse(row, tokenizer)
        # NOTE: the replay drives TTLs and time windows by these, so a step back in time
        # is an error here rather than a negative age there.
        if previous is not None and request.timestamp < previous[0]:
            raise row.error(
                "timestamp",
                f"{_show(row.data['timestamp'])} is earlier than the previous request's {_show(previous[1])}; "
                "timestamps must be non-decreasing",
            )
        previous = (request.timestamp, row.data["timestamp"])
        yield request
