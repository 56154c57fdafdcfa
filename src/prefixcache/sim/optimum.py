"""The offline optimum: the best hit rate any policy could reach at a given capacity.

A policy's hit rate alone does not say whether a better policy, or only a bigger cache,
would help; its distance from the optimum at the same capacity does. The optimum is
Belady's, with bypass, on the flat block sequence (``blocks.request_blocks``).

Two engines compute it: ``belady`` here, the reference (pure Python, the whole sequence in
memory), and the compiled ``_optimum.c`` (streaming through temporary files, memory
proportional to the distinct blocks), which tests/sim/test_optimum.py holds to exactly
the reference's answers. ``optima`` runs the compiled one where it is built.
"""

from __future__ import annotations

import heapq
import math
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

from prefixcache.config import ISOLATION_MODES
from prefixcache.sim.blocks import block_ids, block_salt, request_blocks
from prefixcache.sim.summary import TraceSource
from prefixcache.sim.traces import Request

_optimum: ModuleType | None
try:
    from prefixcache.sim.native import _optimum
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
    that do not depend on them; its temporary files (8 bytes per block access and 16 per
    request) go to ``tempfile.gettempdir()`` (``TMPDIR``). ``engine="python"`` runs the
    reference once per capacity, ``"auto"`` the compiled one where it is built. ``chunk``
    sets the compiled engine's accesses per read or write (the tests cross its chunk
    boundaries with tiny ones)."""
    _check(block_size, isolation, warmup)
    caps = [_blocks(c) for c in capacities]
    if _python(engine) or not caps:
        return [belady(source, c, block_size, isolation, warmup) for c in capacities]
    stream = _Stream(block_size, isolation, chunk)
    try:
        for req in source():
            stream.feed(req)
        return stream.solve(caps, warmup)
    finally:
        stream.close()


class OptimumSweep:
    """The optimum for many (capacity in tokens, block size, isolation) keys, fed the
    trace request by request: the replay feeds it in its first pass, so that the
    optimum needs no read of its own.

    The compiled engine builds one block sequence per block size and isolation as it is
    fed and solves all of its capacities at once; without it ``feed`` is ``None`` and
    ``solve`` runs the reference, which reads the trace once per key."""

    def __init__(self, keys: Iterable[tuple[float, int, str]], warmup: int, *, engine: str = "auto") -> None:
        self.keys = list(dict.fromkeys(keys))
        self.warmup = warmup
        for capacity, block_size, isolation in self.keys:
            _check(block_size, isolation, warmup)
            _blocks(capacity / block_size)
        self._streams: dict[tuple[int, str], _Stream] = {}
        if not _python(engine):
            for _, block_size, isolation in self.keys:
                if (block_size, isolation) not in self._streams:
                    self._streams[(block_size, isolation)] = _Stream(block_size, isolation)

    @property
    def feed(self) -> Callable[[Request], None] | None:
        """What takes each request of the trace, in order; ``None`` when nothing needs them."""
        streams = list(self._streams.values())
        if not streams:
            return None
        if len(streams) == 1:
            return streams[0].feed

        def feed_all(req: Request) -> None:
            for stream in streams:
                stream.feed(req)

        return feed_all

    def solve(self, source: TraceSource) -> dict[tuple[float, int, str], Optimum]:
        """The optimum of every key, once every request was fed (the reference reads ``source``)."""
        if not self._streams:
            return {(c, bs, iso): belady(source, c / bs, bs, iso, self.warmup) for c, bs, iso in self.keys}
        out: dict[tuple[float, int, str], Optimum] = {}
        for (block_size, isolation), stream in self._streams.items():
            tokens = [c for c, bs, iso in self.keys if (bs, iso) == (block_size, isolation)]
            found = stream.solve([_blocks(c / block_size) for c in tokens], self.warmup)
            out.update({(c, block_size, isolation): o for c, o in zip(tokens, found, strict=True)})
        return out

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()


class _Stream:
    """One block sequence (a block size and an isolation) in the compiled engine."""

    def __init__(self, block_size: int, isolation: str, chunk: int | None = None) -> None:
        assert _optimum is not None
        self.block_size, self.isolation = block_size, isolation
        self.contexts: dict[object, int] = {}
        self.seq = _optimum.Sequence(tempfile.gettempdir(), *([] if chunk is None else [chunk]))

    def feed(self, req: Request) -> None:
        salt = block_salt(req, self.isolation)
        context = self.contexts.setdefault(salt, len(self.contexts))
        self.seq.add(context, block_ids(req, self.block_size), req.input_length)

    def solve(self, capacities: list[int | None], warmup: int) -> list[Optimum]:
        return [Optimum(hits, blocks) for hits, blocks in self.seq.solve(capacities, self.block_size, warmup)]

    def close(self) -> None:
        self.seq.close()


def _python(engine: str) -> bool:
    """Whether ``engine`` means the reference (checking its name)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown optimum engine {engine!r}; valid: {', '.join(ENGINES)}")
    if engine == "native" and _optimum is None:
        raise ValueError("the compiled optimum (sim/native/_optimum.c) is not built; use engine 'python' or 'auto'")
    return engine == "python" or _optimum is None


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
