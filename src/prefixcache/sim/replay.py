"""Replay request traces through the cache and measure what each configuration saves.

Tree mode drives the real ``PrefixCache`` (the code that serves requests, on metadata):
per request it matches, inserts the prompt (and, optionally, the output the next turn
will send back), and releases, with virtual time from the trace driving TTLs. Flat
mode treats each block id as an independent object in a bare eviction policy, which
is how other simulators (libCacheSim) see a trace, so the two can be compared. For
every capacity the offline optimum -- Belady with bypass, on the same block sequence
-- says how far each policy is from the best possible hit rate.

Pre-hashed traces (Mooncake, Bailian, or our JSONL with ``hash_ids``) are replayed at
their own block size: each block id becomes one pseudo-token of a cache whose block
size is 1 and whose capacity is counted in native blocks, so the tree, the policies
and tenant isolation (the tenant salts the ids) all apply unchanged.

In every mode a request's hit is the contiguous prefix of its blocks found cached,
in tokens: ``min(hit_blocks * block_size, input_length)``.
"""

from __future__ import annotations

import gc
import heapq
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Protocol

import xxhash
from prometheus_client import CollectorRegistry, generate_latest

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, PromotionConfig
from prefixcache.hashing import CacheContext, token_bytes
from prefixcache.ops.metrics import CacheCollector, ServingMetrics
from prefixcache.policies import EvictionPolicy, make_policy
from prefixcache.sim.costmodel import CostAccumulator, CostModel
from prefixcache.sim.results import ReplayConfig, ReplayResult, TenantResult, TimePoint
from prefixcache.sim.traces import Request

TraceSource = Callable[[], Iterable[Request]]


class ProgressBar(Protocol):
    def advance(self, n: int = 1) -> None: ...


ProgressFactory = Callable[[int, str], AbstractContextManager[ProgressBar]]
TIMELINE_WINDOWS = 48
_UNLIMITED = sys.maxsize


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """What one streaming pass learns before the replays: enough to place the warm-up
    and the timeline windows, and to check the block size of a pre-hashed trace."""

    requests: int
    first_timestamp: float
    last_timestamp: float
    native_block_size: int | None  # the block size of hash_ids, None for token traces
    tenants: int


def summarize(source: TraceSource) -> TraceSummary:
    n, first, last, native, tenants, hashed = 0, 0.0, 0.0, None, set(), set()
    for req in source():
        if n == 0:
            first = req.timestamp
        last = req.timestamp
        n += 1
        tenants.add(req.tenant)
        hashed.add(req.hash_ids is not None)
        if len(hashed) > 1:
            raise ValueError(f"request {n}: the trace mixes hash_ids and token prompts; replay them separately")
        if req.hash_ids is not None:
            if native is not None and req.block_size != native:
                raise ValueError(f"request {n} has block size {req.block_size}, earlier ones {native}")
            native = req.block_size
    return TraceSummary(n, first, last, native, len(tenants))


def effective_configs(configs: Iterable[ReplayConfig], summary: TraceSummary) -> list[ReplayConfig]:
    """The configurations as they will run: a pre-hashed trace fixes the block size (and
    has no tokens to match inside a block), so duplicates that differ only there merge."""
    out: list[ReplayConfig] = []
    for cfg in configs:
        if summary.native_block_size is not None:
            cfg = replace(cfg, block_size=summary.native_block_size, partial_blocks=False)
        if cfg not in out:
            out.append(cfg)
    return out


# ---------------------------------------------------------------------------- blocks


def request_blocks(req: Request, block_size: int, isolation: str) -> list[object]:
    """The request's prefix block ids: the trace's own, or prefix hashes of its tokens
    (one per full block and one for a partial tail), salted by the model always (KV of
    one model is useless to another) and by the tenant unless shared."""
    if req.hash_ids is not None:
        ids: list[object] = list(req.hash_ids)
    else:
        assert req.tokens is not None
        ids = _token_block_ids(req.tokens, block_size)
    salt = req.model if isolation == "shared" else (req.model, req.tenant)
    return [(salt, i) for i in ids]


def _token_block_ids(tokens: tuple[int, ...], block_size: int) -> list[object]:
    data = token_bytes(tokens)
    hasher = xxhash.xxh3_128()
    ids: list[object] = []
    step = 4 * block_size
    for begin in range(0, len(data), step):
        hasher.update(data[begin : begin + step])
        ids.append(hasher.intdigest() ^ (min(step, len(data) - begin) << 120))
    return ids


def hit_tokens(req: Request, hit_blocks: int, block_size: int) -> int:
    return min(hit_blocks * block_size, req.input_length)


# ---------------------------------------------------------------------------- accounting


@dataclass
class _Counter:
    """Counts the requests after the warm-up, overall, per tenant and per time window."""

    result: ReplayResult
    summary: TraceSummary
    warmup: int
    cost: CostAccumulator | None
    seen: int = 0
    _window: TimePoint | None = field(default=None, init=False)
    _index: int = field(default=0, init=False)
    _start: float | None = field(default=None, init=False)
    _width: float = field(default=0.0, init=False)

    def counts(self) -> bool:
        """Advance to the next request; whether it is counted."""
        self.seen += 1
        return self.seen > self.warmup

    def add(self, req: Request, hit: int, blocks: int, evictions: int) -> None:
        res = self.result
        res.requests += 1
        res.lookup_tokens += req.input_length
        res.hit_tokens += hit
        res.hit_requests += hit > 0
        res.blocks_looked_up += blocks
        tenant = res.tenants.get(req.tenant)
        if tenant is None:
            tenant = res.tenants[req.tenant] = TenantResult()
        tenant.requests += 1
        tenant.lookup_tokens += req.input_length
        tenant.hit_tokens += hit
        tenant.hit_requests += hit > 0
        if self.cost is not None:
            self.cost.add(req.input_length, hit)
        self._timeline(req, hit, evictions)

    def _timeline(self, req: Request, hit: int, evictions: int) -> None:
        """Windows of equal trace time over the counted requests; each starts with the
        eviction count so far, turned into a delta by ``finish``."""
        if self._start is None:
            self._start = req.timestamp
            self._width = max(self.summary.last_timestamp - req.timestamp, 0.0) / TIMELINE_WINDOWS
        index = min(int((req.timestamp - self._start) / self._width), TIMELINE_WINDOWS - 1) if self._width else 0
        window = self._window
        if window is None or index != self._index:
            start = self._start + index * self._width
            window = self._window = TimePoint(start, start + self._width, 0, 0, 0, evictions)
            self._index = index
            self.result.timeline.append(window)
        window.requests += 1
        window.lookup_tokens += req.input_length
        window.hit_tokens += hit

    def finish(self, evictions: int) -> None:
        """Turn each window's eviction baseline into the evictions within it."""
        points = self.result.timeline
        for i, point in enumerate(points):
            end = points[i + 1].evictions if i + 1 < len(points) else evictions
            point.evictions = end - point.evictions
        if self.cost is not None:
            self.cost.apply(self.result)


# ---------------------------------------------------------------------------- tree mode


def _cache_config(cfg: ReplayConfig, summary: TraceSummary) -> CacheConfig:
    unlimited = math.isinf(cfg.capacity_tokens)
    capacity = _UNLIMITED if unlimited else int(cfg.capacity_tokens)
    promotion = None
    if cfg.promote_min_tenants and cfg.isolation != "shared":
        min_tokens = cfg.promote_min_tokens
        if summary.native_block_size is not None:  # counted in pseudo-tokens, one per native block
            min_tokens = max(1, -(-min_tokens // summary.native_block_size))
        promotion = PromotionConfig(min_tenants=cfg.promote_min_tenants, min_tokens=min_tokens)
    common = {
        "policy": cfg.policy,
        "isolation": cfg.isolation,
        "events_capacity": 0,
        "ttl_seconds": cfg.ttl_seconds,
        "promotion": promotion,
    }
    if summary.native_block_size is not None:
        # One pseudo-token per native block: capacity in native blocks.
        return CacheConfig(block_size=1, capacity_bytes=capacity, bytes_per_token=summary.native_block_size, **common)  # type: ignore[arg-type]
    return CacheConfig(block_size=cfg.block_size, capacity_tokens=capacity, partial_blocks=cfg.partial_blocks, **common)  # type: ignore[arg-type]


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


class Stepper(Protocol):
    """One tree-mode engine: replays one request at a time and keeps the eviction count.

    ``step`` returns the request's cached prefix in the cache's units: tokens for a token
    trace, native blocks for a pre-hashed one."""

    engine: str

    @property
    def evictions(self) -> int: ...

    def step(self, req: Request) -> int: ...


class CacheStepper:
    """The reference engine: the real ``PrefixCache``, as it serves requests.

    ``registry``, when given, gets the cache's metrics (``CacheCollector``)."""

    engine = "python"

    def __init__(
        self, cfg: ReplayConfig, summary: TraceSummary, include_output: bool, registry: CollectorRegistry | None = None
    ) -> None:
        self._now = 0.0
        self.cache = PrefixCache(_cache_config(cfg, summary), clock=lambda: self._now)
        if registry is not None:
            registry.register(CacheCollector(self.cache))
        self._stats = self.cache._stats  # NOTE: read the live counters; stats() builds a dict per call
        self._dense: dict[int, int] = {}
        self._output = include_output and summary.native_block_size is None
        self._contexts: dict[tuple[str, str], CacheContext] = {}

    @property
    def evictions(self) -> int:
        return self._stats.evictions

    def step(self, req: Request) -> int:
        self._now = req.timestamp
        ctx = self._contexts.get((req.tenant, req.model))
        if ctx is None:
            ctx = self._contexts[(req.tenant, req.model)] = CacheContext(tenant=req.tenant, model=req.model)
        cache, dense = self.cache, self._dense
        # NOTE: block ids become the cache's pseudo-tokens (uint32): map them to dense ints.
        prompt = [dense.setdefault(i, len(dense)) for i in req.hash_ids] if req.hash_ids is not None else req.tokens
        assert prompt is not None
        if self._output and req.output_tokens:
            with cache.match(prompt, ctx) as m:
                cache.insert([*prompt, *req.output_tokens], ctx)
                return m.cached_tokens
        return cache.access(prompt, ctx)[0]


_kernel: ModuleType | None
try:
    from prefixcache.sim import _kernel
except ImportError as exc:  # NOTE: an optional extension; without a compiler the reference engine runs
    _kernel = None
    _KERNEL_MISSING = f"the compiled replay kernel is not built ({exc})"
else:
    _KERNEL_MISSING = ""

ENGINES = ("auto", "native", "python")


def native_unsupported(cfg: ReplayConfig, metrics: bool = False) -> str:
    """Why the compiled kernel cannot replay ``cfg`` ("" when it can)."""
    if _KERNEL_MISSING:
        return _KERNEL_MISSING
    assert _kernel is not None
    reasons = []
    if cfg.policy not in _kernel.POLICIES:
        reasons.append(f"policy {cfg.policy!r} (it has {', '.join(_kernel.POLICIES)})")
    if cfg.partial_blocks:
        reasons.append("partial blocks")
    if cfg.promote_min_tenants and cfg.isolation != "shared":
        reasons.append("hot-prefix promotion")
    if metrics:
        reasons.append("server metrics (--metrics)")
    return "the compiled kernel does not model " + ", ".join(reasons) if reasons else ""


class KernelStepper:
    """The compiled engine (``_kernel.c``): the cache's metadata path -- block tree, pins,
    pools and quotas, policies, TTL -- for the configurations without promotion or
    partial blocks, step for step the same as ``CacheStepper`` (tests/test_sim_kernel.py).

    NOTE: blocks are keyed by (parent, block id), so the tree needs per-block ids, not
    chained keys: a pre-hashed trace's ids (as they are below 2^64, else a 64-bit digest
    of them), or a 64-bit digest of each block's tokens. The kernel verifies parent and
    id on every hit, as the cache verifies tokens; two different blocks under one
    parent with one 64-bit id would alias (odds about n^2 / 2^65 over a replay's n
    sibling pairs). Likewise S3-FIFO's ghost remembers 64-bit path keys where the
    cache's are 128-bit."""

    engine = "native"

    def __init__(self, cfg: ReplayConfig, summary: TraceSummary, include_output: bool) -> None:
        why = native_unsupported(cfg)
        if why:
            raise ValueError(why)
        assert _kernel is not None
        config = _cache_config(cfg, summary)  # the same validation and units as the cache
        partitioned = cfg.isolation == "partitioned"
        ttl = cfg.ttl_seconds if cfg.ttl_seconds is not None and math.isfinite(cfg.ttl_seconds) else None
        self._tree = _kernel.Tree(cfg.policy, config.capacity, config.block_size, partitioned, ttl)  # inf: never
        self._unit = config.block_size
        self._shared = cfg.isolation == "shared"
        self._output = include_output and summary.native_block_size is None
        self._roots: dict[tuple[str, str], int] = {}
        self._tenants: dict[str, int] = {}

    @property
    def evictions(self) -> int:
        return int(self._tree.evictions)

    def step(self, req: Request) -> int:
        tree = self._tree
        name = (req.model, "" if self._shared else req.tenant)
        root = self._roots.get(name)
        if root is None:
            root = self._roots[name] = tree.root(xxhash.xxh3_64_intdigest(repr(name).encode()))
        tenant = self._tenants.setdefault(req.tenant, len(self._tenants))
        now = req.timestamp
        if req.hash_ids is not None:
            return int(tree.access(root, tenant, req.hash_ids, -1, now))
        assert req.tokens is not None
        unit = self._unit
        if self._output and req.output_tokens:
            ids = _block_digests([*req.tokens, *req.output_tokens], unit)
            return int(tree.access(root, tenant, ids, len(req.tokens) // unit, now)) * unit
        return int(tree.access(root, tenant, _block_digests(req.tokens, unit), -1, now)) * unit


def _block_digests(tokens: Sequence[int], block_size: int) -> list[int]:
    """A 64-bit digest of each full block's tokens."""
    data = token_bytes(tokens)
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    return [digest(data[i : i + step]) for i in range(0, len(data) - step + 1, step)]


def make_stepper(
    cfg: ReplayConfig,
    summary: TraceSummary,
    include_output: bool,
    engine: str = "auto",
    registry: CollectorRegistry | None = None,
) -> Stepper:
    """The engine that replays ``cfg``: ``native`` (the compiled kernel; an error when it
    cannot model the configuration), ``python`` (the real ``PrefixCache``) or ``auto``
    (native where it can, else python)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown replay engine {engine!r}; valid: {', '.join(ENGINES)}")
    why = native_unsupported(cfg, registry is not None)
    if engine == "native" and why:
        raise ValueError(f"--engine native cannot replay {cfg.label}: {why}; use --engine python or auto")
    if engine == "python" or why:
        return CacheStepper(cfg, summary, include_output, registry)
    return KernelStepper(cfg, summary, include_output)


class _TreeRun:
    """One tree-mode configuration fed request by request: its stepper and its counters.

    ``registry``, when given, also gets the server's counters per counted request, by
    tenant x model x endpoint, so that a simulated configuration can be read like a live
    server (and fed to ``prefixcache diagnose``)."""

    def __init__(
        self,
        cfg: ReplayConfig,
        counter: _Counter,
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
            self.serving.record_request(
                req.tenant, req.model, req.endpoint or "replay", n, hit, {"pool": hit} if hit else {}, 0, 0, 0
            )

    def finish(self) -> None:
        self.counter.result.evictions = self.stepper.evictions
        self.counter.finish(self.stepper.evictions)


# ---------------------------------------------------------------------------- flat mode


class _FlatRun:
    """Every block id an object of size 1 in a bare policy of ``capacity / block_size``
    objects; a request hits the contiguous prefix of its blocks that are resident."""

    light = True

    def __init__(self, cfg: ReplayConfig, counter: _Counter) -> None:
        self.cfg, self.counter = cfg, counter
        bs = cfg.block_size
        self.capacity = _UNLIMITED if math.isinf(cfg.capacity_tokens) else int(cfg.capacity_tokens) // bs
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


# ---------------------------------------------------------------------------- the optimum


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


# ---------------------------------------------------------------------------- driver


def warmup_requests(summary: TraceSummary, warmup: float) -> int:
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warm-up must be a fraction in [0, 1), got {warmup}")
    return int(summary.requests * warmup)


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
    own. ``progress(total, label)`` may supply a context manager yielding a bar with
    ``advance(n)``, entered once per pass. ``metrics(config, text)`` receives each
    tree-mode replay's Prometheus exposition (which needs the ``PrefixCache``).
    ``engine`` picks tree mode's engine (``make_stepper``); each result names the one that
    ran, and its ``seconds`` are its own replay's, trace reading excluded."""
    summary = summary if summary is not None else summarize(source)
    skip = warmup_requests(summary, warmup)
    runs: list[_TreeRun | _FlatRun] = []
    for cfg in effective_configs(configs, summary):  # NOTE: every configuration is checked before any replay
        counter = _Counter(
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
    for group in passes:
        label = group[0].cfg.label if len(group) == 1 else f"{len(group)} configurations"
        _one_pass(source, group, summary.requests, label, progress)
    results = []
    optimum: dict[tuple[float, int, str], tuple[int, int]] = {}
    for run in runs:
        cfg, result = run.cfg, run.counter.result
        if metrics is not None and isinstance(run, _TreeRun) and run.registry is not None:
            metrics(cfg, generate_latest(run.registry))
        # NOTE: Belady runs on the prompts' full blocks; a policy that also reuses partial
        # blocks or inserted outputs is not bounded by it, so no optimum is claimed there.
        comparable = not cfg.partial_blocks and not (include_output and summary.native_block_size is None)
        if optimal and comparable:
            # NOTE: promotion can at best share what shared mode shares: its optimum is shared mode's.
            isolation = "shared" if cfg.isolation == "shared" or cfg.promote_min_tenants else "namespace"
            key = (cfg.capacity_tokens, cfg.block_size, isolation)
            if key not in optimum:
                optimum[key] = belady(source, cfg.capacity_tokens / cfg.block_size, cfg.block_size, isolation, skip)
            result.optimal_hit_tokens = optimum[key][0]
        results.append(result)
    return results


def _one_pass(
    source: TraceSource,
    runs: list[_TreeRun | _FlatRun],
    total: int,
    label: str,
    progress: ProgressFactory | None,
) -> None:
    """Stream the trace once, feeding every request to each run in turn; each run's
    ``seconds`` add up its own share of the time."""
    clock = time.perf_counter
    spent = [0.0] * len(runs)
    feeds = [run.feed for run in runs]
    with _progress(progress, total, label) as bar, _no_cyclic_gc():
        for req in source():
            for i, feed in enumerate(feeds):
                start = clock()
                feed(req)
                spent[i] += clock() - start
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
