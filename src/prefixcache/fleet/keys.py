"""The router's own block keys: a chained hash of token ids, scoped by namespace and model.

A router does not compute a backend's keys (they are seeded and salted per deployment,
and a vLLM backend hashes differently again): it hashes the tokens that the events
carry, and a request's tokens, the same way. Key ``i`` covers the namespace, the model
and every token of blocks ``0..i``, so equal keys mean equal prefixes (up to the
128-bit hash). Only whole blocks have keys; a partial tail is not routed on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["TOKEN_LIMIT", "TokenRangeError", "chain_keys", "root_key", "token_bytes"]

TOKEN_LIMIT = 1 << 32  # token ids are hashed as 4 little-endian bytes


class TokenRangeError(ValueError):
    """A token id the keys cannot hold: below 0 or at ``TOKEN_LIMIT`` and beyond (a
    request's to refuse, an event's to skip; never an overflow deep in numpy)."""

    def __init__(self) -> None:
        super().__init__("token ids must lie in [0, 2**32)")


def root_key(namespace: str, model: str) -> bytes:
    """The key every chain of ``namespace`` on ``model`` starts from."""
    ns, m = namespace.encode(), model.encode()
    return xxhash.xxh3_128_digest(b"prefixcache-route\0%d:%b%d:%b" % (len(ns), ns, len(m), m))


def chain_keys(parent: bytes, tokens: Sequence[int] | np.ndarray, block_size: int) -> list[bytes]:
    """Keys of the whole blocks of ``tokens`` chained below ``parent`` (a root key or the
    key of the block they follow); a partial last block gets none."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    raw = token_bytes(tokens)
    keys: list[bytes] = []
    key = parent
    step = 4 * block_size
    for start in range(0, len(raw) - step + 1, step):
        key = xxhash.xxh3_128_digest(key + raw[start : start + step])
        keys.append(key)
    return keys


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """``tokens`` as the keys hash them (``<u4`` each); raises ``TokenRangeError`` for an
    id out of range, ``ValueError`` for anything but a flat sequence of integers."""
    try:
        arr = np.asarray(tokens, dtype=np.int64)
    except OverflowError:  # beyond int64, either way
        raise TokenRangeError() from None
    if arr.ndim != 1:
        raise ValueError("tokens must be a flat sequence of token ids")
    if arr.size and (arr.min() < 0 or arr.max() >= TOKEN_LIMIT):
        raise TokenRangeError()
    return arr.astype("<u4", copy=False).tobytes()
