"""Who a request's session is, and how long ``--retention`` retains its prompt.

``auto:P`` is what a client that knows its own loop would ask: a session keeps its
prompt for the P-th percentile of its own gaps between turns so far, so that its next
turn finds it (``auto:P:N``: from its N-th turn on, its turns counted as its gaps are).
That needs sessions:

- a trace that names them (our JSONL's ``session``, Bailian's ``chat_id``): the
  (tenant, session) pair;
- a trace that does not (Mooncake's conversation trace): conversations derived from the
  prefix chain (``PrefixChains``): a request that starts with all of an earlier
  request's full blocks is that request's next turn.

Either way the retention is charged to the request's tenant, as a server charges it (the
tenant is who authenticated; a session is not a tenant): a trace without tenants is one
tenant, whose cap (its own oldest retention ends first) then arbitrates among its
conversations. NOTE: making each conversation a tenant would split the default share
among thousands of "tenants", each cut to a sliver of its prompt, which is no
deployment's behaviour.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Sequence

from prefixcache.sim.blocks import block_ids
from prefixcache.sim.retention import DEFAULT_FIRST_S, RetentionMode, RetentionSpec
from prefixcache.sim.traces import Request

__all__ = ["PrefixChains", "RetentionPlan", "SessionGaps", "nearest_rank"]


def nearest_rank(ordered: Sequence[float], percentile: float) -> float:
    """The P-th percentile of ``ordered`` (ascending, non-empty) by nearest rank: the
    smallest value at least P % of the values are at most."""
    rank = max(1, math.ceil(percentile / 100 * len(ordered) - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


class SessionGaps:
    """Each session's gaps between consecutive requests so far (in arrival order)."""

    __slots__ = ("_gaps", "_last")

    def __init__(self) -> None:
        self._last: dict[Hashable, float] = {}
        self._gaps: dict[Hashable, list[float]] = {}

    def arrive(self, session: Hashable, timestamp: float) -> Sequence[float]:
        """Record a request of ``session`` at ``timestamp``; its gaps so far, ascending
        (the one this request ends included)."""
        gaps = self._gaps.setdefault(session, [])
        last = self._last.get(session)
        if last is not None:
            bisect.insort(gaps, timestamp - last)
        self._last[session] = timestamp
        return gaps


class PrefixChains:
    """Conversations of a trace without session ids, from its prefix chains.

    A request continues the most recent earlier request all of whose full blocks it
    starts with (an earlier turn's partial last block is never in the next turn: the
    next turn fills it with other tokens), deepest match first. A match no deeper than
    the prefix every request of the trace has shared so far (a system prompt) starts a
    new conversation: else every conversation would chain to the first request that
    was only the system prompt.

    NOTE: one dict entry per request (its last full block) and the first request's ids;
    a request costs a lookup per full block at most."""

    __slots__ = ("_block_size", "_common", "_first", "_next", "_tips")

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._tips: dict[tuple[str, str, int], int] = {}  # (tenant, model, last full block id) -> conversation
        self._first: Sequence[int] | None = None
        self._common = 0
        self._next = 0

    def conversation(self, req: Request) -> int:
        ids = block_ids(req, self._block_size)
        full = min(len(ids), req.input_length // self._block_size)
        if self._first is None:
            self._first, self._common = ids[:full], full
        else:
            common, first = min(self._common, full), self._first
            while common and ids[common - 1] != first[common - 1]:
                common -= 1
            self._common = common
        tips, tenant, model = self._tips, req.tenant, req.model
        found = None
        for k in range(full, self._common, -1):
            found = tips.get((tenant, model, ids[k - 1]))
            if found is not None:
                break
        if found is None:
            found, self._next = self._next, self._next + 1
        if full:
            tips[(tenant, model, ids[full - 1])] = found
        return found


class RetentionPlan:
    """How long one replay retains each request's prompt (``None``: not at all).

    Fed every request in trace order, the warm-up's too (a session's gaps start with its
    first turn, counted or not)."""

    __slots__ = ("_chains", "_gaps", "spec")

    def __init__(self, spec: RetentionSpec, block_size: int) -> None:
        self.spec = spec
        self._gaps = SessionGaps()
        self._chains = PrefixChains(block_size)

    def session(self, req: Request) -> Hashable:
        if req.session is not None:
            return (req.tenant, req.session)
        return self._chains.conversation(req)

    def seconds(self, req: Request) -> float | None:
        spec = self.spec
        if spec.mode is RetentionMode.TRACE:
            return req.retention
        if spec.mode is RetentionMode.OFF:
            return None
        assert spec.percentile is not None
        gaps = self._gaps.arrive(self.session(req), req.timestamp)
        if len(gaps) + 1 < spec.from_turn:
            return None  # NOTE: a turn before the N-th asks nothing, so its gap still counts later
        seconds = nearest_rank(gaps, spec.percentile) if gaps else DEFAULT_FIRST_S
        return seconds or None  # NOTE: a 0 s gap (a tie in time) asks nothing
