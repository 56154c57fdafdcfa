"""Replay a trace through N backend caches with a router in front (``prefixcache replay
--backends N --routing ...``).

Per request, in trace order::

    router.choose(now, block ids)        load from BackendQueue, cache from EventIndex
      -> backend b's cache: access        the same engine as a single replay
      -> its KV events -> EventIndex      delivered event_lag requests later
      -> BackendQueue[b].submit           prefill of the uncached tokens, then decode

Each backend's cache is the configuration's own ``PrefixCache`` (or its compiled twin,
``engines``). The routers that read no cache (round-robin, least-loaded) run on the
engine a single replay would pick; those that do (prefix, cost) need the cache's KV
events, which only the ``PrefixCache`` emits, so their backends run it (each result
names its engine). With one backend every routing is the single replay, hit for hit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace

from prefixcache.cache import PrefixCache
from prefixcache.events import BlocksRemoved, BlocksStored
from prefixcache.fleet.scoring import Routing
from prefixcache.hashing import CacheContext
from prefixcache.sim.blocks import hit_tokens, request_blocks
from prefixcache.sim.costmodel import CostModel
from prefixcache.sim.engines import Stepper, engine_config, make_stepper
from prefixcache.sim.fleet_results import POOLED, BackendResult, FleetSpec, RoutingResult
from prefixcache.sim.replay import ProgressFactory, _no_cyclic_gc
from prefixcache.sim.results import UNLIMITED, ReplayConfig
from prefixcache.sim.routing import BackendQueue, EventIndex, IndexOp, Router
from prefixcache.sim.summary import TraceSource, TraceSummary, effective_configs, summarize, warmup_requests
from prefixcache.sim.traces import Request

__all__ = ["fleet_unsupported", "replay_fleet"]


def fleet_unsupported(cfg: ReplayConfig) -> str:
    """Why a fleet cannot replay ``cfg`` ("" when it can).

    NOTE: the router's index holds whole blocks that the events name. A partial tail,
    a published prefix (another pool's blocks) or a TTL (a block expires in the cache
    before any event says so) would make even the oracle's view differ from the cache."""
    reasons = []
    if cfg.mode != "tree":
        reasons.append("flat mode")
    if cfg.cache.partial_blocks:
        reasons.append("partial blocks")
    if cfg.cache.publish is not None:
        reasons.append("hot-prefix publication")
    if cfg.cache.ttl_seconds is not None:
        reasons.append("a TTL")
    return "a fleet replay does not model " + ", ".join(reasons) if reasons else ""


class _EventStepper:
    """The ``PrefixCache`` of one backend with its KV events on: each step also says
    which of the request's block ids were stored and which earlier ones removed."""

    engine = "python"

    def __init__(self, cfg: ReplayConfig, summary: TraceSummary) -> None:
        self._now = 0.0
        self.cache = PrefixCache(replace(engine_config(cfg, summary), events_capacity=1 << 20), clock=self._clock)
        self._unit = 1 if summary.native_block_size is not None else cfg.block_size
        self._dense: dict[int, int] = {}
        self._contexts: dict[tuple[str, str], CacheContext] = {}
        self._ids: dict[bytes, object] = {}  # cache key -> block id, for the blocks it holds

    def _clock(self) -> float:
        return self._now

    @property
    def evictions(self) -> int:
        return self.cache.stats().evictions

    def step(self, req: Request, ids: Sequence[object], ops: list[IndexOp]) -> int:
        self._now = req.timestamp
        ctx = self._contexts.get((req.tenant, req.model))
        if ctx is None:
            ctx = self._contexts[(req.tenant, req.model)] = CacheContext(tenant=req.tenant, model=req.model)
        dense = self._dense
        prompt = [dense.setdefault(i, len(dense)) for i in req.hash_ids] if req.hash_ids is not None else req.tokens
        assert prompt is not None
        cached = self.cache.access(prompt, ctx)[0]
        position = cached // self._unit  # NOTE: stored blocks continue the matched prefix, in order
        for event in self.cache.take_events():
            if isinstance(event, BlocksStored):
                stored = tuple(ids[position : position + len(event.keys)])
                position += len(stored)
                self._ids.update(zip(event.keys, stored, strict=True))
                ops.append((True, stored))
            elif isinstance(event, BlocksRemoved):
                ops.append((False, tuple(self._ids.pop(key) for key in event.keys)))
        return cached


class _Backend:
    """One backend: its cache engine and its queue."""

    def __init__(self, stepper: Stepper | _EventStepper) -> None:
        self.stepper = stepper
        self.queue = BackendQueue()
        self.requests = self.lookup_tokens = self.hit_tokens = 0
        self.prefill_seconds = 0.0

    def step(self, req: Request, ids: Sequence[object], ops: list[IndexOp]) -> int:
        if isinstance(self.stepper, _EventStepper):
            return self.stepper.step(req, ids, ops)
        return self.stepper.step(req)


def _ids_of(req: Request, cfg: ReplayConfig) -> list[object]:
    """The request's whole blocks as ids (salted as the cache salts them): the keys the
    router matches and the events carry. A token trace's partial tail has none."""
    ids = request_blocks(req, cfg.block_size, cfg.isolation)
    return ids if req.tokens is None else ids[: len(req.tokens) // cfg.block_size]


def replay_fleet(
    source: TraceSource,
    configs: Sequence[ReplayConfig],
    spec: FleetSpec,
    cost: CostModel,
    *,
    trace_name: str = "trace",
    warmup: float = 0.0,
    summary: TraceSummary | None = None,
    engine: str = "auto",
    progress: ProgressFactory | None = None,
) -> list[RoutingResult]:
    """Every configuration (each backend's cache) under every routing of ``spec``, then
    the oracle of each routing that reads the caches, then the pooled ceiling; one
    result per run, in that order. ``cost`` gives each request its prefill time (the
    uncached tokens) and the compute avoided."""
    summary = summary if summary is not None else summarize(source)
    skip = warmup_requests(summary, warmup)
    runs: list[tuple[ReplayConfig, int, Routing, str, int | None]] = []
    for cfg in effective_configs(configs, summary):
        why = fleet_unsupported(cfg)
        if why:
            raise ValueError(f"{cfg.label}: {why}")
        for routing in spec.routings:
            if routing not in (Routing.PREFIX, Routing.COST):
                runs.append((cfg, spec.backends, routing, "none", None))
                continue
            if engine == "native":
                raise ValueError(
                    f"--engine native cannot replay {routing.value} routing: it reads the caches' KV events, "
                    "which only the python engine emits; use --engine auto"
                )
            runs.append((cfg, spec.backends, routing, "events", spec.event_lag))
            if spec.oracle:
                runs.append((cfg, spec.backends, routing, "oracle", 0))
        if spec.pooled and spec.backends > 1:
            capacity = UNLIMITED if cfg.unlimited else cfg.cache.capacity * spec.backends
            pooled = replace(cfg, cache=replace(cfg.cache, capacity_tokens=capacity))
            runs.append((pooled, 1, Routing.ROUND_ROBIN, POOLED, None))
    for cfg, _, _, view, _ in runs:  # NOTE: every engine is built, and refused, before any replay
        if view in ("none", POOLED):
            make_stepper(cfg, summary, False, engine)
    return [
        _run(source, cfg, n, routing, view, lag, spec, cost, summary, skip, engine, trace_name, progress)
        for cfg, n, routing, view, lag in runs
    ]


def _run(
    source: TraceSource,
    cfg: ReplayConfig,
    n: int,
    routing: Routing,
    view: str,
    lag: int | None,
    spec: FleetSpec,
    cost: CostModel,
    summary: TraceSummary,
    skip: int,
    engine: str,
    trace_name: str,
    progress: ProgressFactory | None,
) -> RoutingResult:
    events = view in ("events", "oracle")
    backends = [
        _Backend(_EventStepper(cfg, summary) if events else make_stepper(cfg, summary, False, engine)) for _ in range(n)
    ]
    index = EventIndex(n, lag or 0)
    router = Router(routing, spec.scorer, [b.queue for b in backends], index)
    unit = 1 if summary.native_block_size is not None else cfg.block_size
    flops_total = flops_saved = 0.0
    ttfts: list[float] = []
    stale = 0
    label = f"{n} x {cfg.label}: {routing.value} ({view})" if view != POOLED else f"pooled {cfg.label}"
    bar_context = progress(summary.requests, label) if progress is not None else nullcontext(_Silent())
    start = time.perf_counter()
    with bar_context as bar, _no_cyclic_gc():
        for seen, req in enumerate(source()):
            ids = _ids_of(req, cfg)
            chosen, score = router.choose(req.timestamp, ids)
            backend = backends[chosen]
            ops: list[IndexOp] = []
            cached = backend.step(req, ids, ops)
            index.publish(chosen, ops)
            index.next_request()
            hit_blocks = cached // unit
            hit = hit_tokens(req, cached, cfg.block_size) if unit == 1 else cached
            total, saved = cost.request(req.input_length, hit, strict=False)
            prefill_s = cost.gpu_seconds(total - saved)
            ttft = backend.queue.submit(
                req.timestamp, prefill_s, req.output_length * spec.decode_seconds, len(ids) - hit_blocks
            )
            bar.advance(1)
            if seen < skip:
                continue
            backend.requests += 1
            backend.lookup_tokens += req.input_length
            backend.hit_tokens += hit
            backend.prefill_seconds += prefill_s
            flops_total += total
            flops_saved += saved
            ttfts.append(ttft)
            stale += events and score.overlap != hit_blocks
    seconds = time.perf_counter() - start
    results = tuple(
        BackendResult(str(i), b.requests, b.lookup_tokens, b.hit_tokens, b.prefill_seconds, b.stepper.evictions)
        for i, b in enumerate(backends)
    )
    mean, p99 = _ttft_stats(ttfts)
    return RoutingResult(
        routing=routing.value if view != POOLED else POOLED,
        view=view,
        event_lag=lag if view == "events" else None,
        config=cfg,
        trace=trace_name,
        engine=backends[0].stepper.engine,
        warmup_requests=skip,
        backends=results,
        prefill_flops_total=flops_total,
        prefill_flops_saved=flops_saved,
        cost_profile=cost.label,
        ttft_mean=mean if view != POOLED else None,
        ttft_p99=p99 if view != POOLED else None,
        stale_routes=stale if events else None,
        seconds=seconds,
    )


def _ttft_stats(ttfts: list[float]) -> tuple[float | None, float | None]:
    if not ttfts:
        return None, None
    ordered = sorted(ttfts)
    return sum(ordered) / len(ordered), ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class _Silent:
    def advance(self, n: int = 1) -> None:
        return None
