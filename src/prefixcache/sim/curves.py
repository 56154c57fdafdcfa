"""Hit rate versus capacity for one tree-mode configuration: a whole curve from one
pass (textbook LRU) or from miniature replays (every policy the kernel models).

Three methods, one result (``Curve``):

- ``sampled`` (the default): spatially sampled miniature caches (SHARDS, Waldspurger
  et al., FAST 2015; "Cache modeling and optimization using miniature simulations",
  ATC 2017). A request is kept when a hash of its sampling unit falls under the rate
  R; the kept requests are replayed on the compiled kernel, one miniature cache per
  capacity, all in one pass.
- ``stack``: Mattson's LRU stack distances in one pass (``_curves.c``), every capacity
  at once. Exact for an LRU that keeps parents more recent than their children; the
  cache's LRU is not quite that (below).
- ``replay``: a full replay per capacity (``replay.replay``), the reference.

Sampling a tree. A prefix chain must be kept or dropped whole, so the unit is not a
block but the request's first block that at most ``UNIT_SHARE`` of the requests pass
through (a first pass counts them in a sketch); a conversation's turns share it. NOTE:
not simply the first block: every request of the Mooncake conversation trace starts
with the same block. The blocks above the units (system prompts, tool lists, popular
documents: what many units share) cannot be sampled; a miniature would see them
referenced only R times as often. So every request, kept or not, touches its shared
head (and its unit) in every miniature, where a head block weighs R times a sampled
one (miniatures.py says how and why). The heads' hits are counted over all requests,
those below over the kept ones, scaled by what an unlimited cache hits there.

NOTE (LRU, stack versus cache): the cache touches a request's cached prefix before it
links the missing blocks, so the deepest cached block ends up older than its new
children, and LRU's victim search moves it to the tail ("blocked entries") when it
reaches the head while they remain. That refresh depends on the capacity, so the
cache's LRU is no stack algorithm and outlives the stack's: tests/sim/test_curves.py
shows a five-request example. ``stack`` is kept for textbook LRU and for speed. NOTE:
swapping the two steps makes the cache's LRU a stack algorithm, but that LRU, which
loses the refresh, falls below FIFO on both Mooncake traces (docs/simulator.md), so
the cache keeps its order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from prefixcache.sim.engines import native_unsupported
from prefixcache.sim.forks import processes
from prefixcache.sim.held import hold
from prefixcache.sim.miniatures import Chains, Out, Sample, sampled, tokens
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.summary import TraceSource, TraceSummary, effective_configs, summarize, warmup_requests

_curves: ModuleType | None
try:
    from prefixcache.sim.native import _curves
except ImportError as exc:  # NOTE: optional, like the replay kernel; ``replay`` still works
    _curves = None
    _CURVES_MISSING = f"the compiled curve engine is not built ({exc})"
else:
    _CURVES_MISSING = ""

METHODS = ("auto", "stack", "sampled", "replay")
DEFAULT_SAMPLE = 10_000_000
"""Block lookups the sampled method keeps when no rate is given: the rate is
``min(1, DEFAULT_SAMPLE / lookups)``. The sampling noise shrinks with the number of
units kept; the miniatures' own bias (SIEVE's most) with the rate (docs/simulator.md)."""
ERROR_BOUND = 0.01
"""The absolute error in token hit rate the tests hold the default curves of the traces
in the repository to (they keep fewer than ``DEFAULT_SAMPLE`` lookups: rate 1, exact).
Below rate 1 no bound is claimed (``Curve.error_bound`` is ``None``): the errors
measured on a generated workload are in docs/simulator.md ("Curves")."""
UNIT_SHARE = 0.001
"""A sampling unit is a block at most this share of the requests pass through."""
DEFAULT_POINTS = 20


@dataclass(frozen=True, slots=True)
class Curve:
    """Token hit rate at each capacity (tokens, ascending; ``math.inf`` is unlimited)
    of one configuration (policy, block size, isolation) on one trace, after its
    warm-up. ``sampling_rate`` is set for the sampled method, ``error_bound`` (the
    largest absolute error in hit rate) where one is known: 0 at rate 1."""

    policy: str
    block_size: int
    isolation: str
    capacities: tuple[float, ...]
    token_hit_rates: tuple[float, ...]
    method: str
    sampling_rate: float | None = None
    error_bound: float | None = None
    requests: int = 0
    lookup_tokens: int = 0
    seconds: float = 0.0

    def hit_rate_at(self, capacity: float) -> float:
        """The hit rate at ``capacity`` tokens, linear between the points (the last
        point's beyond them, 0 below the first's at capacity 0)."""
        caps, rates = (0.0, *self.capacities), (0.0, *self.token_hit_rates)
        for i in range(1, len(caps)):
            if capacity <= caps[i]:
                lo, hi = caps[i - 1], caps[i]
                if math.isinf(hi) or hi == lo:
                    return rates[i]
                return rates[i - 1] + (rates[i] - rates[i - 1]) * (capacity - lo) / (hi - lo)
        return rates[-1]

    def capacity_for(self, target: float) -> float | None:
        """The smallest capacity (tokens) at which the curve reaches ``target``, linear
        between the points around it; ``None`` when no point does.

        NOTE: hit-rate curves are mostly concave, so the chord lies below them and the
        answer errs towards more capacity."""
        caps, rates = (0.0, *self.capacities), (0.0, *self.token_hit_rates)
        for i in range(1, len(caps)):
            if rates[i] >= target:
                lo, hi = caps[i - 1], caps[i]
                if math.isinf(hi) or rates[i] == rates[i - 1] or target <= rates[i - 1]:
                    return hi if target > rates[i - 1] else lo
                return lo + (hi - lo) * (target - rates[i - 1]) / (rates[i] - rates[i - 1])
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "block_size": self.block_size,
            "isolation": self.isolation,
            "capacities": [None if math.isinf(c) else c for c in self.capacities],
            "token_hit_rates": list(self.token_hit_rates),
            "method": self.method,
            "sampling_rate": self.sampling_rate,
            "error_bound": self.error_bound,
            "requests": self.requests,
            "lookup_tokens": self.lookup_tokens,
            "seconds": self.seconds,
        }


def unsupported(config: ReplayConfig, method: str = "auto") -> str:
    """Why ``curve`` cannot draw ``config`` with ``method`` ("" when it can)."""
    if method not in METHODS:
        return f"unknown curve method {method!r}; valid: {', '.join(METHODS)}"
    cache, reasons = config.cache, []
    if config.mode != "tree":
        reasons.append(f"mode {config.mode!r} (curves are drawn in tree mode)")
    if config.isolation == "partitioned":
        reasons.append("partitioned isolation (per-tenant pools do not scale with a sample)")
    if method == "replay":
        return "curves do not model " + ", ".join(reasons) if reasons else ""
    if method == "stack":
        if config.policy != "lru":
            reasons.append(f"policy {config.policy!r} by stack distances (LRU only; use method 'sampled')")
        if cache.ttl_seconds is not None:
            reasons.append("a TTL by stack distances")
        missing = _CURVES_MISSING
    else:
        missing = _CURVES_MISSING or native_unsupported(config)
    if cache.partial_blocks or cache.publish is not None:
        reasons.append("partial blocks or publication (use method 'replay')")
    if missing:
        reasons.append(missing)
    return "curves do not model " + ", ".join(reasons) if reasons else ""


def curve(
    source: TraceSource,
    config: ReplayConfig,
    capacities: Sequence[float] | None = None,
    *,
    warmup: float = 0.0,
    method: str = "auto",
    rate: float | None = None,
    summary: TraceSummary | None = None,
    seed: int = 0,
    jobs: int | None = None,
    hold_bytes: int | None = None,
) -> Curve:
    """The token hit rate of ``config`` (its capacity ignored) at each of ``capacities``
    (tokens; ``math.inf`` for unlimited; ``None``: ``DEFAULT_POINTS`` spread up to the
    trace's distinct blocks) on the trace ``source()`` streams, with the replay's
    semantics: ``warmup`` (a fraction of the requests, replayed but not counted), the
    configuration's block size (a pre-hashed trace's own), its isolation.

    ``method`` ``auto`` is ``sampled`` (the cache's LRU too: ``stack`` is textbook LRU,
    further from it than its miniatures). ``rate`` is the sampled method's (default: enough to keep
    ``DEFAULT_SAMPLE`` lookups; 1 replays every request), ``seed`` salts its hash,
    ``jobs`` is how many processes share its trees (default: one per CPU this process
    may use; the curve is the same for any number). The trace is read once and held
    in memory up to ``hold_bytes`` (``held.hold``; 0: read on every pass).
    Prompts only: a replay's ``--include-output`` is not modelled."""
    why = unsupported(config, method)
    if why:
        raise ValueError(why)
    if rate is not None and not 0.0 < rate <= 1.0:
        raise ValueError(f"the sampling rate must be in (0, 1], got {rate}")
    if rate is not None and method not in ("auto", "sampled"):
        raise ValueError(f"a sampling rate applies to method 'sampled', not {method!r}")
    workers = processes(jobs)
    if jobs is not None and method not in ("auto", "sampled"):
        raise ValueError(f"jobs apply to method 'sampled', not {method!r}")
    caps = None if capacities is None else _check_capacities(capacities)
    start = time.perf_counter()
    source = hold(source, hold_bytes)
    prefixes = _curves.Prefixes() if method in ("auto", "sampled") and _curves is not None else None
    lookups = [0]
    summary = summarize(_tapped(source, config, prefixes, lookups)) if summary is None or prefixes else summary
    if summary.requests == 0:
        raise ValueError("no requests: the trace is empty or holds only blank lines")
    if method == "auto":
        method = "sampled"
    cfg = effective_configs([config], summary)[0]
    skip = warmup_requests(summary, warmup)
    if method == "stack":
        out = _stack(source, cfg, summary, skip, caps)
    elif method == "replay":
        out = _replayed(source, cfg, summary, warmup, caps or _spread(_distinct(source, cfg, summary), cfg.block_size))
    else:
        assert prefixes is not None
        rate = min(1.0, DEFAULT_SAMPLE / max(lookups[0], 1)) if rate is None else rate
        caps = caps or _spread(prefixes.blocks, cfg.block_size)
        most = max(1, int(summary.requests * UNIT_SHARE))
        sample = Sample(rate, seed, most, prefixes.blocks / max(summary.requests, 1))
        out = sampled(source, cfg, summary, skip, caps, prefixes, sample, workers)
    requests, lookup, caps, rates = out
    bound = 0.0 if rate == 1.0 else None
    return Curve(
        cfg.policy,
        cfg.block_size,
        cfg.isolation,
        tuple(caps),
        tuple(rates),
        method,
        rate if method == "sampled" else None,
        bound if method == "sampled" else None,
        requests,
        lookup,
        time.perf_counter() - start,
    )


def _check_capacities(capacities: Sequence[float]) -> list[float]:
    caps = [float(c) for c in capacities]
    if not caps or any(not c >= 0 for c in caps):
        raise ValueError(f"capacities must be a non-empty list of tokens >= 0 (inf: unlimited), got {capacities!r}")
    return sorted(set(caps))


def _spread(blocks: int, block_size: int, points: int = DEFAULT_POINTS) -> list[float]:
    """``points`` capacities, evenly spaced in log, from a thousandth of the trace's
    distinct blocks to all of them (where every policy reaches the ceiling)."""
    hi = max(blocks, 1)
    lo = max(1, hi // 1000)
    steps = [round(lo * (hi / lo) ** (i / max(points - 1, 1))) for i in range(points)]
    return [float(b * block_size) for b in sorted(set(steps))]


def _tapped(source: TraceSource, config: ReplayConfig, prefixes: Any, lookups: list[int]) -> TraceSource:
    """``source``, counting each request's chain in ``prefixes`` (and its block lookups
    in ``lookups[0]``) as it goes by."""
    if prefixes is None:
        return source

    def tapped() -> Any:
        chains: Chains | None = None
        for req in source():
            if chains is None:
                cfg = replace(config, cache=replace(config.cache, block_size=req.block_size or config.block_size))
                chains = Chains(cfg, req.hash_ids is not None)
            ids = chains.ids(req)
            prefixes.add(chains.root(req), ids)
            lookups[0] += len(ids)
            yield req

    return tapped


def _stack(source: TraceSource, cfg: ReplayConfig, summary: TraceSummary, skip: int, caps: list[float] | None) -> Out:
    assert _curves is not None
    stack = _curves.Stack()
    chains = Chains(cfg, summary.native_block_size is not None)
    bs, requests, lookup = cfg.block_size, 0, 0
    for i, req in enumerate(source()):
        counted = i >= skip
        length = req.input_length if chains.hashed else len(req.tokens or ())
        stack.access(chains.root(req), chains.ids(req), bs, length, counted)
        if counted:
            requests += 1
            lookup += req.input_length
    caps = caps or _spread(stack.blocks, bs)
    hits = stack.hits([None if math.isinf(c) else int(c) // bs for c in caps])
    return requests, lookup, caps, [h / lookup if lookup else 0.0 for h in hits]


def _distinct(source: TraceSource, cfg: ReplayConfig, summary: TraceSummary) -> int:
    if _curves is None:
        return 1 << 20
    prefixes = _curves.Prefixes()
    for _ in _tapped(source, cfg, prefixes, [0])():
        pass
    return int(prefixes.blocks)


def _replayed(source: TraceSource, cfg: ReplayConfig, summary: TraceSummary, warmup: float, caps: list[float]) -> Out:
    configs = [replace(cfg, cache=replace(cfg.cache, capacity_tokens=tokens(c))) for c in caps]
    results = replay(source, configs, warmup=warmup, optimal=False, summary=summary)
    first = results[0]
    return first.requests, first.lookup_tokens, caps, [r.token_hit_rate for r in results]
