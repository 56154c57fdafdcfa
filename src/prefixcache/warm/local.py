"""Warming through this process's engine: the server's model, cache and prefill.

    line ─> prompt_tokens (the server's rendering) ─> peek: all storable blocks cached? ─> skip
                                                        │ no
                                                        v
            Engine.generate(max_tokens=1) ─> match + load the cached prefix, prefill the rest
                                         ─> insert the prompt's KV (as after any request)

One prompt at a time, each waited for until its KV is inserted (``Engine.wait_idle``):
then the next prompt that starts the same way finds it, so a shared prefix is
prefilled once. What was stored is known by asking the cache (``PrefixCache.peek``):
the tree, and the tiers that probe (a disk reopened after a restart, Redis), so a rerun
after an interruption skips what the last run stored, whatever it got to flush; no
side file can say that it is still there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prefixcache.api.prompts import prompt_tokens
from prefixcache.cache import PrefixCache
from prefixcache.engine import Engine, EngineError, Request, SamplingParams
from prefixcache.warm.inputs import BadLine, WarmInputError, WarmItem
from prefixcache.warm.progress import Tally, TierDelta

__all__ = ["Snapshot", "tier_deltas", "warm_engine"]

Snapshot = dict[str, tuple[int, int, int]]  # tier name -> (blocks held, bytes written, writes dropped)
Report = Callable[[Tally, int, str], None]  # after each line: (tally, line, what happened)
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)  # one token: the prefill is what is wanted


def snapshot(cache: PrefixCache) -> Snapshot:
    return {t.name: (t.blocks, t.bytes_written, t.writes_dropped) for t in cache.stats().tiers}


def tier_deltas(cache: PrefixCache, before: Snapshot) -> list[TierDelta]:
    """What each tier gained since ``before`` (flush first: writes still queued are not in it)."""
    bs = cache.config.block_size
    out = []
    for name, (blocks, written, dropped) in snapshot(cache).items():
        held, wrote, lost = before.get(name, (0, 0, 0))
        out.append(TierDelta(name, blocks - held, (blocks - held) * bs, written - wrote, dropped - lost))
    return out


def warm_engine(
    engine: Engine,
    cache: PrefixCache,
    items: Iterable[WarmItem | BadLine],
    tally: Tally,
    report: Report,
    *,
    tenant: str,
    public: bool = False,
    skip_bad: bool = False,
) -> None:
    """Warm every prompt of ``items`` into ``cache`` through ``engine``, adding to ``tally``.
    A prompt the server would refuse (too long for the model, bad token ids) is a
    ``WarmInputError`` naming its line, or is counted as bad with ``skip_bad``."""
    bs = cache.config.block_size
    for item in items:
        if isinstance(item, BadLine):
            tally.bad += 1
            report(tally, item.line, f"bad line skipped: {item.error}")
            continue
        try:
            tokens = prompt_tokens(engine, item.body)
            engine.check_length(len(tokens), GREEDY.max_tokens)
        except (EngineError, ValueError) as exc:
            error = WarmInputError(f"line {item.line}: {exc}")
            if not skip_bad:
                raise error from None
            tally.bad += 1
            report(tally, item.line, f"bad line skipped: {error}")
            continue
        tally.prompts += 1
        report(tally, item.line, _warm_one(engine, cache, tokens, tenant, public, bs, tally))


def _warm_one(
    engine: Engine, cache: PrefixCache, tokens: list[int], tenant: str, public: bool, bs: int, tally: Tally
) -> str:
    ctx = engine.context(tenant)
    storable = len(tokens) // bs * bs  # NOTE: a tier keeps whole blocks; a tail is found only in this process
    if storable == 0:
        tally.short += 1
        return f"{len(tokens)} tokens: shorter than one block ({bs}), nothing to store"
    if public:
        cache.declare_public(tokens, ctx)  # the operator's word: its blocks go to the public pool when stored
    seen = cache.peek(tokens, ctx)
    if seen.cached_tokens >= storable:
        tally.skipped += 1
        tally.cached_tokens += min(seen.cached_tokens, len(tokens))
        return f"{len(tokens)} tokens: already cached, skipped"
    done = engine.generate(Request(tokens, tenant, GREEDY)).result()
    engine.wait_idle()  # NOTE: its KV is inserted after its answer: wait, so the next prompt finds it
    writer = cache.stats().writer
    if writer is not None and writer.queued_bytes * 2 > writer.limit_bytes:
        # NOTE: a full write queue drops writes (a server's requests never wait on a disk);
        # a warm has nobody waiting, so it waits for the slow tiers instead of losing blocks
        cache.flush()
    usage = done.usage
    tally.warmed += 1
    tally.cached_tokens += usage.cached_tokens
    tally.prefilled_tokens += usage.prompt_tokens - usage.cached_tokens
    return f"{len(tokens)} tokens: prefilled {usage.prompt_tokens - usage.cached_tokens}, cached {usage.cached_tokens}"
