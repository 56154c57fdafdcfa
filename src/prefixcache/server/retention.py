"""What a generation route does with the retention a client asks for (OpenAI's
``prompt_cache_retention``, Anthropic's ``cache_control``): the spans it passes to the
engine, and the header that tells the client what its retention got.

A tenant whose cap is zero (or a server without a cache) is served without retention,
and the header says ``refused``: never an error (issue 41).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.cache.retention import RetainOutcome, RetainSpan
from prefixcache.engine import Engine

__all__ = ["RETENTION_HEADER", "Asked", "asked"]

RETENTION_HEADER = "x-prefixcache-retention"


@dataclass(frozen=True, slots=True)
class Asked:
    """A request's retention as the route passes it on: the spans for the engine (none
    without a cache) and the header's value before the answer is known."""

    spans: tuple[RetainSpan, ...]
    outcome: RetainOutcome

    def headers(self, final: RetainOutcome | None = None) -> dict[str, str]:
        """The response header (none when nothing was asked); ``final``: the engine's
        outcome when the answer is whole (a stream's headers go out before it)."""
        if self.outcome is RetainOutcome.NONE:
            return {}
        outcome = final if final is not None and self.outcome is not RetainOutcome.REFUSED else self.outcome
        return {RETENTION_HEADER: outcome.value}


def asked(engine: Engine, tenant: str, spans: Sequence[RetainSpan]) -> Asked:
    """The retention of a request of ``tenant`` asking for ``spans``."""
    if not spans:
        return Asked((), RetainOutcome.NONE)
    cache = engine.cache
    if cache is None:
        return Asked((), RetainOutcome.REFUSED)
    # NOTE: a refused tenant's spans still go to the engine: the cache refuses them there
    # and counts the refusal (``prefixcache_retention_refused_total``)
    outcome = RetainOutcome.REQUESTED if cache.may_retain(tenant) else RetainOutcome.REFUSED
    return Asked(tuple(spans), outcome)
