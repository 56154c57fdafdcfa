"""Context roots and block keys.

A block key names "this context, followed by exactly these tokens (and these non-text
segments)". It is computed by one streaming hasher over a self-delimiting layout::

    key(T) = H( ROOT_TAG | enc(seed, model, model_epoch, adapter, adapter_epoch,
                                tokenizer, namespace, [generation,] extra)  <- the context root
              | tokens[0:T] as little-endian uint32                   <- all tokens so far
              | enc(segments starting before T)                       <- per-block extra keys
              | u64 len(segments encoding) | u64 T )                  <- trailer, read backwards

NOTE: this is the chained key of design.md invariant 1 written as a prefix hash: the key
of block i covers the context root and every token (and segment) of blocks 0..i, so it
changes exactly when the vLLM-style chain H(key_{i-1}, tokens_i, extra_i) would. Hashing
the prefix with a streaming hasher instead of re-feeding the parent digest lets any
depth's key be computed with one C call (``copy``, ``update`` of a memoryview slice,
``digest``), so ``match`` binary-searches the chain with O(log n) hashes, and the
whole chain still costs one pass at insert. The trailer makes the layout injective:
reading from the end gives T, then the segment bytes, then the tokens, then the root.

The encoding of context fields is typed and length-prefixed, so ``("org_1", "2345")``
and ``("org_12345", "")`` differ, and so do an adapter of ``None`` and ``""``.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import xxhash

ROOT_TAG = b"prefixcache/root/v1\x00"
assert array("I").itemsize == 4, "prefixcache needs a 4-byte C unsigned int"
_U64 = struct.Struct("<Q")
_TRAILER = struct.Struct("<QQ")
_MAX_TOKEN = 2**32


class Hasher(Protocol):
    """The streaming interface shared by hashlib, xxhash and blake3 objects."""

    def update(self, data: bytes | memoryview, /) -> object: ...
    def copy(self) -> Hasher: ...
    def digest(self) -> bytes: ...


HashFactory = Callable[[], Hasher]


def _blake3() -> Hasher:
    try:
        import blake3
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ValueError("hash 'blake3' needs the blake3 package: pip install 'prefixcache[blake3]'") from exc
    hasher: Hasher = blake3.blake3()
    return hasher


HASHES: Mapping[str, HashFactory] = {
    "xxh3_128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
    "blake3": _blake3,
}


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# One-shot digests of the same functions: hashing a short prefix in one C call beats
# copying a streaming state. Both give the same key (the input is the same bytes).
ONESHOT: Mapping[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256,
}
ONESHOT_MAX_BYTES = 4096  # above this a streaming pass is cheaper than re-hashing prefixes


def get_hash(name: str) -> HashFactory:
    """The hash factory registered under ``name``; an unknown name lists the valid ones."""
    try:
        return HASHES[name]
    except KeyError:
        raise ValueError(f"unknown hash {name!r}; valid: {', '.join(sorted(HASHES))}") from None


# ---------------------------------------------------------------------------- encoding


def encode(value: Any) -> bytes:
    """Typed, length-prefixed encoding of a key field: injective over the types it accepts
    (None, bool, int, str, bytes, float, and tuples or lists of those)."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"?\x01" if value else b"?\x00"
    if isinstance(value, int):
        digits = str(value).encode()
        return b"I" + _U64.pack(len(digits)) + digits
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return b"S" + _U64.pack(len(data)) + data
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return b"B" + _U64.pack(len(data)) + data
    if isinstance(value, float):
        return b"F" + struct.pack("<d", value)
    if isinstance(value, tuple | list):
        return b"T" + _U64.pack(len(value)) + b"".join(encode(v) for v in value)
    raise TypeError(
        f"cannot use a {type(value).__name__} in a cache key; use None, bool, int, str, bytes, float or tuples of them"
    )


# ---------------------------------------------------------------------------- context


@dataclass(frozen=True, slots=True)
class CacheContext:
    """Who asks and against which model: everything besides tokens that decides whether
    a cached KV block is valid for a request. ``extra`` holds further key material that
    applies to the whole prompt (e.g. a LoRA config hash, a system-level salt)."""

    tenant: str
    model: str = "default"
    adapter: str | None = None
    extra: tuple[Any, ...] = ()
    tokenizer: str = ""
    # NOTE: the encoded ``extra`` names the context in dicts: ``(1,)`` and ``(True,)``
    # are equal as tuples but are different keys, and a list inside is unhashable.
    extra_key: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError("CacheContext.tenant must be a non-empty string")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("CacheContext.model must be a non-empty string")
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise ValueError("CacheContext.adapter must be a string or None")
        if not isinstance(self.tokenizer, str):
            raise ValueError("CacheContext.tokenizer must be a string")
        if not isinstance(self.extra, tuple):
            raise ValueError("CacheContext.extra must be a tuple")
        object.__setattr__(self, "extra_key", encode(self.extra))  # rejects unencodable values now


def root_encoding(
    seed: str,
    ctx: CacheContext,
    namespace: str,
    model_epoch: int,
    adapter_epoch: int,
    generation: int = 0,
) -> bytes:
    """The bytes every key of this context starts with. ``generation`` is the namespace's:
    a tenant purge raises it (``cache/contexts.py``), so no key of the purged blocks is
    ever computed again.

    NOTE: generation 0 leaves the field out (the eight fields the encoding always had), so
    that keys stored before generations existed are still found; from 1 on it is a ninth
    field. Still injective: ``encode`` prefixes a tuple with its length, so no eight-field
    encoding equals a nine-field one, and a nine-field one never holds a 0."""
    if type(generation) is not int or generation < 0:
        raise ValueError(f"a generation is an integer >= 0, not {generation!r}")
    fields = (seed, ctx.model, model_epoch, ctx.adapter, adapter_epoch, ctx.tokenizer, namespace)
    tail = (generation, ctx.extra) if generation else (ctx.extra,)
    return ROOT_TAG + encode(fields + tail)


# ---------------------------------------------------------------------------- segments


@dataclass(frozen=True, slots=True)
class Segment:
    """A non-text span of the prompt, e.g. an image behind placeholder tokens at
    positions ``[start, end)``, named by the hash of its content. Every block that a
    segment starts in or before carries it in its key, so two prompts with the same
    placeholders but different images never share KV from the image on."""

    start: int
    end: int
    key: bytes | str

    def __post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.end, int)) or not 0 <= self.start < self.end:
            raise ValueError(f"Segment needs 0 <= start < end, got [{self.start}, {self.end})")
        if not isinstance(self.key, bytes | str) or not self.key:
            raise ValueError("Segment.key must be a non-empty str or bytes (a content hash)")


@dataclass(frozen=True, slots=True)
class Segments:
    """A prompt's segments, sorted, with the encoding of each prefix of them prepared."""

    starts: tuple[int, ...] = ()
    prefix_enc: tuple[bytes, ...] = (b"",)  # prefix_enc[c] = encoding of the first c segments

    @staticmethod
    def of(segments: Sequence[Segment] | None, num_tokens: int) -> Segments:
        if not segments:
            return NO_SEGMENTS
        ordered = sorted(segments, key=lambda s: (s.start, s.end))
        encs = [b""]
        for seg in ordered:
            if not isinstance(seg, Segment):
                raise TypeError(f"segments must be Segment objects, got {type(seg).__name__}")
            if seg.end > num_tokens:
                raise ValueError(f"segment [{seg.start}, {seg.end}) runs past the prompt ({num_tokens} tokens)")
            encs.append(encs[-1] + encode((seg.start, seg.end, seg.key)))
        return Segments(tuple(s.start for s in ordered), tuple(encs))

    def count_before(self, end: int) -> int:
        """How many segments start before token position ``end``."""
        count = 0
        for start in self.starts:
            if start >= end:
                break
            count += 1
        return count

    def enc_between(self, begin: int, end: int) -> bytes:
        """Encoding of the segments that start in ``[begin, end)``: a block's own share."""
        lo, hi = self.count_before(begin), self.count_before(end)
        return self.prefix_enc[hi][len(self.prefix_enc[lo]) :]


NO_SEGMENTS = Segments()


# ---------------------------------------------------------------------------- tokens


def token_bytes(tokens: Sequence[int] | np.ndarray, vocab_size: int | None = None) -> bytes:
    """Token ids as little-endian uint32 bytes, validated: a bad id is a ``ValueError``
    that names its position, never a silent wrap-around. (A Python ``bool`` is an
    ``int`` and passes as 0 or 1; a numpy array must have an integer dtype.)"""
    if isinstance(tokens, np.ndarray):
        return _ndarray_bytes(tokens, vocab_size)
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        raise ValueError(f"token ids must be a sequence of integers, not {type(tokens).__name__}")
    try:
        packed = array("I", tokens)
    except (TypeError, OverflowError, ValueError):
        _raise_bad_token(tokens, vocab_size)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        packed.byteswap()
    data = packed.tobytes()
    if vocab_size is not None and data:
        arr = np.frombuffer(data, dtype="<u4")
        if int(arr.max()) >= vocab_size:
            _raise_bad_token(tokens, vocab_size)
    return data


def _ndarray_bytes(tokens: np.ndarray, vocab_size: int | None) -> bytes:
    if tokens.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got an array of shape {tokens.shape}")
    if tokens.size == 0:
        return b""
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got an array of dtype {tokens.dtype}")
    lo, hi = int(tokens.min()), int(tokens.max())
    limit = _MAX_TOKEN if vocab_size is None else vocab_size
    if lo < 0 or hi >= limit:
        _raise_bad_token(tokens.tolist(), vocab_size)
    return tokens.astype("<u4", copy=False).tobytes()


def _raise_bad_token(tokens: Any, vocab_size: int | None) -> Any:
    limit = _MAX_TOKEN if vocab_size is None else vocab_size
    for i, tok in enumerate(tokens):
        if not isinstance(tok, int | np.integer):
            raise ValueError(f"token id at position {i} is not an integer: {tok!r}")
        if not 0 <= int(tok) < limit:
            where = f"vocabulary size {vocab_size}" if vocab_size is not None else "2**32"
            raise ValueError(f"token id at position {i} is out of range [0, {where}): {int(tok)}")
    raise ValueError("token ids must be a sequence of integers")


# ---------------------------------------------------------------------------- keys


class KeyChain:
    """The keys of one prompt under one context root, computed on demand.

    ``at(T)`` is the key of the prefix of T tokens; ``many(ends)`` the keys of many
    prefixes in one pass. ``root`` is a streaming hasher that has consumed the root
    encoding ``root_enc``; ``oneshot`` (optional) digests bytes in one call and must be
    the same function, so that both paths give the same keys.
    """

    __slots__ = ("_view", "data", "oneshot", "root", "root_enc", "segments")

    def __init__(
        self,
        root: Hasher,
        data: bytes,
        segments: Segments = NO_SEGMENTS,
        root_enc: bytes = b"",
        oneshot: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self.root = root
        self.data = data
        self.segments = segments
        self.root_enc = root_enc
        self.oneshot = oneshot if root_enc else None
        self._view = memoryview(data)

    def _trailer(self, end: int) -> bytes:
        enc = self.segments.prefix_enc[self.segments.count_before(end)] if self.segments.starts else b""
        return enc + _TRAILER.pack(len(enc), end)

    def at(self, end: int) -> bytes:
        trailer = self._trailer(end) if self.segments.starts else _TRAILER.pack(0, end)
        if self.oneshot is not None and end <= ONESHOT_MAX_BYTES // 4:
            return self.oneshot(b"".join((self.root_enc, self._view[: 4 * end], trailer)))
        h = self.root.copy()
        h.update(self._view[: 4 * end])
        h.update(trailer)
        return h.digest()

    def many(self, ends: Sequence[int]) -> list[bytes]:
        """Keys for increasing prefix lengths ``ends``, in one pass."""
        if not ends:
            return []
        if self.oneshot is not None and ends[-1] <= ONESHOT_MAX_BYTES // 4:
            return [self.at(end) for end in ends]
        h = self.root.copy()
        view, done, out = self._view, 0, []
        trailer = self._trailer if self.segments.starts else None
        pack = _TRAILER.pack
        for end in ends:
            h.update(view[4 * done : 4 * end])
            done = end
            hc = h.copy()
            hc.update(trailer(end) if trailer is not None else pack(0, end))
            out.append(hc.digest())
        return out


def root_hasher(factory: HashFactory, root_enc: bytes) -> Hasher:
    hasher = factory()
    hasher.update(root_enc)
    return hasher
