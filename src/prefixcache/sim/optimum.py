"""The offline optimum: the best hit rate any policy could reach at a given capacity.

A policy's hit rate alone does not say whether a better policy, or only a bigger cache,
would help; its distance from the optimum at the same capacity does. The optimum is
Belady's, with bypass, on the flat block sequence (``blocks.request_blocks``).
"""

from __future__ import annotations

import heapq
import math

from prefixcache.sim.blocks import request_blocks
from prefixcache.sim.summary import TraceSource


def belady(
    source: TraceSource, capacity_blocks: float, block_size: int, isolation: str, warmup: int
) -> tuple[int, int]:
    """Offline optimum with bypass on the flat block sequence: evict (or never admit) the
    block whose next use is farthest away. Returns (hit tokens, block hits) over the
    requests after ``warmup``.

    NOTE: needs the whole block sequence in memory (8 bytes and a list slot per block
    access): the one part of the simulator that does not stream.
    """
    ids: dict[object, int] = {}
    seq: list[int] = []
    bounds: list[int] = [0]
    inputs: list[int] = []
    for req in source():
        for block in request_blocks(req, block_size, isolation):
            seq.append(ids.setdefault(block, len(ids)))
        bounds.append(len(seq))
        inputs.append(req.input_length)
    never = len(seq) + 1
    next_use = [never] * len(seq)
    last: dict[int, int] = {}
    for pos in range(len(seq) - 1, -1, -1):
        next_use[pos] = last.get(seq[pos], never)
        last[seq[pos]] = pos
    cap = math.inf if math.isinf(capacity_blocks) else int(capacity_blocks)
    resident: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hit_tok = block_hits = 0
    for r in range(len(inputs)):
        prefix_hits, prefix = 0, True
        for pos in range(bounds[r], bounds[r + 1]):
            block, nxt = seq[pos], next_use[pos]
            if block in resident:
                if r >= warmup:
                    block_hits += 1
                prefix_hits += prefix
            else:
                prefix = False
                if nxt == never or cap == 0:
                    continue
                if len(resident) >= cap:
                    while -heap[0][0] != resident.get(heap[0][1]):
                        heapq.heappop(heap)
                    if -heap[0][0] <= nxt:
                        continue  # bypass: everything cached is needed sooner
                    _, victim = heapq.heappop(heap)
                    del resident[victim]
            resident[block] = nxt
            heapq.heappush(heap, (-nxt, block))
            if nxt == never:
                del resident[block]
        if r >= warmup:
            hit_tok += min(prefix_hits * block_size, inputs[r])
    return hit_tok, block_hits
