"""A trace file as numbered JSON rows, and the checks of their fields.

The part of reading a trace that no format changes: a ``.gz`` file is recognised by its
magic bytes (whatever its name) and decompressed on the fly, blank lines keep their
numbers, and every error -- a damaged gzip stream, invalid JSON, a field of the wrong
type -- is a ``TraceError`` that names the file, the 1-based line and the field.
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
