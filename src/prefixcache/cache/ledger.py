"""The ledger: the metadata state machine of one cache. It decides; it never moves bytes.

It owns the block tree, the pins, the pools with their quotas and policies, TTLs,
stale roots awaiting reclaim, purges, and (``books``) the residency of every block in
every tier. Its one owner (``owner.py``) calls it under the cache's lock. An insert with KV takes two calls:
``plan_chain`` decides the new blocks (unlinked, their room reserved, the tier each
enters) and ``commit_chain`` links those whose bytes landed; between them the bytes
move, outside the lock. Metadata-only inserts (the simulator) link at once.

Invalidation never scans on the request path: ``bump_epoch`` changes the context root
(so every old key is unreachable at once) and queues the old roots; their blocks are
reclaimed, children first, before any live block is evicted (invariant 7). How blocks
leave is its component ``life`` (``lifecycle.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.cache.contexts import Contexts
from prefixcache.cache.lifecycle import Lifecycle
from prefixcache.cache.plans import Chain, Found, Matched
from prefixcache.cache.publish import Publisher
from prefixcache.cache.residency import Books
from prefixcache.cache.retention import Keeper, Level, Retained
from prefixcache.cache.stats import Counters
from prefixcache.cache.tree import (
    Block,
    BlockTree,
    Lookup,
    Node,
    Pin,
    Root,
    Run,
    RunSpan,
    always_alive,
    blocks_of,
    keys_of,
    path_to,
    runs_to,
)
from prefixcache.config import CacheConfig
from prefixcache.events import BlocksStored, EventLog, PrefixPublished
from prefixcache.hashing import CacheContext
from prefixcache.tenancy import GLOBAL, PUBLIC, Tenancy

__all__ = ["Ledger"]

Alive = Callable[[Block], bool]


class Ledger:
    """Tree, pools, pins, TTL, stale reclaim, purge and residency: one state machine.
    ``life`` (``lifecycle.py``) is how blocks leave, over the same tree, pools and books."""

    def __init__(self, config: CacheConfig, contexts: Contexts, clock: Callable[[], float], books: Books | None):
        self.config = config
        self.contexts = contexts
        self.tree = BlockTree()
        self.tenancy = Tenancy(config)
        self.books = books
        self.publisher = Publisher(config, self.tenancy)
        self.events = EventLog(config.events_capacity)
        self.counters = Counters()
        self.inflight: dict[bytes, Block] = {}  # keys of decided blocks whose bytes are on their way
        self._clock = clock
        levels = [Level("cache", config.capacity, True)]
        if books is not None:
            last = len(books.tiers) - 1
            levels += [Level(tier.name, tier.capacity, False, tier.index == last) for tier in books.tiers]
        self.keeper = Keeper(config.retention, levels, clock)
        if books is not None:
            books.keeper = self.keeper
        self.life = Lifecycle(
            config, contexts, self.tree, self.tenancy, books, self.events, self.counters, clock, self.keeper
        )

    # ================================================================ lookup and match

    def lookup(self, tokens: object, ctx: CacheContext, segments: object, *, probing: bool = False) -> Lookup:
        """The request's chains. ``probing`` (a match or a peek that may ask the tiers): the
        public chain too, even with nothing of it in the tree (``plan_probe``)."""
        namespace = self.tenancy.namespace(getattr(ctx, "tenant", ""))
        # NOTE: strict isolation never reads the public root, not even blocks a tier holds
        # that another server published there (a Redis shared with a server not strict)
        public = self.tenancy.mode != "shared" and not self.config.strict_isolation
        # NOTE: a probing tier may hold published blocks of the public root that this tree
        # never saw (warmed offline, published by another server): look there too.
        books = self.books
        probe_public = (
            probing
            and public
            and books is not None
            and (not self.tenancy.partitioned or self.tenancy.has_public_pool)
            and any(t.probes for t in books.tiers)
        )
        return self.contexts.lookup(tokens, ctx, segments, namespace, public, probe_public)  # type: ignore[arg-type]

    def alive(self) -> Alive:
        ttl = self.config.ttl_seconds
        if ttl is None:
            return always_alive
        horizon = self._clock() - ttl
        return lambda block: block.last_access >= horizon

    def find(self, lookup: Lookup, alive: Alive, *, count: bool = True) -> Found:
        """The deepest verified cached full block for this lookup, and its path. A caught
        hash collision is counted unless ``count`` is off (a peek, which must change nothing)."""
        bs = self.config.block_size
        n_full = len(lookup.data) // 4 // bs
        deepest = self.tree.deepest(lookup, n_full, bs, alive)
        spans = runs_to(deepest)
        if self.tree.verify(lookup, spans):
            return deepest, spans
        if count:
            self.counters.count_collision()
        path = self.tree.walk(lookup, n_full, bs, alive)
        deepest = path[-1] if path else None
        return deepest, runs_to(deepest)

    def match(self, lookup: Lookup, ctx: CacheContext, alive: Alive, found: Found | None = None) -> Matched:
        """Find (unless ``found`` is this lookup's search already made), pin, touch, count."""
        deepest, spans = found if found is not None else self.find(lookup, alive)
        bs = self.config.block_size
        n_tokens = len(lookup.data) // 4
        n_blocks = deepest.end // bs if deepest is not None else 0
        partial, partial_len = self.partial(lookup, deepest, alive)
        pinned = partial if partial is not None else deepest
        pin = None
        if pinned is not None:
            self._touch(spans, partial)
            pin = Pin([pinned])
            if self.keeper.active:
                self.keeper.extend(blocks_of(spans) + ([partial] if partial is not None else []))
        self.counters.count_lookup(ctx.tenant, n_tokens, n_blocks * bs + partial_len, partial_len)
        return Matched(pin, pinned, n_blocks, partial_len, deepest)

    def partial(self, lookup: Lookup, deepest: Block | None, alive: Alive) -> tuple[Block | None, int]:
        """With ``partial_blocks``: the cached block sharing the most leading tokens with
        the request's block after ``deepest``, and how many it shares. Reads only."""
        bs = self.config.block_size
        begin = deepest.end if deepest is not None else 0
        if not self.config.partial_blocks or begin >= len(lookup.data) // 4:
            return None, 0
        parents: list[Node] = [deepest] if deepest is not None else list(lookup.roots)
        return self.tree.partial(lookup, parents, begin, bs, alive)

    def retain(self, lookup: Lookup, ctx: CacheContext, seconds: float) -> Retained:
        """Retain the cached blocks of ``lookup``'s tokens (whole blocks, and a partial
        tail holding exactly the rest) for ``ctx``'s tenant (``retention.py``)."""
        alive = self.alive()
        deepest, spans = self.find(lookup, alive, count=False)
        path = blocks_of(spans)
        partial, shared = self.partial(lookup, deepest, alive)
        if partial is not None and shared == partial.num_tokens and partial.end == len(lookup.data) // 4:
            path.append(partial)
        return self.keeper.retain(ctx.tenant, path, seconds, self._levels_of)

    def _levels_of(self, block: Block) -> int:
        """The retention levels ``block`` is counted in: the cache, and each tier that has it."""
        return 1 if self.books is None else 1 | self.books.avail(block) << 1

    def _touch(self, spans: list[RunSpan], partial: Block | None) -> None:
        """Tell the policies (and the TTL clock) about a hit, deepest block first so
        that every ancestor ends up at least as recent as its descendants."""
        keys = keys_of(spans)
        if partial is not None:
            keys.insert(0, partial.key)
        partitioned = self.tenancy.partitioned
        if not partitioned:
            self.tenancy.pools[GLOBAL].policy.access_many(keys)
            if self.life.ttl is None:
                return
        deepest_first = blocks_of(spans)[::-1]
        if partial is not None:
            deepest_first.insert(0, partial)
        if partitioned:
            by_pool: dict[str, list[bytes]] = {}
            for block in deepest_first:
                assert block.pool is not None
                by_pool.setdefault(block.pool.name, []).append(block.key)
            for name, pool_keys in by_pool.items():
                self.tenancy.pools[name].policy.access_many(pool_keys)
        if self.life.ttl is not None:
            now, ttl = self._clock(), self.life.ttl
            for block in deepest_first:
                block.last_access = now
                ttl.move_to_end(block.key)

    # ================================================================ storing

    def extend(self, lookup: Lookup, ctx: CacheContext, deepest: Block | None, *, tiers: bool) -> Chain | None:
        """What an insert of ``lookup``'s tokens stores after its deepest cached block
        (``deepest``: a search result to reuse, or None to search): None when nothing."""
        n_tokens = len(lookup.data) // 4
        if deepest is None:
            deepest, _ = self.find(lookup, always_alive)  # an expired block is revived, not duplicated
        parent: Node = deepest if deepest is not None else lookup.roots[0]
        bs = self.config.block_size
        ends = list(range(parent.end + bs, n_tokens + 1, bs))
        if self.config.partial_blocks and n_tokens % bs:
            ends.append(n_tokens)
        return self.plan_chain(lookup, 0, parent, ends, ctx, self.tenancy.mode == "shared", tiers=tiers)

    def plan_chain(
        self,
        lookup: Lookup,
        which: int,
        parent: Node,
        ends: list[int],
        ctx: CacheContext,
        public: bool,
        *,
        tiers: bool,
    ) -> Chain | None:
        """Decide the blocks ending at ``ends`` under ``parent``, keyed by the lookup's chain
        ``which``, as far as room allows: created, not linked, room reserved. Public blocks
        belong to nobody, except in shared mode where the tenant that stored a block
        stays its owner (for ``purge``). With ``tiers``, each block also gets the tier it
        enters and a frame's room there."""
        if not ends:
            self.life.refresh_ttl(parent)
            return None
        owner = PUBLIC if public and self.tenancy.mode != "shared" else ctx.tenant
        pool = self.tenancy.pool_for(owner, public)
        begin = parent.end
        data, segs, root = lookup.data, lookup.segments, lookup.roots[which]
        # NOTE: the parent may be a leaf now, the root empty; both, and every cached block
        # the chain skips, must stay while room is made (a pin keeps a block in its tiers).
        pins = [Pin([parent, root])]
        room = self.life.make_room(pool, ends[-1] - begin)
        nodes, bs, has_segs, books = self.tree.nodes, self.config.block_size, bool(segs.starts), self.books
        blocks: list[Block] = []
        keys: set[bytes] = set()
        placed: list[int] = []
        last: Node = parent
        entry = books.entry_tier(parent) if tiers and books is not None else 0
        for key, end in zip(lookup.chains[which].many(ends), ends, strict=True):
            if end - begin > room:
                break
            extra = segs.enc_between(begin, end) if has_segs else b""
            tokens = data[4 * begin : 4 * end]
            existing = nodes.get(key)
            if existing is None and key in keys:
                self.counters.count_collision()  # a weak hash gave two blocks of this chain one key
                break
            if existing is not None:
                if not blocks and existing.parent is last and existing.tokens == tokens and existing.extra == extra:
                    last, begin = existing, end  # already cached (a partial tail the search skips)
                    pins.append(Pin([existing]))
                    if tiers and books is not None:
                        entry = books.entry_tier(existing)
                    continue
                self.counters.count_collision()  # a hash collision: stop, never alias
                break
            if key in self.inflight or (books is not None and books.busy(key)):
                break  # another insert is writing it, or a removed block's frames are still in use
            if end - begin < bs:
                cover = self._covering_tail(last, tokens, extra, owner)
                if cover is not None:  # a longer tail already holds this one
                    last, begin = cover, end
                    break
            if tiers:
                entry = self._place(entry)
                if entry < 0:
                    break
                placed.append(entry)
            block = Block(key, last, tokens, root, owner, public, extra, end)
            if has_segs:
                block.n_segments = last.n_segments + segs.count_before(end) - segs.count_before(begin)
            blocks.append(block)
            keys.add(key)
            room -= end - begin
            last, begin = block, end
        first_parent = blocks[0].parent if blocks else last
        for pin in pins:
            pin.release()
        self.counters.count_declined(max(ends[-1] - begin, 0))
        if not blocks:
            self.life.refresh_ttl(last)
            return None
        chain = Chain(first_parent, root, blocks, pool, ctx, public, Pin([first_parent, root]), 0, placed)
        chain.reserved = chain.end - first_parent.end
        pool.used += chain.reserved
        self.life.used += chain.reserved
        if tiers:
            for block in blocks:
                self.inflight[block.key] = block
        return chain

    def publish(self, lookup: Lookup, ctx: CacheContext, *, tiers: bool) -> Chain | None:
        """The public copy this request's prefix is owed (declared by an operator, or sent
        by enough distinct tenants), as a chain under the public root; None when there is
        nothing to add there."""
        entry = self.contexts.root(ctx, PUBLIC)
        assert entry is not None
        chain = self.contexts.chain(entry, lookup)
        depth, tenants = self.publisher.depth(lookup.data, ctx, chain, self.tree)
        if depth == 0:
            self.contexts.drop_if_empty(entry[0])
            return None
        bs = self.config.block_size
        public = Lookup(lookup.data, lookup.segments, [chain], [entry[0]])
        path = self.tree.walk(public, depth, bs, always_alive)
        if len(path) >= depth:
            return None
        parent: Node = path[-1] if path else entry[0]
        ends = [bs * (i + 1) for i in range(len(path), depth)]
        planned = self.plan_chain(public, 0, parent, ends, ctx, True, tiers=tiers)
        if planned is not None:
            planned.tenants = tenants
        return planned

    def commit(self, chain: Chain, n: int) -> list[Block]:
        """``commit_chain``, plus what a published chain owes: the tenants' counts of its
        prefix are forgotten, the publication counted."""
        linked = self.commit_chain(chain, n)
        if linked and chain.tenants >= 0:
            stored = linked[-1].end - chain.parent.end
            for block in path_to(linked[-1]):
                self.tenancy.forget(block.key)
            self.counters.count_published(len(linked))
            self.events.record(PrefixPublished(tuple(b.key for b in linked), stored, chain.ctx.model, chain.tenants))
        return linked

    def _stored(self, chain: Chain | None) -> int:
        """Commit a metadata-only chain whole; the tokens it stored."""
        if chain is None:
            return 0
        linked = self.commit(chain, len(chain.blocks))
        return linked[-1].end - chain.parent.end if linked else 0

    def insert(self, tokens: object, ctx: CacheContext, segments: object, deepest: Block | None = None) -> int:
        """A metadata-only insert: publish what is owed, then store what the lookup lacks."""
        lookup = self.lookup(tokens, ctx, segments)
        if not lookup.data:
            return 0
        stored = 0
        if self.publisher.active:
            stored = self._stored(self.publish(lookup, ctx, tiers=False))
            if stored:
                lookup = self.lookup(tokens, ctx, segments)
                deepest = None
        return stored + self._stored(self.extend(lookup, ctx, deepest, tiers=False))

    def access(self, tokens: object, ctx: CacheContext, segments: object) -> tuple[int, int]:
        """Match, insert, release as one step (what a simulator does with each request).
        It searches the tree once when no TTL or publication can make the insert see
        another tree."""
        lookup = self.lookup(tokens, ctx, segments)
        matched = self.match(lookup, ctx, self.alive())
        reuse = self.life.ttl is None and not self.publisher.active
        try:
            if reuse:
                stored = self._stored(self.extend(lookup, ctx, matched.deepest, tiers=False)) if lookup.data else 0
            else:
                stored = self.insert(tokens, ctx, segments)
        finally:
            if matched.pin is not None:
                self.life.unpin(matched.pin)
        self.contexts.drop_if_empty(lookup.roots[0])
        return matched.num_blocks * self.config.block_size + matched.partial_tokens, stored

    def _place(self, entry: int) -> int:
        """The tier a new block enters: the first from ``entry`` down that can make room
        for its frame (reserved there); -1 when none can."""
        books = self.books
        assert books is not None
        for k in range(entry, len(books.tiers)):
            if self.life.tier_room(k, 1) >= 1:
                books.tiers[k].used += 1
                return k
        return -1

    def commit_chain(self, chain: Chain, n: int) -> list[Block]:
        """Link the first ``n`` blocks of a planned chain (their bytes landed) and give
        back what the rest reserved. Nothing links under a parent that left meanwhile."""
        blocks = chain.blocks
        for block in blocks:
            self.inflight.pop(block.key, None)
        parent = chain.parent
        if _left(parent) or self._voided(chain):
            n = 0
        linked = blocks[:n]
        stored = linked[-1].end - parent.end if linked else 0
        pool = chain.pool
        pool.used -= chain.reserved - stored
        self.life.used -= chain.reserved - stored
        if linked:
            self._link(chain, linked, stored)
        self.life.unpin(chain.pin)  # NOTE: after linking, so that a parent with new children stays
        return linked

    def _voided(self, chain: Chain) -> bool:
        """Whether a purge or an epoch bump made after ``chain`` was decided covers it: its
        blocks then never link, wherever their bytes went (issue 39, finding 9)."""
        since = chain.since
        if since is None or not self.life.invalid.voids(since, chain.ctx, (chain.root.ctx_name,), chain.data):
            return False
        self.counters.count_voided(chain.end - chain.begin)
        return True

    def _link(self, chain: Chain, linked: list[Block], stored: int) -> None:
        parent, pool = chain.parent, chain.pool
        link = self.tree.link
        for block in linked:
            link(block)
            block.pool = pool
        pool.blocks += len(linked)
        chain.root.members += len(linked)
        run = Run(parent, linked, b"".join(b.tokens for b in linked))
        insert = pool.policy.insert
        for block in reversed(linked):
            insert(block.key, len(block.tokens) >> 2)
        self.life.new_children(parent, linked)
        self.life.supersede_tails(linked[0])
        self.counters.count_inserted(chain.ctx.tenant, stored, len(linked))
        if self.events.capacity:
            parent_key = None if parent.is_root else parent.key
            keys = tuple(b.key for b in linked)
            self.events.record(
                BlocksStored(
                    keys, parent_key, stored, chain.ctx.tenant, chain.ctx.model, pool.name, chain.public, run.src
                )
            )
        self.life.refresh_ttl(linked[-1])

    def _covering_tail(self, parent: Node, tokens: bytes, extra: bytes, owner: str) -> Block | None:
        for child in parent.children.values():
            if (
                child.owner == owner
                and not child.doomed
                and child.tokens.startswith(tokens)
                and child.extra.startswith(extra)
                and self.tree.nodes.get(child.key) is child
            ):
                return child
        return None


def _left(node: Node) -> bool:
    """Whether a node has left the tree (or can no longer be reached) since it was pinned."""
    if isinstance(node, Root):
        return node.stale
    return node.pool is None or node.doomed != "" or node.root.stale
