"""A request as a sequence of independent block ids: the view flat mode replays and the
offline optimum bounds. One definition for both, so that the optimum is an optimum of
exactly what flat mode sees.

In every mode a request's hit is the contiguous prefix of its blocks found cached, in
tokens: ``min(hit_blocks * block_size, input_length)``.
"""

from __future__ import annotations

import xxhash

from prefixcache.hashing import token_bytes
from prefixcache.sim.traces import Request


def request_blocks(req: Request, block_size: int, isolation: str) -> list[object]:
    """The request's prefix block ids: the trace's own, or prefix hashes of its tokens
    (one per full block and one for a partial tail), salted by the model always (KV of
    one model is useless to another) and by the tenant unless shared."""
    if req.hash_ids is not None:
        ids: list[object] = list(req.hash_ids)
    else:
        assert req.tokens is not None
        ids = _token_block_ids(req.tokens, block_size)
    salt = req.model if isolation == "shared" else (req.model, req.tenant)
    return [(salt, i) for i in ids]


def _token_block_ids(tokens: tuple[int, ...], block_size: int) -> list[object]:
    data = token_bytes(tokens)
    hasher = xxhash.xxh3_128()
    ids: list[object] = []
    step = 4 * block_size
    for begin in range(0, len(data), step):
        hasher.update(data[begin : begin + step])
        ids.append(hasher.intdigest() ^ (min(step, len(data) - begin) << 120))
    return ids


def hit_tokens(req: Request, hit_blocks: int, block_size: int) -> int:
    return min(hit_blocks * block_size, req.input_length)
