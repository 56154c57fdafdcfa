"""A request as a sequence of independent block ids: the view flat mode replays and the
offline optimum bounds. One definition for both, so that the optimum is an optimum of
exactly what flat mode sees.

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
    return _token_block_ids(req.tokens, block_size)


def _token_block_ids(tokens: tuple[int, ...], block_size: int) -> list[int]:
    data = token_bytes(tokens)
    hasher = xxhash.xxh3_128()
    ids: list[int] = []
    step = 4 * block_size
    for begin in range(0, len(data), step):
        hasher.update(data[begin : begin + step])
        ids.append(hasher.intdigest() ^ (min(step, len(data) - begin) << 120))
    return ids


def hit_tokens(req: Request, hit_blocks: int, block_size: int) -> int:
    return min(hit_blocks * block_size, req.input_length)
