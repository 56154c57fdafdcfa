"""Residency: the ledger's books of which tier holds which block's frame, and the
decisions that move frames between tiers.

::

    tier 0 (memory) : b0 b1 b2 b3          <- new blocks enter the fastest tier their parent is in
        | demote on eviction ("back"), copy at once ("through"), copy once hit N times ("selective")
        v                       ^ promote the loaded path on a hit below tier 0
    tier 1 (disk)   : b0 b1 b2 b3 b4 b5
    tier 2 (redis)  : ...                  <- shared by a fleet: probed for keys no local tree knows

Each block has two masks (``tree.Residency``): ``held`` (tier k holds its frame) and
``pending`` (a write of it to tier k is queued; until it lands, its bytes are read
from the queue). Invariant 4 of design.md (for every k, tiers 0..k together hold every
block's ancestors) is kept over ``held | pending`` by one rule: a block may leave tier k
when it is also in a faster tier, or when no child can be loaded from a faster tier
than the block will be afterwards (``kids`` counts children by the fastest tier they
can be loaded from, so the test is O(tiers)).

Everything here runs under the cache's lock (``owner.py``) and moves no bytes. Room
is counted in frames, one per block. Two store calls are made here, both bookkeeping
of a memory slab (a ``sync`` store), the only store calls a test's guard allows under
the lock (``tests/guard_store.py``): releasing a slot (``delete``) and unnaming one
whose frame a slower tier still has to receive (``detach``: the frame is copied out
after the lock is released, see ``copyouts``). NOTE: both must be atomic with the
decision that makes them: deferred, a new frame of the same key (a new block, or a
promotion) could land in the slab first and be the one deleted. Writes and deletes in
slower tiers go to the write queue, in decision order.

Every change of a block's residency goes through ``Books.set``, which records it as a
``TierEntered`` / ``TierLeft`` event per tier *kind* (a block in two disk tiers has one
disk copy to a router), so that the events replayed are always the books.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from prefixcache.cache.retention import Keeper
from prefixcache.cache.tierbook import TierBook
from prefixcache.cache.tierevents import record_change
from prefixcache.cache.tree import Block, Node
from prefixcache.events import EventLog, RemovalReason, TierLeft
from prefixcache.storage.base import Frame
from prefixcache.storage.queue import FrameSource, Job, JobKind, LazyFrame, WriteQueue, store_copy

__all__ = ["NONE", "Books", "Residency", "TierBook"]

NONE = 1 << 16  # the "fastest tier" of a block held nowhere


def top(mask: int) -> int:
    """The fastest tier in a mask (``NONE`` for none)."""
    return (mask & -mask).bit_length() - 1 if mask else NONE


class Residency:
    """Where a block's KV bytes are, for a cache with storage tiers (``cache/residency.py``).

    ``held`` has bit k set when tier k holds the block's frame, ``pending`` when a write
    of it to tier k is queued (its bytes are then read from the queue); ``kids`` counts
    the children by the fastest tier they can be loaded from, and ``hits`` the loads
    that used the block (the ``selective`` write policy counts them)."""

    __slots__ = ("held", "hits", "kids", "pending")

    def __init__(self) -> None:
        self.held = 0
        self.pending = 0
        self.kids: list[int] | None = None
        self.hits = 0

    @property
    def avail(self) -> int:
        return self.held | self.pending


def masks(block: Block) -> tuple[int, int]:
    """(held, pending) of a block, 0 for one the tiers never saw."""
    res = block.res
    return (res.held, res.pending) if res is not None else (0, 0)


class Books:
    """The residency of every block across the tiers, and the moves between them."""

    def __init__(
        self, tiers: Sequence[TierBook], queue: WriteQueue, frame_bytes: Callable[[int], int], block_size: int = 0
    ) -> None:
        self.tiers = list(tiers)
        self.queue = queue
        self.frame_bytes = frame_bytes  # tokens -> bytes of a frame that holds them
        self.owner: dict[bytes, Block] = {}  # key -> the block whose frames the tiers hold (or will)
        self.copyouts: list[LazyFrame] = []  # detached memory slots to copy out once the lock is released
        self.events: EventLog | None = None  # where residency changes are recorded (the ledger's log)
        self.block_size = block_size  # what an orphan leaving is announced as (a partial tail is never adopted)
        self.keeper: Keeper | None = None  # retained blocks (the ledger's): counted where they are
        kinds: dict[str, int] = {}
        for tier in self.tiers:
            kinds[tier.config.kind] = kinds.get(tier.config.kind, 0) | tier.bit
        self.kinds = list(kinds.items())  # (kind, mask of its tiers), fast to slow

    # ------------------------------------------------------------------ reading the books

    def avail(self, block: Block) -> int:
        res = block.res
        return res.held | res.pending if res is not None else 0

    def fastest(self, block: Block) -> int:
        return top(self.avail(block))

    def entry_tier(self, parent: Node) -> int:
        """The fastest tier a new child of ``parent`` may enter: one holding the parent
        (and so, by invariant 4, all its ancestors)."""
        if parent.is_root:
            return 0
        return min(top(self.avail(parent)), len(self.tiers) - 1)  # type: ignore[arg-type]

    def tier_tokens(self, path: Sequence[Block], partial_tokens: int) -> dict[str, int]:
        out = {t.name: 0 for t in self.tiers}
        for i, block in enumerate(path):
            k = self.fastest(block)
            if k != NONE:
                n = partial_tokens if partial_tokens and i == len(path) - 1 else block.num_tokens
                out[self.tiers[k].name] += n
        return out

    def take_copyouts(self) -> list[LazyFrame]:
        out, self.copyouts = self.copyouts, []
        return out

    # ------------------------------------------------------------------ changing them

    def set(self, block: Block, held: int, pending: int) -> None:
        """The one place residency changes: keeps the parent's ``kids`` and ``owner`` right."""
        res = block.res
        if res is None:
            res = block.res = Residency()
        old, old_held = res.held | res.pending, res.held
        res.held, res.pending = held, pending
        new = held | pending
        if old_held != held and self.events is not None and self.events.capacity:
            # NOTE: announced when the bytes are there (held), not when a write is queued:
            # another server may read a shared tier the moment it hears of a block
            record_change(self.events, self.kinds, block, old_held, held)
        if block.retainer is not None and self.keeper is not None:
            self.keeper.moved(block, 1 | new << 1)
        if new and not old:
            self.owner[block.key] = block
        elif not new and old and self.owner.get(block.key) is block:
            del self.owner[block.key]
        old_top, new_top = top(old), top(new)
        parent = block.parent
        if old_top == new_top or parent.is_root:
            return
        pres = parent.res  # type: ignore[union-attr]
        if pres is None:  # NOTE: a chain is committed deepest first: its parent's turn comes next
            pres = parent.res = Residency()  # type: ignore[union-attr]
        if pres.kids is None:
            pres.kids = [0] * len(self.tiers)
        if old:
            pres.kids[old_top] -= 1
        if new:
            pres.kids[new_top] += 1

    def busy(self, key: bytes, block: Block | None = None) -> bool:
        """Whether tiers hold (or will hold) a frame of ``key`` for a block other than ``block``."""
        owner = self.owner.get(key)
        return owner is not None and owner is not block

    def adopt(self, block: Block, k: int) -> None:
        """Tier ``k`` holds ``block``'s frame (put there by another process, or before a restart)."""
        tier = self.tiers[k]
        if block.key in tier.orphans:
            tier.orphans.discard(block.key)
            tier.policy.access(block.key)
        else:
            tier.policy.insert(block.key, block.num_tokens)
            tier.used += 1
        held, pending = masks(block)
        self.set(block, held | tier.bit, pending & ~tier.bit)

    def commit_held(self, block: Block, k: int) -> None:
        """A write of ``block`` into tier ``k`` (room reserved before) has landed."""
        tier = self.tiers[k]
        held, pending = masks(block)
        if block.key in tier.orphans:  # NOTE: the write replaced a frame of the same key found on open
            tier.orphans.discard(block.key)
            tier.policy.access(block.key)
            tier.used -= 1
        else:
            tier.policy.insert(block.key, block.num_tokens)
        self.set(block, held | tier.bit, pending & ~tier.bit)

    def queue_put(self, block: Block, k: int, source: FrameSource, source_tier: int = -1) -> bool:
        """Queue a write of ``block`` into tier ``k`` (room reserved before): pending from
        now on. False (room given back, counted) when the queue has no room for it."""
        tier = self.tiers[k]
        job = Job(JobKind.PUT, k, block.key, source, ticket=block, source_tier=source_tier)
        if not self.queue.offer(job):
            tier.counts.dropped()
            tier.used -= 1
            return False
        held, pending = masks(block)
        self.set(block, held, pending | tier.bit)
        return True

    def release(self, k: int, n: int = 1) -> None:
        """Give back room reserved in tier ``k`` for writes that did not happen."""
        self.tiers[k].used -= n

    def drop_frame(self, k: int, key: bytes) -> None:
        """Delete a frame no block owns (any more) from tier ``k``: a slot now, a file or
        Redis key by a queued delete (after every write decided before it)."""
        tier = self.tiers[k]
        if tier.sync:
            tier.store.delete(key)
        else:
            self.queue.offer(Job(JobKind.DELETE, k, key))

    def forget(self, block: Block, reason: RemovalReason) -> None:
        """``block`` leaves the cache: its frames go from every tier, queued writes of it
        are canceled (a write already running is undone at its commit)."""
        res = block.res
        if res is None or not (res.held | res.pending):
            return
        if self.owner.get(block.key) is block:
            for tier in self.tiers:
                if res.held & tier.bit:
                    self.drop_frame(tier.index, block.key)
                    tier.policy.remove(block.key)
                    tier.used -= 1
                    tier.counts.removal(reason)
                elif res.pending & tier.bit:
                    self.queue.cancel(tier.index, block.key, block)
                    tier.used -= 1
        self.set(block, 0, 0)

    # ------------------------------------------------------------------ leaving a tier

    def evictable(self, k: int, key: object) -> bool:
        block = self.owner.get(cast(bytes, key))
        if block is None or block.res is None or not block.res.held & (1 << k):
            return True  # an orphan frame
        if block.pins:
            return False
        res = block.res
        avail = res.held | res.pending
        if top(avail) < k:
            return True  # a faster copy stays: every union keeps it
        # NOTE: its fastest copy will be in tier ``after`` (the slower one it is also in,
        # or the next tier, where it is demoted): no child may be faster than that.
        rest = avail & ~(1 << k)
        if not rest and k + 1 == len(self.tiers) and self._retained(block):
            return False  # retained: its last copy stays
        after = top(rest) if rest else min(k + 1, len(self.tiers))
        kids = res.kids
        return kids is None or not any(kids[:after])

    def victim(self, k: int) -> tuple[bytes, Block | None] | None:
        """The next frame tier ``k``'s policy sends away: (key, its block or None for an
        orphan); None when nothing there may leave."""
        found = self.tiers[k].policy.victim(lambda key: self.evictable(k, key))
        if found is None:
            return None
        key = cast(bytes, found)
        block = self.owner.get(key)
        if block is None or block.res is None or not block.res.held & (1 << k):
            return key, None
        return key, block

    def drop_orphan(self, k: int, key: bytes) -> None:
        tier = self.tiers[k]
        tier.orphans.discard(key)
        self.drop_frame(k, key)
        tier.used -= 1
        tier.counts.eviction()
        kind = tier.config.kind
        # NOTE: a publisher may have announced it from its journal (``fleet/journal.py``);
        # not while a block owns the key, or another tier of the kind still holds it
        kept = key in self.owner or any(key in t.orphans for t in self._of(kind))
        if self.events is not None and self.events.capacity and not kept:
            self.events.record(TierLeft(key, self.block_size, kind))

    def orphans(self) -> dict[str, frozenset[bytes]]:
        """The keys of the frames no block owns, by tier kind."""
        out: dict[str, set[bytes]] = {}
        for tier in self.tiers:
            if tier.orphans:
                out.setdefault(tier.config.kind, set()).update(tier.orphans)
        return {kind: frozenset(keys) for kind, keys in out.items()}

    def _of(self, kind: str) -> list[TierBook]:
        return [t for t in self.tiers if t.config.kind == kind]

    def only_copy(self, k: int, block: Block) -> bool:
        res = block.res
        assert res is not None
        return not (res.held | res.pending) & ~(1 << k)

    def leave(self, k: int, block: Block) -> None:
        """``block`` leaves tier ``k`` (it has another copy, or it leaves the cache next)."""
        tier = self.tiers[k]
        res = block.res
        assert res is not None
        self.drop_frame(k, block.key)
        tier.used -= 1
        tier.counts.eviction()
        self.set(block, res.held & ~tier.bit, res.pending)

    def keep(self, k: int, block: Block) -> None:
        """``block`` must stay in tier ``k`` after all (nowhere to go): back in its policy."""
        self.tiers[k].policy.insert(block.key, block.num_tokens)

    def may_demote(self, k: int, block: Block) -> bool:
        """Whether ``block``'s only copy, in tier ``k``, goes down to tier ``k + 1`` rather
        than out of the cache: there is a tier below, the queue can take the frame, and
        (``selective``) the block was hit often enough or must stay for its children."""
        if k + 1 >= len(self.tiers) or not self.queue.fits(self.frame_bytes(block.num_tokens)):
            return False
        config = self.tiers[k].config
        res = block.res
        assert res is not None
        return (
            config.write != "selective"
            or res.hits >= config.write_after_hits
            or bool(block.children)
            or self._retained(block)
        )

    def _retained(self, block: Block) -> bool:
        return block.retainer is not None and self.keeper is not None and self.keeper.holds(block)

    def demote(self, k: int, block: Block) -> bool:
        """Move ``block``'s only copy from tier ``k`` down to ``k + 1`` (room reserved there
        by the caller): pending below at once, its frame read out of tier ``k`` after the
        lock is released (a memory slot by the deciding thread, see ``copyouts``; a file
        or a key by the writer, which deletes it there once the write is done). False
        when the frame cannot go down: the block then has no copy left (the caller
        removes it)."""
        tier, below = self.tiers[k], self.tiers[k + 1]
        res = block.res
        assert res is not None
        size = self.frame_bytes(block.num_tokens)
        read: Callable[[], Frame | None] | None
        if tier.sync:
            read = tier.store.detach(block.key)  # None only if the slot is gone behind the books' back
            source: FrameSource = LazyFrame(read or _nothing, size)
            if read is not None:
                self.copyouts.append(source)  # type: ignore[arg-type]
        else:
            read, source = _nothing, store_copy(tier.store, block.key, size)
        tier.used -= 1
        tier.counts.eviction()
        self.set(block, res.held & ~tier.bit, res.pending)
        job = Job(JobKind.PUT, k + 1, block.key, source, ticket=block, source_tier=-1 if tier.sync else k)
        if read is None or not self.queue.offer(job):
            below.counts.dropped()
            below.used -= 1
            if not tier.sync:
                self.drop_frame(k, block.key)
            return False
        self.set(block, res.held, res.pending | below.bit)
        below.counts.demotion()
        return True


def _nothing() -> Frame | None:
    return None
