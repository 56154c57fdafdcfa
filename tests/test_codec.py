"""Payload framing (design.md invariant 8, and the "bad block is a miss" half of
invariant 6): bit-exact round trips, zero-copy decode, and a specific ``FrameError``
for every way a frame can be damaged or belong to another block."""

from __future__ import annotations

import ast
import math
import struct
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import support
from prefixcache.storage import codec, header, quant
from prefixcache.storage.codec import (
    CorruptFrame,
    DtypeMismatch,
    FrameError,
    KeyMismatch,
    ShapeMismatch,
    TokenMismatch,
    TruncatedFrame,
    UnsupportedVersion,
    decode,
    encode,
    encoded_size,
    peek_header,
)
from support import WIRE, raises_with

KEY = bytes(range(16))
TOKENS = struct.pack("<4I", 7, 8, 9, 10)
SMALL = (1, 2, 1, 2, 2)  # a 128-byte frame: every cut and every bit is cheap to try
SMOLLM2 = (30, 2, 3, 16, 64)  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, 16-token blocks

# Byte offsets of the fixed header fields (see the layout in codec's docstring).
OFF_VERSION, OFF_HLEN, OFF_DTYPE, OFF_NDIM, OFF_FLAGS, OFF_KEYLEN, OFF_SHAPE = 4, 6, 8, 9, 10, 12, 14
OFF_TOKEN_CK = OFF_SHAPE + 4 * 5 + len(KEY)  # then the payload length (u64) and payload checksum
OFF_PAYLOAD_LEN = OFF_TOKEN_CK + 16


def kv_of(raw: bytes, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Arbitrary bytes as a KV tensor: covers every NaN payload, -0.0, inf and denormal."""
    out: np.ndarray = np.frombuffer(raw, dtype=WIRE[dtype]).reshape(shape)
    return out


def random_kv(shape: tuple[int, ...] = SMALL, dtype: str = "float16", seed: int = 0) -> np.ndarray:
    return support.random_kv(dtype, seed, shape)


def small_frame(dtype: str = "float16") -> bytes:
    return encode(KEY, TOKENS, random_kv(SMALL, dtype), dtype=dtype)


def bits(arr: np.ndarray) -> bytes:
    data: bytes = arr.tobytes()
    return data


def patch(frame: bytes, offset: int, fmt: str, value: int, *, rehash: bool = True) -> bytes:
    """``frame`` with one header field rewritten; ``rehash`` re-seals the header checksum,
    as a buggy (not a damaged) writer would, so only the consistency checks stand guard."""
    out = bytearray(frame)
    struct.pack_into(fmt, out, offset, value)
    if rehash:
        length = struct.unpack_from("<H", frame, OFF_HLEN)[0]
        struct.pack_into("<Q", out, length - 8, xxhash.xxh3_64_intdigest(bytes(out[: length - 8])))
    return bytes(out)


# ============================================================================ round trips

shapes = st.tuples(*(st.integers(1, 4) for _ in range(5)))
dtypes = st.sampled_from(sorted(WIRE))
keys = st.binary(min_size=1, max_size=64)
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=32).map(lambda ts: struct.pack(f"<{len(ts)}I", *ts))


@settings(max_examples=200, deadline=None)
@given(shape=shapes, dtype=dtypes, key=keys, tokens=token_lists, data=st.data())
def test_round_trip_is_bit_exact(
    shape: tuple[int, ...], dtype: str, key: bytes, tokens: bytes, data: st.DataObject
) -> None:
    nbytes = math.prod(shape) * WIRE[dtype].itemsize
    kv = kv_of(data.draw(st.binary(min_size=nbytes, max_size=nbytes)), shape, dtype)
    frame = encode(key, tokens, kv, dtype=dtype)
    assert len(frame) == encoded_size(shape, dtype, len(key))
    for buf in (frame, bytearray(frame), memoryview(frame)):
        out = decode(buf, key=key, tokens=tokens, shape=shape, dtype=dtype)
        assert out.shape == shape and out.dtype.itemsize == WIRE[dtype].itemsize
        assert bits(out) == bits(kv)
    head = peek_header(frame)
    assert (head.key, head.shape, head.dtype, head.frame_length) == (key, shape, dtype, len(frame))
    assert head.header_length % codec.HEADER_ALIGN == 0
    assert (head.version, head.codec) == (1, "raw")  # raw frames stay version 1
    assert codec.verify(frame, key=key) == head


@pytest.mark.parametrize(
    ("dtype", "patterns"),
    [
        ("float32", [0x7FC00000, 0x7FC00001, 0x7F800001, 0xFFC12345, 0x80000000, 0x7F800000, 0x00000001]),
        ("float16", [0x7E00, 0x7E01, 0x7C01, 0xFE55, 0x8000, 0x7C00, 0x0001]),
        ("bfloat16", [0x7FC0, 0x7FC1, 0x7F81, 0xFFC5, 0x8000, 0x7F80, 0x0001]),
    ],
)
def test_nan_payloads_and_negative_zero_survive(dtype: str, patterns: list[int]) -> None:
    """Quiet and signalling NaNs with payloads, -0.0, inf and a denormal come back bit for bit."""
    raw = np.resize(np.array(patterns, dtype=np.uint32 if dtype == "float32" else np.uint16), math.prod(SMALL))
    kv = raw.view(WIRE[dtype]).reshape(SMALL)
    out = decode(encode(KEY, TOKENS, kv, dtype=dtype), key=KEY, dtype=dtype)
    assert bits(out) == bits(kv)
    if dtype != "bfloat16":
        assert np.signbit(out.reshape(-1)[4]) and out.reshape(-1)[4] == 0  # -0.0 is still negative zero


def test_smollm2_block_shape_and_size() -> None:
    kv = random_kv(SMOLLM2, "float16")
    payload = 30 * 2 * 3 * 16 * 64 * 2
    assert payload == 368_640
    assert encoded_size(SMOLLM2, "float16", 16) == 368_640 + 112  # 112-byte header for a 16-byte key
    frame = encode(KEY, TOKENS * 4, kv)
    assert len(frame) == encoded_size(SMOLLM2, "float16", len(KEY))
    out = decode(frame, key=KEY, tokens=TOKENS * 4, shape=SMOLLM2, dtype="float16")
    assert out.dtype == np.float16 and out.shape == SMOLLM2 and bits(out) == bits(kv)


def test_encoded_size_header_grows_in_aligned_steps() -> None:
    sizes = {k: encoded_size(SMALL, "float32", k) - 8 * 4 for k in (1, 16, 32, 46, 47, 65438)}
    assert sizes == {1: 96, 16: 112, 32: 128, 46: 128, 47: 144, 65438: 65520}


def test_the_longest_key_fits_the_u16_header_length() -> None:
    """The header length is a u16: the longest key is 65438 bytes, not 65535."""
    assert codec.MAX_KEY_LEN == 65438
    key = b"\xab" * codec.MAX_KEY_LEN
    frame = encode(key, TOKENS, random_kv())
    assert peek_header(frame).header_length == 65520
    assert bits(decode(frame, key=key, tokens=TOKENS)) == bits(random_kv())


# ============================================================================ zero copy


def test_decode_is_a_view_over_the_frame() -> None:
    frame = encode(KEY, TOKENS, random_kv(SMOLLM2))
    out = decode(frame, key=KEY)
    assert np.shares_memory(out, np.frombuffer(frame, dtype=np.uint8))
    assert not out.flags.writeable  # bytes are immutable, so is the view
    assert out.flags.aligned


def test_decode_of_a_bytearray_sees_later_writes() -> None:
    """Proof of no copy; also why a tier must copy before reusing a slot."""
    buf = bytearray(small_frame())
    out = decode(buf, key=KEY)
    before = out.reshape(-1)[-1].tobytes()
    buf[-1] ^= 0xFF
    assert out.reshape(-1)[-1].tobytes() != before
    raises_with(CorruptFrame, decode, buf, key=KEY)


def test_encode_copies_a_contiguous_array_once() -> None:
    kv = random_kv(SMOLLM2)
    assert codec._contiguous(kv, "float16") is kv


def test_a_larger_slot_is_read_through_peek_header() -> None:
    frame = small_frame()
    slot = memoryview(frame + bytes(100))
    raises_with(CorruptFrame, decode, slot, key=KEY)  # trailing bytes are not silently ignored
    out = decode(slot[: peek_header(slot).frame_length], key=KEY)
    assert bits(out) == bits(random_kv(SMALL))


def test_peek_header_needs_only_the_header() -> None:
    frame = small_frame()
    head = peek_header(frame[:112])
    assert head.header_length == 112 and head.payload_length == 16 and head.frame_length == len(frame)
    assert head.token_checksum == codec.token_checksum(TOKENS)
    assert head.payload_checksum == xxhash.xxh3_128_digest(frame[112:])
    with pytest.raises(FrozenInstanceError):
        head.key = b"x"  # type: ignore[misc]


# ============================================================================ encode input


def test_non_contiguous_and_big_endian_arrays_are_copied_and_round_trip() -> None:
    base = random_kv((2, 2, 3, 4, 6), "float32")
    for kv in (np.asfortranarray(base), base[:, :, ::2], base.astype(">f4")):
        out = decode(encode(KEY, TOKENS, kv), key=KEY, shape=kv.shape, dtype="float32")
        assert bits(out) == np.ascontiguousarray(kv, dtype="<f4").tobytes()


def test_raw_bfloat16_travels_as_labelled_uint16() -> None:
    kv = random_kv(SMALL, "bfloat16")
    frame = encode(KEY, TOKENS, kv, dtype="bfloat16")
    assert peek_header(frame).dtype == "bfloat16"
    out = decode(frame, key=KEY, dtype="bfloat16")
    assert out.dtype.itemsize == 2 and bits(out) == bits(kv)


def test_ml_dtypes_bfloat16_round_trips() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kv = np.linspace(-2, 2, math.prod(SMALL), dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(SMALL)
    frame = encode(KEY, TOKENS, kv)
    assert frame == encode(KEY, TOKENS, kv.view(np.uint16), dtype="bfloat16")
    out = decode(frame, key=KEY, dtype="bfloat16")
    assert out.dtype == kv.dtype and bits(out) == bits(kv)


@pytest.mark.parametrize(
    ("key", "tokens", "kv", "dtype", "error", "words"),
    [
        (b"", TOKENS, random_kv(), None, ValueError, "key must be 1 to 65438 bytes"),
        (b"k" * 65439, TOKENS, random_kv(), None, ValueError, "got 65439"),
        (b"k" * 65536, TOKENS, random_kv(), None, ValueError, "got 65536"),
        ("key", TOKENS, random_kv(), None, TypeError, "key must be bytes"),
        (KEY, TOKENS[:-1], random_kv(), None, ValueError, "multiple of 4"),
        (KEY, [1, 2], random_kv(), None, TypeError, "tokens must be"),
        (KEY, TOKENS, random_kv((2, 2, 1, 2)), None, ValueError, "must have 5 dims"),
        (KEY, TOKENS, np.zeros((1, 2, 0, 2, 2), np.float16), None, ValueError, "every dim"),
        (KEY, TOKENS, np.zeros(SMALL, np.float64), None, ValueError, "unsupported KV dtype float64"),
        (KEY, TOKENS, np.zeros(SMALL, np.int32), None, ValueError, "unsupported KV dtype int32"),
        (KEY, TOKENS, np.zeros(SMALL, np.uint16), None, ValueError, "dtype='bfloat16'"),
        (KEY, TOKENS, np.zeros(SMALL, np.uint16), "float16", ValueError, "dtype='bfloat16'"),
        (KEY, TOKENS, np.zeros(SMALL, np.float16), "float32", ValueError, "does not match"),
        (KEY, TOKENS, np.zeros(SMALL, np.float16), "fp8", ValueError, "valid: float32, float16, bfloat16"),
        (KEY, TOKENS, [[0.0]], None, TypeError, "numpy array"),
    ],
)
def test_encode_rejects_bad_input(
    key: Any, tokens: Any, kv: Any, dtype: str | None, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words) as info:
        encode(key, tokens, kv, dtype=dtype)
    assert not isinstance(info.value, FrameError)  # a caller bug, never a cache miss


@pytest.mark.parametrize(
    ("shape", "dtype", "key_len", "words"),
    [
        ((1, 2, 3, 4), "float16", 16, "5 dims"),
        ((1, 2, 0, 4, 5), "float16", 16, "every dim"),
        ((1, 2, 2**32, 4, 5), "float16", 16, "every dim"),
        ((1, 2, 1.5, 4, 5), "float16", 16, "integers"),
        (SMALL, "int8", 16, "valid"),
        (SMALL, "float16", 0, "key length"),
        (SMALL, "float16", 65439, "key length"),
    ],
)
def test_encoded_size_rejects_bad_input(shape: Any, dtype: str, key_len: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        encoded_size(shape, dtype, key_len)


def test_decode_rejects_bad_arguments_as_caller_bugs() -> None:
    frame = small_frame()
    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"key": b""}, ValueError),
        ({"key": KEY, "tokens": b"abc"}, ValueError),
        ({"key": KEY, "dtype": "fp8"}, ValueError),
        ({"key": KEY.hex()}, TypeError),
    ]
    for kwargs, error in cases:
        with pytest.raises(error) as info:
            decode(frame, **kwargs)
        assert not isinstance(info.value, FrameError)
    with pytest.raises(TypeError, match="contiguous"):
        decode(memoryview(frame + frame)[::2], key=KEY)


# ============================================================================ mismatches


def test_wrong_key_is_a_key_mismatch() -> None:
    err = raises_with(KeyMismatch, decode, small_frame(), key=KEY[::-1])
    assert KEY.hex() in str(err) and KEY[::-1].hex() in str(err)
    raises_with(KeyMismatch, decode, small_frame(), key=KEY + b"\x00")


def test_wrong_tokens_are_a_token_mismatch() -> None:
    frame = small_frame()
    raises_with(TokenMismatch, decode, frame, key=KEY, tokens=struct.pack("<4I", 7, 8, 9, 11))
    raises_with(TokenMismatch, decode, frame, key=KEY, tokens=TOKENS[:-4])
    raises_with(TokenMismatch, decode, frame, key=KEY, tokens=b"")
    assert decode(frame, key=KEY, tokens=bytearray(TOKENS)).shape == SMALL


def test_wrong_expected_shape_or_dtype() -> None:
    frame = small_frame("float16")
    raises_with(ShapeMismatch, decode, frame, key=KEY, shape=(1, 2, 1, 1, 4))
    raises_with(DtypeMismatch, decode, frame, key=KEY, dtype="bfloat16")
    raises_with(DtypeMismatch, decode, frame, key=KEY, dtype="float32")


def test_unknown_version_and_flags() -> None:
    frame = small_frame()
    raises_with(UnsupportedVersion, decode, patch(frame, OFF_VERSION, "<H", 3, rehash=False), key=KEY)
    raises_with(UnsupportedVersion, decode, patch(frame, OFF_VERSION, "<H", 0, rehash=False), key=KEY)
    raises_with(UnsupportedVersion, decode, patch(frame, OFF_FLAGS, "<H", 1), key=KEY)


def test_bad_magic() -> None:
    raises_with(CorruptFrame, decode, b"PXKW" + small_frame()[4:], key=KEY)
    raises_with(CorruptFrame, decode, b"\x00", key=KEY)


def test_payload_checksum() -> None:
    frame = bytearray(small_frame())
    frame[120] ^= 0x01
    err = raises_with(CorruptFrame, decode, bytes(frame), key=KEY)
    assert "payload checksum" in str(err)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "words"),
    [
        (OFF_HLEN, "<H", 128, "header length"),
        (OFF_DTYPE, "<B", 9, "dtype code"),
        (OFF_DTYPE, "<B", 1, "payload length"),  # float32: the shape then needs twice the bytes
        (OFF_SHAPE, "<I", 2, "payload length"),
        (OFF_SHAPE + 8, "<I", 0, "every dim >= 1"),
        (OFF_PAYLOAD_LEN, "<Q", 17, "payload length"),  # the payload-length field itself
    ],
)
def test_a_buggy_writer_is_caught_by_consistency_checks(offset: int, fmt: str, value: int, words: str) -> None:
    """Header fields that disagree even though the header checksum was re-sealed."""
    err = raises_with(CorruptFrame, decode, patch(small_frame(), offset, fmt, value), key=KEY)
    assert words in str(err)


# ============================================================================ damage


@pytest.mark.parametrize("dtype", sorted(WIRE))
def test_every_truncation_is_detected(dtype: str) -> None:
    frame = small_frame(dtype)
    for cut in range(len(frame)):
        with pytest.raises(TruncatedFrame):
            decode(frame[:cut], key=KEY)
        if cut >= peek_header(frame).header_length:
            assert peek_header(frame[:cut]) == peek_header(frame)
        else:
            with pytest.raises(TruncatedFrame):
                peek_header(frame[:cut])


def test_every_flipped_bit_is_detected() -> None:
    """No bit of a frame can change unnoticed, even when the caller passes only the key:
    the header checksum covers what the payload checksum and key comparison cannot."""
    frame = small_frame()
    length = peek_header(frame).header_length
    seen: dict[str, set[type[FrameError]]] = {"header": set(), "payload": set()}
    for bit in range(8 * len(frame)):
        damaged = bytearray(frame)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameError) as info:
            decode(bytes(damaged), key=KEY)
        seen["header" if bit // 8 < length else "payload"].add(type(info.value))
    assert seen == {"header": {CorruptFrame, UnsupportedVersion}, "payload": {CorruptFrame}}


@pytest.mark.parametrize(
    ("offset", "bit"),
    [
        (OFF_DTYPE, 0),
        (OFF_DTYPE, 1),
        (OFF_NDIM, 0),
        (OFF_KEYLEN, 0),
        (OFF_SHAPE, 1),
        (OFF_SHAPE + 16, 3),
        (OFF_PAYLOAD_LEN, 0),
    ],
)
def test_flipped_field_bits_are_corruption(offset: int, bit: int) -> None:
    """float16 (2) and bfloat16 (3) differ in one bit: only the header checksum tells them apart."""
    damaged = bytearray(small_frame())
    damaged[offset] ^= 1 << bit
    raises_with(CorruptFrame, decode, bytes(damaged), key=KEY, tokens=TOKENS)


def test_a_flipped_token_checksum_bit_is_caught_without_tokens() -> None:
    damaged = bytearray(small_frame())
    damaged[OFF_TOKEN_CK] ^= 0x10
    raises_with(CorruptFrame, decode, bytes(damaged), key=KEY)


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=300))
def test_garbage_is_a_frame_error(garbage: bytes) -> None:
    for buf in (garbage, b"PXKV" + garbage, b"PXKV\x01\x00" + garbage):
        with pytest.raises(FrameError):
            decode(buf, key=KEY)


@settings(max_examples=300, deadline=None)
@given(start=st.integers(0, 127), junk=st.binary(min_size=1, max_size=40), cut=st.integers(0, 200))
def test_spliced_or_cut_frames_never_decode_wrong(start: int, junk: bytes, cut: int) -> None:
    frame = small_frame()
    damaged = (frame[:start] + junk + frame[start + len(junk) :])[:cut]
    try:
        out = decode(damaged, key=KEY, tokens=TOKENS)
    except FrameError:
        return
    assert damaged == frame and bits(out) == bits(random_kv(SMALL))


# ============================================================================ hygiene


def test_errors_are_value_errors_and_distinct() -> None:
    errors = [TruncatedFrame, CorruptFrame, KeyMismatch, TokenMismatch, ShapeMismatch, DtypeMismatch]
    errors += [UnsupportedVersion, codec.UnknownCodec]
    assert all(issubclass(e, FrameError) and issubclass(e, ValueError) for e in errors)
    assert len(set(errors)) == 8
    assert issubclass(codec.Unrepresentable, ValueError) and not issubclass(codec.Unrepresentable, FrameError)


def test_no_pickle() -> None:
    """The codec and its header parser import nothing that can deserialize objects."""
    imported = set()
    for module in (codec, header, quant):
        source = Path(module.__file__ or "").read_text()
        assert "pickle" not in source.lower()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module or "")
    stdlib = {"__future__", "collections.abc", "dataclasses", "importlib", "math", "operator", "struct", "typing"}
    assert imported <= stdlib | {"numpy", "xxhash", "prefixcache.storage", "prefixcache.storage.header"}


def test_check_payload_false_skips_only_the_payload_checksum() -> None:
    """For frames a store has just verified: the payload is not hashed again, but the
    header, its checksum and every length still are."""
    frame = bytearray(small_frame())
    head = codec.peek_header(bytes(frame))
    frame[head.header_length] ^= 0x01  # a payload bit: only the payload checksum sees it
    with pytest.raises(CorruptFrame):
        codec.decode(bytes(frame), key=head.key)
    arr = codec.decode(bytes(frame), key=head.key, check_payload=False)
    assert arr.shape == head.shape
    header_flip = bytearray(small_frame())
    header_flip[6] ^= 0x01  # the header length field
    with pytest.raises(FrameError):
        codec.decode(bytes(header_flip), key=head.key, check_payload=False)
    with pytest.raises(TruncatedFrame):
        codec.decode(small_frame()[:-1], key=head.key, check_payload=False)


def test_verify_checks_what_a_store_must_and_returns_the_header() -> None:
    """What disk and Redis run on what they read: key, header, lengths, payload checksum."""
    frame = small_frame()
    assert codec.verify(frame, key=KEY) == peek_header(frame)
    raises_with(KeyMismatch, codec.verify, frame, key=KEY[::-1])
    damaged = bytearray(frame)
    damaged[-1] ^= 0x80
    raises_with(CorruptFrame, codec.verify, bytes(damaged), key=KEY)
    raises_with(TruncatedFrame, codec.verify, frame[:-1], key=KEY)
