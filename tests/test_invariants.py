"""Random sequences of match / insert / release / retain / bump_epoch / purge /
purge_prefix / clock steps, checked after every step against a reference model and the
invariants of design.md: no orphans, pinned never evicted, retained never evicted (nor
its tenant past its cap), capacity never exceeded, stale never matched, namespaces
never crossed, accounting exact, and (when nothing can be evicted) every cached prefix
found. With a memory tier (``tiered``), every match is
also loaded, and the KV loaded is the exact KV of the prefix (invariant 6); its stores
fail the test if called under the cache's lock (``guard_store``, invariant 9)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from guard_store import guard_stores  # noqa: F401  (autouse: no store call under a cache lock)
from prefixcache import CacheConfig, CacheContext, Match, PrefixCache, PublishConfig
from prefixcache.cache.tree import path_to
from prefixcache.config import RetentionConfig, TierConfig
from prefixcache.events import BlocksRemoved, RemovalReason
from prefixcache.tenancy import PUBLIC
from support import Clock, lcp
from tier_worker import frame_bytes, kv_for
from tier_worker import layout as tiny_layout

TENANTS = ("a", "b", "c")
MODELS = ("m1", "m2")
ADAPTERS = (None, "lora")
BS = 4

# Prompts are built from a few shared pieces, so that they share prefixes often.
PIECES = [list(range(10 * i, 10 * i + n)) for i, n in enumerate((3, 4, 5, 8, 9, 2))]
prompts = st.lists(st.sampled_from(range(len(PIECES))), min_size=0, max_size=5).map(
    lambda idx: [tok for i in idx for tok in PIECES[i]]
)

# Who sends what: the arguments of every rule that sends a request.
REQUEST = {
    "tenant": st.sampled_from(TENANTS),
    "model": st.sampled_from(MODELS),
    "adapter": st.sampled_from(ADAPTERS),
    "prompt": prompts,
}


@dataclass
class Reference:
    """What may be served: for each (namespace, model, adapter, epochs) the sequences
    inserted and not purged, with the time each prefix was last used."""

    seqs: dict[tuple[object, ...], dict[tuple[int, ...], float]] = field(default_factory=dict)
    # Promotion: distinct tenants per (context, block-aligned prefix), and the public prefixes.
    senders: dict[tuple[object, ...], set[str]] = field(default_factory=dict)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.held: list[tuple[Match, str]] = []
        self.ref = Reference()
        self.epochs: dict[tuple[str, str | None], int] = {}
        self.holding: set[bytes] = set()  # keys of the blocks retained after the last step
        self.sent: list[tuple[str, str, str | None, list[int]]] = []  # the prompts inserted, to retain

    @initialize(
        isolation=st.sampled_from(["shared", "namespace", "partitioned"]),
        policy=st.sampled_from(["lru", "fifo", "s3fifo", "sieve", "lfuda", "gittins"]),
        partial=st.booleans(),
        capacity_blocks=st.sampled_from([3, 8, 40, 10_000]),
        ttl=st.sampled_from([None, 5.0]),
        promote=st.booleans(),
        tiered=st.booleans(),
        share=st.sampled_from([0.25, 0.5, 1.0]),
        refuse_c=st.booleans(),
    )
    def setup(
        self,
        isolation: str,
        policy: str,
        partial: bool,
        capacity_blocks: int,
        ttl: float | None,
        promote: bool,
        tiered: bool,
        share: float,
        refuse_c: bool,
    ) -> None:
        publish = PublishConfig(min_tenants=2, min_tokens=2 * BS) if promote and isolation != "shared" else None
        # NOTE: a frame per token of capacity: a tier that never has to evict (every block
        # holds a token at least), so that the pools alone decide, as without tiers; a
        # run stores a few hundred blocks at most, hence the bound.
        frames = min(capacity_blocks * BS, 2048)
        tiers = (TierConfig(kind="memory", capacity_bytes=frames * frame_bytes()),) if tiered else ()
        self.tiered = tiered
        self.config = CacheConfig(
            tiers=tiers,
            kv_layout=tiny_layout() if tiered else None,
            writer="inline",
            publish=publish,
            block_size=BS,
            capacity_tokens=capacity_blocks * BS,
            policy=policy,
            isolation=isolation,
            partial_blocks=partial,
            ttl_seconds=ttl,
            retention=RetentionConfig(share=share, tenants={"c": 0.0} if refuse_c else {}),
        )
        self.cache = PrefixCache(self.config, clock=self.clock)
        # Completeness is only owed when nothing can ever be evicted or expire.
        self.roomy = capacity_blocks == 10_000 and ttl is None

    # ------------------------------------------------------------ reference

    def namespace(self, tenant: str) -> str:
        return PUBLIC if self.config.isolation == "shared" else tenant

    def ref_key(self, tenant: str, model: str, adapter: str | None) -> tuple[object, ...]:
        epochs = (self.epochs.get((model, None), 0), self.epochs.get((model, adapter), 0) if adapter else 0)
        return (self.namespace(tenant), model, adapter, epochs)

    def public_key(self, model: str, adapter: str | None) -> tuple[object, ...]:
        return (PUBLIC, *self.ref_key("-", model, adapter)[1:])

    def count_senders(self, tenant: str, model: str, adapter: str | None, prompt: list[int]) -> None:
        promo = self.config.publish
        assert promo is not None
        public = self.public_key(model, adapter)
        for end in range(promo.min_tokens // BS * BS, len(prompt) + 1, BS):
            if end < promo.min_tokens:
                continue
            senders = self.ref.senders.setdefault((*public, tuple(prompt[:end])), set())
            senders.add(tenant)
            if len(senders) >= promo.min_tenants:
                self.ref.seqs.setdefault(public, {})[tuple(prompt[:end])] = self.clock.now

    def allowed(self, prompt: list[int], tenant: str, model: str, adapter: str | None) -> int:
        """The most a match may return: the tenant's own prefixes, and public ones."""
        best = self.best_reference(prompt, self.ref_key(tenant, model, adapter))
        if self.config.publish is not None:
            best = max(best, self.best_reference(prompt, self.public_key(model, adapter)))
        return best

    def record_insert(self, tenant: str, model: str, adapter: str | None, prompt: list[int]) -> None:
        self.sent.append((tenant, model, adapter, prompt))
        self.ref.seqs.setdefault(self.ref_key(tenant, model, adapter), {})[tuple(prompt)] = self.clock.now
        if self.config.publish is not None:
            self.count_senders(tenant, model, adapter, prompt)

    def best_reference(self, prompt: list[int], key: tuple[object, ...]) -> int:
        """The longest prefix of ``prompt`` that the cache may hold for ``key``, at the
        granularity it stores."""
        best = 0
        for seq in self.ref.seqs.get(key, {}):
            n = lcp(prompt, list(seq))
            if not self.config.partial_blocks:
                n = n // BS * BS
            best = max(best, n)
        return best

    # ------------------------------------------------------------ rules

    @rule(**REQUEST, keep=st.booleans())
    def match(self, tenant: str, model: str, adapter: str | None, prompt: list[int], keep: bool) -> None:
        ctx = CacheContext(tenant=tenant, model=model, adapter=adapter)
        m = self.cache.match(prompt, ctx)
        allowed = self.allowed(prompt, tenant, model, adapter)
        # Soundness: never more than what was inserted, in this namespace and epoch.
        assert m.cached_tokens <= allowed, (m.cached_tokens, allowed)
        if self.roomy:
            assert m.cached_tokens == allowed, (m.cached_tokens, allowed)
        assert m.cached_tokens == m.num_blocks * BS + m.partial_tokens
        if self.tiered:
            loaded = self.cache.load(m)
            assert loaded.tokens == m.cached_tokens, (loaded.tokens, m.cached_tokens)
            assert (loaded.kv == kv_for(prompt)[:, :, :, : loaded.tokens, :]).all()
        assert m.partial_tokens < BS or not self.config.partial_blocks
        if m._block is not None:
            blocks = path_to(m._block)
            assert len(blocks) == m.num_blocks + (1 if m.partial_tokens else 0)
            # Namespaces never crossed, and the blocks hold exactly the prompt's tokens.
            ns = self.namespace(tenant)
            assert all(b.root.owner in (ns, PUBLIC) for b in blocks)
            assert all(b.public == (b.root.owner == PUBLIC) for b in blocks)
            matched = b"".join(b.tokens for b in blocks)
            stored = [int.from_bytes(matched[i : i + 4], "little") for i in range(0, len(matched), 4)]
            assert stored[: m.cached_tokens] == prompt[: m.cached_tokens]
        if keep and m._block is not None:
            self.held.append((m, tenant))
        else:
            m.release()

    @precondition(lambda self: self.held)
    @rule(i=st.integers(min_value=0))
    def release(self, i: int) -> None:
        m, _ = self.held.pop(i % len(self.held))
        m.release()

    @rule(**REQUEST, keep_s=st.sampled_from([None, 2.0, 20.0]))
    def insert(self, tenant: str, model: str, adapter: str | None, prompt: list[int], keep_s: float | None) -> None:
        ctx = CacheContext(tenant=tenant, model=model, adapter=adapter)
        used_before = self.cache.used_tokens
        stored = self.cache.insert(prompt, ctx, kv=kv_for(prompt) if self.tiered else None)
        assert 0 <= stored <= len(prompt)
        assert stored == 0 or self.cache.used_tokens <= used_before + stored
        self.record_insert(tenant, model, adapter, prompt)
        if keep_s is not None:  # the prompt retained as it is stored, as a server does
            self.retain(-1, 0, keep_s)

    @precondition(lambda self: not self.tiered)  # NOTE: ``access`` is metadata-only
    @rule(**REQUEST)
    def access(self, tenant: str, model: str, adapter: str | None, prompt: list[int]) -> None:
        """The simulator's one-step match + insert + release agrees with the reference too."""
        ctx = CacheContext(tenant=tenant, model=model, adapter=adapter)
        allowed = self.allowed(prompt, tenant, model, adapter)
        cached, stored = self.cache.access(prompt, ctx)
        assert cached <= allowed, (cached, allowed)
        if self.roomy:
            assert cached == allowed
        assert 0 <= stored <= len(prompt)  # a partial hit's block is stored whole, so not len - cached
        self.record_insert(tenant, model, adapter, prompt)

    @precondition(lambda self: self.sent)
    @rule(i=st.integers(min_value=0), cut=st.integers(min_value=0, max_value=24), seconds=st.sampled_from([2.0, 20.0]))
    def retain(self, i: int, cut: int, seconds: float) -> None:
        """Retain (a prefix of) a prompt sent before, as a client does with its own."""
        tenant, model, adapter, sent = self.sent[i % len(self.sent)]
        prompt = sent[: len(sent) - cut]
        ctx = CacheContext(tenant=tenant, model=model, adapter=adapter)
        before = self.cache.peek(prompt, ctx).cached_tokens
        retained = self.cache.retain(prompt, ctx, seconds)
        assert retained.tokens <= before  # whole cached blocks of the prompt, never more
        if retained.outcome.value == "refused":
            assert tenant == "c" and self.config.retention.tenants, retained
        if retained.tokens:  # the retained prefix is cached, and each of its blocks held
            assert self.cache.peek(prompt[: retained.tokens], ctx).cached_tokens == retained.tokens
            keeper = self.cache._ledger.keeper
            held = [b for b in keeper.order[tenant] if b.retain_until > self.clock.now]
            assert sum(b.num_tokens for b in held) >= retained.tokens

    @rule(model=st.sampled_from(MODELS), adapter=st.sampled_from(ADAPTERS))
    def bump(self, model: str, adapter: str | None) -> None:
        self.cache.bump_epoch(model, adapter)
        self.epochs[(model, adapter)] = self.epochs.get((model, adapter), 0) + 1

    @rule(tenant=st.sampled_from(TENANTS))
    def purge(self, tenant: str) -> None:
        self.cache.purge(tenant)
        if self.config.isolation == "shared":
            # Who owns a shared block depends on who stored it first and on evictions:
            # what remains is still a subset of what was inserted, but no longer all of it.
            self.roomy = False
        else:
            for key in [k for k in self.ref.seqs if k[0] == tenant]:
                del self.ref.seqs[key]

    @rule(tenant=st.sampled_from(TENANTS), model=st.sampled_from(MODELS), prompt=prompts)
    def purge_prefix(self, tenant: str, model: str, prompt: list[int]) -> None:
        if not prompt:
            return
        ctx = CacheContext(tenant=tenant, model=model)
        self.cache.purge_prefix(prompt, ctx)
        # Every sequence starting with the prefix loses the block holding the prefix's
        # end and all below it; what lies before that block stays.
        cut = (len(prompt) - 1) // BS * BS
        keys = [self.ref_key(tenant, model, None)]
        if self.config.publish is not None:
            keys.append(self.public_key(model, None))
            # Others' continuations under a purged public block go too; the reference
            # keeps them (still sound), so it no longer knows every cached prefix.
            self.roomy = False
        for key in keys:
            seqs = self.ref.seqs.get(key, {})
            for seq in [s for s in seqs if list(s[: len(prompt)]) == prompt]:
                stamp = seqs.pop(seq)
                if cut:
                    seqs[seq[:cut]] = max(stamp, seqs.get(seq[:cut], stamp))

    @rule(dt=st.sampled_from([1.0, 3.0, 10.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt
        if self.config.ttl_seconds is not None:
            horizon = self.clock.now - self.config.ttl_seconds
            for seqs in self.ref.seqs.values():
                for seq in [s for s, t in seqs.items() if t < horizon]:
                    del seqs[seq]

    @rule()
    def reclaim(self) -> None:
        self.cache.reclaim()

    # ------------------------------------------------------------ invariants

    @invariant()
    def structure(self) -> None:
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        nodes = cache._ledger.tree.nodes
        live: set[int] = set()
        for key, block in nodes.items():
            assert block.key == key and block.pool is not None and not block.doomed
            live.add(id(block))
        used_by_pool: dict[str, int] = {}
        seen: set[int] = set()

        def visit(block_children: dict[bytes, object]) -> None:
            for child in block_children.values():
                assert child.pool is not None  # type: ignore[attr-defined]
                seen.add(id(child))
                name = child.pool.name  # type: ignore[attr-defined]
                used_by_pool[name] = used_by_pool.get(name, 0) + child.num_tokens  # type: ignore[attr-defined]
                visit(child.children)  # type: ignore[attr-defined]

        roots = {id(r): r for r in cache._ledger.contexts.roots()}
        held = [m._block for m, _ in self.held if m._block is not None]
        for block in held:  # purged or stale while pinned: still accounted, reachable only from here
            roots[id(block.root)] = block.root
            top = block
            while not top.is_root:
                top = top.parent
            roots[id(top)] = top
        for block in nodes.values():
            top = block
            while not top.is_root:
                # No orphans: every ancestor of a findable block is still in the tree.
                assert top.pool is not None
                assert top.parent.children.get(top.key) is top or top.doomed
                top = top.parent
            roots[id(top)] = top
        for root in roots.values():
            visit(root.children)
        for block in held:
            # A purged block still pinned may have lost its place under its parent to a
            # re-inserted block of the same key: it is in flight, still accounted, and
            # freed on release (checked by the accounting below).
            node: Any = block
            while not node.is_root:
                if node.pool is not None and id(node) not in seen:
                    assert node.doomed
                    seen.add(id(node))
                    used_by_pool[node.pool.name] = used_by_pool.get(node.pool.name, 0) + node.num_tokens
                node = node.parent
        assert live <= seen
        # Accounting: pools add up to what the tree holds; capacity never exceeded.
        total = 0
        for name, pool in cache._ledger.tenancy.pools.items():
            assert pool.used == used_by_pool.get(name, 0), (name, pool.used, used_by_pool)
            total += pool.used
            linked = [b for b in nodes.values() if b.pool is pool]
            assert len(pool.policy) == len(linked)
            if pool.policy.tracks_leaves:  # the ledger's leaf news: the blocks with children, exactly
                assert pool.policy._interior == {b.key for b in linked if b.children}  # type: ignore[attr-defined]
        assert cache.used_tokens == total <= self.config.capacity
        # With a real 128-bit hash no verification ever fails.
        assert cache.stats().collisions == 0

    @invariant()
    def retained_never_evicted(self) -> None:
        """No block retained after the last step left the cache for want of room in this
        one (an epoch, a purge, a TTL or a lost frame may end it); the books of retention
        add up, and no tenant holds more than its cap in any level."""
        if not hasattr(self, "cache"):
            return
        for event in self.cache.take_events():
            if isinstance(event, BlocksRemoved) and event.reason is RemovalReason.EVICTED:
                assert not set(event.keys) & self.holding, event
        keeper = self.cache._ledger.keeper
        nodes = self.cache._ledger.tree.nodes
        self.holding = set()
        for tenant, order in keeper.order.items():
            held = [0] * len(keeper.levels)
            for block in order:
                assert block.retainer == tenant and block.pool is not None and not block.doomed
                assert nodes.get(block.key) is block
                books = self.cache._ledger.books
                mask = 1 | (books.avail(block) << 1 if books is not None else 0)
                assert block.retain_mask == mask
                for i, level in enumerate(keeper.levels):
                    if mask & (1 << i):
                        held[i] += block.num_tokens if level.per_token else 1
                if keeper.holds(block):
                    self.holding.add(block.key)
            assert keeper.held[tenant] == held
            assert all(h <= keeper.cap(tenant, i) for i, h in enumerate(held) if keeper.levels[i].binding), (
                tenant,
                held,
            )
        for block in nodes.values():
            assert (block.retainer is None) == (block not in keeper.order.get(block.retainer or "", {}))

    @invariant()
    def pinned_never_evicted(self) -> None:
        for m, _ in self.held:
            assert m._block is not None and m._block.pool is not None
            assert m._block.pins >= 1


CacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheInvariants = CacheMachine.TestCase
