"""The engine's stores are stamped before its match: a purge or an epoch bump while a
request computes is final (issue 39, finding 9: before, the request stored the purged
prefix back when it ended, every token of it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from engine_support import engine, model, tiered_cache
from prefixcache.cache import Match, PrefixCache
from prefixcache.engine import Request, SamplingParams
from prefixcache.hashing import CacheContext

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class InvalidatedMidRequest(PrefixCache):
    """A cache that runs ``then`` right after the first match: the request has its
    stamp and its match, and its prefill and stores are still ahead."""

    then: Any = None
    ctx: CacheContext | None = None

    def match(self, tokens: Any, ctx: CacheContext, segments: Sequence[Any] | None = None) -> Match:
        found = super().match(tokens, ctx, segments)
        then, self.then, self.ctx = self.then, None, ctx
        if then is not None:
            then(self, ctx)
        return found


@pytest.mark.parametrize("how", ["purge", "bump_epoch"])
def test_a_request_in_flight_does_not_store_back_what_was_invalidated(tmp_path: Path, how: str) -> None:
    lm = model()
    plain = tiered_cache(lm, tmp_path)
    cache = InvalidatedMidRequest(plain.config)
    plain.close()
    prompt = list(engine(lm).tokenize_text("The garden shed holds rakes, hoes and spades. " * 12))
    assert len(prompt) >= 100
    cache.then = (lambda c, ctx: c.purge(ctx.tenant)) if how == "purge" else (lambda c, ctx: c.bump_epoch(ctx.model))
    eng = engine(lm, cache)
    try:
        done = eng.generate(Request(prompt, "acme", GREEDY)).result(timeout=120)
    finally:
        eng.close()
    assert done.usage.cached_tokens == 0 and cache.then is None and cache.ctx is not None
    with cache.match(prompt, cache.ctx) as m:
        assert m.cached_tokens == 0  # before the fix: every full block of the prompt was back
    assert cache.stats().voided_tokens >= len(prompt) // 16 * 16
    cache.close()
