"""The byte paths of a cache with storage tiers, each in three steps::

    decide   (owner, under the lock)   what to read, write, demote or drop; pins held
    move     (here, no lock)           reads, checks, copies, writes into memory slots
    commit   (owner, under the lock)   residency follows what really happened

A failed or corrupt read shortens the load (invariant 6); a failed write rolls back
residency; a slow or stalled tier costs its own requests' hits, never the lock.
``TieredPath`` holds no lock and no ledger: it moves bytes between the owner's
decisions and hands what happened (``plans.py``: ``Loaded``, ``Promoted``, ``Written``)
to the owner's commits. Writes to slower tiers go through the write queue
(``writer.py``); nothing in ``storage`` calls back up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefixcache.cache.invalidations import Stamp
from prefixcache.cache.kv import KVSource, LoadedKV, as_kv_array
from prefixcache.cache.owner import Owner
from prefixcache.cache.plans import Chain, LoadPlan, Probe, Probed, Promoted, Written
from prefixcache.cache.residency import Books
from prefixcache.cache.tree import Block
from prefixcache.cache.writer import Writer
from prefixcache.hashing import CacheContext
from prefixcache.storage import codec
from prefixcache.storage.base import Frame, TierError
from prefixcache.storage.transfer import Outcome, Transfer

__all__ = ["TieredPath"]


class TieredPath:
    """Probes, loads and inserts with KV, for one cache: the moves between its owner's
    decisions and commits."""

    def __init__(self, owner: Owner, transfer: Transfer, writer: Writer) -> None:
        assert owner.books is not None
        self.owner = owner
        self.books: Books = owner.books  # NOTE: read here only for what never changes (a tier's ``sync``)
        self.transfer = transfer
        self.writer = writer
        self.layout = transfer.layout

    # ================================================================ probe (match)

    def run_probe(self, probe: Probe) -> Probed:
        """What the tiers hold of ``probe``'s chain, then of its ``then`` chain from where
        the first ends (``Probed``)."""
        tier, n = self._held(probe, 0)
        own = probe.then
        if own is None:
            return Probed(tier, n)
        then_tier, then_n = self._held(own, own.after + n)
        return Probed(tier, n, then_tier, then_n)

    def _held(self, probe: Probe, skip: int) -> tuple[int, int]:
        """(tier, n) for the first probed tier holding the ``n >= 1`` keys of ``probe``
        from its ``skip``-th on; (-1, 0) for none."""
        keys = probe.keys[skip:]
        if not keys:
            return -1, 0
        for k in probe.tiers:
            try:
                found = self.transfer.stores[k].contains_prefix(keys)
            except TierError:
                continue  # counted by the store
            if found:
                return k, found
        return -1, 0

    # ================================================================ load

    def load(self, plan: LoadPlan, out: np.ndarray | None) -> LoadedKV:
        """Read the planned blocks; then, after the owner committed the reads, promote what
        came from a slower tier into a memory tier 0 and hand the owner the outcome."""
        owner, path, reads, first, start = self.owner, plan.path, plan.reads, plan.first, plan.start
        try:
            dest = self.transfer.destination(plan.requested - start, out)
            loaded = self.transfer.load(reads, dest)
        except BaseException:
            owner.unpin(plan.pin)
            raise
        promotion = owner.commit_read(plan, loaded)
        frames: list[Frame | None] = [None] * first + loaded.frames  # by index in ``path``
        done = self._promote(path, promotion.promote, frames)
        read_path = path[first:]  # NOTE: reads[i] is read_path[i]'s
        owed = [(read_path[i], k, bytes(loaded.frames[i] or b"")) for i, k in promotion.copies]  # NOTE: while pinned
        owner.commit_promotion(plan, promotion, Promoted(done, frames, owed))
        self.writer.after_call()
        tokens = start + sum(r.use for r in reads[: loaded.good])
        kv = dest if tokens == plan.requested else np.ascontiguousarray(dest[:, :, :, : tokens - start, :])
        return LoadedKV(tokens, kv, promotion.tier_tokens, plan.requested, start)

    def _promote(self, path: list[Block], promote: list[int], frames: Sequence[Frame | None]) -> int:
        """Put the promoted frames into a memory tier 0 (another kind is queued at the
        commit). Returns how many leading ones landed."""
        if not self.books.tiers[0].sync:
            return len(promote)
        done = 0
        for i in promote:
            frame = frames[i]
            if frame is None or self.transfer.put(0, path[i].key, frame) is not Outcome.DONE:
                break
            done += 1
        return done

    # ================================================================ insert

    def insert(
        self, tokens: object, ctx: CacheContext, segments: object, source: KVSource, since: Stamp | None = None
    ) -> int:
        """Store what the cache lacks of ``tokens`` (a published prefix first, when one is
        owed), reading from ``source`` only the range of the new blocks; nothing that a
        purge or bump after ``since`` covers."""
        if not len(tokens):  # type: ignore[arg-type]
            return 0
        since = since if since is not None else self.owner.stamp()  # NOTE: one for both rounds
        stored = 0
        for round_ in range(2):
            chain = self.owner.plan_insert(tokens, ctx, segments, publish=round_ == 0, since=since)
            if chain is None:
                break
            stored += self._write_chain(chain, source)
            if chain.tenants < 0:  # not a published prefix: nothing more to store
                break
        self.writer.after_call()
        return stored

    def _write_chain(self, chain: Chain, source: KVSource) -> int:
        """Cut the chain's range from ``source``, frame each block, write those entering a
        memory tier; then the owner commits (and queues the others)."""
        try:
            frames = self._frames(chain, source)
        except BaseException:
            self.owner.commit_insert(chain, Written([], 0))
            raise
        landed, failed = 0, None
        tiers = self.books.tiers
        for block, k, frame in zip(chain.blocks, chain.tiers, frames, strict=True):
            if not tiers[k].sync:
                break
            outcome = self.transfer.put(k, block.key, frame)
            if outcome is not Outcome.DONE:
                failed = outcome  # NOTE: counted by the commit, under the lock
                break
            landed += 1
        return self.owner.commit_insert(chain, Written(frames, landed, failed))

    def _frames(self, chain: Chain, source: KVSource) -> list[bytes]:
        begin, end = chain.begin, chain.end
        kv = as_kv_array(source.read(begin, end), self.layout, end - begin)
        label = self.layout.dtype
        frames = []
        for block in chain.blocks:
            lo = block.end - block.num_tokens - begin
            frames.append(
                codec.encode(block.key, block.tokens, kv[:, :, :, lo : lo + block.num_tokens, :], dtype=label)
            )
        return frames
