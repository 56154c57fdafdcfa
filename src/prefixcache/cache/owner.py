"""The one owner of the cache's lock: every critical section of a ``PrefixCache``.

::

    PrefixCache (facade)        checks arguments, builds Match; holds no lock
      |
      +-- Owner                 the lock; each method one section: decide, or commit
      |     +-- Ledger          tree, pins, pools, books   (ledger.py, lifecycle.py)
      |     +-- loadsteps       probe, load, promotion     (what runs in those sections)
      |     +-- writesteps      an insert's chain, a writer's job
      |
      +-- TieredPath            moves bytes: probes, reads, memory puts (tiered.py)
      +-- Writer                moves bytes: the write queue's jobs    (writer.py)

Design.md's three steps, as SGLang's ``commit_writing_through`` /
``commit_loading_onboard``: a method here decides under the lock and returns a plan
(``plans.py``); the bytes move outside it, in ``tiered.py`` or the writer; another
method here commits the outcome they return. Neither byte mover receives the lock
nor the ledger: ``TieredPath`` calls these methods, and the writer is handed only
``commit_write``. Nothing else takes the lock, so "no I/O under the cache lock"
(invariant 9) is a property of this module and of the steps it calls, and ``held``
lets a test check it at every store call (``tests/guard_store.py``).

A section that frees memory slots whose frames a slower tier still has to receive
(a demotion out of a memory tier) copies them out right after it lets go of the lock
(``_deciding``), before it returns: no caller can forget to.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from prefixcache.cache import loadsteps, writesteps
from prefixcache.cache.invalidations import Stamp
from prefixcache.cache.ledger import Alive, Ledger
from prefixcache.cache.lifecycle import Purged
from prefixcache.cache.peek import Peek, in_tree
from prefixcache.cache.plans import Chain, Found, LoadPlan, Matched, Probe, Probed, Promoted, Promotion, Written
from prefixcache.cache.residency import Books
from prefixcache.cache.retention import Retained
from prefixcache.cache.stats import CacheStats, WriterStats, snapshot
from prefixcache.cache.tierevents import resident as resident_events
from prefixcache.cache.tree import Block, Lookup, Pin, path_to
from prefixcache.events import Drained, EpochBumped, Event, RemovalReason
from prefixcache.hashing import CacheContext, Segment
from prefixcache.storage.queue import Job, LazyFrame, WriteQueue
from prefixcache.storage.transfer import Loaded, Outcome

__all__ = ["Owner"]

Segments = Sequence[Segment] | None
Epochs = tuple[int, int, int] | None  # a model's and its adapter's epochs and the generation, when a peek probes


class Owner:
    """The cache's lock and its ledger; each public method is one critical section."""

    def __init__(self, ledger: Ledger) -> None:
        self._lock = threading.RLock()
        self.ledger = ledger
        self.books: Books | None = ledger.books

    def held(self) -> bool:
        """Whether the calling thread holds the cache's lock (what a test's guard asks).

        NOTE: ``RLock._is_owned`` is what ``threading.Condition`` asks an RLock; a wrapper
        counting its own owner would put two Python calls on every section of the
        simulator's hot path."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    # ================================================================ matching

    def begin_match(self, tokens: object, ctx: CacheContext, segments: Segments) -> Matched | Probe:
        """The match; or, when a tier may hold more of the chain than the tree knows, the
        probe to run (``TieredPath.run_probe``) before ``end_match``."""
        ledger, books = self.ledger, self.books
        with self._lock:
            lookup = ledger.lookup(tokens, ctx, segments, probing=True)
            alive = ledger.alive()
            if books is None or not any(t.probes for t in books.tiers):
                return self._matched(lookup, ctx, alive, None)
            found = ledger.find(lookup, alive)
            probe = loadsteps.plan_probe(ledger, lookup, found)
            return self._matched(lookup, ctx, alive, found) if probe is None else probe

    def end_match(self, tokens: object, ctx: CacheContext, segments: Segments, probe: Probe, probed: Probed) -> Matched:
        """Adopt what the probe found, then match."""
        ledger = self.ledger
        with self._lock:
            lookup: Lookup = probe.lookup
            if any(root.stale for root in lookup.roots):  # a bump or purge meanwhile: what was probed is stale
                loadsteps.adopt(ledger, ctx, probe, Probed())
                lookup, again = ledger.lookup(tokens, ctx, segments, probing=True), None
            else:
                again = loadsteps.adopt(ledger, ctx, probe, probed)
            return self._matched(lookup, ctx, ledger.alive(), again)

    def _matched(self, lookup: Lookup, ctx: CacheContext, alive: Alive, found: Found | None) -> Matched:
        ledger = self.ledger
        matched = ledger.match(lookup, ctx, alive, found)
        ledger.contexts.drop_empty(lookup)
        if self.books is not None and matched.block is not None:
            matched.tier_tokens = self.books.tier_tokens(path_to(matched.block), matched.partial_tokens)
        return matched

    def peek(self, tokens: object, ctx: CacheContext, segments: Segments) -> tuple[Peek, Probe | None, Epochs]:
        """What the tree holds (``peek.in_tree``), the probe to run when a tier may hold
        more, and the epochs and generation it was decided under (``peek_again`` compares
        them)."""
        with self._lock:
            ahead, probe = in_tree(self.ledger, tokens, ctx, segments, probing=True)
            return ahead, probe, self._version(ctx) if probe is not None else None

    def peek_again(self, tokens: object, ctx: CacheContext, segments: Segments, epochs: Epochs) -> Peek | None:
        """After a peek's probe: the tree's answer again when an epoch bump or a purge made
        what was probed stale (a match then searches the new roots too); None when none did."""
        with self._lock:
            if self._version(ctx) == epochs:
                return None
            return in_tree(self.ledger, tokens, ctx, segments, probing=False)[0]

    # ================================================================ loading

    def plan_load(self, block: Block | None, pin: Pin | None, partial_tokens: int, first: int) -> LoadPlan:
        with self._lock:
            if block is not None and (pin is None or pin.released):
                raise RuntimeError("load of a released match: its blocks may have been evicted")
            return loadsteps.plan_load(self.ledger, block, partial_tokens, first)

    def commit_read(self, plan: LoadPlan, loaded: Loaded) -> Promotion:
        with self._deciding():
            return loadsteps.commit_read(self.ledger, plan, loaded)

    def commit_promotion(self, plan: LoadPlan, promotion: Promotion, promoted: Promoted) -> None:
        with self._deciding():
            loadsteps.commit_promotion(self.ledger, plan, promotion, promoted)

    def unpin(self, pin: Pin) -> None:
        with self._lock:
            self.ledger.life.unpin(pin)

    # ================================================================ storing

    def stamp(self) -> Stamp:
        with self._lock:
            return self.ledger.life.invalid.stamp()

    def plan_insert(
        self, tokens: object, ctx: CacheContext, segments: object, publish: bool, since: Stamp | None = None
    ) -> Chain | None:
        """The chain an insert with KV stores next: the published prefix it owes (when
        ``publish`` and one is owed: ``chain.tenants >= 0``), else what the cache lacks.
        None too when a purge or bump after ``since`` covers it; the chain carries
        ``since`` (or now), for its commit to check again."""
        ledger = self.ledger
        with self._deciding():
            lookup = ledger.lookup(tokens, ctx, segments)
            seq = since.seq if since is not None else ledger.life.invalid.seq
            if self._voided(seq, lookup, ctx):
                return None
            chain = ledger.publish(lookup, ctx, tiers=True) if publish and ledger.publisher.active else None
            chain = chain if chain is not None else ledger.extend(lookup, ctx, None, tiers=True)
            if chain is not None:
                chain.since, chain.data = seq, lookup.data
            return chain

    def commit_insert(self, chain: Chain, written: Written) -> int:
        with self._deciding():
            return writesteps.commit_chain(self.ledger, chain, written)

    def commit_write(self, job: Job, outcome: Outcome) -> list[tuple[int, bytes]]:
        """The writer's commit of one job; the deletes to run (outside the lock) before its next."""
        with self._deciding():
            return writesteps.commit_write(self.ledger, job, outcome)

    def insert(self, tokens: object, ctx: CacheContext, segments: object, since: Stamp | None = None) -> int:
        with self._lock:
            if since is not None and self._voided(since.seq, self.ledger.lookup(tokens, ctx, segments), ctx):
                return 0
            return self.ledger.insert(tokens, ctx, segments)

    def _version(self, ctx: CacheContext) -> tuple[int, int, int]:
        return self.ledger.contexts.version(ctx, self.ledger.tenancy.namespace(ctx.tenant))

    def _voided(self, seq: int, lookup: Lookup, ctx: CacheContext) -> bool:
        """Whether a purge or bump after ``seq`` covers a store of ``lookup`` (counted)."""
        ledger = self.ledger
        if not ledger.life.invalid.voids(seq, ctx, (root.ctx_name for root in lookup.roots), lookup.data):
            return False
        ledger.counters.count_voided(len(lookup.data) // 4)
        ledger.contexts.drop_empty(lookup)
        return True

    def access(self, tokens: object, ctx: CacheContext, segments: object) -> tuple[int, int]:
        with self._lock:
            return self.ledger.access(tokens, ctx, segments)

    def retain(self, tokens: object, ctx: CacheContext, segments: object, seconds: float) -> Retained:
        ledger = self.ledger
        with self._lock:
            lookup = ledger.lookup(tokens, ctx, segments)
            retained = ledger.retain(lookup, ctx, seconds)
            ledger.contexts.drop_empty(lookup)
            return retained

    def may_retain(self, tenant: str) -> bool:
        with self._lock:
            return self.ledger.keeper.may_retain(tenant)

    def retain_caps(self, tenant: str) -> tuple[int, ...]:
        with self._lock:
            return self.ledger.keeper.caps(tenant, joining=True)

    # ================================================================ invalidation

    def bump_epoch(self, model: str, adapter: str | None) -> int:
        with self._lock:
            epoch = self.ledger.life.bump_epoch(model, adapter)
            self.ledger.events.record(EpochBumped(model, adapter, epoch))
            return epoch

    def raise_epochs(self, found: Mapping[tuple[str, str | None], int]) -> list[tuple[str, str | None]]:
        """Apply epochs read from the tiers (``epochbook.py``) that are above this cache's:
        each a bump to that epoch. Returns the (model, adapter) raised."""
        raised = []
        with self._lock:
            contexts = self.ledger.contexts
            for (model, adapter), epoch in found.items():
                if epoch > contexts.epoch(model, adapter):
                    self.ledger.life.bump_epoch(model, adapter, epoch)
                    self.ledger.events.record(EpochBumped(model, adapter, epoch))
                    raised.append((model, adapter))
        return raised

    def epochs(self) -> dict[tuple[str, str | None], int]:
        with self._lock:
            return self.ledger.contexts.known()

    def raise_generations(self, found: Mapping[str, int]) -> list[str]:
        """Apply generations read from the tiers (``epochbook.py``: other servers' purges,
        or this one's before a restart) that are above this cache's. Returns the names raised."""
        raised = []
        with self._lock:
            contexts = self.ledger.contexts
            for name, generation in found.items():
                if generation > contexts.generation_of(name):
                    self.ledger.life.raise_generation(name, generation)
                    raised.append(name)
        return raised

    def generations(self) -> dict[str, int]:
        with self._lock:
            return self.ledger.contexts.generations()

    def purge(self, tenant: str) -> Purged:
        with self._lock:
            return self.ledger.life.purge(tenant)

    def purge_prefix(self, tokens: object, ctx: CacheContext, segments: object) -> int:
        with self._lock:
            lookup = self.ledger.lookup(tokens, ctx, segments)
            if not lookup.data:
                raise ValueError("purge_prefix needs a non-empty prefix (use purge for a whole tenant)")
            return self.ledger.life.purge_prefix(lookup)

    def declare_public(self, tokens: object, ctx: CacheContext) -> None:
        with self._lock:
            self.ledger.publisher.declare(self.ledger.contexts.tokens(tokens), ctx)  # type: ignore[arg-type]

    def reclaim(self, max_blocks: int | None) -> int:
        with self._lock:
            return self.ledger.life.reclaim(max_blocks)

    # ================================================================ reading

    def take_events(self) -> list[Event]:
        with self._lock:
            return self.ledger.events.take()

    def drain(self, residency: bool) -> Drained:
        with self._lock:
            ledger, books = self.ledger, self.books
            events = ledger.events.take()
            resident = orphans = None
            if residency:
                resident = resident_events(books.owner.values(), books.kinds) if books is not None else []
                orphans = books.orphans() if books is not None else {}
            return Drained(events, ledger.events.dropped, resident, orphans)

    def stats(self, writer_mode: str | None) -> CacheStats:
        """The counters and occupancy now; the tiers' gauges are read from each store's own
        memory (``len``, ``used_bytes``, ``stats``), never from its medium."""
        with self._lock:
            books = self.books
            if books is None or writer_mode is None:
                return snapshot(self.ledger)
            queue = books.queue
            tiers = tuple(t.snapshot(queue.pending_for(t.index)) for t in books.tiers)
            return snapshot(self.ledger, tiers, _writer_stats(writer_mode, queue, books))

    def removed(self, reason: RemovalReason) -> int:
        with self._lock:
            return self.ledger.counters.removals[reason]

    @contextmanager
    def _deciding(self) -> Iterator[None]:
        """A section that may detach memory slots: under the lock, then (the lock let go,
        before the caller goes on) the detached frames are copied out, which frees the
        slots."""
        with self._lock:
            yield
            copyouts: list[LazyFrame] = self.books.take_copyouts() if self.books is not None else []
        for source in copyouts:
            source.frame()


def _writer_stats(mode: str, queue: WriteQueue, books: Books) -> WriterStats:
    return WriterStats(
        mode=mode,
        queued_jobs=len(queue),
        queued_bytes=queue.queued_bytes,
        limit_bytes=queue.limit_bytes,
        done=queue.done,
        dropped=sum(t.counts.writes_dropped for t in books.tiers),
        failed=queue.failed,
        abandoned=queue.abandoned,
    )
