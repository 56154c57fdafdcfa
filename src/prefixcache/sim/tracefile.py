"""A trace file as numbered JSON rows, and the checks of their fields.

The part of reading a trace that no format changes: a ``.gz`` file is recognised by its
magic bytes (whatever its name) and decompressed on the fly, blank lines keep their
numbers, and every error -- a damaged gzip stream, invalid JSON, a field of the wrong
type, a pre-hashed prompt whose ids do not fit its length -- is a ``TraceError`` that
names the file, the 1-based line and the field.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import zlib
from collections.abc import Generator
from pathlib import Path
from typing import Any

_GZIP_MAGIC = b"\x1f\x8b"


class TraceError(ValueError):
    """A malformed trace line: ``"PATH:LINE: field 'NAME': what is wrong"`` (or
    ``"PATH:LINE: invalid JSON: ..."``)."""


# ---------------------------------------------------------------------------- reading lines


def _open(path: Path) -> gzip.GzipFile | io.BufferedReader:
    with path.open("rb") as probe:
        magic = probe.read(2)
    if magic == _GZIP_MAGIC:
        return gzip.open(path, "rb")
    return path.open("rb")


def numbered_lines(path: Path) -> Generator[tuple[int, bytes], None, None]:
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


def load_json(line: bytes, where: str) -> dict[str, Any]:
    try:
        data = json.loads(line, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TraceError(f"{where}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: invalid JSON: expected an object, got {show(data)}")
    return data


# ---------------------------------------------------------------------------- field checks


def show(value: Any) -> str:
    """A value as it appears in the JSON, shortened for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_int(value: Any) -> bool:
    return type(value) is int  # NOTE: excludes bool (true is not a length)


class Row:
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

    def integer(self, name: str, value: Any, minimum: int = 0) -> int:
        if not is_int(value) or value < minimum:
            raise self.error(name, f"must be an integer >= {minimum}, got {show(value)}")
        result: int = value
        return result

    def timestamp(self, value: Any) -> float:
        if (type(value) is not float and not is_int(value)) or not math.isfinite(value) or value < 0:
            raise self.error("timestamp", f"must be a number >= 0, got {show(value)}")
        return float(value)

    def string(self, name: str, value: Any, nonempty: bool = False) -> str:
        if not isinstance(value, str) or (nonempty and not value):
            kind = "a non-empty string" if nonempty else "a string"
            raise self.error(name, f"must be {kind}, got {show(value)}")
        return value

    def ids(self, name: str, value: Any, limit: int | None = None) -> tuple[int, ...]:
        """A list of integers >= 0 (and < ``limit``), checked with C-speed builtins first:
        a Mooncake row holds thousands of ids."""
        if type(value) is not list:
            raise self.error(name, f"must be a list of integers, got {show(value)}")
        ok = all(is_int(x) for x in value) and (not value or min(value) >= 0)
        if ok and limit is not None and value and max(value) >= limit:
            ok = False
        if not ok:
            top = f" and < {limit}" if limit is not None else ""
            for i, item in enumerate(value):
                if not is_int(item) or item < 0 or (limit is not None and item >= limit):
                    raise self.error(name, f"item {i} must be an integer >= 0{top}, got {show(item)}")
        return tuple(value)


# ---------------------------------------------------------------------------- pre-hashed prompts


HASHED_BLOCKS = ("auto", "all", "full")
"""Which blocks of a pre-hashed prompt have an id: ``all`` (a partial last block too:
``ceil(input_length / block_size)`` ids, as Mooncake), ``full`` (full blocks only:
``input_length // block_size`` ids), ``auto`` (whichever the trace follows)."""


class BlockCount:
    """Checks that each pre-hashed prompt has as many ids as its length needs, under one
    convention for the whole trace (``HASHED_BLOCKS``).

    NOTE: a prompt whose length is a multiple of the block size fits both conventions;
    under ``auto`` the first one that fits only one fixes the trace's, and a later prompt
    that fits only the other is an error naming both lines: within one trace the two
    would count a different tail, so which one the trace means cannot be guessed."""

    __slots__ = ("convention", "decided_at")

    def __init__(self, hashed_blocks: str = "auto") -> None:
        if hashed_blocks not in HASHED_BLOCKS:
            raise ValueError(f"unknown hashed_blocks {hashed_blocks!r}; valid: {', '.join(HASHED_BLOCKS)}")
        self.convention: str | None = None if hashed_blocks == "auto" else hashed_blocks
        self.decided_at: str | None = None  # the line that decided it under "auto"

    def check(self, row: Row, field: str, ids: int, block_size: int, input_length: int) -> None:
        """Raise a ``TraceError`` on ``field`` of ``row`` unless ``ids`` fit ``input_length``."""
        need = {"all": -(-input_length // block_size), "full": input_length // block_size}
        fits = [name for name in HASHED_BLOCKS[1:] if ids == need[name]]
        if self.convention in fits or (self.convention is None and len(fits) == 2):
            return
        if self.convention is None and fits:
            self.convention, self.decided_at = fits[0], row.where
            return
        formula = {
            "all": f"ceil({input_length}/{block_size}) = {need['all']}",
            "full": f"{input_length}//{block_size} = {need['full']}",
        }
        what = f"has {ids} ids for input_length {input_length} in blocks of {block_size}"
        if not fits:
            names = [self.convention] if self.convention else list(HASHED_BLOCKS[1:])
            raise row.error(field, f"{what}; needs " + " or ".join(f"{formula[n]} if it {_HASHES[n]}" for n in names))
        found, conv = fits[0], self.convention
        assert conv is not None
        if self.decided_at is None:
            raise row.error(field, f"{what}: it {_HASHES[found]}, but hashed blocks {conv!r} needs {formula[conv]}")
        raise row.error(
            field,
            f"{what}: it {_HASHES[found]}, but the trace since {self.decided_at} {_HASHES[conv]} "
            f"(needs {formula[conv]}); one trace must keep one convention",
        )


_HASHES = {"all": "hashes every block, the partial last one too", "full": "hashes only the full blocks"}
