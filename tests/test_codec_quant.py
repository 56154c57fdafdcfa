"""Compressed frames (issue 29): the bf16, int8 and int4 codecs in the frame format.

Raw frames stay version 1 byte for byte; compressed ones round trip within each
codec's error bound, keep the block's key and token checksum, and every damaged,
unknown or inconsistent frame is a ``FrameError`` (a miss), never data. A tensor a
codec cannot hold is ``Unrepresentable`` on write, not a frame error."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.storage import codec, header, placed, quant
from prefixcache.storage.codec import (
    CODECS,
    CorruptFrame,
    FrameError,
    TruncatedFrame,
    UnknownCodec,
    Unrepresentable,
    UnsupportedVersion,
    decode,
    encode,
    encoded_size,
    peek_header,
    transcode,
    verify,
)
from prefixcache.storage.placed import Place, read_placed
from support import raises_with

KEY = bytes(range(16))
TOKENS = struct.pack("<4I", 7, 8, 9, 10)
SMOLLM2 = (30, 2, 3, 16, 64)
TINY = (1, 2, 1, 2, 2)  # every cut and every bit of its frames is cheap to try
ODD = (3, 2, 1, 5, 7)  # head_dim not a multiple of 32, an odd count per K/V half
WIDE = (2, 2, 2, 3, 96)  # three int4 groups per head_dim
SHAPES = [SMOLLM2, TINY, ODD, WIDE, (1, 2, 1, 1, 1), (2, 2, 3, 5, 33)]
LOSSY = ("bf16", "int8", "int4")
DTYPES = ("float32", "float16", "bfloat16")
OUT = header.OUT_DTYPES

OFF_VERSION, OFF_HLEN, OFF_CODEC, OFF_FLAGS, OFF_SHAPE = 4, 6, 10, 11, 14
OFF_PAYLOAD_LEN = OFF_SHAPE + 4 * 5 + len(KEY) + 16
OFF_PAYLOAD_CK = OFF_PAYLOAD_LEN + 8


# ---------------------------------------------------------------------------- helpers


def kv_in(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as an input tensor of ``dtype`` (bfloat16 as the install's bf16 type)."""
    if dtype == "bfloat16":
        out: np.ndarray = quant.bf16_bits(x).view(OUT["bfloat16"])
        return out
    return x.astype(dtype)


def f32(kv: np.ndarray, dtype: str) -> np.ndarray:
    return quant.to_float32(kv, dtype)


def normal(shape: tuple[int, ...], seed: int = 0, scale: float = 1.0) -> np.ndarray:
    out: np.ndarray = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
    return out


def reseal(frame: bytes | bytearray) -> bytes:
    """Recompute the payload and header checksums, as a buggy writer would: only the
    checks past the checksums stand guard then."""
    out = bytearray(frame)
    length = struct.unpack_from("<H", out, OFF_HLEN)[0]
    out[OFF_PAYLOAD_CK : OFF_PAYLOAD_CK + 16] = xxhash.xxh3_128_digest(bytes(out[length:]))
    struct.pack_into("<Q", out, length - 8, xxhash.xxh3_64_intdigest(bytes(out[: length - 8])))
    return bytes(out)


def out_eps(dtype: str) -> tuple[float, float]:
    """Relative and absolute rounding of a float32 result stored as ``dtype``."""
    return {"float32": (2.0**-24, 0.0), "float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134)}[dtype]


def int8_scales(frame: bytes, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    layers, _, heads, tokens, dim = shape
    head = peek_header(frame)
    at = head.header_length + math.prod(shape)
    k = np.frombuffer(frame, "<f2", layers * heads * dim, at).reshape(layers, heads, dim)
    v = np.frombuffer(frame, "<f2", layers * heads * tokens, at + k.nbytes).reshape(layers, heads, tokens)
    return k.astype(np.float32), v.astype(np.float32)


def int4_params(frame: bytes, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, int]:
    n, size = math.prod(shape), header.int4_group(shape[-1])
    at = peek_header(frame).header_length + (n + 1) // 2
    scale = np.frombuffer(frame, "<f2", n // size, at)
    low = np.frombuffer(frame, "<f2", n // size, at + scale.nbytes)
    return scale.astype(np.float32), low.astype(np.float32), size


# ---------------------------------------------------------------------------- raw is version 1, unchanged

GOLDEN_V1 = "82825a1d4ce824c993fe46b3a44f6a37"  # xxh3_128 of the frames below, written before version 2


def test_raw_frames_are_byte_identical_to_version_1() -> None:
    digest = xxhash.xxh3_128()
    for dtype in DTYPES:
        for shape in (TINY, SMOLLM2, (2, 2, 3, 5, 33)):
            n = math.prod(shape)
            if dtype == "bfloat16":
                kv = (np.arange(n, dtype=np.uint32) * 2654435761 % 65521).astype("<u2")
            else:
                kv = (np.sin(np.arange(n)) * 3).astype(dtype)
            frame = encode(KEY, TOKENS, kv.reshape(shape), dtype=dtype)
            assert frame[OFF_VERSION] == 1 and frame[OFF_CODEC] == frame[OFF_FLAGS] == 0
            digest.update(frame)
    assert digest.hexdigest() == GOLDEN_V1


def v1_frame(key: bytes, tokens: bytes, kv: np.ndarray, dtype: str) -> bytes:
    """Version 1, written out from its spec: what every older writer produced."""
    payload = kv.tobytes()
    code = {"float32": 1, "float16": 2, "bfloat16": 3}[dtype]
    fixed = struct.pack("<4sHHBBHH", b"PXKV", 1, 0, code, 5, 0, len(key))
    tail = struct.pack("<16sQ16s", xxhash.xxh3_128_digest(tokens), len(payload), xxhash.xxh3_128_digest(payload))
    length = -(-(len(fixed) + 20 + len(key) + len(tail) + 8) // 16) * 16
    fixed = fixed[:6] + struct.pack("<H", length) + fixed[8:]
    body = fixed + struct.pack("<5I", *kv.shape) + key + tail
    body += bytes(length - 8 - len(body))
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + payload


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(*(st.integers(1, 4) for _ in range(5))),
    dtype=st.sampled_from(DTYPES),
    key=st.binary(min_size=1, max_size=48),
    seed=st.integers(0, 2**32 - 1),
)
def test_raw_matches_a_version_1_writer(shape: tuple[int, ...], dtype: str, key: bytes, seed: int) -> None:
    wire = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}[dtype]
    kv = np.frombuffer(np.random.default_rng(seed).bytes(math.prod(shape) * np.dtype(wire).itemsize), wire)
    kv = kv.reshape(shape)
    assert encode(key, TOKENS, kv, dtype=dtype, codec="raw") == v1_frame(key, TOKENS, kv, dtype)


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CODECS)
def test_round_trip(name: str, dtype: str, shape: tuple[int, ...]) -> None:
    x = f32(kv_in(normal(shape, seed=len(shape) + shape[-1]), dtype), dtype)
    kv = kv_in(x, dtype)
    frame = encode(KEY, TOKENS, kv, codec=name)
    assert len(frame) == encoded_size(shape, dtype, len(KEY), name)
    head = verify(frame, key=KEY)
    assert (head.codec, head.dtype, head.shape, head.key) == (name, dtype, shape, KEY)
    assert head.version == (1 if name == "raw" else 2) and frame[OFF_CODEC] == CODECS.index(name)
    out = decode(frame, key=KEY, tokens=TOKENS, shape=shape, dtype=dtype)
    assert out.shape == shape and out.dtype == OUT[dtype]
    if name == "raw":
        assert out.tobytes() == kv.tobytes()
        return
    assert out.flags.writeable and out.flags.c_contiguous and not np.shares_memory(out, np.frombuffer(frame, np.uint8))
    err = np.abs(f32(out, dtype) - x)
    assert np.all(err <= np.abs(x) * {"bf16": 2.0**-8, "int8": 0.02, "int4": 0.3}[name] + 0.3), name


@settings(max_examples=80, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.just(2), st.integers(1, 3), st.integers(1, 9), st.integers(1, 70)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
    magnitude=st.sampled_from([1e-6, 1e-3, 1.0, 30.0, 5000.0]),
)
def test_int8_error_is_half_a_step(shape: tuple[int, ...], dtype: str, seed: int, magnitude: float) -> None:
    """|x - x'| <= s / 2 with s the stored (float16) scale of the value's key channel or
    value token, plus the rounding of the result to the output dtype; and the stored
    scale is absmax / 127 rounded to float16 (up, never below it)."""
    rng = np.random.default_rng(seed)
    x32 = normal(shape, seed, magnitude) * rng.choice([0.0, 1.0, 1.0, 1.0], size=shape).astype(np.float32)
    x = f32(kv_in(x32, dtype), dtype)
    frame = encode(KEY, TOKENS, kv_in(x, dtype), codec="int8")
    ks, vs = int8_scales(frame, shape)
    exact_k, exact_v = np.abs(x[:, 0]).max(axis=2) / np.float32(127), np.abs(x[:, 1]).max(axis=3) / np.float32(127)
    for stored, exact in ((ks, exact_k), (vs, exact_v)):
        assert np.all(stored >= exact)
        assert np.all(stored <= np.nextafter(exact.astype(np.float16), np.float16(np.inf)).astype(np.float32))
    step = np.empty(shape, np.float32)
    step[:, 0] = ks[:, :, None, :]
    step[:, 1] = vs[..., None]
    out = f32(decode(frame, key=KEY), dtype)
    rel, tiny = out_eps(dtype)
    bound = step / 2 * (1 + 2.0**-20) + np.abs(out) * rel + tiny
    assert np.all(np.abs(out - x) <= bound)


@settings(max_examples=80, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 2), st.integers(1, 5), st.integers(1, 100)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
    magnitude=st.sampled_from([1e-5, 1.0, 100.0, 3000.0]),
    offset=st.sampled_from([0.0, 1.0, -700.0]),
)
def test_int4_error_is_half_a_step(
    shape: tuple[int, ...], dtype: str, seed: int, magnitude: float, offset: float
) -> None:
    """|x - x'| <= scale / 2 per group of 32 along head_dim (the whole head_dim when 32
    does not divide it), whatever the group's offset from zero."""
    x = f32(kv_in(normal(shape, seed, magnitude) + np.float32(offset), dtype), dtype)
    frame = encode(KEY, TOKENS, kv_in(x, dtype), codec="int4")
    scale, low, size = int4_params(frame, shape)
    groups = x.reshape(-1, size)
    top = groups.max(axis=1)
    assert np.all(low <= groups.min(axis=1)) and np.all(low + 15 * scale >= top - np.abs(top) * 2.0**-20)
    out = f32(decode(frame, key=KEY), dtype).reshape(-1, size)
    rel, tiny = out_eps(dtype)
    slack = np.abs(low)[:, None] * 2.0**-22 + np.abs(out) * rel + tiny
    assert np.all(np.abs(out - groups) <= scale[:, None] / 2 * (1 + 2.0**-20) + slack)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=4 * 24, max_size=4 * 24))
def test_bf16_rounds_to_nearest_even(data: bytes) -> None:
    """bf16 keeps the top 16 bits rounded to nearest even: within 2**-8 relative for
    every finite value, NaN stays NaN, and a bfloat16 input is stored as its own bits."""
    x = np.frombuffer(data, "<f4").reshape(1, 2, 1, 3, 4)
    frame = encode(KEY, TOKENS, x, codec="bf16")
    out = decode(frame, key=KEY)
    finite = np.isfinite(x) & (np.abs(x) < 3.3e38)
    with np.errstate(invalid="ignore"):
        err = np.abs(out - x)
    assert np.all(err[finite] <= np.abs(x)[finite] * 2.0**-8 + 2.0**-133)  # subnormals: absolute
    assert np.array_equal(np.isnan(out), np.isnan(x))
    u = x.view(np.uint32).astype(np.uint64)
    expect = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    got = np.frombuffer(frame, "<u2", x.size, peek_header(frame).header_length).reshape(x.shape)
    assert np.array_equal(got[~np.isnan(x)], expect[~np.isnan(x)])
    bf = out.astype(np.float32)  # float32 out: exactly representable in bf16, so stored as is
    assert encode(KEY, TOKENS, kv_in(bf, "bfloat16"), codec="bf16")[-x.size * 2 :] == frame[-x.size * 2 :]


def test_bf16_of_a_bf16_block_is_its_bits() -> None:
    kv = kv_in(normal(ODD), "bfloat16")
    raw, bf = encode(KEY, TOKENS, kv, codec="raw"), encode(KEY, TOKENS, kv, codec="bf16")
    assert raw[peek_header(raw).header_length :] == bf[peek_header(bf).header_length :]
    assert decode(bf, key=KEY).tobytes() == kv.tobytes()


def test_labelled_uint16_bfloat16_encodes_too() -> None:
    bits = quant.bf16_bits(normal(TINY))
    frame = encode(KEY, TOKENS, bits, dtype="bfloat16", codec="int8")
    assert peek_header(frame).dtype == "bfloat16" and decode(frame, key=KEY).dtype == OUT["bfloat16"]


# ---------------------------------------------------------------------------- layout, from the docstring


def test_int8_layout_byte_for_byte() -> None:
    """A scalar reference of the documented layout: K then V values, then K scales
    [L,H,D], then V scales [L,H,T]."""
    shape = (2, 2, 2, 3, 4)
    layers, _, heads, tokens, dim = shape
    x = normal(shape, 5, 3.0)
    ref = bytearray()
    k_s = np.zeros((layers, heads, dim), np.float16)
    v_s = np.zeros((layers, heads, tokens), np.float16)
    for layer, h, d in np.ndindex(layers, heads, dim):
        k_s[layer, h, d] = up16(float(np.abs(x[layer, 0, h, :, d]).max()) / 127)
    for layer, h, t in np.ndindex(layers, heads, tokens):
        v_s[layer, h, t] = up16(float(np.abs(x[layer, 1, h, t, :]).max()) / 127)
    for kv in range(2):
        for layer, h, t, d in np.ndindex(layers, heads, tokens, dim):
            s = float(k_s[layer, h, d] if kv == 0 else v_s[layer, h, t])
            ref += struct.pack("<b", max(-127, min(127, round(float(x[layer, kv, h, t, d]) / s))))
    ref += k_s.astype("<f2").tobytes() + v_s.astype("<f2").tobytes()
    assert encode(KEY, TOKENS, x, codec="int8")[-len(ref) :] == bytes(ref)
    assert peek_header(encode(KEY, TOKENS, x, codec="int8")).payload_length == len(ref)


def test_int4_layout_byte_for_byte() -> None:
    """Nibbles in C order, low nibble first, then a scale and a minimum per group."""
    shape = (1, 2, 1, 1, 64)  # two groups of 32 per row, four groups in all
    x = normal(shape, 6, 2.0) + np.float32(0.5)
    groups = x.reshape(-1, 32)
    scales, mins, nibbles = [], [], []
    for g in groups:
        low = np.float16(g.min())
        if float(low) > float(g.min()):
            low = np.nextafter(low, np.float16(-np.inf))
        s = up16((float(g.max()) - float(low)) / 15)
        scales.append(s)
        mins.append(low)
        nibbles += [max(0, min(15, round((float(v) - float(low)) / float(s)))) for v in g]
    ref = bytes(a | b << 4 for a, b in zip(nibbles[0::2], nibbles[1::2], strict=True))
    ref += np.array(scales, "<f2").tobytes() + np.array(mins, "<f2").tobytes()
    frame = encode(KEY, TOKENS, x, codec="int4")
    assert frame[-len(ref) :] == ref and peek_header(frame).payload_length == len(ref)


def up16(exact: float) -> np.float16:
    """``exact`` as float16, rounded up when nearest would be below it (the codec's rule)."""
    s = np.float16(np.float32(exact))
    return np.nextafter(s, np.float16(np.inf)) if float(s) < float(np.float32(exact)) else s


def test_int4_pads_an_odd_count() -> None:
    shape = (1, 1, 1, 1, 3)  # three values: one and a half bytes of nibbles
    x = np.array([0.0, 2.0, 30.0], np.float32).reshape(shape)  # scale 2: every value exact
    frame = encode(KEY, TOKENS, x, codec="int4")
    assert peek_header(frame).payload_length == 2 + 2 + 2
    assert np.array_equal(decode(frame, key=KEY), x)


# ---------------------------------------------------------------------------- sizes


def test_sizes_of_a_smollm2_block() -> None:
    """Derived from the layout: int8 is one byte a value plus a float16 per key channel
    and per value token; int4 half a byte plus two float16 per 32 values."""
    layers, _, heads, tokens, dim = SMOLLM2
    n = math.prod(SMOLLM2)
    head = header.header_length(5, len(KEY))
    sizes = {name: encoded_size(SMOLLM2, "float32", len(KEY), name) for name in CODECS}
    assert sizes == {
        "raw": head + 4 * n,
        "bf16": head + 2 * n,
        "int8": head + n + 2 * layers * heads * (dim + tokens),
        "int4": head + n // 2 + 2 * 2 * (n // 32),
    }
    assert sizes["raw"] / sizes["int8"] >= 3.6
    assert sizes["raw"] / sizes["int4"] >= 6
    assert codec.stored_ratio(SMOLLM2, "float32", "int8", len(KEY)) == sizes["raw"] / sizes["int8"]
    assert codec.stored_ratio(SMOLLM2, "float16", "raw") == 1.0
    assert codec.stored_ratio(SMOLLM2, "float16", "int4") > 3
    for dtype in DTYPES:
        for name in CODECS:
            assert len(encode(KEY, TOKENS, kv_in(normal(SMOLLM2), dtype), codec=name)) == encoded_size(
                SMOLLM2, dtype, len(KEY), name
            )


# ---------------------------------------------------------------------------- same block, any codec


def test_transcode_keeps_key_and_tokens() -> None:
    x = normal(SMOLLM2, 3)
    raw = encode(KEY, TOKENS, x)
    int8 = encode(KEY, TOKENS, x, codec="int8")
    assert transcode(int8, key=KEY, codec="int8") is int8
    assert transcode(raw, key=KEY, codec="int8") == int8
    back = transcode(int8, key=KEY, codec="raw")
    assert peek_header(back).version == 1
    assert np.array_equal(decode(back, key=KEY, tokens=TOKENS), decode(int8, key=KEY))
    heads = [peek_header(transcode(raw, key=KEY, codec=name)) for name in CODECS]
    assert {(h.key, h.token_checksum) for h in heads} == {(KEY, peek_header(raw).token_checksum)}
    for name in CODECS:
        decode(transcode(raw, key=KEY, codec=name), key=KEY, tokens=TOKENS)  # the tokens still match


def test_transcode_refuses_bad_frames_and_values() -> None:
    frame = bytearray(encode(KEY, TOKENS, normal(TINY)))
    raises_with(codec.KeyMismatch, transcode, bytes(frame), key=b"other", codec="int8")
    frame[-1] ^= 1
    raises_with(CorruptFrame, transcode, bytes(frame), key=KEY, codec="int8")
    nan = encode(KEY, TOKENS, np.full(TINY, np.nan, np.float32))
    with pytest.raises(Unrepresentable):
        transcode(nan, key=KEY, codec="int4")
    with pytest.raises(ValueError, match="raw, bf16, int8, int4"):
        transcode(nan, key=KEY, codec="zstd")


# ---------------------------------------------------------------------------- writes that cannot be
#
# NOTE: Unrepresentable is a failed write, counted by the caller; it must not look like
# a FrameError (a miss) to any handler.


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 1e10, -1e10])
def test_unrepresentable_values(name: str, value: float) -> None:
    x = normal(ODD)
    x[1, 1, 0, 2, 3] = value
    with pytest.raises(Unrepresentable) as info:
        encode(KEY, TOKENS, x, codec=name)
    assert not isinstance(info.value, FrameError) and isinstance(info.value, ValueError)


def test_int4_minimum_beyond_float16_is_unrepresentable() -> None:
    x = np.full(TINY, -70000.0, np.float32)  # a constant group: scale 0, but min beyond float16
    with pytest.raises(Unrepresentable, match="minimum"):
        encode(KEY, TOKENS, x, codec="int4")


@pytest.mark.parametrize("name", ["raw", "bf16"])
def test_raw_and_bf16_take_any_value(name: str) -> None:
    x = np.array([np.nan, np.inf, -np.inf, 3e38] * 2, np.float32).reshape(TINY)
    out = decode(encode(KEY, TOKENS, x, codec=name), key=KEY)
    assert np.array_equal(out, x.astype(np.float32) if name == "raw" else np.array(out), equal_nan=True)
    assert np.isinf(out.reshape(-1)[1:3]).all() and np.isnan(out.reshape(-1)[0])


def test_zero_blocks_have_zero_scales() -> None:
    for name in LOSSY:
        out = decode(encode(KEY, TOKENS, np.zeros(ODD, np.float32), codec=name), key=KEY)
        assert not out.any()


def test_bad_arguments_are_caller_bugs() -> None:
    with pytest.raises(ValueError, match="raw, bf16, int8, int4"):
        encode(KEY, TOKENS, normal(TINY), codec="fp8")
    with pytest.raises(ValueError, match="raw, bf16, int8, int4"):
        encoded_size(TINY, "float32", 16, "fp8")
    with pytest.raises(ValueError, match="K/V axis") as info:
        encode(KEY, TOKENS, normal((1, 3, 1, 2, 2)), codec="int8")
    assert not isinstance(info.value, FrameError)


# ---------------------------------------------------------------------------- bad frames are misses


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_truncation_is_detected(name: str, dtype: str) -> None:
    frame = encode(KEY, TOKENS, kv_in(normal(TINY), dtype), codec=name)
    for cut in range(len(frame)):
        for check in (decode, verify):
            with pytest.raises(TruncatedFrame):
                check(frame[:cut], key=KEY)


@pytest.mark.parametrize("name", LOSSY)
def test_every_flipped_bit_is_detected(name: str) -> None:
    frame = encode(KEY, TOKENS, normal(TINY, 1), codec=name)
    length = peek_header(frame).header_length
    seen: dict[str, set[type[FrameError]]] = {"header": set(), "payload": set()}
    for bit in range(8 * len(frame)):
        damaged = bytearray(frame)
        damaged[bit // 8] ^= 1 << (bit % 8)
        for check in (decode, verify):
            with pytest.raises(FrameError) as info:
                check(bytes(damaged), key=KEY)
        seen["header" if bit // 8 < length else "payload"].add(type(info.value))
    assert seen == {"header": {CorruptFrame, UnsupportedVersion}, "payload": {CorruptFrame}}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0])
@pytest.mark.parametrize("which", ["key", "value"])
def test_bad_int8_scales_with_good_checksums(bad: float, which: str) -> None:
    shape = ODD
    frame = bytearray(encode(KEY, TOKENS, normal(shape), codec="int8"))
    layers, _, heads, _, dim = shape
    at = peek_header(bytes(frame)).header_length + math.prod(shape)
    at += 0 if which == "key" else 2 * layers * heads * dim
    struct.pack_into("<e", frame, at + 2 * 3, bad)
    err = raises_with(CorruptFrame, decode, reseal(frame), key=KEY)
    assert f"int8 {which} scales" in str(err)
    verify(reseal(frame), key=KEY)  # the checksums match: only decode's scale check can catch it


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -2.0])
@pytest.mark.parametrize("field", ["scale", "min"])
def test_bad_int4_scales_with_good_checksums(bad: float, field: str) -> None:
    frame = bytearray(encode(KEY, TOKENS, normal(WIDE), codec="int4"))
    n = math.prod(WIDE)
    at = peek_header(bytes(frame)).header_length + n // 2 + (0 if field == "scale" else 2 * (n // 32))
    struct.pack_into("<e", frame, at + 2 * 5, bad)
    if field == "min" and bad == -2.0:
        decode(reseal(frame), key=KEY)  # a negative minimum is a fine minimum
        return
    err = raises_with(CorruptFrame, decode, reseal(frame), key=KEY)
    assert "int4" in str(err)


def test_unknown_codec_with_good_checksums_is_a_miss() -> None:
    frame = bytearray(encode(KEY, TOKENS, normal(TINY), codec="int8"))
    for code in (4, 17, 255):
        frame[OFF_CODEC] = code
        err = raises_with(UnknownCodec, decode, reseal(frame), key=KEY)
        assert isinstance(err, UnsupportedVersion)
        raises_with(UnknownCodec, verify, reseal(frame), key=KEY)
        raises_with(UnknownCodec, peek_header, reseal(frame))


def test_flags_of_either_version_must_be_zero() -> None:
    v2 = bytearray(encode(KEY, TOKENS, normal(TINY), codec="int8"))
    v2[OFF_FLAGS] = 1
    err = raises_with(UnsupportedVersion, decode, reseal(v2), key=KEY)
    assert type(err) is UnsupportedVersion
    v1 = bytearray(encode(KEY, TOKENS, normal(TINY)))
    for codec_byte in (1, 2, 3):  # a codec byte in a version-1 frame is a flag it cannot have
        v1[OFF_CODEC] = codec_byte
        raises_with(UnsupportedVersion, decode, reseal(v1), key=KEY)


def test_version_2_raw_is_accepted() -> None:
    x = normal(TINY)
    frame = bytearray(encode(KEY, TOKENS, x))
    frame[OFF_VERSION] = 2
    head = verify(reseal(frame), key=KEY)
    assert (head.version, head.codec) == (2, "raw")
    assert np.array_equal(decode(reseal(frame), key=KEY), x)


def test_payload_length_must_be_the_codec_size() -> None:
    int8 = encode(KEY, TOKENS, normal(WIDE), codec="int8")
    relabelled = bytearray(int8)
    relabelled[OFF_CODEC] = CODECS.index("int4")  # an int8 payload read as int4 is refused by its length
    raises_with(CorruptFrame, decode, reseal(relabelled), key=KEY)
    for delta in (-1, 1, -2):
        longer = bytearray(int8)
        struct.pack_into("<Q", longer, OFF_PAYLOAD_LEN, len(int8) - peek_header(int8).header_length + delta)
        raises_with(CorruptFrame, decode, reseal(longer), key=KEY)
    reshaped = bytearray(int8)
    struct.pack_into("<I", reshaped, OFF_SHAPE + 4, 3)  # int8 needs K and V: a K/V axis of 2
    raises_with(CorruptFrame, decode, reseal(reshaped), key=KEY)


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 200), junk=st.binary(min_size=1, max_size=40), cut=st.integers(0, 300))
def test_spliced_or_cut_frames_never_decode_wrong(start: int, junk: bytes, cut: int) -> None:
    x = normal(TINY, 9)
    for name in LOSSY:
        frame = encode(KEY, TOKENS, x, codec=name)
        damaged = (frame[:start] + junk + frame[start + len(junk) :])[:cut]
        try:
            out = decode(damaged, key=KEY, tokens=TOKENS)
        except FrameError:
            continue
        assert damaged == frame and np.array_equal(out, decode(frame, key=KEY))


# ---------------------------------------------------------------------------- placed reads


def test_a_placed_read_never_takes_a_compressed_frame_for_raw(tmp_path: Path) -> None:
    """A placed read copies the file's last payload-sized bytes as raw rows; a
    compressed frame long enough to fill them is refused by decode, whatever checksum
    the read computed, so its placed bytes never count as the block's KV."""
    shape = (1, 2, 1, 2, 2)
    frame = encode(KEY, TOKENS, normal(shape), codec="int8")
    path = tmp_path / "frame"
    path.write_bytes(frame)
    out = np.zeros(shape, np.float32)
    rows, row = 2, 2 * 2 * 4
    place = Place(out.reshape(-1).view(np.uint8).data, 0, rows, row, row, row)
    got = read_placed(str(path), bytearray(len(frame) + 64), place)
    assert len(got.frame) == len(frame)
    stored = xxhash.xxh3_128_digest(frame[peek_header(frame).header_length :])
    for checksum in (got.checksum, stored):
        err = raises_with(CorruptFrame, decode, got.frame, key=KEY, computed_checksum=checksum)
        assert "int8" in str(err)
    assert placed.NATIVE in (True, False)
