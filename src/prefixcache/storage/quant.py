"""The lossy codecs of the frame format (``codec.py`` frames their payloads): pure,
vectorised numpy, so a CPU tier can compress what it stores without a GPU.

Every codec is fixed-size (``header.payload_size``), so a frame's length field is
checked against its shape before its payload is read. ``x`` is the block's KV tensor
``[L, 2, H, T, D]`` (K = index 0, V = index 1 of the second axis); every multi-byte
field is little-endian, every array C order::

    bf16   +-------------------------------+
           | bfloat16 bits, u16 [L,2,H,T,D] |   round to nearest even (NaN stays NaN)
           +-------------------------------+

    int8   +-------------------+-------------------+----------------+----------------+
           | K  i8 [L,H,T,D]   | V  i8 [L,H,T,D]   | K scale f16    | V scale f16    |
           |                   |                   | [L,H,D]        | [L,H,T]        |
           +-------------------+-------------------+----------------+----------------+
           K: symmetric per channel (one scale per layer, head and dim, over the tokens)
           V: symmetric per token (one scale per layer, head and token, over head_dim)
           x' = q * scale,  q in [-127, 127]

    int4   +----------------------------+--------------------+--------------------+
           | nibbles u8 [ceil(N / 2)]   | scale f16 [N / G]  | min f16 [N / G]    |
           +----------------------------+--------------------+--------------------+
           N = L*2*H*T*D values in C order, two per byte, low nibble first;
           groups of G = 32 consecutive values along head_dim (G = D when 32 does not
           divide D), asymmetric: x' = q * scale + min,  q in [0, 15]

Why these choices: keys have outlier channels that persist across tokens, so a scale
per channel keeps the other channels' precision; values have no such channels, and a
scale per token bounds each token's error by its own magnitude. The stored float16
scale is rounded *up* when rounding to nearest would land below the exact one (and
the int4 minimum *down*), so the largest value never clips: every value's error is at
most half a step of its own scale (plus float32 arithmetic), the bound the tests hold.

A scale, or minimum, that float16 cannot hold, and any non-finite input, raise
``Unrepresentable`` on encode: the write fails rather than storing a block that would
decode to other values. On decode a scale that is negative or not finite, or a
minimum that is not finite, is a ``CorruptFrame``: a frame can carry good checksums
over bad scales if its writer was buggy, and dequantising them would serve NaNs.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from prefixcache.storage.header import CorruptFrame, Unrepresentable, int4_group, payload_size

__all__ = ["bf16_bits", "decode", "encode", "to_float32"]

_F16_MAX: Final = float(np.finfo(np.float16).max)
_F16 = np.dtype("<f2")
_F32 = np.dtype("<f4")


# ---------------------------------------------------------------------------- conversions


def to_float32(kv: np.ndarray, label: str) -> np.ndarray:
    """``kv`` as float32 (exact for every input dtype); bfloat16 as ml_dtypes or uint16 bits."""
    if label == "bfloat16":
        bits = kv.view(np.uint16).astype(np.uint32)
        bits <<= 16
        out: np.ndarray = bits.view(_F32)
        return out
    return np.asarray(kv, dtype=_F32)


def bf16_bits(x: np.ndarray, *, finite: bool = False) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even; a NaN stays a (quiet) NaN.
    ``finite``: the caller knows there is no NaN (a decoded payload), so none is looked for.

    NOTE: written out rather than taken from ml_dtypes, which is optional here."""
    u = np.ascontiguousarray(x, dtype=_F32).view(np.uint32)
    t = u >> 16  # NOTE: in place from here: a block's temporaries are its size, not five times it
    t &= 1
    t += np.uint32(0x7FFF)
    t += u
    out: np.ndarray = np.ascontiguousarray(t.reshape(-1).view(np.uint16)[1::2]).reshape(u.shape)  # high halves (LE)
    if not finite:
        nan = np.isnan(x)
        if nan.any():
            out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def _from_float32(x: np.ndarray, label: str, out: np.dtype) -> np.ndarray:
    """A decoded (finite) float32 payload in the engine's dtype."""
    if label == "float32":
        return x
    if label == "float16":
        return x.astype(_F16)
    if out.name == "bfloat16":  # ml_dtypes is there: its cast rounds to nearest even too, in C
        cast: np.ndarray = x.astype(out)
        return cast
    bits: np.ndarray = bf16_bits(x, finite=True).view(out)
    return bits


# ---------------------------------------------------------------------------- encode


def encode(codec: str, kv: np.ndarray, label: str) -> np.ndarray:
    """The stored payload of ``kv`` (``[L, 2, H, T, D]`` of dtype ``label``) as uint8.

    ``Unrepresentable`` for a value or scale the codec cannot hold (not bf16: like raw
    it holds every value, inf as inf)."""
    if codec == "bf16":
        if label == "bfloat16":
            return np.ascontiguousarray(kv).view(np.uint8).reshape(-1)
        bits: np.ndarray = bf16_bits(to_float32(kv, label)).view(np.uint8).reshape(-1)
        return bits
    x = to_float32(kv, label)
    out = np.empty(payload_size(codec, kv.shape, label), np.uint8)
    if codec == "int8":
        _encode_int8(x, out)
    elif codec == "int4":
        _encode_int4(x, out)
    else:
        raise ValueError(f"not a lossy codec: {codec!r}")
    return out


def _scale16(exact: np.ndarray, what: str) -> np.ndarray:
    """``exact`` (>= 0, float32) as float16, rounded up where nearest would be below it."""
    with np.errstate(over="ignore", invalid="ignore"):
        s = exact.astype(_F16)
        low = s.astype(_F32) < exact
        s[low] = np.nextafter(s[low], _F16.type(np.inf))
    if not np.isfinite(s).all():
        bad = exact[~np.isfinite(s)].flat[0]
        raise Unrepresentable(f"{what}: {bad} is not finite or beyond float16's {_F16_MAX}")
    return s


def _quantise(x: np.ndarray, s: np.ndarray, lo: int, hi: int) -> np.ndarray:
    safe = np.where(s == 0, _F16.type(1), s).astype(_F32)  # s == 0 only where every x is 0
    q = np.rint(x / safe)
    np.clip(q, lo, hi, out=q)
    return q


def _encode_int8(x: np.ndarray, out: np.ndarray) -> None:
    k, v = x[:, 0], x[:, 1]
    k_scale = _scale16(np.abs(k).max(axis=2) / np.float32(127), "int8 key scale")  # [L,H,D]
    v_scale = _scale16(np.abs(v).max(axis=3) / np.float32(127), "int8 value scale")  # [L,H,T]
    half = x.size // 2
    out[:half].view(np.int8).reshape(k.shape)[...] = _quantise(k, k_scale[:, :, None, :], -127, 127)
    out[half : 2 * half].view(np.int8).reshape(v.shape)[...] = _quantise(v, v_scale[..., None], -127, 127)
    at = 2 * half
    out[at : at + k_scale.nbytes] = k_scale.reshape(-1).view(np.uint8)
    out[at + k_scale.nbytes :] = v_scale.reshape(-1).view(np.uint8)


def _encode_int4(x: np.ndarray, out: np.ndarray) -> None:
    groups = x.reshape(-1, int4_group(x.shape[-1]))
    lo, hi = groups.min(axis=1), groups.max(axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        low = lo.astype(_F16)
        above = low.astype(_F32) > lo
        low[above] = np.nextafter(low[above], _F16.type(-np.inf))
    if not np.isfinite(low).all():
        raise Unrepresentable(f"int4 minimum: {lo[~np.isfinite(low)][0]} is not finite or beyond float16")
    low32 = low.astype(_F32)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = _scale16((hi - low32) / np.float32(15), "int4 scale")
    q = _quantise(groups - low32[:, None], scale[:, None], 0, 15).astype(np.uint8).reshape(-1)
    n, packed = q.size, (q.size + 1) // 2
    if n % 2:
        q = np.append(q, np.uint8(0))
    out[:packed] = q[0::2] | (q[1::2] << 4)
    count = groups.shape[0]
    out[packed : packed + 2 * count] = scale.view(np.uint8)
    out[packed + 2 * count :] = low.view(np.uint8)


# ---------------------------------------------------------------------------- decode


def decode(codec: str, payload: memoryview, shape: tuple[int, ...], label: str, out: np.dtype) -> np.ndarray:
    """A new writable ``[L, 2, H, T, D]`` array of dtype ``out`` (``label``'s) from a
    verified payload; ``CorruptFrame`` for scales that could only come from a bad writer."""
    if codec == "bf16":
        bits = np.frombuffer(payload, np.dtype("<u2")).reshape(shape)
        if label == "bfloat16":
            same: np.ndarray = bits.copy().view(out)
            return same
        return _from_float32(to_float32(bits, "bfloat16"), label, out)
    if codec == "int8":
        x = _decode_int8(payload, shape)
    elif codec == "int4":
        x = _decode_int4(payload, shape)
    else:
        raise ValueError(f"not a lossy codec: {codec!r}")
    return _from_float32(x, label, out)


def _check_scales(s: np.ndarray, what: str) -> None:
    ok = (s >= 0) & (s <= _F16_MAX)  # NOTE: NaN fails both comparisons
    if not ok.all():
        raise CorruptFrame(f"{what}: expected finite scales >= 0, found {s[~ok].flat[0]}")


def _decode_int8(payload: memoryview, shape: tuple[int, ...]) -> np.ndarray:
    layers, _, heads, tokens, dim = shape
    half = layers * heads * tokens * dim
    k_scale = np.frombuffer(payload, _F16, layers * heads * dim, 2 * half).reshape(layers, heads, dim)
    v_scale = np.frombuffer(payload, _F16, layers * heads * tokens, 2 * half + k_scale.nbytes)
    v_scale = v_scale.reshape(layers, heads, tokens)
    _check_scales(k_scale, "int8 key scales")
    _check_scales(v_scale, "int8 value scales")
    q = np.frombuffer(payload, np.int8, 2 * half).reshape(2, layers, heads, tokens, dim)  # all K, then all V
    x = np.empty(shape, _F32)
    np.multiply(q[0], k_scale.astype(_F32)[:, :, None, :], out=x[:, 0])
    np.multiply(q[1], v_scale.astype(_F32)[..., None], out=x[:, 1])
    return x


def _decode_int4(payload: memoryview, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    size = int4_group(shape[-1])
    count, packed = n // size, (n + 1) // 2
    scale = np.frombuffer(payload, _F16, count, packed)
    low = np.frombuffer(payload, _F16, count, packed + 2 * count)
    _check_scales(scale, "int4 scales")
    if not np.isfinite(low).all():
        raise CorruptFrame(f"int4 minimums: expected finite, found {low[~np.isfinite(low)][0]}")
    nibbles = np.frombuffer(payload, np.uint8, packed)
    q = np.empty((packed, 2), np.uint8)
    np.bitwise_and(nibbles, 0x0F, out=q[:, 0])
    np.right_shift(nibbles, 4, out=q[:, 1])
    x = q.reshape(-1)[:n].reshape(count, size).astype(_F32)
    x *= scale.astype(_F32)[:, None]
    x += low.astype(_F32)[:, None]
    return x.reshape(shape)
