"""``PrefixCache``: the facade that ties keys, the block tree, pools, policies, tenancy
and invalidation together.

The life of a request::

    m = cache.match(tokens, ctx)     # longest cached prefix, verified; pins it
    ...                               # the caller loads m's blocks, prefills the rest
    m.release()                       # unpin
    cache.insert(tokens, ctx)         # store the new blocks (evicting if needed)

Invalidation never scans on the request path: ``bump_epoch`` changes the context root
(so every old key is unreachable at once) and queues the old roots; their blocks are
reclaimed, children first, before any live block is evicted.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from types import TracebackType
from typing import Any

import numpy as np

from prefixcache.cache.tree import (
    Block,
    BlockTree,
    Lookup,
    Run,
    RunSpan,
    always_alive,
    blocks_of,
    common_tokens,
    keys_of,
    path_to,
    postorder,
    runs_to,
)
from prefixcache.config import CacheConfig
from prefixcache.events import (
    BlocksRemoved,
    BlocksStored,
    EpochBumped,
    Event,
    EventLog,
    PrefixPromoted,
    RemovalReason,
)
from prefixcache.hashing import (
    ONESHOT,
    CacheContext,
    Hasher,
    HashFactory,
    KeyChain,
    Segment,
    Segments,
    get_hash,
    root_encoding,
    token_bytes,
)
from prefixcache.storage.tiered import LoadedKV, TieredStorage, as_kv_array
from prefixcache.tenancy import GLOBAL, PUBLIC, Pool, Tenancy

Tokens = Sequence[int] | np.ndarray
_key_of = attrgetter("key")


@dataclass
class TenantStats:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    inserted_tokens: int = 0


@dataclass
class CacheStats:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    partial_hit_tokens: int = 0
    inserted_tokens: int = 0
    inserted_blocks: int = 0
    declined_tokens: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    collisions: int = 0
    stale_reclaimed: int = 0
    expired: int = 0
    purged: int = 0
    replaced: int = 0
    lost: int = 0
    promoted_blocks: int = 0
    epoch_bumps: int = 0
    purges: int = 0  # operator calls of purge and purge_prefix (``purged`` counts their blocks)
    tenants: dict[str, TenantStats] = field(default_factory=dict)

    def tenant(self, name: str) -> TenantStats:
        stats = self.tenants.get(name)
        if stats is None:
            stats = self.tenants[name] = TenantStats()
        return stats


_REASON_COUNTER = {
    RemovalReason.EVICTED: "evictions",
    RemovalReason.STALE: "stale_reclaimed",
    RemovalReason.EXPIRED: "expired",
    RemovalReason.PURGED: "purged",
    RemovalReason.REPLACED: "replaced",
    RemovalReason.LOST: "lost",
}


class Match:
    """The result of ``PrefixCache.match``: how many leading tokens are cached, and a
    pin on them until ``release`` (also a context manager).

    ``cached_tokens`` = ``num_blocks * block_size + partial_tokens``; the partial part,
    when ``partial_blocks`` is on, is the first ``partial_tokens`` tokens of one more
    cached block that shares them with the request.
    """

    __slots__ = (
        "_block",
        "_cache",
        "_released",
        "cached_tokens",
        "num_blocks",
        "partial_tokens",
        "tenant",
        "tier_tokens",
    )

    def __init__(
        self,
        cache: PrefixCache,
        block: Block | None,
        num_blocks: int,
        partial_tokens: int,
        tenant: str,
    ) -> None:
        self._cache = cache
        self._block = block
        self._released = block is None
        self.num_blocks = num_blocks
        self.partial_tokens = partial_tokens
        self.cached_tokens = num_blocks * cache.config.block_size + partial_tokens
        self.tenant = tenant
        self.tier_tokens: dict[str, int] = {}  # tier name -> matched tokens whose fastest copy is there

    @property
    def block_keys(self) -> tuple[bytes, ...]:
        """Keys of the matched blocks, root-most first (the partial block last). Read
        it before ``release``: afterwards the blocks may be gone."""
        if self._block is None:
            return ()
        if self._released:
            raise RuntimeError("block_keys of a released match: the blocks may have been evicted")
        return tuple(map(_key_of, path_to(self._block)))

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Unpin the matched blocks. Releasing twice is harmless."""
        if not self._released:
            self._released = True
            assert self._block is not None
            self._cache._release(self._block)

    def __enter__(self) -> Match:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Match(cached_tokens={self.cached_tokens}, partial_tokens={self.partial_tokens})"


class PrefixCache:
    """A prefix cache of KV blocks, on metadata (capacity accounting without bytes).

    ``clock`` (seconds, monotonic) drives TTLs and is injected so that the simulator can
    replay virtual time; ``hash_factory`` overrides ``config.hash`` (tests inject weak
    hashes through it).
    """

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        hash_factory: HashFactory | None = None,
    ) -> None:
        self.config = config if config is not None else CacheConfig()
        self._hash = hash_factory if hash_factory is not None else get_hash(self.config.hash)
        self._oneshot = ONESHOT.get(self.config.hash) if hash_factory is None else None
        self._clock = clock
        self._tree = BlockTree()
        self._tenancy = Tenancy(self.config)
        self._epochs: dict[tuple[str, str | None], int] = {}
        self._roots: dict[tuple[Any, ...], tuple[Block, Hasher]] = {}
        self._stale: deque[Iterator[Block]] = deque()
        self._ttl: OrderedDict[bytes, Block] | None = OrderedDict() if self.config.ttl_seconds else None
        self._declared: list[tuple[bytes, tuple[Any, ...]]] = []
        self._events = EventLog(self.config.events_capacity)
        self._stats = CacheStats()
        self._used = 0
        self._lock = threading.RLock()
        self._tiers: TieredStorage | None = None
        if self.config.tiers:
            self._tiers = TieredStorage(
                self.config,
                len(self._hash().digest()),
                on_empty=lambda block: self._remove(block, RemovalReason.EVICTED),
                on_lost=lambda block: self._lose(block),
                reclaim=lambda: bool((self._stale or self._ttl) and self._reclaim_one()),
            )

    # ================================================================ public API

    def match(self, tokens: Tokens, ctx: CacheContext, segments: Sequence[Segment] | None = None) -> Match:
        """The longest cached prefix of ``tokens`` that ``ctx`` may reuse, pinned."""
        with self._lock:
            lookup = self._lookup(tokens, ctx, segments)
            alive = self._alive()
            found = self._adopt(lookup, ctx, alive) if self._tiers is not None else None
            pinned, n_blocks, partial_len, _ = self._match(lookup, ctx, alive, found)
            self._drop_if_empty(lookup.roots[0])
            match = Match(self, pinned, n_blocks, partial_len, ctx.tenant)
            if self._tiers is not None and pinned is not None:
                match.tier_tokens = self._tier_tokens(path_to(pinned), partial_len)
            return match

    def load(self, match: Match, out: np.ndarray | None = None) -> LoadedKV:
        """The KV of ``match``'s cached tokens, read from the fastest tier holding each
        block (and promoted to the fastest tier). ``tokens`` of the result is the true
        length: shorter than ``match.cached_tokens`` when a tier failed or held bad bytes
        (those blocks are dropped and counted). Call it before ``release``.

        ``out``, any writable C-contiguous array of at least ``cached_tokens *
        kv_layout.bytes_per_token`` bytes, is used as the result's memory: a server that
        reuses one buffer skips the page faults of a fresh 50 MB array per request."""
        tiers = self._need_tiers("load")
        with self._lock:
            if match._cache is not self:
                raise ValueError("this match belongs to another cache")
            if match._block is None:
                return tiers.load([], 0, out)
            if match.released:
                raise RuntimeError("load of a released match: its blocks may have been evicted")
            return tiers.load(path_to(match._block), match.partial_tokens, out)

    def prefetch(self, match: Match) -> Future[LoadedKV]:
        """Start ``load(match)`` in the background (keep the match until it is done)."""
        return self._need_tiers("prefetch").prefetch(lambda: self.load(match))

    def close(self) -> None:
        """Close the tiers' stores (files, connections). Idempotent."""
        with self._lock:
            if self._tiers is not None:
                self._tiers.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def insert(
        self, tokens: Tokens, ctx: CacheContext, segments: Sequence[Segment] | None = None, *, kv: Any = None
    ) -> int:
        """Cache the full blocks of ``tokens`` (and the tail, with ``partial_blocks``).
        Returns how many tokens were newly stored; fewer than asked when the pool has
        no room left that eviction can make (pinned or quota-bound).

        With tiers, ``kv`` is the KV of (at least) these tokens, ``[layers, 2, kv_heads,
        >= len(tokens), head_dim]`` (numpy or CPU torch); only new blocks are cut from it."""
        with self._lock:
            lookup = self._lookup(tokens, ctx, segments)
            array = None
            if self._tiers is not None:
                if kv is None:
                    raise ValueError("this cache has tiers: insert needs kv (the KV of the tokens)")
                array = as_kv_array(kv, self._tiers.layout, len(lookup.data) // 4)
            elif kv is not None:
                raise ValueError("kv given, but this cache has no tiers to hold it (configure tiers and kv_layout)")
            return self._insert(lookup, tokens, ctx, segments, None, array)

    def access(self, tokens: Tokens, ctx: CacheContext, segments: Sequence[Segment] | None = None) -> tuple[int, int]:
        """Match, insert, release as one step -- what a simulator does with each request.
        Returns (cached tokens, newly stored tokens). It searches the tree once when no
        TTL, promotion or declared prefix can make the insert see another tree."""
        if self._tiers is not None:
            raise ValueError("access() is metadata-only; with tiers, use match/load/insert(kv=...)")
        with self._lock:
            lookup = self._lookup(tokens, ctx, segments)
            pinned, n_blocks, partial_len, deepest = self._match(lookup, ctx, self._alive())
            reuse = self._ttl is None and self._tenancy.promotion is None and not self._declared
            try:
                stored = self._insert(lookup, tokens, ctx, segments, deepest if reuse else None, None)
            finally:
                if pinned is not None:
                    self._release(pinned)
            self._drop_if_empty(lookup.roots[0])
            return n_blocks * self.config.block_size + partial_len, stored

    def bump_epoch(self, model: str, adapter: str | None = None) -> int:
        """Invalidate every block of ``model`` (or of one adapter of it) at once: O(roots
        of that model), no scan of blocks. Returns the new epoch."""
        with self._lock:
            epoch = self._epochs.get((model, adapter), 0) + 1
            self._epochs[(model, adapter)] = epoch
            for name, (root, _) in list(self._roots.items()):
                _, root_model, root_adapter = name[:3]
                if root_model == model and (adapter is None or root_adapter == adapter):
                    del self._roots[name]
                    root.stale = True
                    self._stale.append(postorder(root))
            self._stats.epoch_bumps += 1
            self._events.record(EpochBumped(model, adapter, epoch))
            return epoch

    def purge(self, tenant: str) -> int:
        """Remove every block ``tenant`` stored (and, where others built on them in
        shared mode, what hangs below). Pinned blocks become unmatchable now and are
        freed on release. Returns the tokens removed or doomed. O(blocks): an admin call."""
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("purge needs a non-empty tenant name")
        with self._lock:
            self._stats.purges += 1
            tops = [
                b
                for b in self._tree.nodes.values()
                if b.owner == tenant and (b.parent is None or b.parent.is_root or b.parent.owner != tenant)
            ]
            return sum(self._purge_subtree(b) for b in tops)

    def purge_prefix(self, tokens: Tokens, ctx: CacheContext, segments: Sequence[Segment] | None = None) -> int:
        """Remove every cached sequence that ``ctx`` can see and that starts with
        ``tokens``: the block holding its end and everything below it."""
        with self._lock:
            lookup = self._lookup(tokens, ctx, segments)
            n_tokens, bs = len(lookup.data) // 4, self.config.block_size
            n_full, tail = divmod(n_tokens, bs)
            if n_tokens == 0:
                raise ValueError("purge_prefix needs a non-empty prefix (use purge for a whole tenant)")
            self._stats.purges += 1
            parents: list[Block] = list(lookup.roots)
            if n_full:
                parents = []
                for chain in lookup.chains:
                    node = self._tree.nodes.get(chain.at(n_full * bs))
                    if node is not None and self._tree.verify(lookup, runs_to(node)):
                        parents.append(node)
            tops = (
                parents
                if not tail
                else [
                    child
                    for parent in parents
                    for child in parent.children.values()
                    if lookup.can_see(child) and child.tokens.startswith(lookup.data[4 * n_full * bs :])
                ]
            )
            return sum(self._purge_subtree(b) for b in tops)

    def declare_public(self, tokens: Tokens, ctx: CacheContext) -> None:
        """An operator's word that this prefix (e.g. a system prompt) may be shared by
        every tenant of ``ctx.model``: from the next request that sends it, its full
        blocks are stored once, in the public pool."""
        if self._tenancy.mode == "shared":
            raise ValueError("declare_public applies to 'namespace' and 'partitioned' isolation")
        with self._lock:
            data = token_bytes(tokens, self.config.vocab_size)
            self._declared.append((data, self._context_name(ctx)))

    def reclaim(self, max_blocks: int | None = None) -> int:
        """Free stale and expired blocks now instead of on demand; returns how many."""
        with self._lock:
            done = 0
            while (max_blocks is None or done < max_blocks) and self._reclaim_one():
                done += 1
            return done

    def take_events(self) -> list[Event]:
        """Drain the events recorded since the last call."""
        with self._lock:
            return self._events.take()

    def stats(self) -> dict[str, Any]:
        """Counters since start, and the current occupancy, overall and per tenant."""
        with self._lock:
            out = asdict(self._stats)
            out["per_tenant"] = out.pop("tenants")
            out.update(
                capacity_tokens=self.config.capacity,
                used_tokens=self._used,
                blocks=len(self._tree),
                stale_roots_pending=len(self._stale),
                events_dropped=self._events.dropped,
                tiers=self._tiers.stats() if self._tiers is not None else [],
                pools={
                    p.name: {
                        "quota_tokens": p.quota,
                        "used_tokens": p.used,
                        "blocks": p.blocks,
                        "evictions": p.evictions,
                    }
                    for p in self._tenancy.pools.values()
                },
            )
            if self._tenancy.partitioned:
                for name, pool in self._tenancy.pools.items():
                    if name != PUBLIC:
                        out["per_tenant"].setdefault(name, asdict(TenantStats()))["used_tokens"] = pool.used
            return out

    @property
    def used_tokens(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._tree)

    # ================================================================ tiers

    def _need_tiers(self, what: str) -> TieredStorage:
        if self._tiers is None:
            raise RuntimeError(f"{what}: this cache is metadata-only (no tiers hold KV bytes)")
        return self._tiers

    def _adopt(
        self, lookup: Lookup, ctx: CacheContext, alive: Callable[[Block], bool]
    ) -> tuple[Block | None, list[RunSpan]] | None:
        """Take into the tree the blocks of this request that a probing tier (Redis, or a
        disk reopened after a restart) holds beyond what the tree knows: keys are the same
        in every process (invariant 2), and the bytes are checked against the tokens when
        loaded (invariant 3). Returns the tree search it made when it adopted nothing (the
        match reuses it), None when the tree must be searched again."""
        tiers = self._tiers
        assert tiers is not None
        if not any(t.probes for t in tiers.tiers):
            return None
        bs = self.config.block_size
        n_full = len(lookup.data) // 4 // bs
        found = self._find(lookup, alive)
        deepest, own = found[0], lookup.roots[0]
        if deepest is not None and deepest.root is not own:
            return found  # matched in the public pool: probing the own chain below it has no parent here
        parent = deepest if deepest is not None else own
        ends = list(range(parent.end + bs, n_full * bs + 1, bs))
        tier, n = tiers.probe(lookup.chains[0].many(ends), parent) if ends else (-1, 0)
        if not n:
            return found
        created = self._store(lookup, 0, parent, ends[:n], ctx, self._tenancy.mode == "shared", adopt=tier)
        return None if created else found

    def _tier_tokens(self, path: list[Block], partial_tokens: int) -> dict[str, int]:
        tiers = self._tiers
        assert tiers is not None
        out = {t.name: 0 for t in tiers.tiers}
        for i, block in enumerate(path):
            if block.tiers:
                n = partial_tokens if partial_tokens and i == len(path) - 1 else block.num_tokens
                out[tiers.top_tier(block).name] += n
        return out

    # ================================================================ lookup

    def _context_name(self, ctx: CacheContext) -> tuple[Any, ...]:
        return (ctx.model, ctx.adapter, ctx.tokenizer, ctx.extra_key)

    def _root(self, ctx: CacheContext, namespace: str, create: bool = True) -> tuple[Block, Hasher] | None:
        name = (namespace, ctx.model, ctx.adapter, ctx.tokenizer, ctx.extra_key)
        entry = self._roots.get(name)
        if entry is None and create:
            model_epoch = self._epochs.get((ctx.model, None), 0)
            adapter_epoch = self._epochs.get((ctx.model, ctx.adapter), 0) if ctx.adapter is not None else 0
            enc = root_encoding(self.config.seed, ctx, namespace, model_epoch, adapter_epoch)
            hasher = self._hash()
            hasher.update(enc)
            root = Block(hasher.copy().digest(), None, b"", None, namespace, namespace == PUBLIC)
            root.ctx_name, root.ctx_enc = name, enc
            entry = self._roots[name] = (root, hasher)
        return entry

    def _drop_if_empty(self, root: Block) -> None:
        """Forget a context root that no block belongs to, so that contexts seen once (a
        tenant that never inserts, a one-off ``extra``) do not accumulate."""
        if not root.members and not root.pins and self._roots.get(root.ctx_name, (None,))[0] is root:
            del self._roots[root.ctx_name]

    def _lookup(self, tokens: Tokens, ctx: CacheContext, segments: Sequence[Segment] | None) -> Lookup:
        if not isinstance(ctx, CacheContext):
            raise TypeError(f"ctx must be a CacheContext, got {type(ctx).__name__}")
        data = token_bytes(tokens, self.config.vocab_size)
        segs = Segments.of(segments, len(data) // 4)
        own = self._root(ctx, self._tenancy.namespace(ctx.tenant))
        assert own is not None
        entries = [own]
        if self._tenancy.mode != "shared":
            public = self._root(ctx, PUBLIC, create=False)
            if public is not None and public[0].children:
                entries.append(public)
        oneshot = self._oneshot
        chains = [KeyChain(hasher, data, segs, root.ctx_enc, oneshot) for root, hasher in entries]
        return Lookup(data, segs, chains, [root for root, _ in entries])

    def _alive(self) -> Callable[[Block], bool]:
        ttl = self.config.ttl_seconds
        if ttl is None:
            return always_alive
        horizon = self._clock() - ttl
        return lambda block: block.last_access >= horizon

    def _find(self, lookup: Lookup, alive: Callable[[Block], bool]) -> tuple[Block | None, list[RunSpan]]:
        """The deepest verified cached full block for this lookup, and its path."""
        bs = self.config.block_size
        n_full = len(lookup.data) // 4 // bs
        deepest = self._tree.deepest(lookup, n_full, bs, alive)
        spans = runs_to(deepest)
        if self._tree.verify(lookup, spans):
            return deepest, spans
        self._stats.collisions += 1
        path = self._tree.walk(lookup, n_full, bs, alive)
        deepest = path[-1] if path else None
        return deepest, runs_to(deepest)

    def _touch(self, spans: list[RunSpan], partial: Block | None) -> None:
        """Tell the policies (and the TTL clock) about a hit, deepest block first so
        that every ancestor ends up at least as recent as its descendants."""
        keys = keys_of(spans)
        if partial is not None:
            keys.insert(0, partial.key)
        if not self._tenancy.partitioned:
            self._tenancy.pools[GLOBAL].policy.access_many(keys)
        if not self._tenancy.partitioned and self._ttl is None:
            return
        deepest_first = blocks_of(spans)[::-1]
        if partial is not None:
            deepest_first.insert(0, partial)
        if self._tenancy.partitioned:
            by_pool: dict[str, list[bytes]] = {}
            for block in deepest_first:
                assert block.pool is not None
                by_pool.setdefault(block.pool.name, []).append(block.key)
            for name, pool_keys in by_pool.items():
                self._tenancy.pools[name].policy.access_many(pool_keys)
        if self._ttl is not None:
            now, ttl = self._clock(), self._ttl
            for block in deepest_first:
                block.last_access = now
                ttl.move_to_end(block.key)

    def _match(
        self,
        lookup: Lookup,
        ctx: CacheContext,
        alive: Callable[[Block], bool],
        found: tuple[Block | None, list[RunSpan]] | None = None,
    ) -> tuple[Block | None, int, int, Block | None]:
        """Find (unless ``found`` is this lookup's search already made), pin, touch and
        count: (pinned block, full blocks, partial tokens, deepest)."""
        deepest, spans = found if found is not None else self._find(lookup, alive)
        bs = self.config.block_size
        n_tokens = len(lookup.data) // 4
        n_blocks = deepest.end // bs if deepest is not None else 0
        partial, partial_len = None, 0
        if self.config.partial_blocks and n_blocks * bs < n_tokens:
            parents = [deepest] if deepest is not None else list(lookup.roots)
            partial, partial_len = self._tree.partial(lookup, parents, n_blocks * bs, bs, alive)
        pinned = partial if partial is not None else deepest
        if pinned is not None:
            self._touch(spans, partial)
            pinned.pins += 1
        self._count_lookup(ctx.tenant, n_tokens, n_blocks * bs + partial_len, partial_len)
        return pinned, n_blocks, partial_len, deepest

    def _insert(
        self,
        lookup: Lookup,
        tokens: Tokens,
        ctx: CacheContext,
        segments: Sequence[Segment] | None,
        deepest: Block | None,
        kv: np.ndarray | None,
    ) -> int:
        """Store what ``lookup`` lacks; ``deepest`` is a search result to reuse (or None)."""
        n_tokens = len(lookup.data) // 4
        if n_tokens == 0:
            return 0
        stored = 0
        if self._tenancy.promotion is not None or self._declared:
            stored = self._promote(lookup, ctx, kv)
            if stored:
                lookup = self._lookup(tokens, ctx, segments)
        if deepest is None:
            deepest, _ = self._find(lookup, always_alive)  # an expired block is revived, not duplicated
        parent = deepest if deepest is not None else lookup.roots[0]
        bs = self.config.block_size
        ends = list(range(parent.end + bs, n_tokens + 1, bs))
        if self.config.partial_blocks and n_tokens % bs:
            ends.append(n_tokens)
        created = self._store(lookup, 0, parent, ends, ctx, self._tenancy.mode == "shared", kv)
        stored += created[-1].end - parent.end if created else 0
        self._stats.tenant(ctx.tenant).inserted_tokens += stored
        return stored

    def _count_lookup(self, tenant: str, n_tokens: int, hit: int, partial: int) -> None:
        for stats in (self._stats, self._stats.tenant(tenant)):
            stats.lookups += 1
            stats.lookup_tokens += n_tokens
            stats.hit_tokens += hit
            stats.hit_requests += hit > 0
        self._stats.partial_hit_tokens += partial

    # ================================================================ storing

    def _store(
        self,
        lookup: Lookup,
        which: int,
        parent: Block,
        ends: list[int],
        ctx: CacheContext,
        public: bool,
        kv: np.ndarray | None = None,
        adopt: int = -1,
    ) -> list[Block]:
        """Store the blocks ending at ``ends`` under ``parent``, keyed by the lookup's
        chain ``which``, as far as room allows; returns the blocks created. Public blocks
        belong to nobody, except in shared mode where the tenant that stored a block
        stays its owner (for ``purge``). With tiers, the blocks' bytes come from ``kv``,
        or, for ``adopt`` >= 0, are already in that tier."""
        if not ends:
            self._refresh_ttl(parent)
            return []
        owner = PUBLIC if public and self._tenancy.mode != "shared" else ctx.tenant
        pool = self._tenancy.pool_for(owner, public)
        begin = parent.end
        data, segs, root = lookup.data, lookup.segments, lookup.roots[which]
        # NOTE: the parent may be a leaf right now, and the root empty: both must survive
        # the eviction below (a pin keeps a block, and keeps a root in the root table).
        parent.pins += 1
        root.pins += 1
        try:
            room = self._make_room(pool, ends[-1] - begin)
        finally:
            parent.pins -= 1
            root.pins -= 1
        nodes, link, bs, has_segs = self._tree.nodes, self._tree.link, self.config.block_size, bool(segs.starts)
        created: list[Block] = []
        for key, end in zip(lookup.chains[which].many(ends), ends, strict=True):
            if end - begin > room:
                break
            extra = segs.enc_between(begin, end) if has_segs else b""
            tokens = data[4 * begin : 4 * end]
            existing = nodes.get(key)
            if existing is not None:
                if existing.parent is parent and existing.tokens == tokens and existing.extra == extra:
                    parent, begin = existing, end  # already cached (a partial tail the search skips)
                    continue
                self._stats.collisions += 1  # a hash collision: stop, never alias
                break
            if end - begin < bs:
                cover = self._covering_tail(parent, tokens, extra, owner)
                if cover is not None:  # a longer tail already holds this one
                    parent, begin = cover, end
                    break
            block = Block(key, parent, tokens, root, owner, public, extra, end)
            if has_segs:
                block.n_segments = parent.n_segments + segs.count_before(end) - segs.count_before(begin)
            block.pool = pool
            link(block)
            created.append(block)
            room -= end - begin
            parent, begin = block, end
        tiers = self._tiers
        if tiers is not None and created:
            first_parent = created[0].parent
            assert first_parent is not None
            created = self._place(tiers, created, kv, adopt)
            parent = created[-1] if created else first_parent
            begin = parent.end
        self._stats.declined_tokens += max(ends[-1] - begin, 0)
        if created:
            first = created[0].parent
            assert first is not None
            stored = created[-1].end - first.end
            pool.used += stored
            pool.blocks += len(created)
            self._used += stored
            root.members += len(created)
            Run(first, created, data[4 * first.end : 4 * created[-1].end])
            self._stored(created, stored, pool, ctx, public)
        self._refresh_ttl(parent)
        return created

    def _place(self, tiers: TieredStorage, created: list[Block], kv: np.ndarray | None, adopt: int) -> list[Block]:
        """Give new blocks their bytes in the tiers; the ones that got none leave the tree
        again (they were linked, but not yet counted anywhere)."""
        if adopt >= 0:
            for block in created:
                tiers.adopt(block, adopt)
            return created
        assert kv is not None
        placed = tiers.write(created, kv)
        for block in reversed(created[placed:]):
            self._tree.detach(block)
        return created[:placed]

    def _stored(self, created: list[Block], stored: int, pool: Pool, ctx: CacheContext, public: bool) -> None:
        """Tell the policy, the statistics and the events about ``stored`` new tokens."""
        insert = pool.policy.insert
        for block in reversed(created):
            insert(block.key, len(block.tokens) >> 2)
        self._supersede_tails(created[0])
        first_parent = created[0].parent
        assert first_parent is not None
        self._stats.inserted_tokens += stored
        self._stats.inserted_blocks += len(created)
        if self._events.capacity:
            parent_key = None if first_parent.is_root else first_parent.key
            keys = tuple(b.key for b in created)
            self._events.record(BlocksStored(keys, parent_key, stored, ctx.tenant, ctx.model, pool.name, public))

    def _refresh_ttl(self, block: Block) -> None:
        """A stored (or re-stored) block and its ancestors count as just used."""
        if self._ttl is None or block.is_root:
            return
        now, ttl = self._clock(), self._ttl
        for b in reversed(path_to(block)):
            b.last_access = now
            ttl[b.key] = b
            ttl.move_to_end(b.key)

    def _covering_tail(self, parent: Block, tokens: bytes, extra: bytes, owner: str) -> Block | None:
        for child in parent.children.values():
            if (
                child.owner == owner
                and not child.doomed
                and child.tokens.startswith(tokens)
                and child.extra.startswith(extra)
                and self._tree.nodes.get(child.key) is child
            ):
                return child
        return None

    def _supersede_tails(self, block: Block) -> None:
        """A partial tail is redundant once a sibling holds its tokens and more.

        NOTE: tails exist only with ``partial_blocks``; without it this is skipped, since a
        popular prefix can have thousands of children (with it, the partial search scans
        them on a miss anyway)."""
        parent = block.parent
        if parent is None or not self.config.partial_blocks:
            return
        for sibling in list(parent.children.values()):
            if (
                sibling is not block
                and sibling.num_tokens < block.num_tokens
                and sibling.num_tokens < self.config.block_size
                and sibling.owner == block.owner
                and sibling.extra == block.extra[: len(sibling.extra)]
                and block.tokens.startswith(sibling.tokens)
                and sibling.pins == 0
                and not sibling.children
            ):
                self._remove(sibling, RemovalReason.REPLACED)

    def _make_room(self, pool: Pool, need: int) -> int:
        """Evict until ``need`` tokens fit in ``pool`` and in the cache; returns how many
        tokens fit at most (``need`` when all do). Stale and expired blocks go first."""
        capacity = self.config.capacity
        need = min(need, pool.quota, capacity)
        while True:
            free = min(pool.quota - pool.used, capacity - self._used)
            if free >= need:
                return need
            if (self._stale or self._ttl) and self._reclaim_one():
                continue
            own_quota_binds = pool.used + need > pool.quota
            if own_quota_binds or not self._tenancy.partitioned:
                # NOTE: the common case, one pool to evict from: a tight loop, no re-checks.
                if not self._evict_from(pool, need - free):
                    return max(free, 0)
                continue
            victim = self._over_quota_victim(pool)
            if victim is None:
                return max(free, 0)
            self._remove(victim, RemovalReason.EVICTED, in_policy=False)

    def _evict_from(self, pool: Pool, tokens: int) -> bool:
        """Evict from ``pool`` until ``tokens`` are freed or nothing is evictable; returns
        whether anything was."""
        victim, nodes, evictable, remove = pool.policy.victim, self._tree.nodes, self._evictable, self._remove
        freed = 0
        while freed < tokens:
            key = victim(evictable)
            if key is None:
                return freed > 0
            block = nodes[key]  # type: ignore[index]
            freed += len(block.tokens) >> 2
            remove(block, RemovalReason.EVICTED, in_policy=False)
        return True

    def _evictable(self, key: Any) -> bool:
        block = self._tree.nodes[key]
        return block.pins == 0 and not block.children

    def _over_quota_victim(self, pool: Pool) -> Block | None:
        """When the cache is full but ``pool`` is within its quota: a block of a pool over
        its quota (a partitioned tenant never loses blocks to another tenant's burst while
        it stays within its share)."""
        for candidate in self._tenancy.over_quota() or [pool]:
            key = candidate.policy.victim(self._evictable)
            if key is not None:
                return self._tree.nodes[key]  # type: ignore[index]
        return None

    # ================================================================ removing

    def _remove(self, block: Block, reason: RemovalReason, in_policy: bool = True) -> None:
        pool, key = block.pool, block.key
        assert pool is not None and block.pins == 0 and not block.children
        self._tree.detach(block)
        if self._tiers is not None:
            self._tiers.forget(block, reason)
        if block.run is not None:
            block.run.truncate(block.run_index)
        if in_policy and not block.doomed:
            pool.policy.remove(key)
        if self._ttl is not None and self._ttl.get(key) is block:
            del self._ttl[key]
        n = len(block.tokens) >> 2
        pool.used -= n
        pool.blocks -= 1
        self._used -= n
        block.pool = None
        root = block.root
        root.members -= 1
        if not root.members:
            self._drop_if_empty(root)
        if reason is RemovalReason.EVICTED:
            pool.evictions += 1
            self._stats.evictions += 1
            self._stats.evicted_tokens += n
        else:
            counter = _REASON_COUNTER[reason]
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        if self._events.capacity:
            self._events.record(BlocksRemoved((block.key,), n, reason, pool.name))

    def _reclaim_one(self) -> bool:
        """Free one stale or expired block, if any can be freed now."""
        while self._stale:
            for block in self._stale[0]:
                if block.pool is not None and block.pins == 0 and not block.children:
                    self._remove(block, RemovalReason.STALE)
                    return True
            self._stale.popleft()
        if self._ttl:
            ttl = self.config.ttl_seconds
            assert ttl is not None
            horizon = self._clock() - ttl
            for block in self._ttl.values():
                if block.last_access >= horizon:
                    break
                if block.pins == 0 and not block.children:
                    self._remove(block, RemovalReason.EXPIRED)
                    return True
        return False

    def _release(self, block: Block) -> None:
        with self._lock:
            block.pins -= 1
            assert block.pins >= 0
            while (
                block.pins == 0 and block.pool is not None and not block.children and (block.doomed or block.root.stale)
            ):
                parent = block.parent
                self._remove(block, RemovalReason(block.doomed) if block.doomed else RemovalReason.STALE)
                if parent is None or parent.is_root:
                    break
                block = parent

    def _lose(self, block: Block) -> None:
        """A tier lost ``block``'s bytes (or held bad ones): it and what hangs below it
        leave the tree, since nothing below can be loaded without it."""
        self._purge_subtree(block, RemovalReason.LOST)

    def _purge_subtree(self, top: Block, reason: RemovalReason = RemovalReason.PURGED) -> int:
        removed = 0
        for block in list(postorder(top)):
            if block.pool is None:
                continue
            removed += block.num_tokens
            if block.pins == 0 and not block.children:
                self._remove(block, reason)
            elif not block.doomed:
                # NOTE: in use right now; make it unmatchable at once and free it on release
                self._tree.unlink(block)
                block.pool.policy.remove(block.key)
                if self._ttl is not None and self._ttl.get(block.key) is block:
                    del self._ttl[block.key]
                block.doomed = reason
        return removed

    # ================================================================ promotion

    def _promote(self, lookup: Lookup, ctx: CacheContext, kv: np.ndarray | None) -> int:
        """Copy the prefix of this request that has become public -- declared by an
        operator, or sent by enough distinct tenants -- under the public root. Returns
        how many tokens were stored there."""
        bs = self.config.block_size
        n_full = len(lookup.data) // 4 // bs
        depth, tenants = self._declared_depth(lookup.data, ctx), 0
        promo = self._tenancy.promotion
        public = self._root(ctx, PUBLIC)
        assert public is not None
        chain = KeyChain(public[1], lookup.data, lookup.segments, public[0].ctx_enc, self._oneshot)
        if promo is not None:
            first = max(1, -(-promo.min_tokens // bs))
            ends = [bs * i for i in range(first, n_full + 1)]
            keys = chain.many(ends)
            for i, key in zip(range(first, n_full + 1), keys, strict=True):
                node = self._tree.nodes.get(key)
                if node is not None and node.public:
                    depth = max(depth, i)
                    continue
                seen = self._tenancy.count(key, ctx.tenant)
                if seen >= promo.min_tenants and i > depth:
                    depth, tenants = i, seen
        if depth == 0:
            self._drop_if_empty(public[0])
            return 0
        pub_lookup = Lookup(lookup.data, lookup.segments, [chain], [public[0]])
        path = self._tree.walk(pub_lookup, depth, bs, always_alive)
        if len(path) >= depth:
            return 0
        parent = path[-1] if path else public[0]
        ends = [bs * (i + 1) for i in range(len(path), depth)]
        created = self._store(pub_lookup, 0, parent, ends, ctx, True, kv)
        for block in path_to(created[-1]) if created else ():
            self._tenancy.forget(block.key)
        if created:
            self._stats.promoted_blocks += len(created)
            stored = created[-1].end - parent.end
            self._events.record(PrefixPromoted(tuple(b.key for b in created), stored, ctx.model, tenants))
            return stored
        return 0

    def _declared_depth(self, data: bytes, ctx: CacheContext) -> int:
        if not self._declared:
            return 0
        name, bs, best = self._context_name(ctx), self.config.block_size, 0
        for declared, declared_name in self._declared:
            if declared_name == name:
                best = max(best, common_tokens(declared, data) // bs)
        return best
