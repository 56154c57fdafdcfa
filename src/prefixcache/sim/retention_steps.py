"""The replay's retain step: after a request's access, retain its prompt in the cache.

Only the ``PrefixCache`` models retention (its ``Keeper``: deadlines, per-tenant caps);
the compiled kernel does not, so ``engines.native_unsupported`` sends every
configuration with retention to the Python engine, whose virtual clock (the trace's
timestamps) drives the deadlines.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.cache import PrefixCache
from prefixcache.hashing import CacheContext
from prefixcache.sim.retention import MAX_RETAIN_S, RetentionCounts, RetentionSpec
from prefixcache.sim.sessions import RetentionPlan
from prefixcache.sim.traces import Request

__all__ = ["Retainer"]


class Retainer:
    """Retains each request's prompt for as long as ``spec`` says, charged to the
    request's tenant, and counts what the calls got."""

    __slots__ = ("_asked", "_cache", "_calls", "_capped", "_plan", "_refused", "_retained", "_unit")

    def __init__(self, cache: PrefixCache, spec: RetentionSpec, block_size: int, unit: int = 1) -> None:
        """``block_size``: the trace's blocks (sessions chain on them); ``unit``: tokens a
        cache token stands for (a pre-hashed trace's native block size, else 1)."""
        self._cache = cache
        self._plan = RetentionPlan(spec, block_size)
        self._unit = unit
        self._calls = self._capped = self._refused = self._asked = self._retained = 0

    def after(self, req: Request, prompt: Sequence[int], ctx: CacheContext) -> None:
        """``prompt`` (the cache's tokens: a pre-hashed trace's dense block ids) was just
        accessed at ``req``'s time: retain it if the plan asks."""
        seconds = self._plan.seconds(req)
        if seconds is None:
            return
        got = self._cache.retain(prompt, ctx, min(seconds, MAX_RETAIN_S))
        self._calls += 1
        # NOTE: the outcome's enum is internal to the cache; its values are its API (a header)
        self._capped += got.outcome == "capped"
        self._refused += got.outcome == "refused"
        self._asked += req.input_length
        self._retained += min(got.tokens * self._unit, req.input_length)

    def counts(self) -> RetentionCounts:
        return RetentionCounts(self._calls, self._capped, self._refused, self._asked, self._retained)
