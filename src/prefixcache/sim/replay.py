"""Replay request traces through the cache and measure what each configuration saves.

Tree mode drives the real ``PrefixCache`` (the code that serves requests, on metadata),
or its compiled twin where that models the configuration (``engines``): per request it
matches, inserts the prompt (and, optionally, the output the next turn will send back),
and releases, with virtual time from the trace driving TTLs. Flat mode treats each
block id as an independent object in a bare eviction policy, which is how other
simulators (libCacheSim) see a trace, so the two can be compared. For every capacity
the offline optimum (``optimum``) says how far each policy is from the best possible
hit rate.

Pre-hashed traces (Mooncake, Bailian, or our JSONL with ``hash_ids``) are replayed at
their own block size: each block id becomes one pseudo-token of a cache whose block
size is 1 and whose capacity is counted in native blocks, so the tree, the policies
and tenant isolation (the tenant salts the ids) all apply unchanged.

This module owns the passes over the trace: which configurations share one, and how
each request reaches every configuration's run.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest

from prefixcache.ops.metrics import RequestRecord, ServingMetrics
from prefixcache.policies import EvictionPolicy, make_policy
from prefixcache.sim.accounting import RequestCounter
from prefixcache.sim.blocks import hit_tokens, request_blocks
from prefixcache.sim.costmodel import CostAccumulator, CostModel
from prefixcache.sim.engines import make_stepper
from prefixcache.sim.optimum import OptimumSweep
from prefixcache.sim.results import UNLIMITED, ReplayConfig, ReplayResult
from prefixcache.sim.summary import TraceSource, TraceSummary, effective_configs, summarize, warmup_requests
from prefixcache.sim.traces import Request


class ProgressBar(Protocol):
    def advance(self, n: int = 1) -> None: ...


ProgressFactory = Callable[[int, str], AbstractContextManager[ProgressBar]]


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for one replay.

    NOTE: a replay allocates hundreds of thousands of blocks that live until evicted or
    until the replay ends; every collection of the older generations walks all of them
    (a third of the replay's time on the Mooncake conversation trace). Evicted blocks
    are freed by reference counting; the cache itself, a cycle, is collected after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ---------------------------------------------------------------------------- tree mode


class _TreeRun:
    """One tree-mode configuration fed request by request: its stepper and its counters.

    ``registry``, when given, also gets the server's counters per counted request, by
    tenant x model x endpoint, so that a simulated configuration can be read like a live
    server (and fed to ``prefixcache diagnose``)."""

    def __init__(
        self,
        cfg: ReplayConfig,
        counter: RequestCounter,
        include_output: bool,
        engine: str,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.cfg, self.counter, self.registry = cfg, counter, registry
        self.stepper = make_stepper(cfg, counter.summary, include_output, engine, registry)
        counter.result.engine = self.stepper.engine
        self.serving = ServingMetrics(registry) if registry is not None else None
        self.hashed = counter.summary.native_block_size is not None
        # NOTE: the compiled kernel holds ~100 bytes a block; the PrefixCache's Python
        # objects several times that, and it is slow enough that reading the trace again
        # costs it little: it gets a pass of its own (see ``replay``).
        self.light = self.stepper.engine == "native"

    def feed(self, req: Request) -> None:
        counter, stepper = self.counter, self.stepper
        counted = counter.counts()
        evictions_before = stepper.evictions
        cached = stepper.step(req)
        if not counted:
            return
        if self.hashed:
            assert req.hash_ids is not None
            hit, blocks = hit_tokens(req, cached, self.cfg.block_size), len(req.hash_ids)  # cached: native blocks
        else:
            assert req.tokens is not None
            hit, blocks = cached, -(-len(req.tokens) // self.cfg.block_size)
        counter.add(req, hit, blocks, evictions_before)
        if self.serving is not None:
            n = req.input_length if self.hashed else len(req.tokens or ())
            hit = min(hit, n)
            tiers = {"pool": hit} if hit else {}
            self.serving.record_request(RequestRecord(req.tenant, req.model, req.endpoint or "replay", n, hit, tiers))

    def finish(self) -> None:
        self.counter.result.evictions = self.stepper.evictions
        self.counter.result.retention = self.stepper.retention()
        self.counter.finish(self.stepper.evictions)


# ---------------------------------------------------------------------------- flat mode


class _FlatRun:
    """Every block id an object of size 1 in a bare policy of ``capacity / block_size``
    objects; a request hits the contiguous prefix of its blocks that are resident."""

    light = True

    def __init__(self, cfg: ReplayConfig, counter: RequestCounter) -> None:
        self.cfg, self.counter = cfg, counter
        bs = cfg.block_size
        self.capacity = UNLIMITED if cfg.unlimited else cfg.cache.capacity // bs
        self.policy = make_policy(cfg.policy, max(self.capacity, 1))
        self.evictions = 0
        self.object_hits = 0

    def feed(self, req: Request) -> None:
        bs = self.cfg.block_size
        blocks = request_blocks(req, bs, self.cfg.isolation)
        counted = self.counter.counts()
        evictions_before = self.evictions
        hit_blocks, hits, self.evictions = _flat_access(self.policy, blocks, self.capacity, self.evictions)
        if counted:
            self.object_hits += hits
            self.counter.add(req, hit_tokens(req, hit_blocks, bs), len(blocks), evictions_before)

    def finish(self) -> None:
        result = self.counter.result
        result.evictions = self.evictions
        result.block_hits = self.object_hits
        self.counter.finish(self.evictions)


def _flat_access(policy: EvictionPolicy, blocks: list[object], capacity: int, evictions: int) -> tuple[int, int, int]:
    hit_blocks, prefix, hits = 0, True, 0
    for block in blocks:
        if block in policy:
            policy.access(block)
            hits += 1
            if prefix:
                hit_blocks += 1
            continue
        prefix = False
        if capacity == 0:
            continue
        if len(policy) >= capacity:
            policy.victim()
            evictions += 1
        policy.insert(block)
    return hit_blocks, hits, evictions


# ---------------------------------------------------------------------------- driver


def replay(
    source: TraceSource,
    configs: Iterable[ReplayConfig],
    *,
    trace_name: str = "trace",
    warmup: float = 0.0,
    include_output: bool = False,
    optimal: bool = True,
    cost: CostModel | None = None,
    progress: ProgressFactory | None = None,
    summary: TraceSummary | None = None,
    metrics: Callable[[ReplayConfig, bytes], None] | None = None,
    engine: str = "auto",
) -> list[ReplayResult]:
    """Replay the trace ``source()`` streams under every configuration; returns one result
    per (effective) configuration, in order.

    The configurations replayed by the compiled kernel and the flat ones share one pass
    over the trace (each request is read once and fed to all of them: reading a trace
    costs more than their replays); each one on the ``PrefixCache`` gets a pass of its
    own. The first pass also builds the optimum's block sequences (``OptimumSweep``;
    without the compiled optimum, its reference reads the trace once more per
    capacity). ``progress(total, label)`` may supply a context manager yielding a bar with
    ``advance(n)``, entered once per pass. ``metrics(config, text)`` receives each
    tree-mode replay's Prometheus exposition (which needs the ``PrefixCache``).
    ``engine`` picks tree mode's engine (``make_stepper``); each result names the one that
    ran, and its ``seconds`` are its own replay's of the counted requests, trace reading
    and warm-up excluded."""
    summary = summary if summary is not None else summarize(source)
    skip = warmup_requests(summary, warmup)
    runs: list[_TreeRun | _FlatRun] = []
    for cfg in effective_configs(configs, summary):  # NOTE: every configuration is checked before any replay
        counter = RequestCounter(
            ReplayResult(cfg, trace_name, warmup_requests=skip),
            summary,
            skip,
            CostAccumulator(cost) if cost is not None else None,
        )
        if cfg.mode == "flat":
            runs.append(_FlatRun(cfg, counter))
        elif cfg.mode == "tree":
            runs.append(_TreeRun(cfg, counter, include_output, engine, CollectorRegistry() if metrics else None))
        else:
            raise ValueError(f"unknown replay mode {cfg.mode!r}; valid: flat, tree")
    shared = [run for run in runs if run.light]
    passes = ([shared] if shared else []) + [[run] for run in runs if not run.light]
    keys = [_optimum_key(run.cfg, include_output, summary) if optimal else None for run in runs]
    sweep = OptimumSweep([key for key in keys if key is not None], skip)
    try:
        for i, group in enumerate(passes):
            label = group[0].cfg.label if len(group) == 1 else f"{len(group)} configurations"
            _one_pass(source, group, summary.requests, skip, label, progress, sweep.feed if i == 0 else None)
        optimum = sweep.solve(source)
    finally:
        sweep.close()
    results = []
    for run, key in zip(runs, keys, strict=True):
        cfg, result = run.cfg, run.counter.result
        if metrics is not None and isinstance(run, _TreeRun) and run.registry is not None:
            metrics(cfg, generate_latest(run.registry))
        if key is not None:
            result.optimal_hit_tokens = optimum[key].hit_tokens
        results.append(result)
    return results


def _optimum_key(cfg: ReplayConfig, include_output: bool, summary: TraceSummary) -> tuple[float, int, str] | None:
    """(capacity in tokens, block size, isolation) of the optimum that bounds ``cfg``, or
    ``None`` when none does.

    NOTE: Belady runs on the prompts' full blocks; a policy that also reuses partial
    blocks or inserted outputs is not bounded by it, so no optimum is claimed there.
    Publication can at best share what shared mode shares: its optimum is shared mode's."""
    if cfg.cache.partial_blocks or (include_output and summary.native_block_size is None):
        return None
    isolation = "shared" if cfg.isolation == "shared" or cfg.cache.publish is not None else "namespace"
    return (cfg.capacity_tokens, cfg.block_size, isolation)


def _one_pass(
    source: TraceSource,
    runs: list[_TreeRun | _FlatRun],
    total: int,
    skip: int,
    label: str,
    progress: ProgressFactory | None,
    also: Callable[[Request], None] | None = None,
) -> None:
    """Stream the trace once, feeding every request to each run in turn, and to ``also``
    (the optimum's block sequences); each run's ``seconds`` add up its own share of the
    time spent on the counted requests (after the first ``skip``), the ones its hit
    rates and ``blocks_looked_up`` cover."""
    clock = time.perf_counter
    spent = [0.0] * len(runs)
    feeds = [run.feed for run in runs]
    with _progress(progress, total, label) as bar, _no_cyclic_gc():
        for n, req in enumerate(source()):
            if n < skip:
                for feed in feeds:
                    feed(req)
            else:
                for i, feed in enumerate(feeds):
                    start = clock()
                    feed(req)
                    spent[i] += clock() - start
            if also is not None:
                also(req)
            bar.advance(1)
    for run, seconds in zip(runs, spent, strict=True):
        run.finish()
        run.counter.result.seconds = seconds


class _Silent:
    def advance(self, n: int = 1) -> None:
        return None


@contextmanager
def _progress(progress: ProgressFactory | None, total: int, label: str) -> Iterator[ProgressBar]:
    if progress is None:
        yield _Silent()
    else:
        with progress(total, label) as bar:
            yield bar
