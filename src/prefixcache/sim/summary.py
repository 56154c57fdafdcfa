"""What one streaming pass over a trace learns before any replay, and what it decides.

A replay cannot hold its trace in memory, yet it needs, before the first request, the
number of requests (to place the warm-up), the time span (for the timeline windows)
and whether the prompts come pre-hashed (which fixes every configuration's block size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.traces import Request

TraceSource = Callable[[], Iterable[Request]]


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """What one streaming pass learns before the replays: enough to place the warm-up
    and the timeline windows, and to check the block size of a pre-hashed trace."""

    requests: int
    first_timestamp: float
    last_timestamp: float
    native_block_size: int | None  # the block size of hash_ids, None for token traces
    tenants: int
    retained: int = 0  # requests whose line asks a retention (``--retention trace`` replays them)


def summarize(source: TraceSource) -> TraceSummary:
    n, first, last, native, tenants, hashed, retained = 0, 0.0, 0.0, None, set(), set(), 0
    for req in source():
        retained += req.retention is not None
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
    return TraceSummary(n, first, last, native, len(tenants), retained)


def effective_configs(configs: Iterable[ReplayConfig], summary: TraceSummary) -> list[ReplayConfig]:
    """The configurations as they will run: a pre-hashed trace fixes the block size (and
    has no tokens to match inside a block), so duplicates that differ only there merge."""
    out: list[ReplayConfig] = []
    for cfg in configs:
        if summary.native_block_size is not None:
            cache = replace(cfg.cache, block_size=summary.native_block_size, partial_blocks=False)
            cfg = replace(cfg, cache=cache)
        if cfg not in out:
            out.append(cfg)
    return out


def warmup_requests(summary: TraceSummary, warmup: float) -> int:
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warm-up must be a fraction in [0, 1), got {warmup}")
    return int(summary.requests * warmup)
