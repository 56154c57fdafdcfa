"""Retention: blocks a client asked to keep (OpenAI's ``prompt_cache_retention``,
Anthropic's ``cache_control``), until a deadline each later hit pushes on, within a cap
of the tenant's own.

::

    retain(span, tenant, seconds)          each block of the span: deadline = now + seconds
        |                                  (a hit later: deadline = max(deadline, now + seconds))
        v
    the tenant's book, per level           level 0: the cache (its capacity in tokens);
    ("cache", then each tier)              level 1 + k: tier k (what it holds of the block)
        |  past the tenant's cap in a level: its own oldest retention there expires first
        v
    eviction                               a retained block is never a victim of the cache's
                                           pools, never leaves the last tier, and goes down a
                                           tier (never out) from a faster one

A retained block still goes for the reasons that are not pressure: an epoch bump, a
purge, a TTL, a lost frame. Retention never moves bytes and runs, as the rest of the
ledger, under the cache's lock.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["MAX_RETAIN_S", "RetainOutcome", "RetainSpan", "Retained"]

MAX_RETAIN_S = 7 * 24 * 3600.0  # the longest retention a span may ask for (an API's longest is 24 h)


@dataclass(frozen=True, slots=True)
class RetainSpan:
    """Keep a prompt's first ``tokens`` tokens cached for ``seconds`` (whole blocks of it:
    a span ending inside a block keeps the blocks before it)."""

    tokens: int
    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"a retained span's tokens must be an integer >= 0, got {self.tokens!r}")
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or not 0 < s <= MAX_RETAIN_S:
            raise ValueError(f"a retained span's seconds must be in (0, {MAX_RETAIN_S:g}], got {s!r}")


class RetainOutcome(enum.StrEnum):
    """What a request's retention got (the server says it in a response header)."""

    NONE = "none"  # nothing asked
    RETAINED = "retained"  # every cached block of every span
    CAPPED = "capped"  # the tenant's cap cut a span (its own older retention expired first)
    REFUSED = "refused"  # the tenant's cap is zero: served without retention


@dataclass(frozen=True, slots=True)
class Retained:
    """What one ``retain`` call did: the tokens now retained (of whole blocks) and how."""

    tokens: int
    outcome: RetainOutcome
