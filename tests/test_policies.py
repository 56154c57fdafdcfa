"""Eviction policies: one shared contract, exact orders, registry, libcachesim parity."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.config import CacheConfig, TierConfig
from prefixcache.policies import (
    POLICIES,
    EvictionPolicy,
    FIFOPolicy,
    LFUDAPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    SievePolicy,
    always,
    make_policy,
)
from prefixcache.policies.base import Key

NAMES = sorted(POLICIES)


def k(i: int) -> bytes:
    """A block-hash-like key: 16 bytes, as the cache uses."""
    return i.to_bytes(16, "little")


def drain(policy: EvictionPolicy, evictable: Callable[[Key], bool] = always) -> list[Key]:
    """Victims until the policy has none left."""
    out = []
    while (key := policy.victim(evictable)) is not None:
        out.append(key)
    return out


def blocked(keys: AbstractSet[Key]) -> Callable[[Key], bool]:
    return lambda key: key not in keys


def once(keys: list[Key]) -> set[Key]:
    """The keys as a set, after checking that none came out twice."""
    assert len(set(keys)) == len(keys), keys
    return set(keys)


@pytest.fixture(params=NAMES)
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    # 20 leaves S3-FIFO a small queue of 2, so both of its queues take part.
    return make_policy(request.param, 20)


# --- the contract every policy keeps -------------------------------------------


class TestContract:
    def test_len_and_contains_follow_insert_and_remove(self, policy: EvictionPolicy) -> None:
        for i in range(10):
            policy.insert(k(i))
        assert len(policy) == 10
        assert all(k(i) in policy for i in range(10))
        assert k(10) not in policy
        policy.remove(k(3))
        assert len(policy) == 9
        assert k(3) not in policy
        victim = policy.victim()
        assert victim is not None and victim not in policy
        assert len(policy) == 8

    def test_victim_of_empty_is_none(self, policy: EvictionPolicy) -> None:
        assert policy.victim() is None
        policy.insert(k(1))
        policy.remove(k(1))
        assert policy.victim() is None

    def test_victim_never_returns_a_blocked_key(self, policy: EvictionPolicy) -> None:
        for i in range(20):
            policy.insert(k(i))
        policy.access_many([k(i) for i in range(0, 20, 3)])
        pinned = {k(i) for i in range(0, 20, 2)}
        out = drain(policy, blocked(pinned))
        assert once(out) == {k(i) for i in range(20)} - pinned
        # the blocked ones are still resident, and leave once unblocked
        assert len(policy) == len(pinned)
        assert all(key in policy for key in pinned)
        assert once(drain(policy)) == pinned

    def test_all_blocked_returns_none_in_bounded_steps(self, policy: EvictionPolicy) -> None:
        for i in range(20):
            policy.insert(k(i))
            policy.access_many([k(i)] * (i % 4))
        calls = 0

        def never(_key: Key) -> bool:
            nonlocal calls
            calls += 1
            return False

        assert policy.victim(never) is None
        # at most ~2 passes (S3-FIFO: its counter may need up to 3 more) per call
        assert calls <= 5 * 20
        assert len(policy) == 20
        assert all(k(i) in policy for i in range(20))
        assert once(drain(policy)) == {k(i) for i in range(20)}

    def test_misuse_raises_key_error(self, policy: EvictionPolicy) -> None:
        policy.insert(k(1))
        with pytest.raises(KeyError):
            policy.insert(k(1))
        with pytest.raises(KeyError):
            policy.access(k(2))
        with pytest.raises(KeyError):
            policy.access_many([k(1), k(2)])
        with pytest.raises(KeyError):
            policy.remove(k(2))
        assert policy.victim() == k(1)
        with pytest.raises(KeyError):
            policy.access(k(1))
        with pytest.raises(KeyError):
            policy.remove(k(1))
        assert len(policy) == 0

    def test_every_key_comes_out_exactly_once(self, policy: EvictionPolicy) -> None:
        keys = [k(i) for i in range(50)]
        out: list[Key] = []
        for i, key in enumerate(keys):
            policy.insert(key)
            policy.access_many([x for x in keys[max(0, i - 5) : i] if x in policy])
            if i % 3 == 2:
                victim = policy.victim()
                assert victim is not None
                out.append(victim)
        out += drain(policy)
        assert once(out) == set(keys)
        assert len(policy) == 0

    def test_removed_key_is_never_a_victim(self, policy: EvictionPolicy) -> None:
        for i in range(10):
            policy.insert(k(i))
        policy.access(k(4))
        policy.remove(k(0))
        policy.remove(k(4))
        out = drain(policy)
        assert k(0) not in out and k(4) not in out
        assert len(out) == 8

    def test_reinserting_an_evicted_key_is_allowed(self, policy: EvictionPolicy) -> None:
        for i in range(5):
            policy.insert(k(i))
        victim = policy.victim()
        assert victim is not None
        policy.insert(victim)
        assert victim in policy and len(policy) == 5


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 15), st.integers(1, 4)),
        st.tuples(st.just("access"), st.integers(0, 15)),
        st.tuples(st.just("access_many"), st.lists(st.integers(0, 15), max_size=6)),
        st.tuples(st.just("remove"), st.integers(0, 15)),
        st.tuples(st.just("victim"), st.frozensets(st.integers(0, 15))),
    ),
    max_size=80,
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None)
@given(ops=OPS, capacity=st.integers(0, 40))
def test_random_operations_keep_the_contract(name: str, ops: list[tuple[Any, ...]], capacity: int) -> None:
    """Random insert/access/remove/victim sequences against a set model."""
    policy = make_policy(name, capacity)
    resident: set[Key] = set()
    for op in ops:
        kind = op[0]
        if kind == "insert":
            key = k(op[1])
            if key in resident:
                with pytest.raises(KeyError):
                    policy.insert(key, op[2])
            else:
                policy.insert(key, op[2])
                resident.add(key)
        elif kind == "access" or kind == "remove":
            key = k(op[1])
            method = policy.access if kind == "access" else policy.remove
            if key in resident:
                method(key)
                if kind == "remove":
                    resident.discard(key)
            else:
                with pytest.raises(KeyError):
                    method(key)
        elif kind == "access_many":
            keys = [k(i) for i in op[1]]
            if all(key in resident for key in keys):
                policy.access_many(keys)
            else:
                with pytest.raises(KeyError):
                    policy.access_many(keys)
        else:
            pinned = {k(i) for i in op[1]}
            victim = policy.victim(blocked(pinned))
            if victim is None:
                assert resident <= pinned
            else:
                assert victim in resident and victim not in pinned
                resident.discard(victim)
        assert len(policy) == len(resident)
        assert all(key in policy for key in resident)
    assert once(drain(policy)) == resident


# --- exact eviction orders on small hand-made sequences ------------------------


def test_lru_order() -> None:
    p = LRUPolicy(0)
    for key in "abcd":
        p.insert(key)
    p.access("a")
    p.access_many(["c"])
    # recency, oldest first: b (inserted 2nd), d (inserted 4th), a, c (hit last)
    assert drain(p) == ["b", "d", "a", "c"]


def test_lru_requeues_blocked_at_the_tail() -> None:
    p = LRUPolicy(0)
    for key in "abc":
        p.insert(key)
    # a is blocked: passed over and moved to the most recent end, b leaves
    assert p.victim(blocked({"a"})) == "b"
    # now c is the oldest, then a
    assert drain(p) == ["c", "a"]


def test_fifo_order() -> None:
    p = FIFOPolicy(0)
    for key in "abcd":
        p.insert(key)
    p.access("a")
    p.access_many(["c", "a"])
    # hits change nothing: insertion order
    assert drain(p) == ["a", "b", "c", "d"]
    for key in "abc":
        p.insert(key)
    # a blocked goes to the tail: b, then c, then a
    assert p.victim(blocked({"a"})) == "b"
    assert drain(p) == ["c", "a"]


def test_lfuda_order() -> None:
    p = LFUDAPolicy(0)
    for key in "abcde":
        p.insert(key)
    for key in "bdba":
        p.access(key)
    # no eviction yet (L = 0), so priorities are frequencies: a 2, b 3, c 1, d 2, e 1.
    # 1: c before e (inserted earlier); 2: d before a (d's last hit was earlier); then b.
    assert drain(p) == ["c", "e", "d", "a", "b"]


def test_lfuda_ages_old_frequencies_away() -> None:
    p = LFUDAPolicy(0)
    p.insert("a")
    p.access_many("aaa")  # frequency 4, priority 4
    for key in "bcd":  # each enters at L + 1 and leaves at once: L = 1, 2, 3
        p.insert(key)
        assert p.victim() == key
    p.insert("e")  # priority L + 1 = 4, as a's: a is the older
    assert p.victim() == "a"
    p.access("e")  # priority L + 2 = 6
    p.insert("f")  # 5
    assert drain(p) == ["f", "e"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "access", "victim"]), st.integers(0, 12)), max_size=120))
def test_lfuda_is_its_definition(ops: list[tuple[str, int]]) -> None:
    """Against the definition, by brute force: priority = L + frequency at the last access,
    L = the last victim's priority, the least recently accessed among equal priorities."""
    p = LFUDAPolicy(0)
    age, ref = 0, {}  # key -> [frequency, priority, last access]
    for seq, (op, key) in enumerate(ops):
        if op == "insert" and key not in ref:
            p.insert(key)
            ref[key] = [1, age + 1, seq]
        elif op == "access" and key in ref:
            p.access(key)
            f = ref[key][0] + 1
            ref[key] = [f, age + f, seq]
        elif op == "victim":
            expected = min(ref, key=lambda k: (ref[k][1], ref[k][2])) if ref else None
            assert p.victim() == expected
            if expected is not None:
                age = ref.pop(expected)[1]
    assert len(p) == len(ref)


def test_lfuda_blocked_lowest_bucket_falls_through() -> None:
    p = LFUDAPolicy(0)
    for key in "abc":
        p.insert(key)
    p.access_many(["c", "c"])
    # a and b (priority 1) are blocked: the next bucket up gives c (3), and L = 3
    assert p.victim(blocked({"a", "b"})) == "c"
    # each of a and b went to the back once: the bucket is back in order
    assert drain(p) == ["a", "b"]
    p.insert("d")
    p.insert("e")
    p.access("e")
    assert drain(p) == ["d", "e"]  # 4 (L + 1), then 5 (L + 2)


def test_sieve_order() -> None:
    p = SievePolicy(0)
    for key in "abcde":  # queue, oldest first: a b c d e
        p.insert(key)
    p.access_many(["a", "c"])
    # hand at a: visited, cleared, moves on; b unvisited -> evict b; hand stops at c
    assert p.victim() == "b"
    p.insert("f")  # newest, at the head end
    p.access("a")  # a visited again, but the hand is past it
    # hand at c: visited, cleared; d unvisited -> evict d; hand at e
    assert p.victim() == "d"
    # e unvisited -> evict; hand at f
    assert p.victim() == "e"
    # f unvisited -> evict; hand wraps to the oldest, a
    assert p.victim() == "f"
    # a visited -> cleared; c (cleared before) -> evict; then a
    assert drain(p) == ["c", "a"]


def test_sieve_hand_passes_blocked_entries() -> None:
    p = SievePolicy(0)
    for key in "abc":
        p.insert(key)
    # a blocked: the hand moves past it (bit stays clear) and evicts b
    assert p.victim(blocked({"a"})) == "b"
    # the hand resumes at c
    assert p.victim() == "c"
    assert p.victim() == "a"


def test_s3fifo_order() -> None:
    # capacity 10, small 3, main 7, ghost 9
    p = S3FIFOPolicy(10, small_ratio=0.3)
    for key in "abc":
        p.insert(key)  # small: a b c (full)
    for key in "de":
        p.insert(key)  # no eviction yet and small is full: overflow into main: d e
    p.access_many(["a", "a", "b", "d"])  # freq a 2, b 1, d 1
    # main (2) within its 7: evict from small. a has 2 hits: moves to main (freq
    # reset to 0), main: d e a. b has 1 hit: evicted, recorded in ghost.
    assert p.victim() == "b"
    p.insert("f")  # small: c f
    # small: c has no hit: evicted into ghost (b c)
    assert p.victim() == "c"
    p.insert("b")  # b is in ghost: straight to main: d e a b; ghost: c
    # small: f evicted
    assert p.victim() == "f"
    # small is empty: main. d has 1 hit: reinserted with 0 (main: e a b d); e leaves
    assert p.victim() == "e"
    # then a (its count was reset on the move), b, d
    assert drain(p) == ["a", "b", "d"]


def test_s3fifo_evicts_from_main_when_main_is_over_its_share() -> None:
    p = S3FIFOPolicy(10, small_ratio=0.3)  # small 3, main 7
    for i in range(11):
        p.insert(i)  # 0 1 2 in small; 3..10 overflow into main, 8 > 7
    # main holds more than its share: evict its oldest, 3
    assert p.victim() == 3
    # main is back at 7: small's oldest goes
    assert p.victim() == 0


def test_s3fifo_counts_sizes() -> None:
    p = S3FIFOPolicy(100)  # small 10, main 90
    p.insert("big", 11)  # larger than the whole small queue: main
    p.insert("x", 4)
    p.insert("y", 6)  # small: x y (10)
    p.victim()
    # x leaves from small; y and the big one stay
    assert "x" not in p and "y" in p and "big" in p
    with pytest.raises(ValueError):
        p.insert("z", 0)


# --- registry --------------------------------------------------------------------


def test_registry_names_every_policy() -> None:
    assert NAMES == ["fifo", "gittins", "lfuda", "lru", "s3fifo", "sieve"]
    for name, cls in POLICIES.items():
        policy = make_policy(name, 64)
        assert type(policy) is cls and policy.name == name and policy.capacity == 64


def test_unknown_policy_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"'arc'.*fifo, gittins, lfuda, lru, s3fifo, sieve"):
        make_policy("arc", 64)


def test_a_retired_policy_says_why_and_what_instead() -> None:
    with pytest.raises(ValueError, match=r"'lfu' was retired: plain LFU never ages.*'lfuda'.*'gittins'") as err:
        make_policy("lfu", 64)
    assert "valid: fifo, gittins, lfuda" in str(err.value)
    with pytest.raises(ValueError, match=r"'lfu' was retired"):
        CacheConfig(policy="lfu")
    with pytest.raises(ValueError, match=r"'lfu' was retired"):
        CacheConfig(tiers=(TierConfig("memory", policy="lfu", capacity_bytes=1 << 20),))


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError):
        make_policy("lru", -1)


# --- parity with libCacheSim -------------------------------------------------------


def zipf_requests(n_keys: int, n_requests: int, alpha: float, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_keys + 1) ** alpha
    return list(rng.choice(n_keys, size=n_requests, p=weights / weights.sum()).tolist())


@pytest.fixture(scope="module")
def zipf() -> list[int]:
    return zipf_requests(10_000, 100_000, alpha=1.0, seed=42)


def our_miss_ratio(policy: EvictionPolicy, requests: list[int], capacity: int, size_of: Callable[[int], int]) -> float:
    """A flat cache: a miss evicts until the object fits, then inserts it."""
    used, misses = 0, 0
    sizes: dict[Key, int] = {}
    for key in requests:
        if key in policy:
            policy.access(key)
            continue
        misses += 1
        size = size_of(key)
        while used + size > capacity:
            victim = policy.victim()
            assert victim is not None
            used -= sizes.pop(victim)
        policy.insert(key, size)
        sizes[key] = size
        used += size
    return misses / len(requests)


def their_miss_ratio(cache: Any, requests: list[int], size_of: Callable[[int], int]) -> float:
    import libcachesim as lcs

    # NOTE: one get() per request rather than a trace file: fast enough here, and no
    # TraceReader, whose close() followed by garbage collection frees it twice.
    get = cache.get
    hits = sum(bool(get(lcs.Request(obj_id=key, obj_size=size_of(key)))) for key in requests)
    return 1.0 - hits / len(requests)


# NOTE: not lfuda. libCacheSim's LFUDA.c is not the textbook policy: a hit adds the age L
# to a frequency (not 1), and L follows the lowest priority in the cache even without an
# eviction; its scan for that minimum is linear in the highest priority, which grows
# without bound (a parity run of 100k requests did not finish in 10 minutes). Ours is
# checked against its definition instead (test_lfuda_is_its_definition).
LCS_CLASSES = {"lru": "LRU", "fifo": "FIFO", "s3fifo": "S3FIFO", "sieve": "Sieve"}


@pytest.mark.parametrize("capacity", [100, 1_000])
@pytest.mark.parametrize("name", sorted(LCS_CLASSES))  # the policies libCacheSim has
def test_miss_ratio_matches_libcachesim(name: str, capacity: int, zipf: list[int]) -> None:
    # Measured (Zipf 1.0, 100k requests over 10k keys, seed 42): all five agree with
    # libCacheSim on every single request, at both sizes. 0.001 (100 requests)
    # leaves room only for a tie-break change in a future libCacheSim.
    lcs = pytest.importorskip("libcachesim")
    ours = our_miss_ratio(make_policy(name, capacity), zipf, capacity, lambda _: 1)
    theirs = their_miss_ratio(getattr(lcs, LCS_CLASSES[name])(capacity), zipf, lambda _: 1)
    assert abs(ours - theirs) <= 0.001, (name, capacity, ours, theirs)


def test_s3fifo_sized_entries_match_libcachesim() -> None:
    """Queues count sizes like libCacheSim's byte-based ones."""
    lcs = pytest.importorskip("libcachesim")
    requests = zipf_requests(5_000, 30_000, alpha=1.0, seed=7)
    sizes = np.random.default_rng(7).integers(1, 9, size=5_000).tolist()
    ours = our_miss_ratio(S3FIFOPolicy(2_000), requests, 2_000, sizes.__getitem__)
    theirs = their_miss_ratio(lcs.S3FIFO(2_000), requests, sizes.__getitem__)
    assert abs(ours - theirs) <= 0.001, (ours, theirs)
