"""The host-memory tier (a slab of fixed-size slots, zero-copy reads) and the metadata-only
null tier: bit-exact round trips of codec frames, O(1) slot reuse, ``TierFull`` without
side effects, and byte accounting that never exceeds the capacity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.storage import codec
from prefixcache.storage.base import TierError, TierFull, TierStore
from prefixcache.storage.memory import SLAB_ALIGN, MemoryStore
from prefixcache.storage.null import NullStore
from support import SHAPE, TOKENS, frame_of, key_of, random_kv


def bits(arr: np.ndarray) -> bytes:
    return arr.tobytes()


def store_for(blocks: int, dtype: str = "float16") -> MemoryStore:
    return MemoryStore.for_blocks(blocks, SHAPE, dtype)


# ============================================================================ MemoryStore


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_codec_frames_round_trip_bit_exact(dtype: str) -> None:
    store = store_for(8, dtype)
    kvs = {key_of(i): random_kv(dtype, i) for i in range(8)}
    for key, kv in kvs.items():
        store.put(key, codec.encode(key, TOKENS, kv, dtype=dtype))
    views = store.get_many(list(kvs))
    for (key, kv), view in zip(kvs.items(), views, strict=True):
        assert view is not None
        out = codec.decode(view, key=key, tokens=TOKENS, shape=SHAPE, dtype=dtype)
        assert bits(out) == bits(kv)


def test_for_blocks_sizes_slots_from_the_codec() -> None:
    frame = codec.encoded_size(SHAPE, "float16", 16)
    store = MemoryStore.for_blocks(5, SHAPE, "float16")
    assert store.slot_bytes >= frame and store.slot_bytes % codec.HEADER_ALIGN == 0
    assert store.slot_bytes - frame < codec.HEADER_ALIGN
    assert store.slots == 5 and store.capacity_bytes == 5 * store.slot_bytes
    with pytest.raises(ValueError, match="blocks"):
        MemoryStore.for_blocks(-1, SHAPE, "float16")
    assert store.room_for(frame) == 5 and store.room_for(store.slot_bytes + 1) == 0  # a slot per frame
    store.put(key_of(0), frame_of(0))
    assert store.room_for(1) == 4


def test_reads_are_zero_copy_read_only_views_of_the_slab() -> None:
    store = store_for(2)
    store.put(key_of(0), frame_of(0))
    store.put(key_of(1), frame_of(1))
    (view,) = store.get_many([key_of(1)])
    assert isinstance(view, memoryview) and view.readonly
    arr = np.frombuffer(view, dtype=np.uint8)
    assert np.shares_memory(arr, store._slab)
    assert arr.ctypes.data == store._slab.ctypes.data + store.slot_bytes  # slot 1, right where the diagram says
    assert store._slab.ctypes.data % SLAB_ALIGN == 0
    decoded = codec.decode(view, key=key_of(1))
    assert np.shares_memory(decoded, store._slab)  # the decoded tensor is a view too


def test_a_deleted_slot_is_the_next_one_used() -> None:
    store = store_for(4)
    for i in range(4):
        store.put(key_of(i), frame_of(i))
    assert store.free_slots == 0
    assert store.delete(key_of(2)) is True
    assert store.delete(key_of(2)) is False
    (before,) = store.get_many([key_of(3)])
    store.put(key_of(9), frame_of(9))  # O(1): the freed slot is popped, nothing is scanned
    (view,) = store.get_many([key_of(9)])
    assert view is not None and before is not None
    slot_of_9 = (np.frombuffer(view, np.uint8).ctypes.data - store._slab.ctypes.data) // store.slot_bytes
    assert slot_of_9 == 2
    assert bytes(before) == frame_of(3)  # the neighbours are untouched


def test_full_store_raises_tier_full_and_stores_nothing() -> None:
    store = store_for(2)
    store.put(key_of(0), frame_of(0))
    store.put(key_of(1), frame_of(1))
    with pytest.raises(TierFull):
        store.put(key_of(2), frame_of(2))
    assert isinstance(TierFull(), TierError)
    assert key_of(2) not in store and len(store) == 2
    assert store.get_many([key_of(2)]) == [None]
    assert store.stats.puts == 2
    assert [bytes(v) for v in store.get_many([key_of(0), key_of(1)]) if v is not None] == [frame_of(0), frame_of(1)]


def test_replacing_a_key_reuses_its_slot_even_when_full() -> None:
    store = store_for(2)
    store.put(key_of(0), frame_of(0))
    store.put(key_of(1), frame_of(1))
    new = codec.encode(key_of(0), TOKENS, random_kv("float16", 99), dtype="float16")
    store.put(key_of(0), new)  # no free slot, but none is needed
    assert len(store) == 2 and store.used_bytes == 2 * store.slot_bytes
    (view,) = store.get_many([key_of(0)])
    assert view is not None and bytes(view) == new


def test_a_shorter_replacement_returns_only_its_own_bytes() -> None:
    store = MemoryStore(64, 32)
    store.put(b"k", b"x" * 32)
    store.put(b"k", b"yy")
    assert store.get_many([b"k"]) == [memoryview(b"yy")]


def test_a_frame_larger_than_a_slot_is_a_value_error_naming_both_sizes() -> None:
    store = MemoryStore(1024, 100)
    with pytest.raises(ValueError, match=r"101 bytes.*100-byte slot"):
        store.put(b"k", bytes(101))
    assert len(store) == 0 and store.stats.puts == 0
    store.put(b"k", bytes(100))  # exactly a slot fits
    assert b"k" in store


def test_capacity_rounds_down_to_whole_slots() -> None:
    store = MemoryStore(1000, 300)
    assert store.slots == 3 and store.capacity_bytes == 900
    for i in range(3):
        store.put(key_of(i), b"a")  # one byte still takes a whole slot
    assert store.used_bytes == 900
    with pytest.raises(TierFull):
        store.put(key_of(3), b"a")
    tiny = MemoryStore(10, 300)  # not even one slot
    assert tiny.slots == 0 and tiny.capacity_bytes == 0
    with pytest.raises(TierFull):
        tiny.put(b"k", b"a")


def test_a_frame_takes_what_used_bytes_counts_for_it() -> None:
    """``footprint``: a whole slot in memory however short the frame; its own length in a
    store that counts the lengths it holds (the null tier, as the base says)."""
    frame = frame_of(0)
    slot = len(frame) + codec.HEADER_ALIGN
    slotted, null = MemoryStore(4 * slot, slot), NullStore(1 << 20)
    for store in (slotted, null):
        store.put(key_of(0), frame)
    assert slotted.footprint(len(frame)) == slotted.used_bytes == slot
    assert null.footprint(len(frame)) == null.used_bytes == len(frame)


@pytest.mark.parametrize("slot_bytes", [0, -1, True, 1.5])
def test_bad_slot_sizes_are_refused(slot_bytes: object) -> None:
    with pytest.raises(ValueError, match="slot_bytes"):
        MemoryStore(100, slot_bytes)  # type: ignore[arg-type]


def test_frames_of_any_contiguous_buffer_type() -> None:
    store = MemoryStore(256, 64)
    store.put(b"a", bytearray(b"abc"))
    store.put(b"b", np.arange(4, dtype=np.float32).data)  # cast to bytes, 16 of them
    got = store.get_many([b"a", b"b"])
    assert got[0] == memoryview(b"abc")
    assert got[1] is not None and bytes(got[1]) == np.arange(4, dtype=np.float32).tobytes()
    with pytest.raises(TypeError, match="contiguous"):
        store.put(b"c", memoryview(bytes(8))[::2])
    with pytest.raises(TypeError, match="key"):
        store.put("c", b"x")  # type: ignore[arg-type]


def test_contains_prefix_of_a_chain() -> None:
    store = store_for(8)
    chain = [key_of(i) for i in range(6)]
    assert store.contains_prefix(chain) == 0
    for key in chain[:4]:
        store.put(key, frame_of(0))
    assert store.contains_prefix(chain) == 4
    assert store.contains_prefix(chain[:3]) == 3
    assert store.contains_prefix([]) == 0


def test_stats_count_hits_misses_and_bytes() -> None:
    store = store_for(4)
    frame = frame_of(0)
    store.put(key_of(0), frame)
    store.put(key_of(0), frame)
    store.put(key_of(1), frame)
    store.get_many([key_of(0), key_of(5), key_of(1), key_of(0)])
    store.delete(key_of(1))
    store.delete(key_of(7))
    s = store.stats
    assert (s.hits, s.misses, s.puts, s.deletes) == (3, 1, 3, 1)
    assert s.bytes_written == 3 * len(frame) and s.bytes_read == 3 * len(frame)
    assert not s.errors


def test_context_manager_closes_and_close_is_idempotent() -> None:
    with store_for(2) as store:
        assert isinstance(store, TierStore)
        store.put(key_of(0), frame_of(0))
        (view,) = store.get_many([key_of(0)])
    assert isinstance(store, MemoryStore)
    assert len(store) == 0 and store.used_bytes == 0 and key_of(0) not in store
    assert store.get_many([key_of(0)]) == [None]
    assert view is not None and bytes(view) == frame_of(0)  # a view kept its bytes alive
    with pytest.raises(TierError, match="closed"):
        store.put(key_of(0), frame_of(0))
    store.close()


_OPS = st.lists(
    st.tuples(st.sampled_from(["put", "delete", "get"]), st.integers(0, 7), st.integers(0, 48)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, slot_bytes=st.integers(1, 40), slots=st.integers(0, 5), extra=st.integers(0, 39))
def test_matches_a_dict_reference_and_never_exceeds_capacity(
    ops: list[tuple[str, int, int]], slot_bytes: int, slots: int, extra: int
) -> None:
    store = MemoryStore(slots * slot_bytes + extra % slot_bytes, slot_bytes)
    ref: dict[bytes, bytes] = {}
    for n, (op, k, length) in enumerate(ops):
        key = key_of(k)
        if op == "put":
            frame = bytes([n % 256]) * length
            if length > slot_bytes:
                with pytest.raises(ValueError):
                    store.put(key, frame)
            elif key not in ref and len(ref) == slots:
                with pytest.raises(TierFull):
                    store.put(key, frame)
            else:
                store.put(key, frame)
                ref[key] = frame
        elif op == "delete":
            assert store.delete(key) is (ref.pop(key, None) is not None)
        else:
            (got,) = store.get_many([key])
            assert (None if got is None else bytes(got)) == ref.get(key)
        assert store.used_bytes == len(ref) * slot_bytes <= store.capacity_bytes
        assert len(store) == len(ref) and store.free_slots == slots - len(ref)
    keys = [key_of(k) for k in range(8)]
    assert [None if v is None else bytes(v) for v in store.get_many(keys)] == [ref.get(k) for k in keys]


# ============================================================================ NullStore


def test_null_store_keeps_residency_and_lengths_but_no_bytes() -> None:
    store = NullStore(100)
    store.put(b"a", bytes(40))
    store.put(b"b", bytes(50))
    assert b"a" in store and b"c" not in store and len(store) == 2
    assert store.used_bytes == 90
    assert store.get_many([b"a", b"c"]) == [None, None]  # nothing to serve, held or not
    assert (store.stats.hits, store.stats.misses, store.stats.bytes_read) == (1, 1, 40)
    with pytest.raises(TierFull):
        store.put(b"c", bytes(11))
    assert b"c" not in store and store.used_bytes == 90
    store.put(b"a", bytes(50))  # a replacement counts its new length only
    assert store.used_bytes == 100
    assert store.delete(b"a") is True and store.delete(b"a") is False
    assert store.used_bytes == 50 and store.stats.deletes == 1
    store.put_size(b"d", 50)  # the simulator accounts for a frame without building it
    assert store.used_bytes == 100 <= store.capacity_bytes
    assert store.contains_prefix([b"b", b"d", b"x"]) == 2


def test_null_store_close_and_context_manager() -> None:
    with NullStore(10) as store:
        store.put(b"k", b"abc")
    assert len(store) == 0 and store.used_bytes == 0
    store.close()
    with pytest.raises(ValueError, match="nbytes"):
        NullStore(10).put_size(b"k", -1)


def test_kinds() -> None:
    assert MemoryStore.kind == "memory" and NullStore.kind == "null"
