"""The miniatures' head cost (``head_unit``, sampled curves) in the compiled kernel
against its Python reference (sim/minitree.py), on random requests: every answer and
counter after every request, for every policy the kernel has."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.sim.minitree import MiniTree

_kernel = pytest.importorskip("prefixcache.sim.native._kernel", reason="the compiled replay kernel is not built")

BASE = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # a shared head many requests start with


@st.composite
def requests(draw: st.DrawFn) -> tuple[int, list[int], int, int]:
    """(root, ids, match_blocks, head): ids share a prefix of ``BASE`` and end in a short
    random tail, so heads are shared and tails both repeat and diverge."""
    ids = BASE[: draw(st.integers(0, len(BASE)))] + draw(st.lists(st.integers(0, 5), max_size=6))
    match = draw(st.one_of(st.just(-1), st.integers(0, len(ids))))
    return draw(st.integers(0, 1)), ids, match, draw(st.integers(0, len(ids) + 1))


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(_kernel.POLICIES),
    capacity=st.integers(0, 80),
    unit=st.integers(1, 6),
    head_unit=st.integers(0, 9),
    trace=st.lists(requests(), max_size=40),
)
def test_the_kernels_head_cost_is_its_python_reference(
    policy: str, capacity: int, unit: int, head_unit: int, trace: list[tuple[int, list[int], int, int]]
) -> None:
    tree = _kernel.Tree(policy, capacity, unit, False, None, head_unit)
    ref = MiniTree(policy, capacity, unit, head_unit)
    roots = [(tree.root(key), ref.root(key)) for key in (7, 7)]  # NOTE: one key, two roots: they stay apart
    for step, (r, ids, match, head) in enumerate(trace):
        got = tree.access(roots[r][0], 0, ids, match, 0.0, head)
        want = ref.access(roots[r][1], ids, match, head)
        state = (got, tree.used, len(tree), tree.evictions)
        assert state == (want, ref.used, len(ref), ref.evictions), f"request {step}: {r, ids, match, head}"
        assert tree.used <= max(capacity, 0)


def test_a_head_block_costs_head_unit_and_a_block_below_it_unit() -> None:
    ref = MiniTree("lru", 100, 8, 2)
    root = ref.root(1)
    assert ref.access(root, [1, 2, 3, 4], head=3) == 0
    assert ref.used == 3 * 2 + 8
    assert ref.access(root, [1, 2, 3, 4, 5], head=5) == 4  # a hit costs nothing; the new block is in the head
    assert ref.used == 3 * 2 + 8 + 2


def test_what_does_not_fit_is_not_stored_and_the_rest_is_evicted_in_policy_order() -> None:
    ref = MiniTree("fifo", 10, 4, 1)
    root = ref.root(1)
    ref.access(root, [1, 2], head=2)  # 2 head blocks: 2
    ref.access(root, [5, 6, 7])  # 12 needed, 8 free: evicts [1, 2] (the oldest chain, deepest blocked first)
    assert (ref.used, len(ref), ref.evictions) == (8, 2, 2)
    assert ref.access(root, [5, 6]) == 2
