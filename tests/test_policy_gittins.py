"""The Gittins policy: its index, what it learns, and what it does with it.

The shared contract (insert/access/remove/victim, blocked entries, bounded steps) is
tests/test_policies.py's, which runs every registered policy; these are its own."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.policies import GittinsPolicy, LRUPolicy, make_policy
from prefixcache.policies.base import EvictionPolicy
from prefixcache.policies.gittins import gittins_index


def brute_index(hits: list[float], risk: list[float]) -> list[float]:
    """The definition, in O(n^2): max over T > a of hits / occupancy over [a, T)."""
    xs, ys, surv = [0.0], [0.0], 1.0
    for h, r in zip(hits, risk, strict=True):
        hz = min(max(h / r if r > 0 else 0.0, 0.0), 1.0)
        xs.append(xs[-1] + surv)
        ys.append(ys[-1] + surv * hz)
        surv *= 1.0 - hz
    out = []
    for a in range(len(hits)):
        slopes = [(ys[t] - ys[a]) / (xs[t] - xs[a]) for t in range(a + 1, len(xs)) if xs[t] > xs[a]]
        out.append(max([0.0, *slopes]))
    return out


tables = st.integers(1, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0, 10, allow_nan=False), min_size=n, max_size=n),
        st.lists(st.floats(0, 1, allow_nan=False), min_size=n, max_size=n),
    )
)


@settings(max_examples=300, deadline=None)
@given(tables)
def test_index_is_the_definition(table: tuple[list[float], list[float]]) -> None:
    risk, share = table
    hits = [r * s for r, s in zip(risk, share, strict=True)]
    assert gittins_index(hits, risk) == pytest.approx(brute_index(hits, risk), rel=1e-9, abs=1e-12)


def test_memoryless_reuse_has_a_flat_index() -> None:
    # hazard 0.1 at every age: waiting tells nothing, the index is the hazard
    n = 50
    risk = [0.9**x * 1000 for x in range(n)]
    hits = [0.1 * r for r in risk]
    assert gittins_index(hits, risk) == pytest.approx([0.1] * n)


def test_think_time_makes_the_index_rise_with_age() -> None:
    # no reuse for 10 bins, then a reuse is likely: a block 9 bins old is worth more
    # than a fresh one, which still has the wait ahead of it
    risk = [100.0] * 10 + [100.0, 50.0, 25.0]
    hits = [0.0] * 10 + [50.0, 25.0, 12.5]
    index = gittins_index(hits, risk)
    assert index[0] < index[5] < index[9]
    assert index[10] == pytest.approx(0.5)


def flat_hits(policy: EvictionPolicy, requests: list[int], capacity: int, count_from: int = 0) -> int:
    hits = 0
    for i, key in enumerate(requests):
        if key in policy:
            policy.access(key)
            hits += i >= count_from
            continue
        if len(policy) >= capacity:
            policy.victim()
        policy.insert(key)
    return hits


def test_a_loop_larger_than_the_cache_still_hits() -> None:
    """LRU gets nothing from a loop over more keys than it holds: it evicts each key
    just before its turn. Reuse at a fixed distance is a think time: the index learns
    it and keeps part of the loop, as the optimum does."""
    loop = list(range(120)) * 40
    capacity = 100
    lru = flat_hits(LRUPolicy(capacity), loop, capacity, len(loop) // 2)
    gittins = flat_hits(GittinsPolicy(capacity), loop, capacity, len(loop) // 2)
    assert lru == 0
    assert gittins > 0.5 * len(loop) / 2


def test_one_off_keys_do_not_flush_a_reused_working_set() -> None:
    rng = random.Random(3)
    hot = list(range(50))
    requests, fresh = [], 1000
    for _ in range(20_000):
        if rng.random() < 0.5:
            requests.append(rng.choice(hot))
        else:
            requests.append(fresh)
            fresh += 1
    capacity = 60
    lru = flat_hits(LRUPolicy(capacity), requests, capacity, len(requests) // 2)
    gittins = flat_hits(GittinsPolicy(capacity), requests, capacity, len(requests) // 2)
    hot_requests = sum(1 for key in requests[len(requests) // 2 :] if key < 1000)
    assert gittins > 0.95 * hot_requests
    assert gittins > lru


def test_an_evicted_key_stored_again_counts_as_a_reuse() -> None:
    p = GittinsPolicy(4)
    p.insert("a")
    p.insert("b")
    assert p.victim() in {"a", "b"}
    p.insert("c")
    gone = "a" if "a" not in p else "b"
    p.insert(gone)  # back from the ghost: its class is "reused once"
    assert p._meta[gone][2] == 1
    assert p._meta["c"][2] == 0


def test_remove_leaves_no_ghost() -> None:
    p = GittinsPolicy(4)
    p.insert("a")
    p.remove("a")
    p.insert("a")
    assert p._meta["a"][2] == 0


def test_parameters_are_checked() -> None:
    with pytest.raises(ValueError):
        GittinsPolicy(10, horizon=0)
    with pytest.raises(ValueError):
        GittinsPolicy(10, bins=1)
    assert make_policy("gittins", 10).name == "gittins"


def test_blocked_entries_keep_their_age() -> None:
    """A blocked entry moves to the back of its own tick's group: it keeps its age."""
    p = GittinsPolicy(100)
    for key in "abc":
        p.insert(key)  # capacity 100: one tick, one group
    assert p.victim(lambda key: key != "a") == "b"  # a is blocked (a parent, a pin)
    ((tick, group),) = p._groups[0].items()
    assert list(group) == ["c", "a"] and p._meta["a"][0] == tick
    assert p.victim(lambda key: False) is None
    assert len(p) == 2


def test_leaves_told_by_the_cache_are_the_only_candidates() -> None:
    p = GittinsPolicy(100)
    for key in "abcd":
        p.insert(key)
    for key in "bcd":
        p.set_leaf(key, False)  # a chain d -> c -> b -> a, deepest a
    asked: list[str] = []

    def evictable(key: str) -> bool:
        asked.append(key)
        return True

    assert p.victim(evictable) == "a"
    assert asked == ["a"]
    p.set_leaf("b", True)
    p.access("c")  # an interior entry is touched: still no candidate
    assert p.victim() == "b"
    p.remove("d")
    p.set_leaf("c", True)
    assert p.victim() == "c" and len(p) == 0
