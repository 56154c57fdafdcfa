"""The byte paths of a cache with storage tiers, each in three steps::

    decide   (ledger, under the lock)   what to read, write, demote or drop; pins held
    move     (transfer, no lock)        reads, checks, copies, writes into memory slots
    commit   (ledger, under the lock)   residency follows what really happened

A failed or corrupt read shortens the load (invariant 6); a failed write rolls back
residency; a slow or stalled tier costs its own requests' hits, never the lock.
Writes to slower tiers go through the write queue (``writer.py``); nothing in
``storage`` calls back up.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from prefixcache.cache.kv import KVSource, LoadedKV, as_kv_array
from prefixcache.cache.ledger import Ledger
from prefixcache.cache.plans import Chain, Found, LoadPlan, Probe
from prefixcache.cache.residency import NONE, Books
from prefixcache.cache.tree import Block, Lookup, Node, Pin, path_to
from prefixcache.cache.writer import Writer, count_failed_write, fill
from prefixcache.hashing import CacheContext
from prefixcache.storage import codec
from prefixcache.storage.base import Frame, TierError
from prefixcache.storage.queue import FrameSource
from prefixcache.storage.transfer import Outcome, Read, Transfer

__all__ = ["TieredPath"]


class TieredPath:
    """Probes, loads and inserts with KV, for one cache."""

    def __init__(self, lock: threading.RLock, ledger: Ledger, transfer: Transfer, writer: Writer) -> None:
        assert ledger.books is not None
        self.lock = lock
        self.ledger = ledger
        self.books: Books = ledger.books
        self.transfer = transfer
        self.writer = writer
        self.layout = transfer.layout

    # ================================================================ probe (match)

    def plan_probe(self, lookup: Lookup, found: Found, *, pin: bool = True) -> Probe | None:
        """Under the lock: the keys of this request's chain beyond what the tree holds, and
        the tiers to ask for them (Redis, or a disk reopened after a restart: keys are the
        same in every process, invariant 2). None when there is nothing to ask. Without
        ``pin`` (a peek, which adopts nothing) the probe holds nothing in the tree."""
        books = self.books
        deepest, own = found[0], lookup.roots[0]
        if deepest is not None and deepest.root is not own:
            return None  # matched in the public pool: nothing of ours hangs there
        parent: Node = deepest if deepest is not None else own
        bs = self.ledger.config.block_size
        ends = list(range(parent.end + bs, len(lookup.data) // 4 // bs * bs + 1, bs))
        limit = books.entry_tier(parent)
        tiers = [t.index for t in books.tiers if t.index >= limit and t.probes]
        if not ends or not tiers:
            return None
        return Probe(found, parent, ends, lookup.chains[0].many(ends), tiers, Pin([parent, own]) if pin else None)

    def run_probe(self, probe: Probe) -> tuple[int, int]:
        """No lock: (tier, n) for the first probed tier holding the ``n >= 1`` leading keys."""
        for k in probe.tiers:
            try:
                found = self.transfer.stores[k].contains_prefix(probe.keys)
            except TierError:
                continue  # counted by the store
            if found:
                return k, found
        return -1, 0

    def adopt(self, lookup: Lookup, ctx: CacheContext, probe: Probe, tier: int, n: int) -> Found | None:
        """Under the lock: take the probed blocks into the tree (their bytes are checked
        against the tokens when loaded, invariant 3). Returns the search to reuse, or
        None when the tree changed and must be searched again."""
        ledger = self.ledger
        assert probe.pin is not None and probe.parent is not None
        parent, again = probe.parent, None
        if not n:
            again = probe.found
        elif parent.is_root or (parent.pool is not None and not parent.doomed):  # type: ignore[union-attr]
            shared = ledger.tenancy.mode == "shared"
            chain = ledger.plan_chain(lookup, 0, parent, probe.ends[:n], ctx, shared, tiers=False)
            linked = ledger.commit_chain(chain, len(chain.blocks)) if chain is not None else []
            for block in reversed(linked):  # deepest first into the tier's policy
                self.books.adopt(block, tier)
        ledger.unpin(probe.pin)  # NOTE: last, so that the root is not dropped as empty before its blocks come
        return again

    # ================================================================ load

    def plan_load(self, block: Block | None, partial_tokens: int, first: int = 0) -> LoadPlan:
        """Under the lock: where each block of the path to ``block`` from its ``first`` on
        is read from, and a pin on the whole path while it is read (so no frame of it is
        freed meanwhile, and the unread ancestors a promotion builds on stay put)."""
        path = path_to(block) if block is not None else []
        first = min(first, len(path))
        books = self.books
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

    def load(self, plan: LoadPlan, out: np.ndarray | None) -> LoadedKV:
        """No lock, then the commits: read the planned blocks; promote what came from a
        slower tier into tier 0; copy down what ``selective`` tiers now owe. Only the
        blocks read are counted, touched, promoted or copied."""
        path, reads, first, start = plan.path, plan.reads, plan.first, plan.start
        read_path = path[first:]  # NOTE: reads[i] is read_path[i]'s
        try:
            dest = self.transfer.destination(plan.requested - start, out)
            loaded = self.transfer.load(reads, dest)
        except BaseException:
            with self.lock:
                self.ledger.unpin(plan.pin)
            raise
        with self.lock:
            tier_tokens = self._count(read_path, reads, loaded.good, loaded.failure, loaded.seconds)
            promote = self._plan_promotion(path, first, loaded.good)
            copies = self._plan_copies(read_path, reads, loaded.good)
            copyouts = self.books.take_copyouts()
        fill(copyouts)
        frames: list[Frame | None] = [None] * first + loaded.frames  # by index in ``path``
        done = self._promote(path, promote, frames)
        owed = [(read_path[i], k, bytes(loaded.frames[i] or b"")) for i, k in copies]  # NOTE: while pinned
        with self.lock:
            self._commit_promotion(path, promote, done, frames)
            for block, k, data in owed:
                self.books.queue_put(block, k, FrameSource(data, len(data)))
            self.ledger.unpin(plan.pin)
            copyouts = self.books.take_copyouts()
        fill(copyouts)
        self.writer.after_call()
        tokens = start + sum(r.use for r in reads[: loaded.good])
        kv = dest if tokens == plan.requested else np.ascontiguousarray(dest[:, :, :, : tokens - start, :])
        return LoadedKV(tokens, kv, tier_tokens, plan.requested, start)

    def _count(
        self, path: list[Block], reads: list[Read], good: int, failure: str | None, seconds: dict[int, float]
    ) -> dict[str, int]:
        """Hits, misses and latency per tier; policies told of the hits; a block a tier
        failed to give back is lost, with what hangs below it."""
        tiers = self.books.tiers
        tier_tokens = {t.name: 0 for t in tiers}
        for k, secs in seconds.items():
            tiers[k].latency.observe(secs)
        touched: dict[int, list[bytes]] = {}
        for read, block in zip(reads[:good], path, strict=False):
            tier = tiers[read.tier]
            tier.hits += 1
            tier_tokens[tier.name] += read.use
            assert block.res is not None
            block.res.hits += 1
            if not read.queued:
                touched.setdefault(read.tier, []).append(block.key)
        for k, keys in touched.items():
            tiers[k].policy.access_many(reversed(keys))  # deepest first: ancestors end up more recent
        if good < len(reads):
            read, block = reads[good], path[good]
            tiers[read.tier].misses += 1
            tiers[read.tier].errors[failure or "missing"] += 1
            res = block.res
            # NOTE: a queued frame that could not be read is the writer's to settle (its job fails)
            if not read.queued and res is not None and res.held & (1 << read.tier) and block.pool is not None:
                self.ledger.lose(block)
        return tier_tokens

    def _plan_promotion(self, path: list[Block], first: int, good: int) -> list[int]:
        """The loaded blocks (``path[first:first + good]``) that go up into tier 0,
        root-most first, while room can be made. An unread ancestor not in tier 0 stops
        it: nothing may enter tier 0 above a parent that is not there (invariant 4)."""
        books, top = self.books, self.books.tiers[0]
        promote = []
        for i in range(first + good):
            if books.avail(path[i]) & top.bit:
                continue
            if i < first or self.ledger.tier_room(0, 1) < 1:
                break
            top.used += 1
            promote.append(i)
        return promote

    def _plan_copies(self, path: list[Block], reads: list[Read], good: int) -> list[tuple[int, int]]:
        """``selective`` tiers: the loaded blocks hit often enough to be copied down now."""
        books, tiers = self.books, self.books.tiers
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
            elif self.writer.queue.fits(books.frame_bytes(path[i].num_tokens)) and self.ledger.tier_room(below, 1):
                tiers[below].used += 1
                copies.append((i, below))
        return copies

    def _promote(self, path: list[Block], promote: list[int], frames: Sequence[Frame | None]) -> int:
        """No lock: put the promoted frames into a memory tier 0 (another kind is queued at
        the commit). Returns how many leading ones landed."""
        if not self.books.tiers[0].sync:
            return len(promote)
        done = 0
        for i in promote:
            frame = frames[i]
            if frame is None or self.transfer.put(0, path[i].key, frame) is not Outcome.DONE:
                break
            done += 1
        return done

    def _commit_promotion(
        self, path: list[Block], promote: list[int], done: int, frames: Sequence[Frame | None]
    ) -> None:
        books, top = self.books, self.books.tiers[0]
        if top.sync:  # NOTE: deepest first into the policy, as a chain's blocks are
            for j in reversed(range(len(promote))):
                if j >= done:
                    books.release(0)
                else:
                    books.commit_held(path[promote[j]], 0)
                    top.promotions += 1
            return
        for j, i in enumerate(promote):
            block = path[i]
            if j >= done:
                books.release(0)
            elif (frame := frames[i]) is not None and books.queue_put(block, 0, FrameSource(bytes(frame), len(frame))):
                top.promotions += 1
            else:
                if frame is None:
                    books.release(0)
                done = j  # NOTE: the rest would hang under a block that is not there

    # ================================================================ insert

    def insert(self, tokens: object, ctx: CacheContext, segments: object, source: KVSource) -> int:
        """Store what the cache lacks of ``tokens`` (a published prefix first, when one is
        owed), reading from ``source`` only the range of the new blocks."""
        ledger, stored = self.ledger, 0
        for round_ in range(2):
            with self.lock:
                lookup = ledger.lookup(tokens, ctx, segments)
                if not lookup.data:
                    return 0
                chain = ledger.publish(lookup, ctx, tiers=True) if round_ == 0 and ledger.publisher.active else None
                published = chain is not None
                if chain is None:
                    chain = ledger.extend(lookup, ctx, None, tiers=True)
                copyouts = self.books.take_copyouts()
            fill(copyouts)
            if chain is None:
                break
            stored += self._write_chain(chain, source)
            if not published:
                break
        self.writer.after_call()
        return stored

    def _write_chain(self, chain: Chain, source: KVSource) -> int:
        """No lock: cut the chain's range from ``source``, frame each block, write those
        entering a memory tier; then commit (the others are queued there)."""
        try:
            frames = self._frames(chain, source)
        except BaseException:
            with self.lock:
                self._commit_chain(chain, [], 0)
            raise
        landed = 0
        tiers = self.books.tiers
        for block, k, frame in zip(chain.blocks, chain.tiers, frames, strict=True):
            if not tiers[k].sync:
                break
            outcome = self.transfer.put(k, block.key, frame)
            if outcome is not Outcome.DONE:
                count_failed_write(tiers[k], outcome)
                break
            landed += 1
        with self.lock:
            stored = self._commit_chain(chain, frames, landed)
            copyouts = self.books.take_copyouts()
        fill(copyouts)
        return stored

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

    def _commit_chain(self, chain: Chain, frames: list[bytes], landed: int) -> int:
        """Under the lock: link the blocks whose bytes are placed (written to a memory tier,
        or queued for another), give back the room of the rest, and queue the
        write-through copies."""
        books, ledger = self.books, self.ledger
        tiers = books.tiers
        n, queued = landed, 0
        if frames:
            while n < len(chain.blocks) and not tiers[chain.tiers[n]].sync:
                queued += len(frames[n])
                if not self.writer.queue.fits(queued):
                    tiers[chain.tiers[n]].writes_dropped += 1
                    break
                n += 1
            ledger.counters.kv_bytes_in += (chain.end - chain.begin) * self.layout.bytes_per_token
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
            if tiers[k].sync:
                self._write_through(block, k, frames[i])
        return linked[-1].end - chain.parent.end if linked else 0

    def _write_through(self, block: Block, k: int, frame: bytes) -> None:
        """A ``through`` tier copies a block to the next tier as soon as it holds it."""
        if self.books.tiers[k].config.write == "through" and k + 1 < len(self.books.tiers):
            self.ledger.copy_down(block, k + 1, frame)
