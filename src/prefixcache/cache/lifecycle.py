"""How blocks leave: room in pools and tiers, removal for every reason, stale and
expired reclaim, purges and the end of a pin. A component the ledger holds
(``ledger.life``): the other half of the life of a block, and the state it needs of its
own (the stale roots, the TTL order, the tokens in use). It shares the tree, pools,
books, counters and event log with the ledger, and runs, as the ledger does, under the
cache's lock (``owner.py``).

A block leaves the cache when its pool's policy picks it, when it leaves the last tier
that held it, or for a reason of its own (``RemovalReason``); always childless and
unpinned. A pinned block that must go (a purge, a lost frame) is unlinked at once,
so no request finds it, and freed when its last pin is released.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prefixcache.cache.contexts import Contexts
from prefixcache.cache.invalidations import EpochBumped, GenerationRaised, Invalidations, PrefixPurged, TenantPurged
from prefixcache.cache.residency import Books
from prefixcache.cache.retention import Keeper
from prefixcache.cache.stats import Counters
from prefixcache.cache.tree import Block, BlockTree, Lookup, Node, Pin, Root, path_to, postorder, runs_to
from prefixcache.config import CacheConfig
from prefixcache.events import BlocksRemoved, EventLog, RemovalReason
from prefixcache.storage.base import Frame
from prefixcache.storage.queue import FrameSource
from prefixcache.tenancy import PUBLIC, Pool, Tenancy

__all__ = ["Lifecycle", "Purged"]


@dataclass(frozen=True, slots=True)
class Purged:
    """What a tenant purge did under the lock: the tokens it removed (or doomed, pinned),
    and the generation it raised, as (record name, generation), for the durable tiers to
    keep. ``generation`` is None in shared isolation, where the tenant has no namespace of
    its own, and when the namespace is at its last generation (``last``)."""

    removed: int
    generation: tuple[str, int] | None
    last: bool = False


class Lifecycle:
    """Room, removal, reclaim and unpinning over the ledger's state."""

    def __init__(
        self,
        config: CacheConfig,
        contexts: Contexts,
        tree: BlockTree,
        tenancy: Tenancy,
        books: Books | None,
        events: EventLog,
        counters: Counters,
        clock: Callable[[], float],
        keeper: Keeper,
    ) -> None:
        self.config = config
        self.contexts = contexts
        self.tree = tree
        self.tenancy = tenancy
        self.books = books
        self.events = events
        self.counters = counters
        self.stale: deque[Iterator[Block]] = deque()  # the blocks of stale roots, children first
        self.ttl: OrderedDict[bytes, Block] | None = OrderedDict() if config.ttl_seconds else None
        self.used = 0  # tokens held or reserved, in every pool
        self.invalid = Invalidations()  # purges and bumps, numbered: a store decided before one loses
        self.keeper = keeper  # retained blocks: never a pool's victim while their retention holds
        self._clock = clock

    # ================================================================ room in a pool

    def make_room(self, pool: Pool, need: int) -> int:
        """Evict until ``need`` tokens fit in ``pool`` and in the cache; returns how many
        tokens fit at most (``need`` when all do). Stale and expired blocks go first."""
        capacity = self.config.capacity
        need = min(need, pool.quota, capacity)
        while True:
            free = min(pool.quota - pool.used, capacity - self.used)
            if free >= need:
                return need
            if (self.stale or self.ttl) and self.reclaim_one():
                continue
            own_quota_binds = pool.used + need > pool.quota
            if own_quota_binds or not self.tenancy.partitioned:
                # NOTE: the common case, one pool to evict from: a tight loop, no re-checks.
                if not self._evict_from(pool, need - free):
                    return max(free, 0)
                continue
            victim = self._over_quota_victim(pool)
            if victim is None:
                return max(free, 0)
            self.remove(victim, RemovalReason.EVICTED, in_policy=False)

    def _evict_from(self, pool: Pool, tokens: int) -> bool:
        """Evict from ``pool`` until ``tokens`` are freed or nothing is evictable; returns
        whether anything was."""
        victim, nodes, evictable, remove = pool.policy.victim, self.tree.nodes, self._evictable, self.remove
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
        block = self.tree.nodes[key]
        return block.pins == 0 and not block.children and (block.retainer is None or not self.keeper.holds(block))

    def _over_quota_victim(self, pool: Pool) -> Block | None:
        """When the cache is full but ``pool`` is within its quota: a block of a pool over
        its quota (a partitioned tenant never loses blocks to another tenant's burst while
        it stays within its share)."""
        for candidate in self.tenancy.over_quota() or [pool]:
            key = candidate.policy.victim(self._evictable)
            if key is not None:
                return self.tree.nodes[key]  # type: ignore[index]
        return None

    # ================================================================ room in a tier

    def tier_room(self, k: int, n: int) -> int:
        """Make room for ``n`` frames in tier ``k``; returns how many fit. Stale and expired
        blocks go first (invariant 7); a victim whose only copy is here goes down a tier
        (or, when it cannot and has no children, out of the cache)."""
        books = self.books
        assert books is not None
        tier = books.tiers[k]
        while tier.free < n:
            if (self.stale or self.ttl) and self.reclaim_one():
                continue
            picked = books.victim(k)
            if picked is None:
                break
            key, block = picked
            if block is None:
                books.drop_orphan(k, key)
            elif not books.only_copy(k, block):
                books.leave(k, block)
            elif not self._demote(k, block):
                break
        return min(tier.free, n)

    def _demote(self, k: int, block: Block) -> bool:
        """``block``'s only copy leaves tier ``k``: down a tier, or out of the cache when it
        cannot go down and nothing hangs below it; False when it must stay."""
        books = self.books
        assert books is not None
        with Pin([block]):  # NOTE: making room below must not take it out of the tree
            below = books.may_demote(k, block) and self.tier_room(k + 1, 1) >= 1
            if below:
                books.tiers[k + 1].used += 1
        if below:
            if not books.demote(k, block):
                self.lose(block)  # its frame could not be handed on: gone with what hangs below
            return True
        if block.children or self.keeper.holds(block):
            books.keep(k, block)  # NOTE: retained, it stays where it is rather than leave the cache
            return False
        books.leave(k, block)
        self.remove(block, RemovalReason.EVICTED)
        return True

    def copy_down(self, block: Block, k: int, frame: Frame) -> None:
        """Queue a copy of ``block`` (which a faster tier holds) into tier ``k``: adopted
        instead when that tier found its frame on open; dropped (counted) when the queue
        or the tier has no room. A block that is stale or going is not copied."""
        books = self.books
        assert books is not None
        tier = books.tiers[k]
        if block.pool is None or block.doomed or block.root.stale or books.avail(block) & tier.bit:
            return  # going, or already there (or on its way: a demotion made room meanwhile)
        if block.key in tier.orphans:  # already there, from before a restart
            books.adopt(block, k)
            return
        with Pin([block]):  # NOTE: making room may reclaim stale blocks: never this one
            room = books.queue.fits(len(frame)) and self.tier_room(k, 1) >= 1
        if not room:
            tier.counts.dropped()
            return
        tier.used += 1
        books.queue_put(block, k, FrameSource(frame, len(frame)))

    # ================================================================ leaves

    def new_children(self, parent: Node, linked: list[Block]) -> None:
        """Tell a policy that ranks leaves (``tracks_leaves``) which blocks just stopped
        being leaves: each of a new chain but its deepest, and its parent when the chain
        is that block's first child. (``remove`` tells it of the reverse.)

        NOTE: after the chain's ``insert`` calls, in this order, as the compiled kernel
        does: where a policy groups entries, which group comes first depends on it."""
        policy = linked[0].pool.policy if linked[0].pool is not None else None
        if policy is not None and policy.tracks_leaves:
            for block in linked[:-1]:
                policy.set_leaf(block.key, False)
        if isinstance(parent, Block) and len(parent.children) == 1:
            _leaf_news(parent, False)

    # ================================================================ removing

    def remove(self, block: Block, reason: RemovalReason, in_policy: bool = True) -> None:
        pool, key = block.pool, block.key
        assert pool is not None and block.pins == 0 and not block.children
        self.keeper.leave(block)
        self.tree.detach(block)
        if self.books is not None:
            self.books.forget(block, reason)
        if block.run is not None:
            block.run.truncate(block.run_index)
        if in_policy and not block.doomed:
            pool.policy.remove(key)
        parent = block.parent
        if not parent.children and isinstance(parent, Block):
            _leaf_news(parent, True)
        if self.ttl is not None and self.ttl.get(key) is block:
            del self.ttl[key]
        n = len(block.tokens) >> 2
        pool.used -= n
        pool.blocks -= 1
        self.used -= n
        block.pool = None
        root = block.root
        root.members -= 1
        if not root.members:
            self.contexts.drop_if_empty(root)
        self.counters.count_removal(reason, n, pool)
        if self.events.capacity:
            self.events.record(BlocksRemoved((block.key,), n, reason, pool.name))

    def reclaim_one(self) -> bool:
        """Free one stale or expired block, if any can be freed now."""
        while self.stale:
            for block in self.stale[0]:
                if block.pool is not None and block.pins == 0 and not block.children:
                    self.remove(block, RemovalReason.STALE)
                    return True
            self.stale.popleft()
        if self.ttl:
            ttl = self.config.ttl_seconds
            assert ttl is not None
            horizon = self._clock() - ttl
            for block in self.ttl.values():
                if block.last_access >= horizon:
                    break
                if block.pins == 0 and not block.children:
                    self.remove(block, RemovalReason.EXPIRED)
                    return True
        return False

    def unpin(self, pin: Pin) -> None:
        """Release ``pin``; what was removed (or made stale) while pinned is freed now,
        from the deepest pinned block up."""
        if pin.released:
            return
        pin.release()
        deepest = next((node for node in reversed(pin.nodes) if not node.is_root), None)
        block: Node | None = deepest
        while (
            isinstance(block, Block)
            and block.pins == 0
            and block.pool is not None
            and not block.children
            and (block.doomed or block.root.stale)
        ):
            parent = block.parent
            self.remove(block, RemovalReason(block.doomed) if block.doomed else RemovalReason.STALE)
            block = parent
        for node in pin.nodes:
            if node.is_root:
                self.contexts.drop_if_empty(node)  # type: ignore[arg-type]

    def lose(self, block: Block) -> None:
        """A tier lost ``block``'s bytes (or held bad ones): it and what hangs below it leave
        the tree, since nothing below can be loaded without it."""
        self.purge_subtree(block, RemovalReason.LOST)

    def purge_subtree(self, top: Node, reason: RemovalReason = RemovalReason.PURGED) -> int:
        removed = 0
        for block in list(postorder(top)):
            if block.pool is None:
                continue
            removed += block.num_tokens
            if block.pins == 0 and not block.children:
                self.remove(block, reason)
            elif not block.doomed:
                # NOTE: in use right now; make it unmatchable at once and free it on release
                self.tree.unlink(block)
                block.pool.policy.remove(block.key)
                if self.ttl is not None and self.ttl.get(block.key) is block:
                    del self.ttl[block.key]
                self.keeper.leave(block)
                block.doomed = reason
        return removed

    def purge(self, tenant: str) -> Purged:
        """Remove what this tree holds of ``tenant`` now; and, where the tenant has a key
        namespace of its own (not in shared isolation), raise that namespace's generation,
        so that no key of its old blocks is computed again: what a tier holds of them (a
        disk after a restart, another server's Redis) is never found. Its roots go stale,
        and whatever hangs there still is reclaimed first, as after an epoch bump."""
        self.counters.count_purge()
        self.invalid.record(TenantPurged(tenant))
        tops = [
            b for b in self.tree.nodes.values() if b.owner == tenant and (b.parent.is_root or b.parent.owner != tenant)
        ]
        removed = sum(self.purge_subtree(b) for b in tops)
        if self.tenancy.mode == "shared":
            return Purged(removed, None)
        raised = self.contexts.next_generation(self.tenancy.namespace(tenant))
        if raised is None:
            return Purged(removed, None, last=True)
        name, generation, stale = raised
        self._reclaim_first(stale)
        return Purged(removed, (name, generation))

    def raise_generation(self, name: str, to: int) -> None:
        """Another server's purge, read from a tier: the namespace named ``name`` goes to
        generation ``to`` (above this cache's), its roots stale, as ``purge`` leaves them."""
        self._reclaim_first(self.contexts.raise_generation(name, to))
        self.invalid.record(GenerationRaised(name, self.config.seed))

    def _reclaim_first(self, stale: list[Root]) -> None:
        for root in stale:
            self.stale.append(postorder(root))

    def purge_prefix(self, lookup: Lookup) -> int:
        n_tokens, bs = len(lookup.data) // 4, self.config.block_size
        n_full, tail = divmod(n_tokens, bs)
        self.counters.count_purge()
        # NOTE: the public root's name even when nothing hangs there yet: a publication of
        # this prefix decided before the purge must not land after it
        names = {root.ctx_name for root in lookup.roots} | {(PUBLIC, *lookup.roots[0].ctx_name[1:])}
        self.invalid.record(PrefixPurged(frozenset(names), lookup.data))
        parents: list[Node] = list(lookup.roots)
        if n_full:
            parents = []
            for chain in lookup.chains:
                node = self.tree.nodes.get(chain.at(n_full * bs))
                if node is not None and self.tree.verify(lookup, runs_to(node)):
                    parents.append(node)
        if not tail:
            return sum(self.purge_subtree(b) for b in parents)
        rest = lookup.data[4 * n_full * bs :]
        tops = [
            child
            for parent in parents
            for child in parent.children.values()
            if lookup.can_see(child) and child.tokens.startswith(rest)
        ]
        return sum(self.purge_subtree(b) for b in tops)

    def refresh_ttl(self, block: Node) -> None:
        """A stored (or re-stored) block and its ancestors count as just used."""
        if self.ttl is None or block.is_root:
            return
        now, ttl = self._clock(), self.ttl
        for b in reversed(path_to(block)):
            b.last_access = now
            ttl[b.key] = b
            ttl.move_to_end(b.key)

    def supersede_tails(self, block: Block) -> None:
        """A partial tail is redundant once a sibling holds its tokens and more.

        NOTE: tails exist only with ``partial_blocks``; without it this is skipped, since a
        popular prefix can have thousands of children (with it, the partial search scans
        them on a miss anyway)."""
        if not self.config.partial_blocks:
            return
        for sibling in list(block.parent.children.values()):
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
                self.remove(sibling, RemovalReason.REPLACED)

    def bump_epoch(self, model: str, adapter: str | None, to: int | None = None) -> int:
        """A new epoch for ``model`` (or one adapter of it): the next one, or ``to`` (an
        epoch another server or a tier's record knows, above this one)."""
        epoch, stale = self.contexts.bump(model, adapter, to)
        self._reclaim_first(stale)
        self.counters.count_epoch_bump()
        self.invalid.record(EpochBumped(model, adapter))
        return epoch

    def reclaim(self, max_blocks: int | None) -> int:
        done = 0
        while (max_blocks is None or done < max_blocks) and self.reclaim_one():
            done += 1
        return done


def _leaf_news(block: Block, leaf: bool) -> None:
    """``set_leaf`` for a block still in its pool's policy (not gone, not doomed)."""
    pool = block.pool
    if pool is not None and not block.doomed and pool.policy.tracks_leaves:
        pool.policy.set_leaf(block.key, leaf)
