"""The frame's header: its layout in bytes, its parsing and checks, and the errors a bad
frame raises (``codec.py`` describes the format and frames payloads with it).

Every way a frame can be bad raises a ``FrameError`` subclass, which a tier turns into
a miss (invariant 6); a bad *argument* (a caller bug) raises plain ``ValueError`` or
``TypeError`` instead, so that it is never mistaken for a miss.
"""

from __future__ import annotations

import importlib
import math
import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
import xxhash

Buffer = bytes | bytearray | memoryview

MAGIC: Final = b"PXKV"
VERSION: Final = 1  # raw frames: still written as version 1, byte for byte what every older reader reads
VERSION_CODEC: Final = 2  # compressed frames: the old u16 flags split into codec u8 and flags u8
NDIM: Final = 5  # [layers, 2 (K, V), kv_heads, block_tokens, head_dim]
HEADER_ALIGN: Final = 16
MAX_DIM = 0xFFFFFFFF

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
CODES: Final = {"float32": 1, "float16": 2, "bfloat16": 3}
LABELS: Final = {code: label for label, code in CODES.items()}
WIRE_DTYPES: Final[dict[str, np.dtype]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # raw bfloat16 bits
}
FLOAT_LABELS: Final[dict[np.dtype, str]] = {np.dtype("<f4"): "float32", np.dtype("<f2"): "float16"}
DTYPES: Final = tuple(CODES)


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
# what ``decode`` returns per dtype label (bfloat16: ml_dtypes if importable, else its uint16 bits)
OUT_DTYPES: Final[dict[str, np.dtype]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": _bfloat16_out(),
}

# codec name -> its code in a version-2 header (the low byte of what version 1 calls flags)
CODEC_CODES: Final = {"raw": 0, "bf16": 1, "int8": 2, "int4": 3}
CODEC_NAMES: Final = {code: name for name, code in CODEC_CODES.items()}
CODECS: Final = tuple(CODEC_CODES)
INT4_GROUP: Final = 32  # values per int4 group along head_dim (the whole head_dim when it does not divide)


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


class UnknownCodec(UnsupportedVersion):
    """A well-checksummed frame of a codec this reader does not know: a miss, never bytes
    read as another codec's."""


class Unrepresentable(ValueError):
    """A tensor a lossy codec cannot hold (a non-finite value, a scale beyond float16).

    NOTE: not a ``FrameError``: it is raised by a *write*, which fails and is counted by
    the caller (who may store the block raw instead); no frame exists to be a miss."""


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
    codec: str = "raw"  # NOTE: last and defaulted so that version-1 constructors keep working

    @property
    def frame_length(self) -> int:
        """Bytes of the whole frame: slice a larger slot with this before ``decode``."""
        return self.header_length + self.payload_length


def header_length(ndim: int, key_len: int) -> int:
    raw = _FIXED.size + 4 * ndim + key_len + _TAIL.size + _HEADER_CHECKSUM.size
    # NOTE: padded to 16 so the payload starts aligned (CPython's bytes data is 16-aligned
    # for large objects): an aligned float32 view is faster and some consumers require it.
    return -(-raw // HEADER_ALIGN) * HEADER_ALIGN


def token_checksum(tokens: Buffer) -> bytes:
    """The 16-byte checksum a frame stores for its block's token bytes (``FrameHeader.token_checksum``)."""
    return xxhash.xxh3_128_digest(tokens)


def int4_group(head_dim: int) -> int:
    return INT4_GROUP if head_dim % INT4_GROUP == 0 else head_dim


def payload_size(codec: str, shape: tuple[int, ...], label: str) -> int:
    """Stored payload bytes of a frame: every codec is fixed-size, so a length field that
    disagrees is caught before any byte is read through it. ``ValueError`` for a shape
    the codec cannot hold (int8 needs the K/V axis to be 2)."""
    n = math.prod(shape)
    if codec == "raw":
        return n * WIRE_DTYPES[label].itemsize
    if codec == "bf16":
        return 2 * n
    layers, kv, heads, tokens, dim = shape
    if codec == "int8":
        if kv != 2:
            raise ValueError(f"int8 needs a K/V axis of 2, got shape {shape}")
        return n + 2 * layers * heads * (dim + tokens)  # int8 values, fp16 K scales per channel, V per token
    if codec == "int4":
        return (n + 1) // 2 + 4 * (n // int4_group(dim))  # packed nibbles, fp16 scale and min per group
    raise ValueError(f"unknown codec {codec!r}; valid: {', '.join(CODECS)}")


def pack_header(
    key: bytes, label: str, shape: tuple[int, ...], tok_ck: bytes, payload: memoryview, codec: str = "raw"
) -> bytes:
    ndim, length = len(shape), header_length(len(shape), len(key))
    version = VERSION if codec == "raw" else VERSION_CODEC
    body = b"".join(
        (
            _FIXED.pack(MAGIC, version, length, CODES[label], ndim, CODEC_CODES[codec], len(key)),
            _SHAPE.pack(*shape),
            key,
            _TAIL.pack(tok_ck, payload.nbytes, xxhash.xxh3_128_digest(payload)),
        )
    )
    body += bytes(length - _HEADER_CHECKSUM.size - len(body))
    return body + _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def byte_view(frame: Buffer) -> memoryview:
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if not view.c_contiguous:
        raise TypeError("frame must be a contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def parse_header(view: memoryview) -> FrameHeader:
    size = len(view)
    if bytes(view[:4]) != MAGIC[: min(size, 4)]:
        raise CorruptFrame(f"bad magic: expected {MAGIC!r}, found {bytes(view[:4])!r}")
    if size < _FIXED.size:
        raise TruncatedFrame(f"expected at least {_FIXED.size} header bytes, found {size}")
    _, version, length, code, ndim, flags, key_len = _FIXED.unpack_from(view)
    if version not in (VERSION, VERSION_CODEC):
        raise UnsupportedVersion(f"expected format version {VERSION} or {VERSION_CODEC}, found {version}")
    expected = header_length(ndim, key_len)
    if length != expected:
        raise CorruptFrame(
            f"header length: expected {expected} bytes for {ndim} dims and a {key_len}-byte key, found {length}"
        )
    if size < length:
        raise TruncatedFrame(f"expected a {length}-byte header, found {size} bytes")
    _check_header_checksum(view, length)
    return _header_fields(view, version, code, ndim, _codec_of(version, flags), key_len, length)


def _check_header_checksum(view: memoryview, length: int) -> None:
    end = length - _HEADER_CHECKSUM.size
    (stored,) = _HEADER_CHECKSUM.unpack_from(view, end)
    computed = xxhash.xxh3_64_intdigest(view[:end])
    if stored != computed:
        raise CorruptFrame(f"header checksum: expected {computed:016x}, found {stored:016x}")


def _codec_of(version: int, flags: int) -> str:
    """The codec a header's u16 at offset 10 names: version 1 has only flags there (0);
    version 2 has the codec in its low byte and flags (0) in its high byte."""
    if version == VERSION:
        if flags:
            raise UnsupportedVersion(f"expected flags 0 in version {VERSION}, found {flags:#06x}")
        return "raw"
    codec, flags = flags & 0xFF, flags >> 8
    if flags:
        raise UnsupportedVersion(f"expected flags 0 in version {VERSION_CODEC}, found {flags:#04x}")
    if codec not in CODEC_NAMES:
        raise UnknownCodec(f"codec code: expected one of {sorted(CODEC_NAMES)}, found {codec}")
    return CODEC_NAMES[codec]


def _header_fields(
    view: memoryview, version: int, code: int, ndim: int, codec: str, key_len: int, length: int
) -> FrameHeader:
    """Fields of a header whose checksum matched: what is left to catch is a bad writer."""
    if code not in LABELS:
        raise CorruptFrame(f"dtype code: expected one of {sorted(LABELS)}, found {code}")
    if ndim != NDIM or key_len == 0:
        raise CorruptFrame(f"expected {NDIM} dims and a non-empty key, found {ndim} dims and {key_len} key bytes")
    shape = _SHAPE.unpack_from(view, _FIXED.size)
    at = _FIXED.size + 4 * ndim
    tok_ck, payload_len, pay_ck = _TAIL.unpack_from(view, at + key_len)
    label = LABELS[code]
    if 0 in shape:
        raise CorruptFrame(f"shape: expected every dim >= 1, found {shape}")
    try:
        expected_len = payload_size(codec, shape, label)
    except ValueError:
        raise CorruptFrame(f"shape: expected a K/V axis of 2 for {codec}, found {shape}") from None
    if payload_len != expected_len:
        raise CorruptFrame(
            f"payload length: expected {expected_len} bytes for {codec} {label} {shape}, found {payload_len}"
        )
    key = bytes(view[at : at + key_len])
    return FrameHeader(version, label, shape, key, tok_ck, payload_len, pay_ck, length, codec)


def show_key(key: bytes) -> str:
    text = key[:32].hex()
    return f"{text}... ({len(key)} bytes)" if len(key) > 32 else text
