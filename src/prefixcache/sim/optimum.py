"""The offline optimum: the best hit rate any policy could reach at a given capacity.

A policy's hit rate alone does not say whether a better policy, or only a bigger cache,
would help; its distance from the optimum at the same capacity does. The optimum is
Belady's, with bypass, on the flat block sequence (``blocks.request_blocks``).

Two engines compute it: ``belady`` here, the reference (pure Python, the whole sequence in
memory), and the compiled ``_optimum.c`` (streaming through temporary files, memory
proportional to the distinct blocks), which tests/test_sim_optimum.py holds to exactly
the reference's answers. ``optima`` runs the compiled one where it is built.
"""

from __future__ import annotations

import heapq
import math
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

from prefixcache.config import ISOLATION_MODES
from prefixcache.sim.blocks import block_ids, block_salt, request_blocks
from prefixcache.sim.summary import TraceSource

_optimum: ModuleType | None
try:
    from prefixcache.sim import _optimum
except ImportError:  # NOTE: an optional extension; without a compiler the reference runs
    _optimum = None

ENGINES = ("auto", "native", "python")


@dataclass(frozen=True, slots=True)
class Optimum:
    """Belady's hits over the requests after the warm-up: the tokens of each request's
    contiguous prefix of hit blocks, and every block hit."""

    hit_tokens: int
    block_hits: int


def native_available() -> bool:
    return _optimum is not None


def optima(
    source: TraceSource,
    capacities: Sequence[float],
    block_size: int,
    isolation: str,
    warmup: int,
    *,
    engine: str = "auto",
    chunk: int | None = None,
) -> list[Optimum]:
    """The optimum at each capacity (in blocks, ``math.inf`` for unlimited), in order.

    The compiled engine reads the trace once for all the capacities and shares the passes
    that do not depend on them; its temporary files (12 bytes per block access and 16 per
    request) go to ``tempfile.gettempdir()`` (``TMPDIR``). ``engine="python"`` runs the
    reference once per capacity, ``"auto"`` the compiled one where it is built. ``chunk``
    sets the compiled engine's accesses per read or write (the tests cross its chunk
    boundaries with tiny ones)."""
    _check(block_size, isolation, warmup)
    caps = [_blocks(c) for c in capacities]
    if engine not in ENGINES:
        raise ValueError(f"unknown optimum engine {engine!r}; valid: {', '.join(ENGINES)}")
    if engine == "native" and _optimum is None:
        raise ValueError("the compiled optimum (sim/_optimum.c) is not built; use engine 'python' or 'auto'")
    if engine == "python" or _optimum is None or not caps:
        return [belady(source, c, block_size, isolation, warmup) for c in capacities]
    seq = _optimum.Sequence(tempfile.gettempdir(), *([] if chunk is None else [chunk]))
    try:
        contexts: dict[object, int] = {}
        for req in source():
            salt = block_salt(req, isolation)
            seq.add(contexts.setdefault(salt, len(contexts)), block_ids(req, block_size), req.input_length)
        solved = seq.solve(caps, block_size, warmup)
    finally:
        seq.close()
    return [Optimum(hits, blocks) for hits, blocks in solved]


def optima_by_key(
    source: TraceSource, keys: Iterable[tuple[float, int, str]], warmup: int, *, engine: str = "auto"
) -> dict[tuple[float, int, str], Optimum]:
    """The optimum for each (capacity in tokens, block size, isolation): one ``optima``
    per block size and isolation (they make the block sequence), all its capacities at once."""
    groups: dict[tuple[int, str], list[float]] = {}
    for capacity, block_size, isolation in keys:
        group = groups.setdefault((block_size, isolation), [])
        if capacity not in group:
            group.append(capacity)
    out: dict[tuple[float, int, str], Optimum] = {}
    for (block_size, isolation), tokens in groups.items():
        blocks = [c / block_size for c in tokens]
        found = optima(source, blocks, block_size, isolation, warmup, engine=engine)
        out.update({(c, block_size, isolation): o for c, o in zip(tokens, found, strict=True)})
    return out


def _blocks(capacity_blocks: float) -> int | None:
    """The capacity as a whole number of blocks, ``None`` when unlimited."""
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int | float):
        raise TypeError(f"capacity must be a number of blocks, got {capacity_blocks!r}")
    if math.isnan(capacity_blocks) or capacity_blocks < 0:
        raise ValueError(f"capacity must be >= 0 blocks (inf: unlimited), got {capacity_blocks!r}")
    return None if math.isinf(capacity_blocks) else int(capacity_blocks)


def _check(block_size: int, isolation: str, warmup: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"unknown isolation {isolation!r}; valid: {', '.join(ISOLATION_MODES)}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a number of requests >= 0, got {warmup!r}")


def belady(source: TraceSource, capacity_blocks: float, block_size: int, isolation: str, warmup: int) -> Optimum:
    """Offline optimum with bypass on the flat block sequence: evict (or never admit) the
    block whose next use is farthest away; hits over the requests after ``warmup``.

    NOTE: the reference: needs the whole block sequence in memory (8 bytes and a list
    slot per block access). ``optima`` runs the compiled engine, which streams."""
    _check(block_size, isolation, warmup)
    cap_blocks = _blocks(capacity_blocks)
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
    cap = math.inf if cap_blocks is None else cap_blocks
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
    return Optimum(hit_tok, block_hits)
