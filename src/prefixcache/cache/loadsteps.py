"""The decisions and commits of a probe and of a load, run by the lock's owner
(``owner.py``) under the cache's lock: what to ask a probing tier, what to read from
which tier, and what the reads that came back change (hits, misses, lost blocks,
promotions into tier 0, copies a ``selective`` tier owes the tier below). No bytes
move here; ``tiered.py`` moves them between these steps.
"""

from __future__ import annotations

from prefixcache.cache.ledger import Ledger
from prefixcache.cache.plans import Found, LoadPlan, Probe, Probed, Promoted, Promotion
from prefixcache.cache.residency import NONE, Books
from prefixcache.cache.tree import Block, Lookup, Node, Pin, path_to
from prefixcache.hashing import CacheContext
from prefixcache.storage.queue import FrameSource
from prefixcache.storage.transfer import Loaded, Read

__all__ = ["adopt", "commit_promotion", "commit_read", "plan_load", "plan_probe"]


def _books(ledger: Ledger) -> Books:
    assert ledger.books is not None
    return ledger.books


# ================================================================ probe (match)


def plan_probe(ledger: Ledger, lookup: Lookup, found: Found, *, pin: bool = True) -> Probe | None:
    """The keys of this request's chain beyond what the tree holds, and the tiers to ask
    for them (Redis, or a disk reopened after a restart: keys are the same in every
    process, invariant 2). None when there is nothing to ask. Without ``pin`` (a peek,
    which adopts nothing) the probe holds nothing in the tree.

    A match on the request's own chain is continued on it. Otherwise (no match, or a
    published prefix) the public chain is asked first, which the lookup carries whenever
    a tier probes (published blocks outlive the tree that published them: a restart, a
    ``prefixcache warm``, another server on the same Redis), then the request's own
    chain from where the public one ends (``Probe.then``)."""
    deepest = found[0]
    which = 0 if deepest is None else _chain_of(lookup, deepest)
    if which < 0:
        return None
    if which == 0 and deepest is not None:
        return _probe_chain(ledger, lookup, found, 0, deepest, pin)
    own = _probe_chain(ledger, lookup, found, 0, None, pin)
    if own is not None and deepest is not None:
        own.after = deepest.end // ledger.config.block_size  # the public match's blocks
    public = _probe_chain(ledger, lookup, found, 1, deepest, pin) if len(lookup.roots) > 1 else None
    if public is None:
        return own
    public.then = own
    return public


def _chain_of(lookup: Lookup, block: Block) -> int:
    return next((i for i, root in enumerate(lookup.roots) if block.root is root), -1)


def _probe_chain(
    ledger: Ledger, lookup: Lookup, found: Found, which: int, deepest: Block | None, pin: bool
) -> Probe | None:
    books = _books(ledger)
    root = lookup.roots[which]
    parent: Node = deepest if deepest is not None else root
    bs = ledger.config.block_size
    ends = list(range(parent.end + bs, len(lookup.data) // 4 // bs * bs + 1, bs))
    limit = books.entry_tier(parent)
    tiers = [t.index for t in books.tiers if t.index >= limit and t.probes]
    if not ends or not tiers:
        return None
    keys = lookup.chains[which].many(ends)
    return Probe(lookup, found, parent, ends, keys, tiers, Pin([parent, root]) if pin else None, which)


def adopt(ledger: Ledger, ctx: CacheContext, probe: Probe, probed: Probed) -> Found | None:
    """Take the probed blocks the tiers hold into the tree (their bytes are checked
    against the tokens when loaded, invariant 3): ``probe``'s chain's, then its ``then``
    chain's under them. Returns the search to reuse, or None when the tree changed and
    must be searched again. Every pin the probes took is let go."""
    assert probe.parent is not None
    again: Found | None = probe.found if not probed.blocks else None
    last: Node | None = probe.parent
    if probed.n:
        last = _adopt_chain(ledger, ctx, probe, probe.parent, 0, probed.n, probed.tier)
    own = probe.then
    if own is not None and probed.then_n and last is not None:
        # NOTE: under the deepest public block there is one, else under the own root
        parent = last if not last.is_root else own.parent
        assert parent is not None
        skip = own.after + probed.n
        _adopt_chain(ledger, ctx, own, parent, skip, probed.then_n, probed.then_tier)
    step: Probe | None = probe
    while step is not None:  # NOTE: last, so that a root is not dropped as empty before its blocks come
        assert step.pin is not None
        ledger.life.unpin(step.pin)
        step = step.then
    return again


def _adopt_chain(
    ledger: Ledger, ctx: CacheContext, probe: Probe, parent: Node, skip: int, n: int, tier: int
) -> Node | None:
    """Link ``n`` blocks of ``probe``'s chain from its ``skip``-th key under ``parent``,
    held by ``tier``; the deepest of them, or None when not all could be linked."""
    if not (parent.is_root or (parent.pool is not None and not parent.doomed)):  # type: ignore[union-attr]
        return None
    # NOTE: blocks of the public chain are the public pool's, as when published; in
    # shared mode a block stays its storing tenant's (``plan_chain``)
    public = probe.which > 0 or ledger.tenancy.mode == "shared"
    ends = probe.ends[skip : skip + n]
    # NOTE: a prefix purge reaches only the frames the tree knows: a probed frame under one
    # may predate it (a restart, another server), so the chain is cut before it
    names, data = (probe.lookup.roots[probe.which].ctx_name,), probe.lookup.data
    cut = ledger.life.invalid.purged_from(names, data)
    if cut is not None:
        ends = [end for end in ends if 4 * end < cut]  # ascending: the blocks before the purged prefix
    if not ends:
        return None
    chain = ledger.plan_chain(probe.lookup, probe.which, parent, ends, ctx, public, tiers=False)
    linked = ledger.commit_chain(chain, len(chain.blocks)) if chain is not None else []
    books = _books(ledger)
    for block in reversed(linked):  # deepest first into the tier's policy
        books.adopt(block, tier)
    return linked[-1] if len(linked) == n else None


# ================================================================ load


def plan_load(ledger: Ledger, block: Block | None, partial_tokens: int, first: int = 0) -> LoadPlan:
    """Where each block of the path to ``block`` from its ``first`` on is read from, and a
    pin on the whole path while it is read (so no frame of it is freed meanwhile, and the
    unread ancestors a promotion builds on stay put)."""
    path = path_to(block) if block is not None else []
    first = min(first, len(path))
    books = _books(ledger)
    reads: list[Read] = []
    requested = start = 0
    last = len(books.tiers) - 1
    for i, b in enumerate(path):
        use = partial_tokens if partial_tokens and i == len(path) - 1 else b.num_tokens
        requested += use
        if i < first:
            start += use
            continue
        k = books.fastest(b)
        if k == NONE or len(reads) < i - first:
            continue
        assert b.res is not None
        keep = k > 0 or (k < last and books.tiers[k].config.write == "selective")  # promoted, copied down
        reads.append(Read(b.key, b.tokens, use, k, not b.res.held & (1 << k), keep))
    return LoadPlan(path, reads, requested, Pin(path), first, start)


def commit_read(ledger: Ledger, plan: LoadPlan, loaded: Loaded) -> Promotion:
    """What the reads change: hits, misses and latency counted, policies told, a lost
    block dropped; then the promotion into tier 0 and the copies down, decided (room
    reserved). Only the blocks read are counted, touched, promoted or copied."""
    read_path = plan.path[plan.first :]  # NOTE: reads[i] is read_path[i]'s
    tier_tokens = _count(ledger, read_path, plan.reads, loaded)
    promote = _plan_promotion(ledger, plan.path, plan.first, loaded.good)
    copies = _plan_copies(ledger, read_path, plan.reads, loaded.good)
    return Promotion(tier_tokens, promote, copies)


def commit_promotion(ledger: Ledger, plan: LoadPlan, promotion: Promotion, promoted: Promoted) -> None:
    """The promoted blocks that landed (or were queued) hold tier 0, the others give their
    room back; the owed copies are queued; the path is unpinned."""
    books = _books(ledger)
    _commit_promotion(books, plan.path, promotion.promote, promoted)
    for block, k, data in promoted.owed:
        books.queue_put(block, k, FrameSource(data, len(data)))
    ledger.life.unpin(plan.pin)


def _count(ledger: Ledger, path: list[Block], reads: list[Read], loaded: Loaded) -> dict[str, int]:
    """Hits, misses and latency per tier; policies told of the hits; a block a tier
    failed to give back is lost, with what hangs below it."""
    tiers, good = _books(ledger).tiers, loaded.good
    tier_tokens = {t.name: 0 for t in tiers}
    for k, secs in loaded.seconds.items():
        tiers[k].counts.seconds(secs)
    touched: dict[int, list[bytes]] = {}
    for read, block in zip(reads[:good], path, strict=False):
        tier = tiers[read.tier]
        tier.counts.hit()
        tier_tokens[tier.name] += read.use
        assert block.res is not None
        block.res.hits += 1
        if not read.queued:
            touched.setdefault(read.tier, []).append(block.key)
    for k, keys in touched.items():
        tiers[k].policy.access_many(reversed(keys))  # deepest first: ancestors end up more recent
    if good < len(reads):
        read, block = reads[good], path[good]
        tiers[read.tier].counts.miss(loaded.failure)
        res = block.res
        # NOTE: a queued frame that could not be read is the writer's to settle (its job fails)
        if not read.queued and res is not None and res.held & (1 << read.tier) and block.pool is not None:
            ledger.life.lose(block)
    return tier_tokens


def _plan_promotion(ledger: Ledger, path: list[Block], first: int, good: int) -> list[int]:
    """The loaded blocks (``path[first:first + good]``) that go up into tier 0,
    root-most first, while room can be made. An unread ancestor not in tier 0 stops
    it: nothing may enter tier 0 above a parent that is not there (invariant 4)."""
    books = _books(ledger)
    top = books.tiers[0]
    promote = []
    for i in range(first + good):
        if books.avail(path[i]) & top.bit:
            continue
        if i < first or ledger.life.tier_room(0, 1) < 1:
            break
        top.used += 1
        promote.append(i)
    return promote


def _plan_copies(ledger: Ledger, path: list[Block], reads: list[Read], good: int) -> list[tuple[int, int]]:
    """``selective`` tiers: the loaded blocks hit often enough to be copied down now."""
    books = _books(ledger)
    tiers = books.tiers
    copies = []
    for i in range(good):
        read, res = reads[i], path[i].res
        below, config = read.tier + 1, tiers[read.tier].config
        assert res is not None
        owed = (
            config.write == "selective"
            and not read.queued
            and res.hits >= config.write_after_hits
            and below < len(tiers)
            and not books.avail(path[i]) & (1 << below)
        )
        if not owed:
            continue
        if path[i].key in tiers[below].orphans:  # already there, from before a restart
            books.adopt(path[i], below)
        elif books.queue.fits(books.frame_bytes(path[i].num_tokens)) and ledger.life.tier_room(below, 1):
            tiers[below].used += 1
            copies.append((i, below))
    return copies


def _commit_promotion(books: Books, path: list[Block], promote: list[int], promoted: Promoted) -> None:
    top, done, frames = books.tiers[0], promoted.done, promoted.frames
    if top.sync:  # NOTE: deepest first into the policy, as a chain's blocks are
        for j in reversed(range(len(promote))):
            if j >= done:
                books.release(0)
            else:
                books.commit_held(path[promote[j]], 0)
                top.counts.promotion()
        return
    for j, i in enumerate(promote):
        block = path[i]
        if j >= done:
            books.release(0)
        elif (frame := frames[i]) is not None and books.queue_put(block, 0, FrameSource(bytes(frame), len(frame))):
            top.counts.promotion()
        else:
            if frame is None:
                books.release(0)
            done = j  # NOTE: the rest would hang under a block that is not there
