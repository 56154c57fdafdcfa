"""``PrefixCache``: the one object a server or a simulator holds.

The life of a request::

    m = cache.match(tokens, ctx)     # longest cached prefix, verified; pins it
    kv = cache.load(m)               # with tiers: its KV, the true length (invariant 6)
    ...                               # the model prefills the rest
    m.release()                       # unpin
    cache.insert(tokens, ctx, kv=source)   # store the new blocks (their range of the KV only)

The facade takes no lock: every critical section is a method of the lock's one owner
(``owner.py``), which decides and commits with the ledger; bytes move outside it
(``tiered.py``), and writes to slower tiers run in the writer (``writer.py``), so
``stats()`` and ``/metrics`` never wait on a disk or a network.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from prefixcache.cache.contexts import Contexts
from prefixcache.cache.epochbook import SYNC_S, EpochKeeping
from prefixcache.cache.invalidations import Stamp
from prefixcache.cache.kv import KVSource, LoadedKV, kv_source
from prefixcache.cache.ledger import Ledger
from prefixcache.cache.owner import Owner
from prefixcache.cache.peek import Peek, peek
from prefixcache.cache.plans import Matched, Probe
from prefixcache.cache.residency import Books
from prefixcache.cache.retention import Retained, RetainSpan
from prefixcache.cache.stats import CacheStats
from prefixcache.cache.tierbook import TierBook
from prefixcache.cache.tiered import TieredPath
from prefixcache.cache.tree import Pin, path_to
from prefixcache.cache.writer import Writer
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.events import Drained, Event, RemovalReason
from prefixcache.hashing import ONESHOT, CacheContext, HashFactory, Segment, get_hash
from prefixcache.policies import make_policy
from prefixcache.storage import codec
from prefixcache.storage.base import EpochKeeper, TierStore
from prefixcache.storage.open import open_store
from prefixcache.storage.queue import WriteQueue
from prefixcache.storage.transfer import Transfer
from prefixcache.strict import refuse_public

__all__ = ["Match", "PrefixCache"]

Tokens = Sequence[int] | np.ndarray
KV = np.ndarray | KVSource | Any  # a numpy array, a CPU torch tensor, or a KVSource
StoreFactory = Callable[[TierConfig, int, str], TierStore]  # (tier, frame bytes, seed) -> its store


class Match:
    """The result of ``PrefixCache.match``: how many leading tokens are cached, and a
    pin on them until ``release`` (also a context manager).

    ``cached_tokens`` = ``num_blocks * block_size + partial_tokens``; the partial part,
    when ``partial_blocks`` is on, is the first ``partial_tokens`` tokens of one more
    cached block that shares them with the request. ``tier_tokens`` splits them by the
    tier each block's fastest copy is in."""

    __slots__ = ("_block", "_cache", "_pin", "cached_tokens", "num_blocks", "partial_tokens", "tenant", "tier_tokens")

    def __init__(self, cache: PrefixCache, matched: Matched, tenant: str) -> None:
        self._cache = cache
        self._pin = matched.pin
        self._block = matched.block
        self.num_blocks = matched.num_blocks
        self.partial_tokens = matched.partial_tokens
        self.cached_tokens = matched.num_blocks * cache.config.block_size + matched.partial_tokens
        self.tenant = tenant
        self.tier_tokens: dict[str, int] = matched.tier_tokens

    @property
    def block_keys(self) -> tuple[bytes, ...]:
        """Keys of the matched blocks, root-most first (the partial block last). Read
        it before ``release``: afterwards the blocks may be gone."""
        if self._block is None:
            return ()
        if self.released:
            raise RuntimeError("block_keys of a released match: the blocks may have been evicted")
        return tuple(b.key for b in path_to(self._block))

    @property
    def released(self) -> bool:
        return self._pin is None or self._pin.released

    def release(self) -> None:
        """Unpin the matched blocks. Releasing twice is harmless."""
        if self._pin is not None and not self._pin.released:
            self._cache._unpin(self._pin)

    def __enter__(self) -> Match:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Match(cached_tokens={self.cached_tokens}, partial_tokens={self.partial_tokens})"


class PrefixCache:
    """A prefix cache of KV blocks: metadata only (the simulator), or with storage tiers
    that hold the bytes (``config.tiers`` and ``config.kv_layout``).

    ``clock`` (seconds, monotonic) drives TTLs and is injected so that the simulator can
    replay virtual time; ``hash_factory`` overrides ``config.hash`` (tests inject weak
    hashes through it); ``store_factory`` opens each tier's store (tests inject faults);
    ``epoch_sync_s`` is how often the shared tiers' epochs are read again (None: only
    when ``sync_epochs`` or ``bump_epoch`` is called; ``epochbook.py``).
    """

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        hash_factory: HashFactory | None = None,
        store_factory: StoreFactory = open_store,
        epoch_sync_s: float | None = SYNC_S,
    ) -> None:
        self.config = config = config if config is not None else CacheConfig()
        factory = hash_factory if hash_factory is not None else get_hash(config.hash)
        oneshot = ONESHOT.get(config.hash) if hash_factory is None else None
        contexts = Contexts(config.seed, factory, oneshot, config.vocab_size)
        self._io: TieredPath | None = None
        self._writer: Writer | None = None
        self._prefetcher: ThreadPoolExecutor | None = None
        self._epochs: EpochKeeping | None = None
        if not config.tiers:
            self._ledger = Ledger(config, contexts, clock, None)
            self._owner = Owner(self._ledger)
            return
        if config.kv_layout is None:
            raise ValueError("tiers need kv_layout (the model's layers, kv_heads, head_dim and dtype)")
        layout = config.kv_layout
        key_len = len(factory().digest())
        books, transfer = _open_tiers(config, layout, key_len, store_factory)
        self._ledger = Ledger(config, contexts, clock, books)
        books.events = self._ledger.events  # NOTE: one log, so tier moves keep their order among the rest
        self._owner = Owner(self._ledger)
        self._writer = Writer(config.writer, transfer, self._owner.commit_write)
        self._io = TieredPath(self._owner, transfer, self._writer)
        stores = zip(config.tiers, transfer.stores, strict=True)
        keepers = [(tc.label, store) for tc, store in stores if isinstance(store, EpochKeeper)]
        if keepers:
            self._epochs = EpochKeeping(self._owner, keepers, epoch_sync_s)
        # NOTE: made here, not on the first prefetch, so that no lock guards its making; a
        # pool makes its thread on its first task
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="prefixcache-prefetch")

    # ================================================================ matching and loading

    def match(self, tokens: Tokens, ctx: CacheContext, segments: Sequence[Segment] | None = None) -> Match:
        """The longest cached prefix of ``tokens`` that ``ctx`` may reuse, pinned.

        With a tier that may hold blocks no local tree knows (Redis, a disk reopened after
        a restart), the request's own chain is probed there, outside the lock, and what is
        found is adopted: keys are the same in every process, and the bytes are checked
        against the tokens when loaded."""
        decided = self._owner.begin_match(tokens, ctx, segments)
        if isinstance(decided, Probe):
            assert self._io is not None
            decided = self._owner.end_match(tokens, ctx, segments, decided, self._io.run_probe(decided))
        return Match(self, decided, ctx.tenant)

    def peek(self, tokens: Tokens, ctx: CacheContext, segments: Sequence[Segment] | None = None) -> Peek:
        """What ``match`` would find now, with no side effect: nothing pinned, touched,
        counted, recorded or adopted (``peek.py``). For a scheduler that asks again and
        again about a request that waits; the match when it runs is the answer to act on."""
        return peek(self._owner, self._io, tokens, ctx, segments)

    def load(self, match: Match, out: np.ndarray | None = None, *, first_block: int = 0) -> LoadedKV:
        """The KV of ``match``'s cached tokens, read from the fastest tier holding each
        block (and promoted to the fastest tier). ``tokens`` of the result is the true
        length: shorter than ``match.cached_tokens`` when a tier failed or held bad bytes
        (those blocks are dropped and counted). Call it before ``release``.

        ``first_block``: the caller holds blocks ``0 .. first_block - 1`` already (vLLM's
        own prefix cache), so only the blocks from it on are read, verified, counted and
        promoted; the result's ``kv`` covers tokens ``start .. tokens``. Past the match's
        blocks it is a load of nothing (``tokens == start == requested``).

        ``out``, any writable C-contiguous array of at least ``(cached_tokens - start) *
        kv_layout.bytes_per_token`` bytes, is used as the result's memory: a server that
        reuses one buffer skips the page faults of a fresh 50 MB array per request."""
        if first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {first_block}")
        io = self._need_io("load")
        if match._cache is not self:
            raise ValueError("this match belongs to another cache")
        plan = self._owner.plan_load(match._block, match._pin, match.partial_tokens, first_block)
        return io.load(plan, out)

    def prefetch(self, match: Match, *, first_block: int = 0) -> Future[LoadedKV]:
        """Start ``load(match, first_block=...)`` in the background (keep the match until it is done)."""
        self._need_io("prefetch")
        assert self._prefetcher is not None
        return self._prefetcher.submit(self.load, match, first_block=first_block)

    def _unpin(self, pin: Pin) -> None:
        self._owner.unpin(pin)
        if self._writer is not None:
            self._writer.after_call()

    # ================================================================ storing

    def insert(
        self,
        tokens: Tokens,
        ctx: CacheContext,
        segments: Sequence[Segment] | None = None,
        *,
        kv: KV = None,
        since: Stamp | None = None,
    ) -> int:
        """Cache the full blocks of ``tokens`` (and the tail, with ``partial_blocks``).
        Returns how many tokens were newly stored; fewer than asked when the pool has
        no room left that eviction can make (pinned or quota-bound).

        With tiers, ``kv`` is the KV of these tokens: an array ``[layers, 2, kv_heads, >=
        len(tokens), head_dim]`` (numpy or CPU torch), or a ``KVSource``; only the range
        of the new blocks is read from it (``stats().kv_bytes_in`` counts it).

        ``since``: the ``stamp()`` taken when this store was decided (a request's, before
        its match). A purge or epoch bump made after it that covers these tokens wins:
        nothing is stored (``stats().voided_tokens``), so a request in flight cannot
        bring back what an operator purged. Without it, the store counts as decided now."""
        if self._io is None:
            if kv is not None:
                raise ValueError("kv given, but this cache has no tiers to hold it (configure tiers and kv_layout)")
            return self._owner.insert(tokens, ctx, segments, since)
        if kv is None:
            raise ValueError("this cache has tiers: insert needs kv (the KV of the tokens)")
        assert self.config.kv_layout is not None
        source = kv_source(kv, self.config.kv_layout, len(tokens))
        return self._io.insert(tokens, ctx, segments, source, since)

    def retain(
        self, tokens: Tokens, ctx: CacheContext, seconds: float, segments: Sequence[Segment] | None = None
    ) -> Retained:
        """Keep the cached blocks of ``tokens`` (a prompt's prefix, stored before) for
        ``seconds``, charged to ``ctx``'s tenant; each later hit of a block extends its
        retention by as long again. No eviction takes a retained block out of the cache
        (under pressure it goes down a tier); epochs, purges and TTLs still end it. Past
        the tenant's cap its own oldest retention ends first (``cache/retention.py``)."""
        RetainSpan(len(tokens), seconds)  # the one check of what a span may ask
        return self._owner.retain(tokens, ctx, segments, seconds)

    def may_retain(self, tenant: str) -> bool:
        """Whether ``tenant``'s retention cap is above zero (else ``retain`` is refused)."""
        return self._owner.may_retain(tenant)

    def retain_caps(self, tenant: str) -> tuple[int, ...]:
        """``tenant``'s retention cap in each level (``stats().retention_levels``) if it
        retained now: tokens of the cache, frames of each tier."""
        return self._owner.retain_caps(tenant)

    def stamp(self) -> Stamp:
        """Now, for a store decided now and made later (``insert(..., since=stamp)``): a
        request takes it before its match, so that a purge or an epoch bump while it
        computes is final. Cheap: one number, read under the lock."""
        return self._owner.stamp()

    def access(self, tokens: Tokens, ctx: CacheContext, segments: Sequence[Segment] | None = None) -> tuple[int, int]:
        """Match, insert, release as one step -- what a simulator does with each request.
        Returns (cached tokens, newly stored tokens)."""
        if self._io is not None:
            raise ValueError("access() is metadata-only; with tiers, use match/load/insert(kv=...)")
        return self._owner.access(tokens, ctx, segments)

    # ================================================================ invalidation

    def bump_epoch(self, model: str, adapter: str | None = None) -> int:
        """Invalidate every block of ``model`` (or of one adapter of it) at once: O(roots
        of that model), no scan of blocks. Returns the new epoch.

        With tiers that outlive the process (disk, Redis, S3), the epoch is kept there
        too (``epochbook.py``): a restart, and every server sharing the tier, misses the
        old blocks. ``EpochNotKept`` when a tier did not take it: the bump holds here,
        and the tier is written again at every sync."""
        if self._epochs is not None:
            return self._epochs.bump(model, adapter)
        return self._owner.bump_epoch(model, adapter)

    def sync_epochs(self) -> list[tuple[str, str | None]]:
        """Read the epochs and generations that the shared tiers (Redis, S3) keep and
        apply what is higher than this cache's: another server's bumps and purges. A
        thread does it every ``epoch_sync_s`` seconds; call it to know it is done. Returns
        the (model, adapter) raised (a generation raised names no tenant: it is applied,
        not listed)."""
        return self._epochs.sync() if self._epochs is not None else []

    def purge(self, tenant: str) -> int:
        """Remove every block ``tenant`` stored (and, where others built on them in
        shared mode, what hangs below). Pinned blocks become unmatchable now and are
        freed on release. Returns the tokens removed or doomed here. O(blocks): an admin
        call.

        In "namespace" and "partitioned" isolation the purge is also final beyond this
        tree: it raises the generation of the tenant's key namespace, so no key of its
        old blocks is computed again, and with tiers that outlive the process (disk,
        Redis, S3) the generation is kept there, as an epoch is: a restart, and every
        server sharing the tier once it syncs, misses them too. ``EpochNotKept`` when a
        tier did not keep it (the purge holds here, and the tier is written again at
        every sync). In "shared" isolation the tenant has no namespace of its own: the
        purge removes what this tree holds and nothing else (blocks the tenant stored in
        a tier this tree does not know, after a restart or on another server, stay).
        Prefixes published to the public pool are everybody's and stay."""
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("purge needs a non-empty tenant name")
        try:
            if self._epochs is not None:
                return self._epochs.purge(tenant)
            return self._owner.purge(tenant).removed
        finally:
            self._after()

    def purge_prefix(self, tokens: Tokens, ctx: CacheContext, segments: Sequence[Segment] | None = None) -> int:
        """Remove every cached sequence that ``ctx`` can see and that starts with
        ``tokens``: the block holding its end and everything below it."""
        removed = self._owner.purge_prefix(tokens, ctx, segments)
        self._after()
        return removed

    def declare_public(self, tokens: Tokens, ctx: CacheContext) -> None:
        """An operator's word that this prefix (e.g. a system prompt) may be shared by
        every tenant of ``ctx.model``: from the next request that sends it, its full
        blocks are stored once, in the public pool."""
        if self.config.strict_isolation:
            raise refuse_public("declare_public")
        if self._ledger.tenancy.mode == "shared":
            raise ValueError("declare_public applies to 'namespace' and 'partitioned' isolation")
        self._owner.declare_public(tokens, ctx)

    def reclaim(self, max_blocks: int | None = None) -> int:
        """Free stale and expired blocks now instead of on demand; returns how many."""
        done = self._owner.reclaim(max_blocks)
        self._after()
        return done

    # ================================================================ the rest

    def take_events(self) -> list[Event]:
        """Drain the events recorded since the last call."""
        return self._owner.take_events()

    def drain(self, residency: bool = False) -> Drained:
        """Drain the events with the count dropped so far, and (``residency``) every
        block's tier residency after them, in one step under the lock: what a consumer
        needs to notice that it missed events and to rebuild what it missed."""
        return self._owner.drain(residency)

    def stats(self) -> CacheStats:
        """Counters since start, and the occupancy now: overall, per tenant, pool and tier."""
        return self._owner.stats(self._writer.mode if self._writer is not None else None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write to a tier is done; False when ``timeout`` (seconds)
        passed first. A graceful shutdown calls it, so a restart finds what was computed."""
        return self._writer.flush(timeout) if self._writer is not None else True

    def close(self, timeout: float | None = None) -> bool:
        """Flush (for at most ``timeout`` seconds), then close the stores. Writes still
        queued after that are abandoned and counted. Idempotent; returns whether every
        write was done."""
        if self._writer is None or self._io is None:
            return True
        if self._epochs is not None:
            self._epochs.close(timeout)
        done = self._writer.close(timeout)
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
        self._io.transfer.close()  # NOTE: files and connections close outside the lock too
        return done

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def removed(self, reason: RemovalReason) -> int:
        """Blocks that left the cache for ``reason`` since start: one counter, cheaper than
        ``stats()`` for a caller that asks after every request (the simulator)."""
        return self._owner.removed(reason)

    @property
    def used_tokens(self) -> int:
        return self._ledger.life.used

    def __len__(self) -> int:
        return len(self._ledger.tree)

    def _need_io(self, what: str) -> TieredPath:
        if self._io is None:
            raise RuntimeError(f"{what}: this cache is metadata-only (no tiers hold KV bytes)")
        return self._io

    def _after(self) -> None:
        if self._writer is not None:
            self._writer.after_call()


def _open_tiers(
    config: CacheConfig, layout: KVLayout, key_len: int, store_factory: StoreFactory
) -> tuple[Books, Transfer]:
    """The stores, their books and the byte mover; a disk that holds yesterday's frames
    has them as orphans, adopted when a request asks for them (the warm restart)."""
    shape = layout.shape(config.block_size)
    frames = [codec.encoded_size(shape, layout.dtype, key_len, tc.codec) for tc in config.tiers]
    stores = []
    try:
        for tc, frame in zip(config.tiers, frames, strict=True):
            stores.append(store_factory(tc, frame, config.seed))
    except BaseException:
        for store in stores:
            store.close()
        raise
    queue = WriteQueue(config.write_queue_bytes)
    books = []
    for i, (tc, store, frame) in enumerate(zip(config.tiers, stores, frames, strict=True)):
        policy = make_policy(tc.policy or config.policy, max(config.tier_tokens(tc), 1))
        book = TierBook(i, tc, store, policy, len(store) + store.room_for(frame), store.footprint(frame))
        keys = getattr(store, "keys", None)  # a store that lists what it holds (a disk) may hold orphans
        if callable(keys):
            book.orphans.update(keys())
            for key in book.orphans:
                policy.insert(key, config.block_size)
            book.used = len(book.orphans)
        books.append(book)
    trusts = [
        s.verifies_reads or (s.private and not tc.verify_payload) for s, tc in zip(stores, config.tiers, strict=True)
    ]
    transfer = Transfer(stores, trusts, layout, queue, config.io_threads, [tc.codec for tc in config.tiers])

    def frame_bytes(tokens: int) -> int:
        return codec.encoded_size(layout.shape(tokens), layout.dtype, key_len)

    return Books(books, queue, frame_bytes, config.block_size), transfer
