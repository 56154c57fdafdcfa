"""Retention in a replay: what ``--retention`` asks for, and what a trace line may carry.

A replay with retention calls ``PrefixCache.retain`` on each request's prompt after its
access, for as long as the request asks, charged to the request's tenant
(``cache/retention.py``: deadlines each hit extends, per-tenant caps). How long:

=============  ============================================================================
``off``        no retention, whatever the trace carries (the default)
``trace``      each line's own ``retention`` (seconds; ``tracefile``'s field, below)
``auto:P``     each session retains its prompt for the P-th percentile (1..100, nearest
               rank) of its own inter-turn gaps seen so far, ``DEFAULT_FIRST_S`` before it
               has one: what a client that knows its own loop would ask (``sessions``)
``auto:P:N``   the same from a session's N-th turn on (N >= 1), nothing before it: a
               client that knows most of its conversations end early (a chat's first
               turns) keeps the cap for the ones that have shown they go on
=============  ============================================================================

A trace line's retention (our JSONL, and Mooncake's or Bailian's lines when they carry
it): ``retention`` as seconds (a number; 0 or ``null`` asks none) or as a duration the
APIs write (``"5m"``, ``"1h"``, ``"24h"``, ``"90s"``); or OpenAI's
``prompt_cache_retention`` (``"in_memory"``: none, ``"24h"``).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from prefixcache.config import MAX_RETAIN_S

__all__ = [
    "DEFAULT_FIRST_S",
    "FORMS",
    "MAX_RETAIN_S",
    "RETENTION_OFF",
    "RetentionCounts",
    "RetentionMode",
    "RetentionSpec",
    "parse_retention",
    "trace_seconds",
]


DEFAULT_FIRST_S = 300.0
"""What ``auto:P`` asks before a session has a gap of its own: five minutes, the TTL
Anthropic's ``cache_control`` gets when it names none (what a client that knows nothing
of its loop yet is given)."""

FORMS = "off, trace, auto:P or auto:P:N (P a percentile from 1 to 100, N a first turn >= 1; e.g. auto:90, auto:75:4)"

# The trace fields that carry a retention, and OpenAI's values of its own.
RETENTION_FIELDS = ("retention", "prompt_cache_retention")
_OPENAI_VALUES = {"in_memory": None, "24h": 24 * 3600.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh])\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


class RetentionMode(enum.StrEnum):
    OFF = "off"
    TRACE = "trace"
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class RetentionSpec:
    """How long a replay retains each prompt (``--retention``); ``percentile`` and
    ``from_turn`` (a session's first turn that retains; 1: every turn) only with ``auto``."""

    mode: RetentionMode = RetentionMode.OFF
    percentile: float | None = None
    from_turn: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.mode, RetentionMode):
            raise ValueError(f"retention mode must be a RetentionMode, got {self.mode!r}")
        p = self.percentile
        if self.mode is RetentionMode.AUTO:
            if isinstance(p, bool) or not isinstance(p, int | float) or not math.isfinite(p) or not 1 <= p <= 100:
                raise ValueError(f"retention auto:P needs a percentile P from 1 to 100, got {p!r}")
            n = self.from_turn
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"retention auto:P:N needs a first turn N >= 1, got {n!r}")
        elif p is not None or self.from_turn != 1:
            raise ValueError(f"retention {self.mode.value} takes no percentile nor first turn, got {p!r}")

    @property
    def on(self) -> bool:
        return self.mode is not RetentionMode.OFF

    @property
    def label(self) -> str:
        if self.mode is RetentionMode.AUTO:
            assert self.percentile is not None
            turn = f":{self.from_turn}" if self.from_turn > 1 else ""
            return f"auto:{self.percentile:g}{turn}"
        return self.mode.value


RETENTION_OFF = RetentionSpec()


def parse_retention(text: str) -> RetentionSpec:
    """``--retention``'s value: ``off``, ``trace``, ``auto:P`` or ``auto:P:N``; anything
    else a ``ValueError`` naming the forms."""
    value = text.strip().lower()
    if value in (RetentionMode.OFF.value, RetentionMode.TRACE.value):
        return RetentionSpec(RetentionMode(value))
    head, sep, tail = value.partition(":")
    if head == RetentionMode.AUTO.value and sep:
        pct, turn_sep, turn = tail.partition(":")
        try:
            percentile = float(pct)
        except ValueError:
            percentile = math.nan
        if not (math.isfinite(percentile) and 1 <= percentile <= 100):
            raise ValueError(f"invalid retention {text!r}: auto:P needs a percentile P from 1 to 100; valid: {FORMS}")
        from_turn = int(turn) if turn.isdigit() else 0
        if turn_sep and from_turn < 1:
            raise ValueError(f"invalid retention {text!r}: auto:P:N needs a first turn N >= 1; valid: {FORMS}")
        p = int(percentile) if percentile.is_integer() else percentile
        return RetentionSpec(RetentionMode.AUTO, p, from_turn if turn_sep else 1)
    raise ValueError(f"invalid retention {text!r}; valid: {FORMS}")


def trace_seconds(name: str, value: object) -> float | None:
    """A trace line's retention in seconds (``None``: none asked), or a ``ValueError``
    saying what the field accepts (the reader adds the file, line and field)."""
    if value is None:
        return None
    if name == "prompt_cache_retention":
        if isinstance(value, str) and value in _OPENAI_VALUES:
            return _OPENAI_VALUES[value]
        raise ValueError(f"must be one of {', '.join(repr(v) for v in _OPENAI_VALUES)}, got {value!r}")
    seconds: float
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"must be seconds (a number) or a duration such as '5m', '1h', got {value!r}")
    if isinstance(value, str):
        found = _DURATION.match(value)
        if found is None:
            raise ValueError(f"must be seconds (a number) or a duration such as '5m', '1h', '24h', got {value!r}")
        seconds = float(found.group(1)) * _UNIT_S[found.group(2)]
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_RETAIN_S:
        raise ValueError(f"must be from 0 to {MAX_RETAIN_S:g} seconds (7 days), got {value!r}")
    return seconds or None


@dataclass(frozen=True, slots=True)
class RetentionCounts:
    """What a replay's ``retain`` calls got, over the whole replay (warm-up included):
    calls, the ones the tenant's cap cut (``CAPPED``) or refused, the tokens asked and
    the tokens retained (the cached blocks of the prompt, within the cap)."""

    calls: int
    capped: int
    refused: int
    asked_tokens: int
    retained_tokens: int
