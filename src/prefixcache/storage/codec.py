"""Payload framing: one block's KV for all layers as bytes a tier can store and trust.

A frame is a versioned binary header followed by the tensor's bytes, raw or compressed
by a codec (design.md invariant 8: only plain bytes and fixed-width fields are parsed,
no object serializer, so a frame read back from disk or Redis can never run code)::

    +------+-----+---+----+---+-----+---+-------+-----+--------+---+--------+-----+--------+-----------+
    | PXKV | ver | H | dt | n | c f | k | shape | key | tok_ck | P | pay_ck | pad | hdr_ck | payload   |
    +------+-----+---+----+---+-----+---+-------+-----+--------+---+--------+-----+--------+-----------+
       4      2    2   1    1   1 1   2    4n      k      16     8     16    0-15     8       P bytes
    |<------------------------------------------ header: H bytes ---------------------->|

    field    type     meaning (all integers little-endian)
    -------  -------  -----------------------------------------------------------------------
    PXKV     4 bytes  magic
    ver      u16      format version: 1 for raw frames, 2 for compressed ones
    H        u16      header length = offset of the payload, a multiple of 16
    dt       u8       dtype code of the (decoded) tensor: 1 float32, 2 float16, 3 bfloat16
    n        u8       number of dims, 5: [layers, 2 (K, V), kv_heads, block_tokens, head_dim]
    c f      u8 u8    version 2: codec (0 raw, 1 bf16, 2 int8, 3 int4), then flags, 0;
                      version 1: one u16 of flags, 0 (a reader refuses flags it does not know)
    k        u16      key length, 1..65438 (so that H fits its u16)
    shape    u32 x n  the (decoded) tensor's shape, every dim >= 1
    key      k bytes  the block key (hashing.py)
    tok_ck   16 bytes xxh3_128 of the block's token ids as little-endian uint32
    P        u64      stored payload length: prod(shape) * itemsize for raw, the codec's
                      exact size for this shape otherwise (every codec is fixed-size)
    pay_ck   16 bytes xxh3_128 of the stored payload
    pad      zeros    so that H is a multiple of 16
    hdr_ck   u64      xxh3_64 of the header's first H - 8 bytes
    payload  P bytes  raw: the tensor in C order, little-endian; else the codec's layout
                      (quant.py)

NOTE: raw frames are still written as version 1, byte for byte what older writers
wrote, so older readers and existing disks keep working; only compressed frames need a
reader that knows version 2. A frame of a codec the reader does not know is a miss
(``UnknownCodec``). The key does not depend on the codec: a block stored compressed is
the same block (``transcode`` keeps key and token checksum).

``encode`` copies the tensor once (header and payload joined into one ``bytes``);
``decode`` verifies everything and returns a view over a raw frame, copying nothing,
or a new array dequantised from a compressed one, only after it verified the frame.
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

import math
import operator
from collections.abc import Sequence

import numpy as np
import xxhash

from prefixcache.storage import quant
from prefixcache.storage.header import (
    CODECS,
    CODES,
    DTYPES,
    FLOAT_LABELS,
    HEADER_ALIGN,
    MAGIC,
    MAX_DIM,
    MAX_KEY_LEN,
    NDIM,
    OUT_DTYPES,
    VERSION,
    WIRE_DTYPES,
    Buffer,
    CorruptFrame,
    DtypeMismatch,
    FrameError,
    FrameHeader,
    KeyMismatch,
    ShapeMismatch,
    TokenMismatch,
    TruncatedFrame,
    UnknownCodec,
    Unrepresentable,
    UnsupportedVersion,
    byte_view,
    header_length,
    pack_header,
    parse_header,
    payload_size,
    show_key,
    token_checksum,
)

__all__ = [
    "CODECS",
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
    "UnknownCodec",
    "Unrepresentable",
    "UnsupportedVersion",
    "decode",
    "encode",
    "encoded_size",
    "peek_header",
    "stored_ratio",
    "token_checksum",
    "transcode",
    "verify",
]


# ---------------------------------------------------------------------------- encode


def encode(key: bytes, tokens: Buffer, kv: np.ndarray, *, dtype: str | None = None, codec: str = "raw") -> bytes:
    """One block's frame: header plus ``kv``'s bytes, raw or in ``codec`` (``CODECS``).

    ``tokens`` are the block's token ids as little-endian uint32 bytes (as the cache
    stores them); only their checksum is kept. ``dtype`` is needed for raw bfloat16
    (``np.uint16`` arrays) and otherwise, when given, must agree with ``kv``. A lossy
    codec raises ``Unrepresentable`` for a tensor it cannot hold (a non-finite value, a
    scale beyond float16): a failed write, not a bad frame.

    NOTE: a non-C-contiguous (or big-endian) ``kv`` is accepted and made contiguous
    little-endian with one extra copy, because the payload checksum needs the bytes in
    frame order before the header is written. Hand over a C-contiguous array to get the
    single copy (the join of header and payload) of a raw frame.
    """
    _check_codec(codec)
    _check_tokens(tokens, "tokens")
    return _encode(key, token_checksum(tokens), kv, dtype, codec)


def _encode(key: bytes, tok_ck: bytes, kv: np.ndarray, dtype: str | None, codec: str) -> bytes:
    """``encode`` with the token checksum given: ``transcode`` keeps the one it read."""
    _check_key(key)
    label = _label_of(kv, dtype)
    arr = _contiguous(kv, label)
    shape = _check_shape(arr.shape)
    if codec == "raw":
        payload = arr.reshape(-1).view(np.uint8).data
    else:
        _check_codec_shape(shape, label, codec)
        payload = quant.encode(codec, arr, label).data
    return b"".join((pack_header(key, label, shape, tok_ck, payload, codec), payload))


def encoded_size(shape: Sequence[int], dtype: str, key_len: int, codec: str = "raw") -> int:
    """Exact length of a frame of this shape, dtype, key length and codec: fixed-size
    slots and byte-counted capacities use it."""
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ValueError(f"shape must be a sequence of integers, got {shape!r}") from None
    shape = _check_shape(dims)
    _check_label(dtype)
    _check_codec(codec)
    if not 1 <= key_len <= MAX_KEY_LEN:
        raise ValueError(f"key length must be in [1, {MAX_KEY_LEN}], got {key_len}")
    return header_length(len(shape), key_len) + _check_codec_shape(shape, dtype, codec)


def stored_ratio(shape: Sequence[int], dtype: str, codec: str, key_len: int = 32) -> float:
    """How many frames of ``codec`` fit in the bytes of one raw frame (header included):
    what a planner multiplies a tier's capacity in blocks by."""
    return encoded_size(shape, dtype, key_len) / encoded_size(shape, dtype, key_len, codec)


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; valid: {', '.join(CODECS)}")


def _check_codec_shape(shape: tuple[int, ...], label: str, codec: str) -> int:
    try:
        return payload_size(codec, shape, label)
    except ValueError as exc:
        raise ValueError(f"{exc} (the codec needs it)") from None


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
    if dtype not in CODES:
        raise ValueError(f"unsupported dtype label {dtype!r}; valid: {', '.join(DTYPES)}")


def _check_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) != NDIM:
        raise ValueError(f"KV must have {NDIM} dims [layers, 2, kv_heads, block_tokens, head_dim], got shape {shape}")
    if min(shape) < 1 or max(shape) > MAX_DIM:
        raise ValueError(f"every dim must be in [1, 2**32), got shape {shape}")
    return shape


def _label_of(kv: np.ndarray, dtype: str | None) -> str:
    """The dtype label of ``kv``, checked against the caller's label when one is given."""
    if not isinstance(kv, np.ndarray):
        raise TypeError(f"kv must be a numpy array, got {type(kv).__name__}")
    if dtype is not None:
        _check_label(dtype)
    found = FLOAT_LABELS.get(kv.dtype) or _other_label(kv.dtype, dtype)
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
    wire = WIRE_DTYPES[label] if kv.dtype.kind in "fu" else kv.dtype  # ml_dtypes' bfloat16 (kind "V") stays itself
    if kv.flags.c_contiguous and kv.dtype == wire:
        return kv  # the fast path: no copy
    arr: np.ndarray = np.ascontiguousarray(kv, dtype=wire)
    return arr


# ---------------------------------------------------------------------------- decode


def peek_header(frame: Buffer) -> FrameHeader:
    """The verified header of ``frame``; needs only the header's bytes, not the payload."""
    return parse_header(byte_view(frame))


def decode(
    frame: Buffer,
    *,
    key: bytes,
    tokens: Buffer | None = None,
    shape: tuple[int, ...] | None = None,
    dtype: str | None = None,
    check_payload: bool = True,
    computed_checksum: bytes | None = None,
) -> np.ndarray:
    """The KV tensor of a frame, verified before anything is read from its payload.

    A raw frame comes back as a view over the frame's bytes (no copy): read-only when
    the frame is (``bytes``), and it keeps the frame alive; a caller that reuses the
    frame's buffer (a slot, an mmap) must copy the array first. A compressed frame comes
    back as a new, writable array of the header's dtype.

    ``key`` is always checked; ``tokens``, ``shape`` and ``dtype`` when given (shape and
    dtype are the decoded tensor's for every codec).

    NOTE: ``check_payload=False`` skips only the payload checksum (the header, its
    checksum and every length are still checked). It is for frames whose exact,
    immutable bytes a store has just verified (``TierStore.verifies_reads``), so that
    a load hashes each payload once; anything else must keep the check.
    ``computed_checksum`` is the payload's checksum as the caller computed it while it
    read the bytes (``placed.read_placed``): compared to the header's instead of hashing.
    A placed read copies raw rows, so a compressed frame given with it is refused
    (``CorruptFrame``): its bytes, placed as if raw, are not the block's KV.
    """
    _check_key(key)
    if tokens is not None:
        _check_tokens(tokens, "tokens")
    if dtype is not None:
        _check_label(dtype)
    view = byte_view(frame)
    head = parse_header(view)
    _check_expected(head, key, tokens, shape, dtype)
    if computed_checksum is not None and head.codec != "raw":
        raise CorruptFrame(f"placed read: expected a raw frame, found codec {head.codec}")
    _check_payload(view, head, check_payload, computed_checksum)
    out_dtype = OUT_DTYPES[head.dtype]
    if head.codec != "raw":
        return quant.decode(head.codec, view[head.header_length :], head.shape, head.dtype, out_dtype)
    out: np.ndarray = np.frombuffer(view, out_dtype, math.prod(head.shape), head.header_length)
    return out.reshape(head.shape)


def verify(frame: Buffer, *, key: bytes) -> FrameHeader:
    """The header of a whole, intact frame of ``key``: header, lengths and payload
    checksum checked, nothing dequantised. What a store runs on the bytes it reads, so
    it never hands out another block's or a damaged frame, whatever its codec."""
    _check_key(key)
    view = byte_view(frame)
    head = parse_header(view)
    _check_expected(head, key, None, None, None)
    _check_payload(view, head)
    return head


def transcode(frame: Buffer, *, key: bytes, codec: str, check_payload: bool = True) -> Buffer:
    """The same block as a frame of ``codec``: same key, same token checksum (the key
    never depends on the codec). ``frame`` itself when it already is one (checked as
    ``decode`` would). ``FrameError`` for a bad ``frame``; ``Unrepresentable`` when
    ``codec`` cannot hold its values."""
    _check_codec(codec)
    _check_key(key)
    view = byte_view(frame)
    head = parse_header(view)
    _check_expected(head, key, None, None, None)
    _check_payload(view, head, check_payload)
    if head.codec == codec:
        return frame
    kv = decode(frame, key=key, check_payload=False)
    return _encode(key, head.token_checksum, kv, head.dtype, codec)


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
        raise KeyMismatch(f"key: expected {show_key(key)}, found {show_key(head.key)}")
    if tokens is not None and (ck := token_checksum(tokens)) != head.token_checksum:
        count = memoryview(tokens).nbytes // 4
        raise TokenMismatch(f"token checksum of {count} tokens: expected {ck.hex()}, found {head.token_checksum.hex()}")
    if shape is not None and tuple(shape) != head.shape:
        raise ShapeMismatch(f"shape: expected {tuple(shape)}, found {head.shape}")
    if dtype is not None and dtype != head.dtype:
        raise DtypeMismatch(f"dtype: expected {dtype}, found {head.dtype}")


def _check_payload(view: memoryview, head: FrameHeader, checksum: bool = True, computed: bytes | None = None) -> None:
    found = len(view) - head.header_length
    if found < head.payload_length:
        raise TruncatedFrame(f"payload: expected {head.payload_length} bytes, found {found}")
    if found > head.payload_length:
        raise CorruptFrame(f"payload: expected {head.payload_length} bytes, found {found} (trailing bytes)")
    if not checksum:
        return
    if computed is None:
        computed = xxhash.xxh3_128_digest(view[head.header_length :])
    if computed != head.payload_checksum:
        raise CorruptFrame(f"payload checksum: expected {computed.hex()}, found {head.payload_checksum.hex()}")
