"""The block tree and its search: common_tokens, postorder, the binary search over
prefix keys, verification against stored tokens (design.md invariant 3), partial
blocks and the Match handle."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import CacheConfig, CacheContext, PrefixCache, Segment
from prefixcache.cache.tree import Block, BlockTree, Root, common_tokens, path_to, postorder
from support import lcp

A = CacheContext(tenant="a", model="m")
B = CacheContext(tenant="b", model="m")  # same length as "a": under a weak hash all keys collide
ROOMY = 1 << 24


def tok(*ids: int) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def hit(cache: PrefixCache, tokens: list[int], ctx: CacheContext, segments: list[Segment] | None = None) -> int:
    with cache.match(tokens, ctx, segments) as m:
        return m.cached_tokens


class LengthHash:
    """A deliberately broken hash: the digest is the number of bytes hashed, so every
    two prefixes of equal length (same context field lengths, same token count) collide."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def update(self, data: bytes | memoryview, /) -> None:
        self.n += len(data)

    def copy(self) -> LengthHash:
        return LengthHash(self.n)

    def digest(self) -> bytes:
        return self.n.to_bytes(16, "little")


# ============================================================================ common_tokens


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        (b"", b"", 0),
        (tok(1, 2, 3), b"", 0),
        (tok(1, 2, 3), tok(1, 2, 3), 3),
        (tok(1, 2, 3), tok(1, 2), 2),
        (tok(1, 2), tok(1, 2, 3), 2),
        (tok(1, 2, 3), tok(9, 2, 3), 0),
        (tok(1, 2, 3), tok(1, 2, 4), 2),
        (tok(1, 2, 3, 4, 5), tok(1, 9, 3, 4, 5), 1),
        (tok(0x01000000), tok(0x01000001), 0),  # differ in the first byte of a token
        (tok(5, 0x01000000), tok(5, 0x02000000), 1),  # differ in the last byte of a token
        (tok(*range(100)), tok(*range(63), 0, *range(64, 100)), 63),
    ],
)
def test_common_tokens_cases(a: bytes, b: bytes, want: int) -> None:
    assert common_tokens(a, b) == want
    assert common_tokens(b, a) == want


_token_lists = st.lists(st.integers(0, 3), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_token_lists, _token_lists, st.lists(st.integers(0, 2**32 - 1), max_size=8))
def test_common_tokens_matches_a_reference_loop(a: list[int], b: list[int], shared: list[int]) -> None:
    a, b = shared + a, shared + b  # make long common prefixes likely
    assert common_tokens(tok(*a), tok(*b)) == lcp(a, b)


# ============================================================================ postorder


def _hand_tree() -> tuple[Root, dict[str, Block], BlockTree]:
    r"""
    root
      |-- x --- xa --- xaa
      |     \-- xb
      \-- y
    """
    tree = BlockTree()
    root = Root(b"root", "", True)
    blocks: dict[str, Block] = {}
    for name, parent in [("x", None), ("xa", "x"), ("xaa", "xa"), ("xb", "x"), ("y", None)]:
        up = root if parent is None else blocks[parent]
        block = Block(name.encode(), up, tok(len(name), 7), root, "t", False)
        tree.link(block)
        blocks[name] = block
    return root, blocks, tree


def _assert_children_first(order: list[Block]) -> None:
    position = {id(b): i for i, b in enumerate(order)}
    for block in order:
        for child in block.children.values():
            assert position[id(child)] < position[id(block)], (child, block)


def test_postorder_children_before_parents_and_never_the_root() -> None:
    root, blocks, tree = _hand_tree()
    order = list(postorder(root))
    assert root not in order
    assert sorted(b.key for b in order) == sorted(b.key for b in blocks.values())
    assert len(order) == len(set(map(id, order))) == 5
    _assert_children_first(order)

    sub = list(postorder(blocks["x"]))  # a non-root top is included, last
    assert sub[-1] is blocks["x"]
    assert {b.key for b in sub} == {b"x", b"xa", b"xaa", b"xb"}
    _assert_children_first(sub)
    assert list(postorder(blocks["xaa"])) == [blocks["xaa"]]
    assert list(postorder(Root(b"lonely", "", True))) == []
    assert blocks["xaa"].end == 3 * 2 and path_to(blocks["xaa"]) == []  # hand-built: no runs

    # removal in postorder never detaches a block that still has children
    for block in list(postorder(root)):
        tree.detach(block)
    assert len(tree) == 0 and not root.children


def test_postorder_on_a_cache_built_tree() -> None:
    cache = PrefixCache(CacheConfig(block_size=2, capacity_tokens=ROOMY))
    for prompt in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [1, 2, 7, 7], [8, 8, 8, 8]):
        cache.insert(prompt, A)
    roots = {id(b.root): b.root for b in cache._ledger.tree.nodes.values()}
    assert len(roots) == 1
    (root,) = roots.values()
    order = list(postorder(root))
    assert all(not b.is_root for b in order)
    assert {b.key for b in order} == set(cache._ledger.tree.nodes)
    assert len(order) == len(cache) == 7
    _assert_children_first(order)


# ============================================================================ binary search


_prompt_pieces = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [9] * 5, [4, 4], list(range(20, 37)), [0]]
_prompts = st.lists(st.sampled_from(range(len(_prompt_pieces))), max_size=6).map(
    lambda idx: [t for i in idx for t in _prompt_pieces[i]]
)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([1, 4, 16]),
    st.booleans(),
    st.lists(_prompts, min_size=1, max_size=6),
    st.lists(_prompts, min_size=1, max_size=6),
)
def test_match_finds_the_longest_cached_prefix(
    block_size: int, partial: bool, inserted: list[list[int]], queries: list[list[int]]
) -> None:
    cache = PrefixCache(CacheConfig(block_size=block_size, capacity_tokens=ROOMY, partial_blocks=partial))
    for prompt in inserted:
        cache.insert(prompt, A)
    for query in queries + inserted:
        shared = max(lcp(query, p) for p in inserted)
        want = shared if partial else shared // block_size * block_size
        with cache.match(query, A) as m:
            assert m.cached_tokens == want, (query, inserted)
            assert m.num_blocks == shared // block_size
            assert len(m.block_keys) == m.num_blocks + (m.partial_tokens > 0)
        assert hit(cache, query, B) == 0
    assert cache.stats().collisions == 0


def test_match_at_every_depth() -> None:
    """Each depth of a long chain is found, so the binary search's lo/hi bounds are right."""
    prompt = list(range(1000, 1000 + 16 * 40))
    cache = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY))
    cache.insert(prompt, A)
    for depth in range(41):
        query = [*prompt[: 16 * depth], 1, 2, 3]
        assert hit(cache, query, A) == 16 * depth
        assert hit(cache, prompt[: 16 * depth + 15], A) == 16 * depth


# ============================================================================ collisions (invariant 3)


P = list(range(100, 112))  # 3 blocks of 4
Q = [100, 101, 102, 103, 7, 7, 7, 7, 8, 8, 8, 8]  # same length, shares one block with P
R = [5] * 12  # same length, shares nothing with P


@pytest.mark.parametrize("partial", [False, True])
def test_weak_hash_collisions_are_caught_and_counted(partial: bool) -> None:
    config = CacheConfig(block_size=4, capacity_tokens=ROOMY, partial_blocks=partial)
    weak = PrefixCache(config, hash_factory=LengthHash)
    weak.insert(P, A)
    assert weak.stats().collisions == 0
    assert hit(weak, P, A) == 12

    assert hit(weak, Q, A) == 4  # every key of Q collides with P's; only the shared block is served
    assert weak.stats().collisions == 1
    assert hit(weak, R, A) == 0
    assert weak.stats().collisions == 2

    # inserting the colliding prompt never aliases P's blocks
    weak.insert(Q, A)
    assert weak.stats().collisions > 2
    assert hit(weak, P, A) == 12
    assert hit(weak, Q, A) == 4
    with weak.match(Q, A) as m:
        assert len(m.block_keys) == 1

    real = PrefixCache(config)
    real.insert(P, A)
    assert (hit(real, P, A), hit(real, Q, A), hit(real, R, A)) == (12, 4, 0)
    real.insert(Q, A)
    assert (hit(real, P, A), hit(real, Q, A)) == (12, 12)
    assert real.stats().collisions == 0


def test_weak_hash_never_crosses_namespaces() -> None:
    for partial in (False, True):
        cache = PrefixCache(
            CacheConfig(block_size=4, capacity_tokens=ROOMY, isolation="namespace", partial_blocks=partial),
            hash_factory=LengthHash,
        )
        cache.insert([*P, 1, 2], A)
        assert hit(cache, [*P, 1, 2], A) == (14 if partial else 12)
        for query in ([*P, 1, 2], P, P[:8], P[:6], P[:2]):
            assert hit(cache, query, B) == 0, query
        assert cache.stats().collisions >= 1
        assert cache.stats().tenants["b"].hit_tokens == 0
        # and B's own inserts cannot be served to A either
        cache.insert(R, B)
        assert hit(cache, R, A) == 0


@pytest.mark.parametrize("factory", [None, LengthHash], ids=["real-hash", "weak-hash"])
@pytest.mark.parametrize("partial", [False, True])
def test_private_continuation_of_a_public_prefix_stays_private(factory: Any, partial: bool) -> None:
    """A's private blocks hang below a public block (the parent is shared), so the tree
    structure alone does not separate them from B: only the namespace check does."""
    config = CacheConfig(block_size=4, capacity_tokens=ROOMY, isolation="namespace", partial_blocks=partial)
    cache = PrefixCache(config, hash_factory=factory)
    system, secret = [1, 2, 3, 4, 5, 6, 7, 8], [90, 91, 92, 93, 94, 95, 96, 97, 98]
    cache.declare_public(system, A)
    cache.insert([*system, *secret], A)
    assert hit(cache, [*system, *secret], A) == (17 if partial else 16)
    for query in ([*system, *secret], [*system, *secret[:6]], [*system, *secret[:2]], [*system, 90]):
        assert hit(cache, query, B) == 8, query  # the public prefix, and not one token more
    assert cache.stats().tenants["b"].hit_tokens == 8 * 4


def test_weak_hash_never_ignores_segments() -> None:
    prompt = [*range(1, 41), *([7] * 40), *range(500, 516)]
    cache = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY), hash_factory=LengthHash)
    img_a, img_b = [Segment(40, 80, b"hash-a")], [Segment(40, 80, b"hash-b")]  # same lengths
    assert cache.insert(prompt, A, img_a) == 96
    assert hit(cache, prompt, A, img_a) == 96
    assert hit(cache, prompt, A, img_b) == 32
    assert cache.stats().collisions >= 1
    assert hit(cache, prompt, A, [Segment(40, 80, b"hash-a")]) == 96


def test_weak_hash_never_serves_another_model() -> None:
    cache = PrefixCache(CacheConfig(block_size=4, capacity_tokens=ROOMY), hash_factory=LengthHash)
    cache.insert(P, CacheContext(tenant="a", model="m1"))
    assert hit(cache, P, CacheContext(tenant="a", model="m2")) == 0
    cache.bump_epoch("m1")
    assert hit(cache, P, CacheContext(tenant="a", model="m1")) == 0


def test_constant_hash_still_serves_only_true_prefixes() -> None:
    class Constant(LengthHash):
        def copy(self) -> Constant:
            return Constant()

        def digest(self) -> bytes:
            return b"same"

    cache = PrefixCache(CacheConfig(block_size=4, capacity_tokens=ROOMY), hash_factory=Constant)
    cache.insert(P, A)
    assert len(cache) == 1  # the second key collided with the first: stored nothing more
    assert hit(cache, P, A) == 4
    assert hit(cache, Q, A) == 4
    assert hit(cache, R, A) == 0
    assert hit(cache, P, B) == 0


# ============================================================================ partial blocks


LONG = list(range(200, 248))  # three full blocks of 16


def test_partial_block_match_is_token_granular() -> None:
    on = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY, partial_blocks=True))
    off = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY, partial_blocks=False))
    query = [*LONG[:20], 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    for cache in (on, off):
        cache.insert(LONG, A)
    with on.match(query, A) as m:
        assert (m.cached_tokens, m.num_blocks, m.partial_tokens) == (20, 1, 4)
        keys = m.block_keys
        assert len(keys) == 2
    with on.match(LONG, A) as full:
        assert keys == full.block_keys[:2]  # the partial block is the cached block [16, 32)
    with off.match(query, A) as m:
        assert (m.cached_tokens, m.num_blocks, m.partial_tokens) == (16, 1, 0)
        assert len(m.block_keys) == 1
    assert on.stats().partial_hit_tokens == 4
    assert off.stats().partial_hit_tokens == 0


def test_partial_block_within_the_first_block() -> None:
    cache = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY, partial_blocks=True))
    cache.insert(LONG, A)
    with cache.match([*LONG[:5], 0, 0], A) as m:
        assert (m.cached_tokens, m.num_blocks, m.partial_tokens) == (5, 0, 5)
        assert len(m.block_keys) == 1
    assert hit(cache, LONG[:5], A) == 5
    assert hit(cache, [0, *LONG[1:5]], A) == 0


def test_tail_of_a_cached_prompt_is_matched() -> None:
    prompt = LONG[:36]  # two full blocks and a tail of 4
    on = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY, partial_blocks=True))
    off = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY, partial_blocks=False))
    assert on.insert(prompt, A) == 36
    assert off.insert(prompt, A) == 32
    with on.match(prompt, A) as m:
        assert (m.cached_tokens, m.num_blocks, m.partial_tokens) == (36, 2, 4)
        tail_key = m.block_keys[-1]
        assert len(m.block_keys) == 3
    (tail,) = (b for b in on._ledger.tree.nodes.values() if b.end == 36)
    assert tail.key == tail_key and tail.num_tokens == 4
    with on.match(prompt[:34], A) as m:
        assert (m.cached_tokens, m.partial_tokens) == (34, 2)
        assert m.block_keys[-1] == tail_key
    assert hit(on, [*prompt, 1, 2, 3], A) == 36
    assert hit(on, [*prompt[:35], 0], A) == 35
    assert hit(off, prompt, A) == 32

    # inserting it again stores nothing and is not a collision
    assert on.insert(prompt, A) == 0
    assert on.stats().collisions == 0
    # a longer prompt replaces the tail with a full block
    assert on.insert(LONG, A) == 16
    assert hit(on, prompt, A) == 36
    assert len(on) == 3


def test_partial_never_crosses_tenants() -> None:
    for factory in (None, LengthHash):
        cache = PrefixCache(
            CacheConfig(block_size=16, capacity_tokens=ROOMY, partial_blocks=True, isolation="namespace"),
            hash_factory=factory,
        )
        cache.insert(LONG[:36], A)
        for query in (LONG[:36], LONG[:34], LONG[:20], LONG[:5], [*LONG[:3], 0]):
            with cache.match(query, B) as m:
                assert (m.cached_tokens, m.partial_tokens, m.block_keys) == (0, 0, ()), query
        assert hit(cache, LONG[:5], A) == 5


def test_partial_block_respects_segments() -> None:
    cache = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY, partial_blocks=True))
    prompt = list(range(1, 49))
    cache.insert(prompt, A, [Segment(20, 30, b"img-a")])
    assert hit(cache, prompt[:24], A, [Segment(20, 24, b"img-a")]) == 16  # segment (20, 24) is not (20, 30)
    assert hit(cache, prompt[:40], A, [Segment(20, 30, b"img-b")]) == 16
    assert hit(cache, prompt[:40], A, [Segment(20, 30, b"img-a")]) == 40


# ============================================================================ Match


def _pins(cache: PrefixCache) -> int:
    return sum(b.pins for b in cache._ledger.tree.nodes.values())


def test_match_release_is_idempotent_and_unpins() -> None:
    cache = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY))
    cache.insert(LONG, A)
    m = cache.match(LONG, A)
    assert not m.released and _pins(cache) == 1
    assert len(m.block_keys) == m.num_blocks == 3
    m2 = cache.match(LONG[:20], A)
    assert _pins(cache) == 2
    m.release()
    assert m.released and _pins(cache) == 1
    m.release()
    m.release()
    assert _pins(cache) == 1  # a second release does not take m2's pin
    m2.release()
    assert _pins(cache) == 0
    with pytest.raises(RuntimeError, match="released"):
        _ = m.block_keys


def test_match_as_context_manager() -> None:
    cache = PrefixCache(CacheConfig(block_size=16, capacity_tokens=ROOMY, partial_blocks=True))
    cache.insert(LONG[:36], A)
    with cache.match(LONG[:36], A) as m:
        assert _pins(cache) == 1
        assert len(m.block_keys) == m.num_blocks + 1 == 3
    assert m.released and _pins(cache) == 0
    with pytest.raises(RuntimeError):
        _ = m.block_keys

    with pytest.raises(KeyError), cache.match(LONG, A) as m:
        raise KeyError("the caller failed while loading")
    assert m.released and _pins(cache) == 0


def test_a_miss_holds_nothing() -> None:
    cache = PrefixCache(CacheConfig(block_size=16))
    m = cache.match(LONG, A)
    assert (m.cached_tokens, m.num_blocks, m.partial_tokens) == (0, 0, 0)
    assert m.released and m.block_keys == ()
    m.release()
    assert m.block_keys == ()


def test_match_tenant_and_counters() -> None:
    cache = PrefixCache(CacheConfig(block_size=16))
    cache.insert(LONG, A)
    with cache.match(LONG[:40], A) as m:
        assert m.tenant == "a"
    stats: dict[str, Any] = cache.stats()
    assert (stats.lookups, stats.lookup_tokens, stats.hit_tokens, stats.hit_requests) == (1, 40, 32, 1)
