"""The commits of writes, run by the lock's owner (``owner.py``) under the cache's lock:
an insert's chain once its bytes are framed and placed, and each job the writer ran.

A chain's commit links the blocks whose bytes are placed (written to a memory tier, or
queued for another), gives back the room of the rest and queues the write-through
copies. A job's commit:

    put done      the block holds it now (and a ``through`` tier queues the next copy);
                  a block that left meanwhile gets the frame deleted again
    put failed    residency rolls back; a block with no copy left is lost (invariant 6)
    moved frame   the copy it came from is deleted (its room was given back when decided)
"""

from __future__ import annotations

from prefixcache.cache.ledger import Ledger
from prefixcache.cache.plans import Chain, Written
from prefixcache.cache.residency import Books
from prefixcache.cache.tree import Block
from prefixcache.storage.queue import FrameSource, Job, JobKind
from prefixcache.storage.transfer import Outcome

__all__ = ["commit_chain", "commit_write"]


def _books(ledger: Ledger) -> Books:
    assert ledger.books is not None
    return ledger.books


# ================================================================ an insert's chain


def commit_chain(ledger: Ledger, chain: Chain, written: Written) -> int:
    """Link the blocks of ``chain`` whose bytes are placed; the tokens stored."""
    books = _books(ledger)
    tiers, frames, landed = books.tiers, written.frames, written.landed
    if written.failed is not None:
        tiers[chain.tiers[landed]].failed_write(written.failed)
    n, queued = landed, 0
    if frames:
        while n < len(chain.blocks) and not tiers[chain.tiers[n]].sync:
            queued += len(frames[n])
            if not books.queue.fits(queued):
                tiers[chain.tiers[n]].counts.dropped()
                break
            n += 1
        layout = ledger.config.kv_layout
        assert layout is not None
        ledger.counters.count_kv_in((chain.end - chain.begin) * layout.bytes_per_token)
    linked = ledger.commit(chain, n)
    for i, (block, k) in enumerate(zip(chain.blocks, chain.tiers, strict=True)):
        if i >= len(linked):
            books.release(k)
            if i < landed:
                books.drop_frame(k, block.key)  # written, but its parent left meanwhile
        elif not tiers[k].sync:
            books.queue_put(block, k, FrameSource(frames[i], len(frames[i])))
    # NOTE: into the tiers' policies deepest first, as into the pools': a parent (which
    # cannot leave before its children) is then never older than its children.
    for block, k in reversed(list(zip(linked, chain.tiers, strict=False))):
        if tiers[k].sync:
            books.commit_held(block, k)
    # NOTE: the copies last: the queue's room went to the blocks that have no other copy
    for i, (block, k) in enumerate(zip(linked, chain.tiers, strict=False)):
        if tiers[k].sync and tiers[k].config.write == "through" and k + 1 < len(tiers):
            ledger.life.copy_down(block, k + 1, frames[i])  # a ``through`` tier copies on at once
    return linked[-1].end - chain.parent.end if linked else 0


# ================================================================ a writer's job


def commit_write(ledger: Ledger, job: Job, outcome: Outcome) -> list[tuple[int, bytes]]:
    """What ``job`` changed; returns the deletes to run before the next job."""
    if job.kind is JobKind.DELETE:
        return []
    books = _books(ledger)
    block = job.ticket
    assert isinstance(block, Block)
    tier = books.tiers[job.tier]
    deletes = [(job.source_tier, job.key)] if job.source_tier >= 0 else []
    if outcome is Outcome.SKIPPED:
        return deletes  # canceled before it ran: its room went back when it was canceled
    res = block.res
    live = not job.canceled and res is not None and bool(res.pending & tier.bit) and books.owner.get(job.key) is block
    if outcome is Outcome.DONE:
        if live:
            books.commit_held(block, job.tier)
            _onward(ledger, block, job)
        elif not _claimed(books, job):
            deletes.append((job.tier, job.key))  # the block left while it was written
        return deletes
    tier.failed_write(outcome)
    if live:
        assert res is not None
        books.release(job.tier)
        books.set(block, res.held, res.pending & ~tier.bit)
        if not (res.held | res.pending) and block.pool is not None:
            ledger.life.lose(block)  # its only copy never landed: gone with what hangs below
    return deletes


def _claimed(books: Books, job: Job) -> bool:
    """Whether another block now owns ``job.key`` in its tier (its own write, queued
    after this one, replaces the frame: deleting it would take that one too)."""
    owner = books.owner.get(job.key)
    res = owner.res if owner is not None else None
    return res is not None and bool((res.held | res.pending) & (1 << job.tier))


def _onward(ledger: Ledger, block: Block, job: Job) -> None:
    """A ``through`` tier passes a block on to the next tier as soon as it holds it.
    NOTE: ``job.source`` was read when the job ran: its frame is in hand, not read here."""
    books = _books(ledger)
    below = job.tier + 1
    if books.tiers[job.tier].config.write != "through" or below >= len(books.tiers) or job.source is None:
        return
    frame = job.source.frame()
    if frame is not None:
        ledger.life.copy_down(block, below, frame)
