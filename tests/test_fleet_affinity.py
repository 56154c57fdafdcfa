"""``prompt_cache_key`` as a routing hint (issue 41, point 2): the same tenant and key go to
the same backend when KV scores tie or no backend holds anything yet; the KV held always
comes first; another tenant's same key is another affinity; never a cache scope."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.fleet.scoring import MAX_CACHE_KEY, BackendView, Routing, Scorer, affinity_of

NAMES = ("a", "b", "c", "d")


def views(
    order: tuple[str, ...], held: dict[str, int] | None = None, load: dict[str, float] | None = None
) -> list[BackendView]:
    held, load = held or {}, load or {}
    return [BackendView(n, ("device",) * held.get(n, 0), load.get(n, 0.0)) for n in order]


@settings(max_examples=50, deadline=None)
@given(
    key=st.text(min_size=1, max_size=40),
    rotation=st.integers(0, 3),
    loads=st.lists(st.floats(0, 50), min_size=4, max_size=4),
)
def test_a_key_goes_to_one_backend_whatever_the_order_and_load_while_nothing_is_held(
    key: str, rotation: int, loads: list[float]
) -> None:
    affinity = affinity_of("acme", key)
    assert affinity is not None
    first = Scorer().choose(Routing.COST, 8, views(NAMES), 0, affinity).backend
    order = NAMES[rotation:] + NAMES[:rotation]
    again = Scorer().choose(Routing.COST, 8, views(order, load=dict(zip(NAMES, loads, strict=True))), 0, affinity)
    assert again.backend == first


def test_keys_spread_over_the_backends() -> None:
    chosen = Counter(
        Scorer().choose(Routing.COST, 8, views(NAMES), 0, affinity_of("acme", f"k{i}")).backend for i in range(400)
    )
    assert set(chosen) == set(NAMES) and min(chosen.values()) > 60  # about 100 each


def test_the_kv_held_comes_before_the_key() -> None:
    affinity = affinity_of("acme", "session-1")
    favourite = Scorer().choose(Routing.COST, 8, views(NAMES), 0, affinity).backend
    other = next(n for n in NAMES if n != favourite)
    for routing in (Routing.COST, Routing.PREFIX):
        assert Scorer().choose(routing, 8, views(NAMES, held={other: 3}), 0, affinity).backend == other


def test_ties_of_held_kv_go_to_the_keys_backend() -> None:
    affinity = affinity_of("acme", "session-2")
    assert affinity is not None
    two = ("b", "c")
    pick = Scorer().choose(Routing.COST, 8, views(NAMES, held=dict.fromkeys(two, 2)), 0, affinity).backend
    assert pick in two
    assert Scorer().choose(Routing.COST, 8, views(NAMES[::-1], held=dict.fromkeys(two, 2)), 0, affinity).backend == pick


def test_without_a_key_routing_is_as_before() -> None:
    scorer = Scorer()
    for order in (NAMES, NAMES[::-1]):
        assert scorer.choose(Routing.COST, 8, views(order), 0, None).backend == order[0]  # the caller's rotation


def test_another_tenants_same_key_is_another_affinity_and_bad_keys_are_none() -> None:
    assert affinity_of("acme", "k") != affinity_of("globex", "k")
    assert affinity_of("acme\x00k", "") is None
    assert affinity_of("acme", "a\x00b") != affinity_of("acme\x00a", "b")
    for bad in (None, 7, ["k"], {"k": 1}, "", "x" * (MAX_CACHE_KEY + 1)):
        assert affinity_of("acme", bad) is None
    assert affinity_of("acme", "\ud800") is not None  # a lone surrogate is a key, never an error


@pytest.mark.parametrize("routing", [Routing.ROUND_ROBIN, Routing.LEAST_LOADED])
def test_routings_blind_to_kv_ignore_the_key(routing: Routing) -> None:
    affinity = affinity_of("acme", "k")
    load = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 4.0}
    without = Scorer().choose(routing, 8, views(NAMES, load=load), 1, None)
    assert Scorer().choose(routing, 8, views(NAMES, load=load), 1, affinity) == without
