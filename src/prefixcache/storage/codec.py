"""Payload framing: one block's KV for all layers as bytes a tier can store and trust.

A frame is a versioned binary header followed by the raw tensor bytes (design.md
invariant 8: only plain bytes and fixed-width fields are parsed, no object serializer,
so a frame read back from disk or Redis can never run code)::

    +------+-----+---+----+---+-----+---+-------+-----+--------+---+--------+-----+--------+-----------+
    | PXKV | ver | H | dt | n | flg | k | shape | key | tok_ck | P | pay_ck | pad | hdr_ck | payload   |
    +------+-----+---+----+---+-----+---+-------+-----+--------+---+--------+-----+--------+-----------+
       4      2    2   1    1    2    2    4n      k      16     8     16    0-15     8       P bytes
    |<------------------------------------------ header: H bytes ---------------------->|

    field    type     meaning (all integers little-endian)
    -------  -------  -----------------------------------------------------------------------
    PXKV     4 bytes  magic
    ver      u16      format version, 1
    H        u16      header length = offset of the payload, a multiple of 16
    dt       u8       dtype code: 1 float32, 2 float16, 3 bfloat16
    n        u8       number of dims, 5: [layers, 2 (K, V), kv_heads, block_tokens, head_dim]
    flg      u16      flags, 0 (a reader refuses flags it does not know)
    k        u16      key length, 1..65438 (so that H fits its u16)
    shape    u32 x n  the tensor's shape, every dim >= 1
    key      k bytes  the block key (hashing.py)
    tok_ck   16 bytes xxh3_128 of the block's token ids as little-endian uint32
    P        u64      payload length = prod(shape) * itemsize
    pay_ck   16 bytes xxh3_128 of the payload
    pad      zeros    so that H is a multiple of 16
    hdr_ck   u64      xxh3_64 of the header's first H - 8 bytes
    payload  P bytes  the tensor in C order, little-endian

``encode`` copies the tensor once (header and payload joined into one ``bytes``);
``decode`` verifies everything and returns a view over the frame, copying nothing.
Every way a frame can be bad raises a ``FrameError`` subclass, which a tier turns into
a miss (invariant 6); a bad *argument* (a caller bug) raises plain ``ValueError`` or
``TypeError`` instead, so that it is never mistaken for a miss.

NOTE: the checksums are xxh3 because this is integrity against corruption (a torn
write, a flipped bit, a slot reused for another block), not authentication: anyone who
can write the store can forge a frame with matching checksums. A store shared with
untrusted writers needs a MAC on top, keyed by a secret the writers do not have.

NOTE: the header has its own checksum because the payload checksum cannot catch every
flipped header bit: float16 <-> bfloat16 differ in one bit of the dtype code and have
the same itemsize, and the token checksum is only compared when the caller passes
tokens. The length fields are also cross-checked (H against n and k, P against shape
and dtype, the frame's length against H + P) so that a damaged length is reported as
what it is before any bytes are read through it.

bfloat16: numpy has no bfloat16, so raw bf16 bytes travel as ``np.uint16`` arrays with
an explicit ``dtype="bfloat16"`` label; an ``ml_dtypes.bfloat16`` array is accepted
as is. ``decode`` returns bfloat16 frames as ``ml_dtypes.bfloat16`` when that package
is importable and as ``np.uint16`` (the same bits) when it is not; ``dtype="bfloat16"``
tells a caller which it is either way. ml_dtypes is optional, never a dependency.
"""

from __future__ import annotations

import importlib
import math
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import xxhash

__all__ = [
    "DTYPES",
    "HEADER_ALIGN",
    "MAGIC",
    "MAX_KEY_LEN",
    "NDIM",
    "VERSION",
    "WIRE_DTYPES",
    "CorruptFrame",
    "DtypeMismatch",
    "FrameError",
    "FrameHeader",
    "KeyMismatch",
    "ShapeMismatch",
    "TokenMismatch",
    "TruncatedFrame",
    "UnsupportedVersion",
    "decode",
    "encode",
    "encoded_size",
    "peek_header",
    "token_checksum",
]

MAGIC: Final = b"PXKV"
VERSION: Final = 1
NDIM: Final = 5  # [layers, 2 (K, V), kv_heads, block_tokens, head_dim]
HEADER_ALIGN: Final = 16
_MAX_DIM = 0xFFFFFFFF

_FIXED = struct.Struct("<4sHHBBHH")  # magic, version, header length, dtype, ndim, flags, key length
_TAIL = struct.Struct("<16sQ16s")  # token checksum, payload length, payload checksum
_HEADER_CHECKSUM = struct.Struct("<Q")
_SHAPE = struct.Struct(f"<{NDIM}I")
# NOTE: H is a u16, so the longest key is what still fits a 16-aligned header in 65535
# bytes: 65438, not the 65535 the u16 key length could say. Block keys are 16-32 bytes.
MAX_KEY_LEN: Final = 0xFFFF // HEADER_ALIGN * HEADER_ALIGN - (
    _FIXED.size + _SHAPE.size + _TAIL.size + _HEADER_CHECKSUM.size
)

# dtype label -> (code in the header, little-endian numpy dtype of the payload's items)
_CODES: Final = {"float32": 1, "float16": 2, "bfloat16": 3}
_LABELS: Final = {code: label for label, code in _CODES.items()}
WIRE_DTYPES: Final[dict[str, np.dtype]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # raw bfloat16 bits
}
_WIRE = WIRE_DTYPES
_FLOAT_LABELS: Final[dict[np.dtype, str]] = {np.dtype("<f4"): "float32", np.dtype("<f2"): "float16"}
DTYPES: Final = tuple(_CODES)

Buffer = bytes | bytearray | memoryview


def _ml_bfloat16() -> np.dtype | None:
    """ml_dtypes' bfloat16 if the package is importable: optional, never required."""
    try:
        module = importlib.import_module("ml_dtypes")
    except ImportError:
        return None
    bfloat16: np.dtype = np.dtype(module.bfloat16)
    return bfloat16


def _bfloat16_out() -> np.dtype:
    native = _ml_bfloat16()
    return np.dtype("<u2") if native is None else native  # NOTE: not `or`: a plain np.dtype is falsy


# NOTE: resolved once at import and never changed: a constant of the install, not state.
_OUT: Final[dict[int, np.dtype]] = {1: np.dtype("<f4"), 2: np.dtype("<f2"), 3: _bfloat16_out()}


# ---------------------------------------------------------------------------- errors


class FrameError(ValueError):
    """A frame that must not be served: the tiers count it and treat it as a miss."""


class TruncatedFrame(FrameError):
    """The frame ends before its header or payload does (a torn or partial write)."""


class CorruptFrame(FrameError):
    """Bad magic, a checksum that does not match, or length fields that disagree."""


class KeyMismatch(FrameError):
    """A well-formed frame of another block, e.g. a reused slot or a hash-named file overwritten."""


class TokenMismatch(FrameError):
    """The frame's block was computed for other tokens (invariant 3: a hash is never trusted alone)."""


class ShapeMismatch(FrameError):
    """The frame's tensor has another shape than the reader's model expects."""


class DtypeMismatch(FrameError):
    """The frame's tensor has another dtype than the reader's model expects."""


class UnsupportedVersion(FrameError):
    """A frame from a newer (or unknown) writer: a version or flags this reader does not know."""


# ---------------------------------------------------------------------------- header


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A verified header, for tools and for tiers that size or route frames before reading them."""

    version: int
    dtype: str
    shape: tuple[int, ...]
    key: bytes
    token_checksum: bytes
    payload_length: int
    payload_checksum: bytes
    header_length: int

    @property
    def frame_length(self) -> int:
        """Bytes of the whole frame: slice a larger slot with this before ``decode``."""
        return self.header_length + self.payload_length


def _header_length(ndim: int, key_len: int) -> int:
    raw = _FIXED.size + 4 * ndim + key_len + _TAIL.size + _HEADER_CHECKSUM.size
    # NOTE: padded to 16 so the payload starts aligned (CPython's bytes data is 16-aligned
    # for large objects): an aligned float32 view is faster and some consumers require it.
    return -(-raw // HEADER_ALIGN) * HEADER_ALIGN


def token_checksum(tokens: Buffer) -> bytes:
    """The 16-byte checksum a frame stores for its block's token bytes (``FrameHeader.token_checksum``)."""
    return xxhash.xxh3_128_digest(tokens)


def _pack_header(key: bytes, label: str, shape: tuple[int, ...], tok_ck: bytes, payload: memoryview) -> bytes:
    ndim, length = len(shape), _header_length(len(shape), len(key))
    body = b"".join(
        (
            _FIXED.pack(MAGIC, VERSION, length, _CODES[label], ndim, 0, len(key)),
            _SHAPE.pack(*shape),
            key,
            _TAIL.pack(tok_ck, payload.nbytes, xxhash.xxh3_128_digest(payload)),
        )
    )
    body += bytes(length - _HEADER_CHECKSUM.size - len(body))
    return body + _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


# ---------------------------------------------------------------------------- encode


def encode(key: bytes, tokens: Buffer, kv: np.ndarray, *, dtype: str | None = None) -> bytes:
    """One block's frame: header plus the raw bytes of ``kv``.

    ``tokens`` are the block's token ids as little-endian uint32 bytes (as the cache
    stores them); only their checksum is kept. ``dtype`` is needed for raw bfloat16
    (``np.uint16`` arrays) and otherwise, when given, must agree with ``kv``.

    NOTE: a non-C-contiguous (or big-endian) ``kv`` is accepted and made contiguous
    little-endian with one extra copy, because the payload checksum needs the bytes in
    frame order before the header is written. Hand over a C-contiguous array to get the
    single copy (the join of header and payload).
    """
    _check_key(key)
    _check_tokens(tokens, "tokens")
    label = _label_of(kv, dtype)
    arr = _contiguous(kv, label)
    shape = _check_shape(arr.shape)
    payload = arr.reshape(-1).view(np.uint8).data
    return b"".join((_pack_header(key, label, shape, token_checksum(tokens), payload), payload))


def encoded_size(shape: Sequence[int], dtype: str, key_len: int) -> int:
    """Exact length of a frame of this shape, dtype and key length: fixed-size slots use it."""
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ValueError(f"shape must be a sequence of integers, got {shape!r}") from None
    shape = _check_shape(dims)
    _check_label(dtype)
    if not 1 <= key_len <= MAX_KEY_LEN:
        raise ValueError(f"key length must be in [1, {MAX_KEY_LEN}], got {key_len}")
    return _header_length(len(shape), key_len) + math.prod(shape) * _WIRE[dtype].itemsize


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_LEN:
        raise ValueError(f"key must be 1 to {MAX_KEY_LEN} bytes, got {len(key)}")


def _check_tokens(tokens: Buffer, name: str) -> None:
    if not isinstance(tokens, bytes | bytearray | memoryview):
        raise TypeError(f"{name} must be little-endian uint32 bytes, got {type(tokens).__name__}")
    nbytes = memoryview(tokens).nbytes
    if nbytes % 4:
        raise ValueError(f"{name} must be little-endian uint32 bytes, a multiple of 4; got {nbytes} bytes")


def _check_label(dtype: str) -> None:
    if dtype not in _CODES:
        raise ValueError(f"unsupported dtype label {dtype!r}; valid: {', '.join(DTYPES)}")


def _check_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) != NDIM:
        raise ValueError(f"KV must have {NDIM} dims [layers, 2, kv_heads, block_tokens, head_dim], got shape {shape}")
    if min(shape) < 1 or max(shape) > _MAX_DIM:
        raise ValueError(f"every dim must be in [1, 2**32), got shape {shape}")
    return shape


def _label_of(kv: np.ndarray, dtype: str | None) -> str:
    """The dtype label of ``kv``, checked against the caller's label when one is given."""
    if not isinstance(kv, np.ndarray):
        raise TypeError(f"kv must be a numpy array, got {type(kv).__name__}")
    if dtype is not None:
        _check_label(dtype)
    found = _FLOAT_LABELS.get(kv.dtype) or _other_label(kv.dtype, dtype)
    if dtype is not None and dtype != found:
        raise ValueError(f"dtype label {dtype!r} does not match the array's dtype {kv.dtype} ({found})")
    return found


def _other_label(dt: np.dtype, dtype: str | None) -> str:
    """The labels off the fast path: bfloat16 (ml_dtypes or labelled uint16) and big-endian floats."""
    if dt.name == "bfloat16":  # ml_dtypes, recognised without importing it
        return "bfloat16"
    if dt.kind == "u" and dt.itemsize == 2:
        if dtype != "bfloat16":
            raise ValueError(f"a uint16 array is raw bfloat16 only with dtype='bfloat16'; got dtype={dtype!r}")
        return "bfloat16"
    if dt.kind == "f" and dt.itemsize in (2, 4):
        return "float16" if dt.itemsize == 2 else "float32"
    raise ValueError(f"unsupported KV dtype {dt}; valid: float32, float16, bfloat16 (or uint16 labelled bfloat16)")


def _contiguous(kv: np.ndarray, label: str) -> np.ndarray:
    wire = _WIRE[label] if kv.dtype.kind in "fu" else kv.dtype  # ml_dtypes' bfloat16 (kind "V") stays itself
    if kv.flags.c_contiguous and kv.dtype == wire:
        return kv  # the fast path: no copy
    arr: np.ndarray = np.ascontiguousarray(kv, dtype=wire)
    return arr


# ---------------------------------------------------------------------------- decode


def peek_header(frame: Buffer) -> FrameHeader:
    """The verified header of ``frame``; needs only the header's bytes, not the payload."""
    return _parse_header(_byte_view(frame))


def decode(
    frame: Buffer,
    *,
    key: bytes,
    tokens: Buffer | None = None,
    shape: tuple[int, ...] | None = None,
    dtype: str | None = None,
    check_payload: bool = True,
) -> np.ndarray:
    """The KV tensor of a frame, verified, as a view over the frame's bytes (no copy).

    ``key`` is always checked; ``tokens``, ``shape`` and ``dtype`` when given. The
    array is read-only when the frame is (``bytes``) and keeps the frame alive; a caller
    that reuses the frame's buffer (a slot, an mmap) must copy the array first.

    NOTE: ``check_payload=False`` skips only the payload checksum (the header, its
    checksum and every length are still checked). It is for frames whose exact,
    immutable bytes a store has just verified (``TierStore.verifies_reads``), so that
    a load hashes each payload once; anything else must keep the check.
    """
    _check_key(key)
    if tokens is not None:
        _check_tokens(tokens, "tokens")
    if dtype is not None:
        _check_label(dtype)
    view = _byte_view(frame)
    head = _parse_header(view)
    _check_expected(head, key, tokens, shape, dtype)
    _check_payload(view, head, check_payload)
    out: np.ndarray = np.frombuffer(view, _OUT[_CODES[head.dtype]], math.prod(head.shape), head.header_length)
    return out.reshape(head.shape)


def _byte_view(frame: Buffer) -> memoryview:
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if not view.c_contiguous:
        raise TypeError("frame must be a contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _parse_header(view: memoryview) -> FrameHeader:
    size = len(view)
    if bytes(view[:4]) != MAGIC[: min(size, 4)]:
        raise CorruptFrame(f"bad magic: expected {MAGIC!r}, found {bytes(view[:4])!r}")
    if size < _FIXED.size:
        raise TruncatedFrame(f"expected at least {_FIXED.size} header bytes, found {size}")
    _, version, length, code, ndim, flags, key_len = _FIXED.unpack_from(view)
    if version != VERSION:
        raise UnsupportedVersion(f"expected format version {VERSION}, found {version}")
    expected = _header_length(ndim, key_len)
    if length != expected:
        raise CorruptFrame(
            f"header length: expected {expected} bytes for {ndim} dims and a {key_len}-byte key, found {length}"
        )
    if size < length:
        raise TruncatedFrame(f"expected a {length}-byte header, found {size} bytes")
    _check_header_checksum(view, length)
    return _header_fields(view, code, ndim, flags, key_len, length)


def _check_header_checksum(view: memoryview, length: int) -> None:
    end = length - _HEADER_CHECKSUM.size
    (stored,) = _HEADER_CHECKSUM.unpack_from(view, end)
    computed = xxhash.xxh3_64_intdigest(view[:end])
    if stored != computed:
        raise CorruptFrame(f"header checksum: expected {computed:016x}, found {stored:016x}")


def _header_fields(view: memoryview, code: int, ndim: int, flags: int, key_len: int, length: int) -> FrameHeader:
    """Fields of a header whose checksum matched: what is left to catch is a bad writer."""
    if flags:
        raise UnsupportedVersion(f"expected flags 0 in version {VERSION}, found {flags:#06x}")
    if code not in _LABELS:
        raise CorruptFrame(f"dtype code: expected one of {sorted(_LABELS)}, found {code}")
    if ndim != NDIM or key_len == 0:
        raise CorruptFrame(f"expected {NDIM} dims and a non-empty key, found {ndim} dims and {key_len} key bytes")
    shape = _SHAPE.unpack_from(view, _FIXED.size)
    at = _FIXED.size + 4 * ndim
    tok_ck, payload_len, pay_ck = _TAIL.unpack_from(view, at + key_len)
    label = _LABELS[code]
    if 0 in shape:
        raise CorruptFrame(f"shape: expected every dim >= 1, found {shape}")
    expected_len = math.prod(shape) * _WIRE[label].itemsize
    if payload_len != expected_len:
        raise CorruptFrame(f"payload length: expected {expected_len} bytes for {label} {shape}, found {payload_len}")
    return FrameHeader(VERSION, label, shape, bytes(view[at : at + key_len]), tok_ck, payload_len, pay_ck, length)


def _check_expected(
    head: FrameHeader,
    key: bytes,
    tokens: Buffer | None,
    shape: tuple[int, ...] | None,
    dtype: str | None,
) -> None:
    # NOTE: these come before the payload checksum, the one expensive step: a frame of
    # another block (a reused slot) is refused without hashing its payload.
    if head.key != key:
        raise KeyMismatch(f"key: expected {_show(key)}, found {_show(head.key)}")
    if tokens is not None and (ck := token_checksum(tokens)) != head.token_checksum:
        count = memoryview(tokens).nbytes // 4
        raise TokenMismatch(f"token checksum of {count} tokens: expected {ck.hex()}, found {head.token_checksum.hex()}")
    if shape is not None and tuple(shape) != head.shape:
        raise ShapeMismatch(f"shape: expected {tuple(shape)}, found {head.shape}")
    if dtype is not None and dtype != head.dtype:
        raise DtypeMismatch(f"dtype: expected {dtype}, found {head.dtype}")


def _check_payload(view: memoryview, head: FrameHeader, checksum: bool = True) -> None:
    found = len(view) - head.header_length
    if found < head.payload_length:
        raise TruncatedFrame(f"payload: expected {head.payload_length} bytes, found {found}")
    if found > head.payload_length:
        raise CorruptFrame(f"payload: expected {head.payload_length} bytes, found {found} (trailing bytes)")
    if not checksum:
        return
    computed = xxhash.xxh3_128_digest(view[head.header_length :])
    if computed != head.payload_checksum:
        raise CorruptFrame(f"payload checksum: expected {computed.hex()}, found {head.payload_checksum.hex()}")


def _show(key: bytes) -> str:
    text = key[:32].hex()
    return f"{text}... ({len(key)} bytes)" if len(key) > 32 else text
