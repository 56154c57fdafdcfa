"""Streaming readers for request traces: Mooncake FAST'25, Alibaba Bailian, and our JSONL.

A trace can be larger than memory, so every reader yields one ``Request`` per line and
keeps nothing behind. A ``.gz`` file (recognised by its magic bytes, whatever its name)
is decompressed on the fly. A malformed line is a ``TraceError`` that names the file,
the 1-based line and the field, never a bare ``KeyError`` and never a skipped row: a
replay that silently drops requests reports hit rates of a workload nobody sent.
What every format shares (gzip, line numbers, JSON, typed field checks) is in
``tracefile``; the tokenizers for ``text`` prompts are in ``tokenizers``.

Formats (``fmt=``; ``"auto"`` looks at the keys of the first non-empty line):

``mooncake``  Mooncake FAST'25 (Moonshot AI): ``timestamp`` (ms), ``input_length``,
              ``output_length``, ``hash_ids`` (prefix ids of 512-token blocks,
              ``ceil(input_length / 512)`` of them; see below for traces that hash only
              full blocks). Tenant and model "default".
``bailian``   Alibaba Qwen "KVCache in the wild": ``chat_id``, ``parent_chat_id``,
              ``timestamp`` (s), ``input_length``, ``output_length``, ``type``, ``turn``,
              ``hash_ids`` (16-token blocks). Tenant and model "default", ``type`` becomes
              the endpoint, ``str(chat_id)`` the session.
``jsonl``     ours, documented below.

Mooncake's and Bailian's lines may also carry a retention (``retention`` or
``prompt_cache_retention``, as in ours below); their other unknown keys are ignored.

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
                             ``hash_ids``, whose length it fixes (below)
``output_length``  no        generated tokens, integer >= 0; defaults to
                             ``len(output_tokens)``, else 0
``output_tokens``  no        generated token ids
``retention``      no        seconds to retain the prompt after its access (a number, or
                             ``"5m"``, ``"1h"``, ``"24h"``; 0 asks none); or OpenAI's
                             ``prompt_cache_retention`` (``"in_memory"``, ``"24h"``).
                             Replayed with ``--retention trace`` (``retention``)
=================  ========  ===========================================================

Exactly one of ``tokens``, ``text`` and ``hash_ids`` is given; ``null`` counts as absent
for optional fields. An unknown key is an error (a misspelt ``endpont`` would otherwise
quietly become ``""``). In the third-party formats unknown keys are ignored.

Pre-hashed prompts (Mooncake's and ours) come in two conventions: an id for every block,
the partial last one too (``ceil(input_length / block_size)`` ids, as Mooncake), or for
the full blocks only (``input_length // block_size`` ids: the tail has no id and is never
a hit). ``hashed_blocks=`` says which (``"all"``, ``"full"``), or ``"auto"`` detects it;
one trace keeps one (``tracefile.BlockCount``). Bailian rows are not checked (below).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.sim.retention import RETENTION_FIELDS, trace_seconds
from prefixcache.sim.tokenizers import Tokenizer
from prefixcache.sim.tracefile import BlockCount, Row, TraceError, is_int, load_json, numbered_lines, show

FORMATS = ("mooncake", "bailian", "jsonl")
MOONCAKE_BLOCK_SIZE = 512
BAILIAN_BLOCK_SIZE = 16
_NATIVE_BLOCK_SIZES: Mapping[str, int | None] = {
    "mooncake": MOONCAKE_BLOCK_SIZE,
    "bailian": BAILIAN_BLOCK_SIZE,
    "jsonl": None,
}
_MAX_TOKEN = 2**32  # token ids are hashed as uint32 (hashing.token_bytes)


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
    retention: float | None = None  # seconds the line asks its prompt retained (retention.trace_seconds)


def native_block_size(fmt: str) -> int | None:
    """The block size a format's ``hash_ids`` are cut at; ``None`` for ours (per record)."""
    try:
        return _NATIVE_BLOCK_SIZES[fmt]
    except KeyError:
        raise ValueError(f"unknown trace format {fmt!r}; valid: {', '.join(FORMATS)}") from None


# ---------------------------------------------------------------------------- formats


Parser = Callable[[Row, Tokenizer | None], Request]


def _parse_mooncake(row: Row, tokenizer: Tokenizer | None) -> Request:
    timestamp = row.timestamp(row.required("timestamp")) / 1000.0  # ms -> s
    input_length = row.integer("input_length", row.required("input_length"))
    output_length = row.integer("output_length", row.required("output_length"))
    hash_ids = row.ids("hash_ids", row.required("hash_ids"))
    return Request(
        timestamp=timestamp,
        tenant="default",
        model="default",
        endpoint="",
        input_length=input_length,
        output_length=output_length,
        hash_ids=hash_ids,
        block_size=MOONCAKE_BLOCK_SIZE,
        retention=_retention(row),
    )


def _parse_bailian(row: Row, tokenizer: Tokenizer | None) -> Request:
    chat_id = row.required("chat_id")
    if not (is_int(chat_id) or (isinstance(chat_id, str) and chat_id)):
        raise row.error("chat_id", f"must be an integer or a non-empty string, got {show(chat_id)}")
    for name in ("parent_chat_id", "turn"):  # unused, but a wrong type means a wrong file
        value = row.optional(name)
        if value is not None and not is_int(value) and not isinstance(value, str):
            raise row.error(name, f"must be an integer or a string, got {show(value)}")
    kind = row.optional("type")
    endpoint = "" if kind is None else row.string("type", kind)
    # NOTE: no length check here, unlike Mooncake: the upstream FAQ says the last input
    # block may hold padding replaced by output tokens, and the files are not here to
    # confirm that len(hash_ids) == ceil(input_length / 16) holds on every row.
    return Request(
        timestamp=row.timestamp(row.required("timestamp")),
        tenant="default",
        model="default",
        endpoint=endpoint,
        input_length=row.integer("input_length", row.required("input_length")),
        output_length=row.integer("output_length", row.required("output_length")),
        hash_ids=row.ids("hash_ids", row.required("hash_ids")),
        block_size=BAILIAN_BLOCK_SIZE,
        session=str(chat_id),
        retention=_retention(row),
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
    *RETENTION_FIELDS,
)
_PROMPT_SOURCES = ("tokens", "text", "hash_ids")


def _parse_jsonl(row: Row, tokenizer: Tokenizer | None) -> Request:
    unknown = sorted(row.data.keys() - set(_JSONL_FIELDS))
    if unknown:
        raise row.error(unknown[0], f"unknown field; valid: {', '.join(_JSONL_FIELDS)}")
    timestamp = row.timestamp(row.required("timestamp"))
    tenant = row.string("tenant", row.required("tenant"), nonempty=True)
    model = row.string("model", row.required("model"), nonempty=True)
    endpoint = row.optional("endpoint")
    session = row.optional("session")
    tokens, hash_ids, block_size, input_length = _jsonl_prompt(row, tokenizer)
    output_tokens, output_length = _jsonl_output(row)
    return Request(
        timestamp=timestamp,
        tenant=tenant,
        model=model,
        endpoint="" if endpoint is None else row.string("endpoint", endpoint),
        input_length=input_length,
        output_length=output_length,
        tokens=tokens,
        hash_ids=hash_ids,
        block_size=block_size,
        output_tokens=output_tokens,
        session=None if session is None else row.string("session", session, nonempty=True),
        retention=_retention(row),
    )


def _retention(row: Row) -> float | None:
    """The line's retention in seconds, from whichever field carries it (at most one)."""
    given = [name for name in RETENTION_FIELDS if row.optional(name) is not None]
    if len(given) > 1:
        raise row.error(given[1], f"conflicts with {given[0]!r}; give one retention")
    if not given:
        return None
    try:
        return trace_seconds(given[0], row.data[given[0]])
    except ValueError as exc:
        raise row.error(given[0], str(exc)) from None


def _jsonl_prompt(
    row: Row, tokenizer: Tokenizer | None
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
    tokens = row.ids("tokens", row.data["tokens"], _MAX_TOKEN) if given[0] == "tokens" else _tokenize(row, tokenizer)
    input_length = row.optional("input_length")
    if input_length is not None and row.integer("input_length", input_length) != len(tokens):
        raise row.error("input_length", f"is {input_length} but the prompt has {len(tokens)} tokens")
    return tokens, None, None, len(tokens)


def _tokenize(row: Row, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    text = row.string("text", row.data["text"])
    if tokenizer is None:
        raise row.error("text", "needs a tokenizer: pass tokenizer=load_tokenizer('utf8') or a tokenizer.json path")
    try:
        ids = tokenizer.encode(text)
    except ValueError as exc:
        raise row.error("text", f"tokenizer {tokenizer.name!r} failed: {exc}") from exc
    return row.ids("text", list(ids), _MAX_TOKEN)


def _jsonl_hash_ids(row: Row) -> tuple[None, tuple[int, ...], int, int]:
    hash_ids = row.ids("hash_ids", row.data["hash_ids"])
    block_size = row.integer("block_size", row.required("block_size"), minimum=1)
    input_length = row.integer("input_length", row.required("input_length"))
    return None, hash_ids, block_size, input_length


def _jsonl_output(row: Row) -> tuple[tuple[int, ...] | None, int]:
    raw_tokens = row.optional("output_tokens")
    raw_length = row.optional("output_length")
    tokens = None if raw_tokens is None else row.ids("output_tokens", raw_tokens, _MAX_TOKEN)
    if raw_length is None:
        return tokens, 0 if tokens is None else len(tokens)
    length = row.integer("output_length", raw_length)
    if tokens is not None and length != len(tokens):
        raise row.error("output_length", f"is {length} but output_tokens has {len(tokens)} tokens")
    return tokens, length


_PARSERS: Mapping[str, Parser] = {
    "mooncake": _parse_mooncake,
    "bailian": _parse_bailian,
    "jsonl": _parse_jsonl,
}
# NOTE: the field a prompt with the wrong number of ids is blamed on; Bailian's are not
# counted (see _parse_bailian).
_COUNTED: Mapping[str, str] = {"mooncake": "hash_ids", "jsonl": "input_length"}


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
    lines = numbered_lines(path)
    try:
        for lineno, line in lines:
            where = f"{path}:{lineno}"
            return where, load_json(line, where)
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


def read_trace(
    path: str | Path, fmt: str = "auto", tokenizer: Tokenizer | None = None, hashed_blocks: str = "auto"
) -> Iterator[Request]:
    """The requests of a trace, one line at a time.

    The format name, ``hashed_blocks`` (``tracefile.HASHED_BLOCKS``) and (for ``"auto"``)
    the first line are checked now; every later line when the iterator reaches it. An
    empty trace yields nothing.
    """
    path = Path(path)
    if fmt != "auto" and fmt not in _PARSERS:
        raise ValueError(f"unknown trace format {fmt!r}; valid: auto, {', '.join(FORMATS)}")
    BlockCount(hashed_blocks)  # NOTE: checks the name now, not at the first line
    if not path.is_file():
        raise FileNotFoundError(f"no trace file {str(path)!r}")
    if fmt == "auto":
        first = _first_record(path)
        if first is None:
            return iter(())
        fmt = _guess(first[1], first[0])
    return _read(path, fmt, tokenizer, hashed_blocks)


def _read(path: Path, fmt: str, tokenizer: Tokenizer | None, hashed_blocks: str) -> Iterator[Request]:
    parse, counted, count = _PARSERS[fmt], _COUNTED.get(fmt), BlockCount(hashed_blocks)
    previous: tuple[float, Any] | None = None  # (seconds, the value as written)
    for lineno, line in numbered_lines(path):
        row = Row(load_json(line, f"{path}:{lineno}"), f"{path}:{lineno}")
        request = parse(row, tokenizer)
        if counted is not None and request.hash_ids is not None and request.block_size is not None:
            count.check(row, counted, len(request.hash_ids), request.block_size, request.input_length)
        # NOTE: the replay drives TTLs and time windows by these, so a step back in time
        # is an error here rather than a negative age there.
        if previous is not None and request.timestamp < previous[0]:
            raise row.error(
                "timestamp",
                f"{show(row.data['timestamp'])} is earlier than the previous request's {show(previous[1])}; "
                "timestamps must be non-decreasing",
            )
        previous = (request.timestamp, row.data["timestamp"])
        yield request
