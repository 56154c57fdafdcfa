"""A request as a sequence of block ids: the view flat mode replays and the offline
optimum bounds (one definition for both, so that the optimum is an optimum of exactly
what flat mode sees), and the ids the kernel's tree hangs under a context root.

The simulator's one chained block hash is ``prefix_ids``: an id per block that names the
block and every block before it (flat mode, the optimum, the workload generator's
Mooncake-style ids). The kernel chains in C instead (``chain(parent key, id)``,
native/_simmap.h) and takes ``block_digests``, one digest per block; its roots are
``root_key``. NOTE: the kernel's ids feed the sampled curves' draw, so their values,
not only their equalities, are part of every sampled result.

In every mode a request's hit is the contiguous prefix of its blocks found cached, in
tokens: ``min(hit_blocks * block_size, input_length)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from prefixcache.hashing import token_bytes
from prefixcache.sim.traces import Request


def request_blocks(req: Request, block_size: int, isolation: str) -> list[object]:
    """The request's prefix blocks: ``(block_salt, id)`` for each of its ``block_ids``."""
    salt = block_salt(req, isolation)
    return [(salt, i) for i in block_ids(req, block_size)]


def block_salt(req: Request, isolation: str) -> object:
    """What keeps one request's blocks apart from another's with the same ids: the model
    always (KV of one model is useless to another), and the tenant unless shared."""
    return req.model if isolation == "shared" else (req.model, req.tenant)


def block_ids(req: Request, block_size: int) -> Sequence[int]:
    """The request's prefix block ids: the trace's own, or prefix hashes of its tokens
    (one per full block and one for a partial tail)."""
    if req.hash_ids is not None:
        return req.hash_ids
    assert req.tokens is not None
    return prefix_ids(token_bytes(req.tokens), block_size)


def prefix_ids(data: bytes | memoryview, block_size: int, skip: int = 0) -> list[int]:
    """A 128-bit id for each block of ``data`` (token ids as little-endian uint32) and one
    for a partial tail, after the first ``skip`` blocks: the hash of everything up to the
    block's end, its top bits XOR the block's length in bytes.

    NOTE: a prefix hash, as hashing.py's keys are, so an id names its block and all
    before it; streamed, so the whole chain is one pass and ``skip`` blocks already
    named cost one C call. A partial tail's shorter bytes never give a full block's id."""
    step, end = 4 * block_size, len(data)
    hasher = xxhash.xxh3_128(data[: skip * step])
    update, digest, full = hasher.update, hasher.intdigest, step << 120  # NOTE: bound once: the loop is hot
    ids: list[int] = []
    for begin in range(skip * step, end - step + 1, step):
        update(data[begin : begin + step])
        ids.append(digest() ^ full)
    tail = end % step if end > skip * step else 0
    if tail:
        update(data[end - tail :])
        ids.append(digest() ^ (tail << 120))
    return ids


def block_digests(tokens: Sequence[int], block_size: int) -> list[int]:
    """A 64-bit digest of each full block's tokens, alone: the kernel's block ids (its
    tree chains them under their parent)."""
    data = token_bytes(tokens)
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    return [digest(data[i : i + step]) for i in range(0, len(data) - step + 1, step)]


def root_key(model: str, namespace: str) -> int:
    """The kernel's 64-bit key of a context root: a model and a namespace ("" when the
    cache is shared, else the tenant)."""
    return xxhash.xxh3_64_intdigest(repr((model, namespace)).encode())


def hit_tokens(req: Request, hit_blocks: int, block_size: int) -> int:
    return min(hit_blocks * block_size, req.input_length)
