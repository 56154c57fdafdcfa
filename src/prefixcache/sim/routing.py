"""What a simulated router knows when it picks a backend: each backend's load, in time,
and its cache contents, as KV events deliver them.

Load (``BackendQueue``) follows the trace's clock. A backend prefills one request at a
time, first come first served (prefill is compute-bound), and decodes every request
whose prefill is done side by side (decode is batched)::

    arrival t --> wait --> prefill (uncached tokens) --> first token --> decode --> done
                  \\________ pending: counts its prefill blocks ______/ \\_ generating _/

``Scorer.load`` turns the two sets into the load the routers compare.

Cache contents (``EventIndex``) are a set of block ids per backend, changed only by the
events the backends emit (blocks stored, blocks removed), delivered ``lag`` requests
after the request that caused them: the router decides on a view that may be stale,
as a live router fed by KV events does. ``lag=0`` is the oracle: every event is
applied before the next decision, so the index is the caches' exact contents.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from prefixcache.fleet.scoring import BackendView, Routing, Score, Scorer

# One event as the index applies it: (stored?, block ids). Ids are hashable: (salt, id).
IndexOp = tuple[bool, tuple[object, ...]]


class BackendQueue:
    """The requests in flight on one backend: pending prefill, then generating."""

    __slots__ = ("_generating", "_pending", "free_at", "pending_blocks")

    def __init__(self) -> None:
        self._pending: deque[tuple[float, float, int]] = deque()  # (first token, done, prefill blocks)
        self._generating: list[float] = []  # heap of done times
        self.pending_blocks = 0
        self.free_at = 0.0  # when the prefill engine is next idle

    def advance(self, now: float) -> None:
        """Move the requests whose first token came by ``now`` to generating, and drop
        those done by ``now``."""
        pending, generating = self._pending, self._generating
        while pending and pending[0][0] <= now:
            _, done, blocks = pending.popleft()
            self.pending_blocks -= blocks
            heapq.heappush(generating, done)
        while generating and generating[0] <= now:
            heapq.heappop(generating)

    @property
    def generating(self) -> int:
        return len(self._generating)

    def submit(self, now: float, prefill_s: float, decode_s: float, blocks: int) -> float:
        """Queue a request arriving at ``now``; returns its time to first token.

        NOTE: first tokens come in arrival order (one FIFO prefill engine), so the
        pending queue stays sorted by first-token time and ``advance`` pops its head."""
        start = max(now, self.free_at)
        first = self.free_at = start + prefill_s
        if first <= now:  # nothing to prefill and nothing queued: generating at once
            heapq.heappush(self._generating, first + decode_s)
        else:
            self._pending.append((first, first + decode_s, blocks))
            self.pending_blocks += blocks
        return first - now


class EventIndex:
    """The router's view of every backend's blocks, fed by events ``lag`` requests late."""

    __slots__ = ("_due", "_held", "lag", "requests")

    def __init__(self, backends: int, lag: int) -> None:
        if lag < 0:
            raise ValueError(f"event lag must be >= 0 requests, got {lag}")
        self.lag = lag
        self._held: list[set[object]] = [set() for _ in range(backends)]
        self._due: deque[tuple[int, int, list[IndexOp]]] = deque()  # (due before request #, backend, ops)
        self.requests = 0  # requests routed so far

    def publish(self, backend: int, ops: list[IndexOp]) -> None:
        """Events of the request just served on ``backend`` (call before ``next_request``):
        the router sees them once ``lag`` more requests have been routed."""
        if ops:
            self._due.append((self.requests + 1 + self.lag, backend, ops))

    def next_request(self) -> None:
        """One more request routed: deliver the events now due."""
        self.requests += 1
        due = self._due
        while due and due[0][0] <= self.requests:
            _, backend, ops = due.popleft()
            held = self._held[backend]
            for stored, ids in ops:
                if stored:
                    held.update(ids)
                else:
                    held.difference_update(ids)

    def overlap(self, backend: int, ids: Sequence[object]) -> int:
        """How many of ``ids``, from the first, the backend holds as far as the router knows."""
        held = self._held[backend]
        n = 0
        for block in ids:
            if block not in held:
                break
            n += 1
        return n


class Router:
    """One routing policy over a fleet: builds each backend's ``BackendView`` and lets
    the ``Scorer`` choose. Every backend is device memory to the router (one tier)."""

    __slots__ = ("index", "queues", "routing", "scorer", "turn")

    def __init__(self, routing: Routing, scorer: Scorer, queues: Sequence[BackendQueue], index: EventIndex) -> None:
        self.routing, self.scorer, self.queues, self.index = routing, scorer, list(queues), index
        self.turn = 0

    @property
    def reads_cache(self) -> bool:
        return self.routing in (Routing.PREFIX, Routing.COST)

    def choose(self, now: float, ids: Sequence[object]) -> tuple[int, Score]:
        """The backend for a request of block ``ids`` arriving at ``now``, and its score.

        NOTE: the views are rotated by the request's number, so that ties (equal load,
        equal overlap) go round-robin rather than always to backend 0, as the Scorer's
        tie rule intends; round-robin itself then always takes the first view."""
        n = len(self.queues)
        start = self.turn % n
        views = []
        for k in range(n):
            b = (start + k) % n
            queue = self.queues[b]
            queue.advance(now)
            overlap = self.index.overlap(b, ids) if self.reads_cache else 0
            load = self.scorer.load(queue.pending_blocks, queue.generating)
            views.append(BackendView(str(b), ("device",) * overlap, load))
        score = self.scorer.choose(self.routing, len(ids), views, 0)
        self.turn += 1
        return int(score.backend), score
