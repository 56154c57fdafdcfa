"""The decisions and commits of a probe and of a load, run by the lock's owner
(``owner.py``) under the cache's lock: what to ask a probing tier, what to read from
which tier, and what the reads that came back change (hits, misses, lost blocks,
promotions into tier 0, copies a ``selective`` tier owes the tier below). No bytes
move here; ``tiered.py`` moves them between these steps.
"""

from __future__ import annotations

from prefixcache.cache.ledger import Ledger
from prefixcache.cache.plans import Found, LoadPlan, Probe, Promoted, Promotion
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
    which adopts nothing) the probe holds nothing in the tree."""
    books = _books(ledger)
    deepest, own = found[0], lookup.roots[0]
    if deepest is not None and deepest.root is not own:
        return None  # matched in the public pool: nothing of ours hangs there
    parent: Node = deepest if deepest is not None else own
    bs = ledger.config.block_size
    ends = list(range(parent.end + bs, len(lookup.data) // 4 // bs * bs + 1, bs))
    limit = books.entry_tier(parent)
    tiers = [t.index for t in books.tiers if t.index >= limit and t.probes]
    if not ends or not tiers:
        return None
    keys = lookup.chains[0].many(ends)
    return Probe(lookup, found, parent, ends, keys, tiers, Pin([parent, own]) if pin else None)


def adopt(ledger: Ledger, ctx: CacheContext, probe: Probe, tier: int, n: int) -> Found | None:
    """Take the ``n`` probed blocks tier ``tier`` holds into the tree (their bytes are
    checked against the tokens when loaded, invariant 3). Returns the search to reuse, or
    None when the tree changed and must be searched again."""
    assert probe.pin is not None and probe.parent is not None
    parent, again = probe.parent, None
    if not n:
        again = probe.found
    elif parent.is_root or (parent.pool is not None and not parent.doomed):  # type: ignore[union-attr]
        shared = ledger.tenancy.mode == "shared"
        chain = ledger.plan_chain(probe.lookup, 0, parent, probe.ends[:n], ctx, shared, tiers=False)
        linked = ledger.commit_chain(chain, len(chain.blocks)) if chain is not None else []
        books = _books(ledger)
        for block in reversed(linked):  # deepest first into the tier's policy
            books.adopt(block, tier)
    ledger.life.unpin(probe.pin)  # NOTE: last, so that the root is not dropped as empty before its blocks come
    return again


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
