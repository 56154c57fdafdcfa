"""The simulator's chained block hash (sim/blocks.py ``prefix_ids``): an id names its
block and every block before it, a partial tail included, and skipping blocks already
named changes no id."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefixcache.hashing import token_bytes
from prefixcache.sim.blocks import prefix_ids

tokens = st.lists(st.integers(0, 3), max_size=24)


@given(a=tokens, b=tokens, block_size=st.integers(1, 5))
def test_two_ids_are_equal_exactly_when_their_prefixes_are(a: list[int], b: list[int], block_size: int) -> None:
    ids_a, ids_b = prefix_ids(token_bytes(a), block_size), prefix_ids(token_bytes(b), block_size)
    assert len(ids_a) == -(-len(a) // block_size)
    for i, x in enumerate(ids_a):
        for j, y in enumerate(ids_b):
            end_a, end_b = min(len(a), (i + 1) * block_size), min(len(b), (j + 1) * block_size)
            assert (x == y) == (a[:end_a] == b[:end_b])


@given(a=tokens, block_size=st.integers(1, 5), skip=st.integers(0, 8))
def test_skipping_named_blocks_changes_no_id(a: list[int], block_size: int, skip: int) -> None:
    data = token_bytes(a)
    assert prefix_ids(data, block_size, skip) == prefix_ids(data, block_size)[skip:]
    assert prefix_ids(memoryview(data), block_size) == prefix_ids(data, block_size)
