"""A trace read once and held in memory, for the commands that pass over it many times
(the planner's search rounds, the curves' sketch and miniatures).

Parsing a trace's JSON lines costs about as much as replaying them on the compiled
kernel, and the planner passes over the trace a dozen times. ``hold(source)`` reads it
once into flat arrays; each later pass rebuilds the same ``Request`` objects from them.
The ids and tokens sit in ``array`` buffers that no reference count touches, so the
processes ``fork_map`` starts share them without copying.

A trace is not held (``hold`` returns ``source`` itself, streamed from its file on each
pass, as before) when its arrays would pass the memory budget, or when an id does not
fit in 64 bits. Either way every pass yields the same requests: holding changes the
time a command takes, never its answer (tests/sim/test_held.py).
"""

from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prefixcache.sim.summary import TraceSource
from prefixcache.sim.traces import Request

__all__ = ["HeldTrace", "default_budget", "hold"]

REQUEST_BYTES = 96
"""What one request's scalars and string references cost in the held arrays, about."""


def default_budget() -> int:
    """A quarter of this machine's memory (1 GiB where it cannot be read)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (AttributeError, ValueError, OSError):  # NOTE: not on every platform
        return 1 << 30


@dataclass(slots=True)
class _Ints:
    """One ``tuple[int, ...] | None`` field of every request: the values end to end."""

    values: array[int] = field(default_factory=lambda: array("Q"))
    ends: array[int] = field(default_factory=lambda: array("q"))  # -1: None
    _end: int = 0

    def add(self, ints: tuple[int, ...] | None) -> int:
        """Append one request's field; the bytes it took."""
        if ints is None:
            self.ends.append(-1)
            return 8
        self.values.extend(ints)  # NOTE: OverflowError beyond 64 bits (the trace is not held)
        self._end += len(ints)
        self.ends.append(self._end)
        return 8 * len(ints) + 8

    def reader(self) -> Iterator[tuple[int, ...] | None]:
        values, start = memoryview(self.values), 0
        for end in self.ends:
            if end < 0:
                yield None
            else:
                yield tuple(values[start:end])
                start = end


@dataclass(slots=True)
class HeldTrace:
    """A ``TraceSource`` over requests held in flat arrays (``hold`` builds one)."""

    timestamps: array[float] = field(default_factory=lambda: array("d"))
    lengths: array[int] = field(default_factory=lambda: array("q"))  # input, output, block size (-1: None)
    names: list[str | None] = field(default_factory=list)  # tenant, model, endpoint, session
    tokens: _Ints = field(default_factory=_Ints)
    hash_ids: _Ints = field(default_factory=_Ints)
    output_tokens: _Ints = field(default_factory=_Ints)
    nbytes: int = 0

    def __len__(self) -> int:
        return len(self.timestamps)

    def add(self, req: Request) -> None:
        intern = sys.intern
        self.timestamps.append(req.timestamp)
        self.lengths.extend((req.input_length, req.output_length, -1 if req.block_size is None else req.block_size))
        session = None if req.session is None else intern(req.session)
        self.names.extend((intern(req.tenant), intern(req.model), intern(req.endpoint), session))
        self.nbytes += REQUEST_BYTES + sum(
            ints.add(value)
            for ints, value in (
                (self.tokens, req.tokens),
                (self.hash_ids, req.hash_ids),
                (self.output_tokens, req.output_tokens),
            )
        )

    def __call__(self) -> Iterator[Request]:
        lengths, names = self.lengths, self.names
        fields = zip(self.tokens.reader(), self.hash_ids.reader(), self.output_tokens.reader(), strict=True)
        for i, (timestamp, (tokens, hash_ids, output_tokens)) in enumerate(zip(self.timestamps, fields, strict=True)):
            tenant, model, endpoint, session = names[4 * i : 4 * i + 4]
            assert tenant is not None and model is not None and endpoint is not None
            yield Request(
                timestamp=timestamp,
                tenant=tenant,
                model=model,
                endpoint=endpoint,
                input_length=lengths[3 * i],
                output_length=lengths[3 * i + 1],
                tokens=tokens,
                hash_ids=hash_ids,
                block_size=None if lengths[3 * i + 2] < 0 else lengths[3 * i + 2],
                output_tokens=output_tokens,
                session=session,
            )


def hold(source: TraceSource, budget: int | None = None) -> TraceSource:
    """``source``'s requests held in memory (one pass over it now), or ``source`` itself
    when they would take more than ``budget`` bytes (default: ``default_budget()``; 0
    never holds) or carry an id beyond 64 bits. A malformed trace raises here, as its
    first pass would."""
    limit = default_budget() if budget is None else budget
    if limit <= 0 or isinstance(source, HeldTrace):
        return source
    held = HeldTrace()
    requests: Iterable[Request] = source()
    try:
        for req in requests:
            held.add(req)
            if held.nbytes > limit:
                return source
    except OverflowError:
        return source
    finally:
        close = getattr(requests, "close", None)
        if close is not None:  # NOTE: a generator over an open file, left early
            close()
    return held
