"""The capacity planner: how much cache a trace needs for a target token hit rate, in
which tiers, and what it saves per hour of traffic.

The answer comes from the hit-rate-versus-capacity curve of one configuration (policy,
isolation, block size) on the trace:

1. The ceiling: an unlimited cache's hit rate. A target above it cannot be reached by
   any capacity, and the plan says so (``reachable`` is false) instead of searching.
2. The capacity: a search over capacities for the smallest one whose hit rate reaches
   the target, assuming the hit rate grows with capacity. It keeps a bracket
   ``(below, above]``, where ``below`` was measured under the target and ``above`` at or
   over it, and narrows it geometrically, several probes a round (one pass over the
   trace replays them all), until ``above <= below * (1 + precision)`` or the two are
   one block apart. The answer is ``above``: the true smallest capacity lies in
   ``(above / (1 + precision), above]``.
3. The tiers, filled fastest first: tier ``k`` holds the capacity between the
   cumulative sizes of the tiers before it and its own, and serves, by recency, the
   hits a cache of the larger size has and one of the smaller has not:
   ``hit_rate(cum_k) - hit_rate(cum_(k-1))``. The shares add up to the hit rate of the
   tiers' total (the plan's capacity when they hold it).
4. The savings: the prefill FLOPs the cache saves at the plan's capacity (the cost
   model, on the counted requests), as GPU-hours and money per hour of trace time.
5. The codecs (``codec_sizing``, ``plan_tiers``), when a tier or ``codecs`` names one:
   the capacity in stored bytes of each, a codec tier's tokens per byte, the decode
   time its hits add to their transfer, and the savings net of loading the hits the
   tiers serve. Without a codec the plan and its outputs are what they always were.
6. Layer groups (``kv_groups``), for a model whose layers differ (sliding windows,
   recurrent state): bytes per token are its bytes per block at the plan's block size
   over the block's tokens, the bytes a cache that can hit at every block boundary
   stores; the plan also gives the full-KV equivalent and what one prompt of the
   trace's mean length needs resumed at its end alone. A uniform model's plan and its
   outputs are what they always were.

The curve comes from a ``CurveSource``. ``ExactCurve``, the default, replays the trace
at each capacity asked for (the compiled kernel where it models the configuration;
the capacities of one round split across one process per CPU, ``sim/forks.py``);
a faster source (stack distances, sampled miniature caches) can replace it in
``make_plan``'s ``curve`` argument. Whatever the source, the plan's own capacity and the
ceiling are always measured by exact replays, so the figures it reports are exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from types import MappingProxyType
from typing import Protocol

from prefixcache.config import CacheConfig, KVLayout
from prefixcache.kv_groups import AnyLayout
from prefixcache.sim.codec_sizing import (
    RAW,
    DecodeRate,
    Measure,
    check_codec,
    check_grouped_codecs,
    codecs,
    decode_rate,
    measure_decode_rate,
)
from prefixcache.sim.costmodel import CostModel
from prefixcache.sim.forks import fork_map, processes
from prefixcache.sim.held import hold
from prefixcache.sim.plan_inputs import Tier, check_tiers, decode_rates
from prefixcache.sim.plan_tiers import CodecSize, TierShare, codec_sizes, split
from prefixcache.sim.replay import replay
from prefixcache.sim.results import UNLIMITED, ReplayConfig, ReplayResult
from prefixcache.sim.summary import TraceSource, TraceSummary, summarize, warmup_requests

DEFAULT_PRECISION = 0.01
"""The search stops when the bracket's two ends are within this relative distance."""
DEFAULT_PRICE_PER_GPU_HOUR = 2.0
"""Dollars per GPU-hour when none is given: a planning assumption, stated in the output."""
FIRST_PROBES = 8  # the first round spreads over the whole range: the curve's shape
PROBES = 3  # later rounds: each narrows the bracket about four times (in log scale)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """The token hit rate of the counted requests at one capacity (``math.inf``: unlimited)."""

    capacity_tokens: float
    token_hit_rate: float


class CurveSource(Protocol):
    """Hit rates at given capacities of one configuration on one trace."""

    @property
    def label(self) -> str:
        """What computes the curve, for the output (e.g. ``exact replay (native)``)."""
        ...

    def hit_rates(self, capacities: Sequence[float]) -> list[CurvePoint]:
        """One point per capacity, in the same order."""
        ...


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """Everything the planner is asked besides the trace."""

    target: float
    cost: CostModel
    kv: AnyLayout  # a uniform model's KVLayout, or the GroupedLayout of one whose layers differ
    policy: str = CacheConfig().policy  # the library's default
    isolation: str = CacheConfig().isolation
    block_size: int = 16  # token traces; a pre-hashed trace uses its own
    warmup: float = 0.5
    precision: float = DEFAULT_PRECISION
    tiers: tuple[Tier, ...] = ()
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR
    codecs: tuple[str, ...] = ()  # also size the cache in these (besides the tiers' own)
    decode_rates: tuple[tuple[str, float], ...] = ()  # given decode rates (bytes/s) by codec; others measured

    def __post_init__(self) -> None:
        if not _number(self.target) or not 0 < self.target <= 1:
            raise ValueError(f"target hit rate must be in (0, 1], got {self.target!r}")
        if not _number(self.precision) or not 0 < self.precision < 1:
            raise ValueError(f"precision must be in (0, 1), got {self.precision!r}")
        if not _number(self.price_per_gpu_hour) or self.price_per_gpu_hour < 0:
            raise ValueError(f"price per GPU-hour must be >= 0, got {self.price_per_gpu_hour!r}")
        if not _number(self.warmup) or not 0 <= self.warmup < 1:
            raise ValueError(f"warm-up must be a fraction in [0, 1), got {self.warmup!r}")
        object.__setattr__(self, "tiers", check_tiers(self.tiers))
        object.__setattr__(self, "codecs", tuple(dict.fromkeys(check_codec(c, "--codec") for c in self.codecs)))
        object.__setattr__(self, "decode_rates", decode_rates(self.decode_rates))
        named = [*self.codecs, *(t.codec for t in self.tiers), *(name for name, _ in self.decode_rates)]
        check_grouped_codecs(self.kv, named, repr(self.cost.model.name))
        idle = sorted({name for name, _ in self.decode_rates} - set(self.sized_codecs))
        if idle:
            raise ValueError(f"decode rate given for {', '.join(idle)}, which no tier stores and --codec does not name")
        self.config(1)  # the cache configuration checks policy, isolation and block size

    @property
    def codec_aware(self) -> bool:
        """Whether the plan speaks of codecs: a tier stores one, or ``codecs`` names any.
        NOTE: otherwise every output is what it was before codecs existed, byte for byte."""
        return bool(self.codecs) or any(t.codec != RAW for t in self.tiers)

    @property
    def sized_codecs(self) -> tuple[str, ...]:
        """The codecs the plan sizes the cache in (raw first when any), in ``codec.CODECS`` order."""
        named = {RAW, *self.codecs, *(t.codec for t in self.tiers)} if self.codec_aware else set()
        return tuple(c for c in codecs() if c in named)

    def config(self, capacity: float) -> ReplayConfig:
        cap = UNLIMITED if math.isinf(capacity) else int(capacity)
        cache = CacheConfig(
            policy=self.policy, capacity_tokens=cap, block_size=self.block_size, isolation=self.isolation
        )
        return ReplayConfig(cache)


def _number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x)


class ExactCurve:
    """The default ``CurveSource``: exact replays, every capacity of one call in one pass
    over the trace in each of up to ``jobs`` processes (``make_plan``: one per CPU), each
    capacity replayed once (results are kept). The results do not depend on ``jobs``."""

    def __init__(
        self, source: TraceSource, inputs: PlanInputs, summary: TraceSummary, engine: str = "auto", jobs: int = 1
    ) -> None:
        self.source, self.inputs, self.summary, self.engine = source, inputs, summary, engine
        self.jobs = processes(jobs)
        self.results: dict[float, ReplayResult] = {}

    @property
    def label(self) -> str:
        engines = sorted({r.engine for r in self.results.values()}) or ["not run"]
        return f"exact replay ({', '.join(engines)})"

    def measure(self, capacities: Sequence[float]) -> list[ReplayResult]:
        todo = sorted({c for c in capacities if c not in self.results})
        parts = [todo[i :: self.jobs] for i in range(min(self.jobs, len(todo)))]  # NOTE: strided: even sizes
        for part, results in zip(parts, fork_map(self._replay, parts), strict=True):
            self.results.update(zip(part, results, strict=True))
        return [self.results[c] for c in capacities]

    def _replay(self, capacities: list[float]) -> list[ReplayResult]:
        return replay(
            self.source,
            [self.inputs.config(c) for c in capacities],
            warmup=self.inputs.warmup,
            optimal=False,
            cost=self.inputs.cost,
            summary=self.summary,
            engine=self.engine,
        )

    def hit_rates(self, capacities: Sequence[float]) -> list[CurvePoint]:
        return [CurvePoint(c, r.token_hit_rate) for c, r in zip(capacities, self.measure(capacities), strict=True)]


@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's answer. ``capacity_tokens`` is ``None`` when the target is above the
    ceiling; the savings are then those of an unlimited cache."""

    trace: str
    inputs: PlanInputs
    requests: int  # counted (after the warm-up)
    warmup_requests: int
    block_size: int  # the trace's own for a pre-hashed trace
    ceiling: float  # hit rate of an unlimited cache
    capacity_tokens: float | None
    hit_rate: float  # measured at the plan's capacity (or the ceiling)
    below: CurvePoint | None  # the largest capacity measured under the target
    bytes_per_token: float
    tiers: tuple[TierShare, ...]
    tiers_hold: float  # tokens the tiers hold together (math.inf without tiers)
    traffic_seconds: float  # trace time of the counted requests
    gpu_hours_saved: float  # over the counted requests
    prefill_seconds_per_hit_token: float | None  # GPU time a hit token saves, on average
    curve: tuple[CurvePoint, ...]  # every point measured, by capacity
    monotone: bool  # the measured hit rates never fell as capacity grew
    curve_source: str
    engine: str
    over_context: int  # counted prompts longer than the model's context (costed all the same)
    lookup_tokens: int = 0  # counted prompt tokens looked up (the tiers' hit rates are shares of them)
    decode: Mapping[str, DecodeRate] = field(default_factory=lambda: MappingProxyType({}))  # by codec: rates used
    sizes: tuple[CodecSize, ...] = ()  # the capacity in each codec's stored bytes (codec-aware plans)
    mean_prompt_tokens: float = 0.0  # of the counted prompts (what a grouped layout's prefix figure is at)

    @property
    def reachable(self) -> bool:
        return self.capacity_tokens is not None

    @property
    def kv_bytes(self) -> float | None:
        return None if self.capacity_tokens is None else self.capacity_tokens * self.bytes_per_token

    @property
    def gpu_hours_per_hour(self) -> float | None:
        """GPU-hours of prefill saved per hour of traffic (``None`` for a trace without a time span)."""
        return self.gpu_hours_saved / (self.traffic_seconds / 3600) if self.traffic_seconds > 0 else None

    @property
    def money_per_hour(self) -> float | None:
        per_hour = self.gpu_hours_per_hour
        return None if per_hour is None else per_hour * self.inputs.price_per_gpu_hour

    @property
    def tiers_suffice(self) -> bool:
        return self.capacity_tokens is None or self.tiers_hold >= self.capacity_tokens

    @property
    def load_hours(self) -> float:
        """Hours spent loading the hits the tiers serve (transfer + decode), over the counted requests."""
        return sum(s.hit_rate * self.lookup_tokens * s.load_seconds_per_token for s in self.tiers) / 3600

    @property
    def decode_hours(self) -> float:
        """The decode part of ``load_hours``."""
        return sum(s.hit_rate * self.lookup_tokens * s.decode_seconds_per_token for s in self.tiers) / 3600

    @property
    def net_gpu_hours_saved(self) -> float:
        """Prefill GPU-hours saved less the loads of the hits the tiers serve, were the GPU
        to wait for every one of them (the pessimistic end: a load that overlaps other
        work costs nothing)."""
        return self.gpu_hours_saved - self.load_hours

    @property
    def net_money_per_hour(self) -> float | None:
        if self.traffic_seconds <= 0:
            return None
        return self.net_gpu_hours_saved / (self.traffic_seconds / 3600) * self.inputs.price_per_gpu_hour


def _probes(below: float, above: float, n: int, granule: int) -> list[float]:
    """Up to ``n`` capacities strictly inside ``(below, above)``, geometrically spaced,
    multiples of ``granule``."""
    low = max(below, granule / 2)
    ratio = (above / low) ** (1 / (n + 1))
    out = {granule * round(low * ratio**i / granule) for i in range(1, n + 1)}
    return sorted(c for c in out if below < c < above)


def search(curve: CurveSource, target: float, upper: float, granule: int, precision: float) -> list[CurvePoint]:
    """Every point the search measured. With ``hit_rate(upper) >= target`` (the caller
    checked it) the smallest capacity measured at or over the target is the answer."""
    below, above = 0.0, upper
    points: list[CurvePoint] = []
    n = FIRST_PROBES
    while above > below * (1 + precision) and above - below > granule:
        probes = _probes(below, above, n, granule)
        if not probes:
            break
        for point in curve.hit_rates(probes):
            points.append(point)
            if point.token_hit_rate >= target:
                above = min(above, point.capacity_tokens)
        below = max([below] + [p.capacity_tokens for p in points if p.capacity_tokens < above])
        n = PROBES
    return points


@dataclass(frozen=True, slots=True)
class TraceFacts:
    """What the planner reads off the trace itself, in one pass."""

    upper_bound: float  # tokens of every prompt, in whole blocks: a cache this big never evicts
    traffic_seconds: float  # trace time from the first counted request to the last request
    over_context: int  # counted prompts longer than the model's context
    mean_prompt_tokens: float = 0.0  # of the counted prompts


def trace_facts(source: TraceSource, summary: TraceSummary, inputs: PlanInputs, skip: int) -> TraceFacts:
    size = summary.native_block_size or inputs.block_size
    context = inputs.cost.model.context_length
    upper, first, over, prompts, counted = 0, summary.last_timestamp, 0, 0, 0
    for i, req in enumerate(source()):
        upper += -(-req.input_length // size) * size
        if i == skip:
            first = req.timestamp
        over += i >= skip and req.input_length > context
        if i >= skip:
            prompts, counted = prompts + req.input_length, counted + 1
    mean = prompts / counted if counted else 0.0
    return TraceFacts(float(max(upper, size)), max(summary.last_timestamp - first, 0.0), over, mean)


def make_plan(
    source: TraceSource,
    inputs: PlanInputs,
    *,
    trace_name: str = "trace",
    curve: CurveSource | None = None,
    engine: str = "auto",
    jobs: int | None = None,
    hold_bytes: int | None = None,
    measure: Measure = measure_decode_rate,
) -> Plan:
    """Plan the cache for ``inputs.target`` on the trace ``source()`` streams.

    ``curve`` supplies the hit rates the search and the tier split read (default: exact
    replays); the ceiling and the plan's own capacity are replayed exactly, in up to
    ``jobs`` processes (default: one per CPU; the plan is the same for any number).
    The trace is read once and held in memory up to ``hold_bytes`` (``held.hold``: the
    default budget; 0 reads it from ``source`` on every pass; the same plan either way).
    ``measure`` times a codec's decode where ``inputs`` gives no rate for it."""
    workers = processes(jobs)
    source = hold(source, hold_bytes)
    summary = summarize(source)
    if summary.requests == 0:
        raise ValueError(f"{trace_name}: the trace has no requests")
    skip = warmup_requests(summary, inputs.warmup)
    if skip >= summary.requests:
        raise ValueError(f"{trace_name}: the warm-up leaves no request to count")
    exact = ExactCurve(source, inputs, summary, engine, workers)
    curve = exact if curve is None else curve
    granule = summary.native_block_size or inputs.block_size
    facts = trace_facts(source, summary, inputs, skip)
    upper = facts.upper_bound
    (top,) = exact.measure([math.inf])
    ceiling = top.token_hit_rate
    points = [CurvePoint(math.inf, ceiling)]
    capacity: float | None = None
    below: CurvePoint | None = None
    if ceiling >= inputs.target:
        points += search(curve, inputs.target, upper, granule, inputs.precision)
        capacity = min([upper] + [p.capacity_tokens for p in points if p.token_hit_rate >= inputs.target])
        misses = [p for p in points if p.capacity_tokens < capacity and p.token_hit_rate < inputs.target]
        below = max(misses, key=lambda p: p.capacity_tokens) if misses else None
    (at,) = exact.measure([math.inf if capacity is None else capacity])
    if capacity is not None:
        points.append(CurvePoint(capacity, at.token_hit_rate))
    kv, given = inputs.kv, dict(inputs.decode_rates)
    decode: Mapping[str, DecodeRate] = MappingProxyType({})
    sizes: tuple[CodecSize, ...] = ()
    if isinstance(kv, KVLayout):
        bpt: float = kv.bytes_per_token
        decode = MappingProxyType({c: decode_rate(c, kv, granule, given, measure) for c in inputs.sized_codecs})
        sizes = codec_sizes(inputs.sized_codecs, capacity, kv, granule)
    else:  # layer groups: raw only (PlanInputs refuses codecs for them)
        bpt = kv.stored_bytes_per_token(granule)
    saved_gpu_s = inputs.cost.gpu_seconds(at.prefill_flops_saved or 0.0)
    per_hit = saved_gpu_s / at.hit_tokens if at.hit_tokens else None
    shares, tiers_hold = split(curve.hit_rates, inputs.tiers, kv, granule, capacity, per_hit, points, decode)
    curve_points = _dedupe(points)
    rates = [p.token_hit_rate for p in curve_points]
    return Plan(
        trace=trace_name,
        inputs=inputs,
        requests=at.requests,
        warmup_requests=skip,
        block_size=granule,
        ceiling=ceiling,
        capacity_tokens=capacity,
        hit_rate=at.token_hit_rate,
        below=below,
        bytes_per_token=bpt,
        tiers=shares,
        tiers_hold=tiers_hold,
        traffic_seconds=facts.traffic_seconds,
        gpu_hours_saved=at.gpu_hours_saved or 0.0,
        prefill_seconds_per_hit_token=per_hit,
        curve=curve_points,
        monotone=all(a <= b for a, b in pairwise(rates)),
        curve_source=curve.label,
        engine=at.engine,
        over_context=facts.over_context,
        lookup_tokens=at.lookup_tokens,
        decode=decode,
        sizes=sizes,
        mean_prompt_tokens=facts.mean_prompt_tokens,
    )


def _dedupe(points: Sequence[CurvePoint]) -> tuple[CurvePoint, ...]:
    """One point per capacity (the last measured), by capacity."""
    by_capacity = {p.capacity_tokens: p for p in points}
    return tuple(by_capacity[c] for c in sorted(by_capacity))
