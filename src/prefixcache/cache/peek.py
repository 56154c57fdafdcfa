"""``PrefixCache.peek``: how much of a prompt ``match`` would find now, changing nothing.

A scheduler (vLLM's) asks how many tokens of a waiting request are cached each time it
considers the request, possibly many times before it runs; only the last answer is
followed by a match. Were each question a match, a request that waits would count as
many lookups and hits, refresh its blocks in every policy and TTL clock (reordering
evictions for everyone else) and pin what it may never use. So a peek searches the
tree as ``match`` does and then forgets it did:

- no pin, no policy told (no ``access_many``), no TTL ``last_access`` moved;
- no counter (not even a caught hash collision) and no event;
- no context root left behind (a root its lookup made is dropped again);
- a probing tier (Redis, a disk reopened after a restart) is asked, outside the lock,
  how many more blocks of the chain it holds, but nothing found is adopted: its
  books, residency and policies stay as they were; the match that follows adopts.

A peek is advice, not a promise: between it and the match the cache may change, and
the match's answer (then the load's) is the one to act on (invariant 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.cache.ledger import Ledger
from prefixcache.cache.loadsteps import plan_probe
from prefixcache.cache.plans import Probe
from prefixcache.hashing import CacheContext, Segment

if TYPE_CHECKING:
    from prefixcache.cache.owner import Owner
    from prefixcache.cache.tiered import TieredPath

__all__ = ["Peek", "in_tree", "peek"]


@dataclass(frozen=True, slots=True)
class Peek:
    """What ``match`` would find now. ``num_blocks`` leading whole blocks, verified against
    the request's tokens; ``probed_blocks`` of them are held only by a probing tier (the
    match adopts them, unless the pool cannot make room for them then). With
    ``partial_blocks``, ``partial_tokens`` more are shared with one cached block after
    them; it is 0 past probed blocks, below which the tree knows nothing.
    ``cached_tokens`` = ``num_blocks * block_size + partial_tokens``, as a match's."""

    num_blocks: int
    cached_tokens: int
    partial_tokens: int = 0
    probed_blocks: int = 0


def peek(
    owner: Owner, io: TieredPath | None, tokens: object, ctx: CacheContext, segments: Sequence[Segment] | None
) -> Peek:
    """The tree's answer under the lock; then, when a tier probes, its answer without it."""
    ahead, probe, epochs = owner.peek(tokens, ctx, segments)
    if probe is None:
        return ahead
    assert io is not None
    n = io.run_probe(probe).blocks
    # NOTE: an epoch bump or a purge meanwhile made what was probed stale: a match then
    # searches the tree again under the new roots, and so does a peek
    again = owner.peek_again(tokens, ctx, segments, epochs)
    if again is not None:
        return again
    if not n:
        return ahead
    blocks = ahead.num_blocks + n
    return Peek(blocks, blocks * owner.ledger.config.block_size, 0, n)


def in_tree(
    ledger: Ledger,
    tokens: object,
    ctx: CacheContext,
    segments: Sequence[Segment] | None,
    *,
    probing: bool,
) -> tuple[Peek, Probe | None]:
    """Under the lock: what the tree holds, as ``match`` searches it (live blocks under the
    current roots only), and the probe to run when a tier may hold more."""
    contexts, books = ledger.contexts, ledger.books
    roots = len(contexts)
    lookup = ledger.lookup(tokens, ctx, segments, probing=probing)
    made_root = len(contexts) > roots
    alive = ledger.alive()
    found = ledger.find(lookup, alive, count=False)
    deepest = found[0]
    _, partial = ledger.partial(lookup, deepest, alive)
    probe = None
    if probing and books is not None and any(t.probes for t in books.tiers):
        probe = plan_probe(ledger, lookup, found, pin=False)
    if made_root:  # NOTE: only a root this lookup made: one that was there stays, as without a peek
        contexts.drop_empty(lookup)
    n = deepest.end // ledger.config.block_size if deepest is not None else 0
    return Peek(n, n * ledger.config.block_size + partial, partial), probe
