"""The worker's half of the connector, free of vLLM: what a step loads and saves.

The scheduler's half (``scheduler.py``) turns vLLM's scheduler output into ``LoadSpec``
and ``SaveSpec`` records; this half carries them out against vLLM's paged KV
(``paged.py``) and the ``PrefixCache`` it owns:

- ``load``: match the request's prefix again (the scheduler's lookup pinned nothing),
  load its KV (every frame verified; a lost or corrupt block shortens it, invariant 6)
  and scatter it into the vLLM blocks the scheduler allocated. The blocks it could not
  fill are returned: vLLM recomputes them.
- ``save``: ``insert`` the request's computed full blocks; the cache reads from vLLM's
  blocks only the range it stores (into host memory, before vLLM may reuse them), and
  the writer copies it to slower tiers in the background.

``Tally`` counts what happened for vLLM's metrics (``metrics.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefixcache.cache.facade import PrefixCache
from prefixcache.cache.invalidations import Stamp
from prefixcache.config import CacheConfig
from prefixcache.hashing import CacheContext
from prefixcache.integrations.vllm.paged import PagedKV, PagedSource
from prefixcache.integrations.vllm.scope import Scope

__all__ = ["ConnectorWorker", "LoadSpec", "SaveSpec", "Tally", "VoidLoad"]

log = logging.getLogger("prefixcache.vllm")


@dataclass(frozen=True)
class LoadSpec:
    """Load ``tokens`` (block-aligned, the prefix to reuse) for ``req_id``: its blocks
    ``first_block ..`` go into vLLM blocks ``block_ids`` (the ones before are vLLM's own
    prefix-cache hits)."""

    req_id: str
    scope: Scope
    tokens: tuple[int, ...]
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class VoidLoad:
    """A load the scheduler promised vLLM but cannot plan (a hook failed between the
    promise and the plan): the worker reports it failed and vLLM recomputes. A sync load
    names the vLLM blocks it was to fill (reported as load errors); an async one fails
    as a whole (``failed_recving``: vLLM recomputes the request from its start)."""

    req_id: str
    block_ids: tuple[int, ...] = ()
    whole: bool = False


@dataclass(frozen=True)
class SaveSpec:
    """Store the first ``len(tokens)`` (block-aligned) tokens of ``req_id``, whose KV is
    in vLLM blocks ``block_ids`` (one per block of ``tokens``)."""

    req_id: str
    scope: Scope
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Loaded:
    """What one load did, for ``ConnectorWorker.commit`` to count."""

    spec: LoadSpec
    blocks: int  # leading blocks of ``spec.block_ids`` filled
    tier_tokens: dict[str, int]  # tokens placed, by the tier they came from
    seconds: float
    error: bool  # the load raised (counted; its blocks are recomputed)


def _first_tokens(tier_tokens: dict[str, int], used: int) -> dict[str, int]:
    """The tiers of the first ``used`` tokens of a load whose blocks came from these
    tiers, fastest first (a prefix sits in tiers at least as fast as what follows it)."""
    out: dict[str, int] = {}
    for tier, tokens in tier_tokens.items():
        take = min(tokens, used)
        if take:
            out[tier] = take
        used -= take
    return out


@dataclass
class Tally:
    """What the worker did since the last ``take``: plain data, since vLLM ships it from
    the worker process to the one that serves ``/metrics``."""

    hit_tokens: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, tier) -> tokens loaded
    lost_tokens: Counter[str] = field(default_factory=Counter)  # tenant -> tokens promised but not loaded
    saved_tokens: Counter[str] = field(default_factory=Counter)  # tenant -> tokens newly stored
    load_seconds: list[float] = field(default_factory=list)
    save_seconds: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)  # "load" / "save" -> calls that raised
    hook_failures: Counter[tuple[str, str]] = field(default_factory=Counter)  # (hook, exception) -> calls (wall.py)
    bypassed: Counter[str] = field(default_factory=Counter)  # reason -> requests served without the cache

    def to_dict(self) -> dict[str, Any]:
        return {
            "hit_tokens": [[t, tier, n] for (t, tier), n in self.hit_tokens.items()],
            "lost_tokens": dict(self.lost_tokens),
            "saved_tokens": dict(self.saved_tokens),
            "load_seconds": list(self.load_seconds),
            "save_seconds": list(self.save_seconds),
            "errors": dict(self.errors),
            "hook_failures": [[hook, kind, n] for (hook, kind), n in self.hook_failures.items()],
            "bypassed": dict(self.bypassed),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Tally:
        return cls(
            hit_tokens=Counter({(t, tier): n for t, tier, n in data.get("hit_tokens", ())}),
            lost_tokens=Counter(data.get("lost_tokens", {})),
            saved_tokens=Counter(data.get("saved_tokens", {})),
            load_seconds=list(data.get("load_seconds", ())),
            save_seconds=list(data.get("save_seconds", ())),
            errors=Counter(data.get("errors", {})),
            hook_failures=Counter({(hook, kind): n for hook, kind, n in data.get("hook_failures", ())}),
            bypassed=Counter(data.get("bypassed", {})),
        )

    def merge(self, other: Tally) -> Tally:
        return Tally(
            self.hit_tokens + other.hit_tokens,
            self.lost_tokens + other.lost_tokens,
            self.saved_tokens + other.saved_tokens,
            self.load_seconds + other.load_seconds,
            self.save_seconds + other.save_seconds,
            self.errors + other.errors,
            self.hook_failures + other.hook_failures,
            self.bypassed + other.bypassed,
        )

    def is_empty(self) -> bool:
        return not (
            self.hit_tokens
            or self.lost_tokens
            or self.saved_tokens
            or self.load_seconds
            or self.save_seconds
            or self.errors
            or self.hook_failures
            or self.bypassed
        )


class ConnectorWorker:
    """Owns the ``PrefixCache`` of one vLLM worker and the view of its paged KV."""

    def __init__(self, config: CacheConfig, paged: PagedKV, model: str) -> None:
        self.paged = paged
        self.model = model
        self.cache = PrefixCache(
            dataclasses.replace(config, block_size=paged.block_size, partial_blocks=False, kv_layout=paged.kv_layout)
        )
        self.tally = Tally()
        self._contexts: dict[tuple[str, str | None], CacheContext] = {}
        self._closed = False

    def context(self, scope: Scope) -> CacheContext:
        key = (scope.tenant, scope.adapter)
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = scope.context(self.model)
        return ctx

    def lookup(self, tokens: Sequence[int] | np.ndarray, scope: Scope) -> int:
        """How many leading tokens (whole blocks) the cache holds for this scope; asks
        without side effects (vLLM may ask again for a request that stays waiting)."""
        seen = self.cache.peek(tokens, self.context(scope), scope.segments(len(tokens)))
        return seen.num_blocks * self.paged.block_size

    def load(self, spec: LoadSpec) -> list[int]:
        """Fill the spec's vLLM blocks now; returns those it could not fill (for vLLM to recompute)."""
        return self.commit(self.fetch(spec))

    def fetch(self, spec: LoadSpec) -> Loaded:
        """Match, read and place the spec's blocks: the part of a load that may run on
        an I/O thread while vLLM's step goes on (it touches the cache, which has its own
        lock, and only the vLLM blocks allocated to this request; not the tally)."""
        n = self.paged.block_size
        start = time.perf_counter()
        done, tiers, error = 0, {}, False  # blocks of the spec placed in vLLM's memory
        try:
            segments = spec.scope.segments(len(spec.tokens))
            with self.cache.match(spec.tokens, self.context(spec.scope), segments) as m:
                if m.num_blocks > spec.first_block:
                    got = self.cache.load(m, first_block=spec.first_block)  # vLLM holds the blocks before
                    end = min(got.tokens // n, spec.first_block + len(spec.block_ids))
                    if end > spec.first_block:
                        kv = got.kv[:, :, :, : (end - spec.first_block) * n, :]
                        self.paged.scatter(kv, spec.block_ids[: end - spec.first_block])
                        done = end - spec.first_block  # only once placed: a failed copy is a miss
                        tiers = _first_tokens(got.tier_tokens, done * n)
        except Exception:  # a failed load is a miss for those blocks, never a failed request
            log.exception("prefixcache: load for request %s failed", spec.req_id)
            error = True
        return Loaded(spec, done, tiers, time.perf_counter() - start, error)

    def commit(self, loaded: Loaded) -> list[int]:
        """Count a finished load; returns the vLLM blocks it could not fill."""
        spec, n = loaded.spec, self.paged.block_size
        if loaded.error:
            self.tally.errors["load"] += 1
        for tier, tokens in loaded.tier_tokens.items():
            self.tally.hit_tokens[(spec.scope.tenant, tier)] += tokens
        self.tally.load_seconds.append(loaded.seconds)
        failed = list(spec.block_ids[loaded.blocks :])
        if failed:
            self.tally.lost_tokens[spec.scope.tenant] += len(failed) * n
        return failed

    def save(self, spec: SaveSpec, since: Stamp | None = None) -> int:
        """Store the spec's blocks; returns the tokens newly stored. ``since``: the stamp
        of the request (``PrefixCache.insert``): nothing a purge or bump after it covers."""
        start = time.perf_counter()
        stored = 0
        try:
            source = PagedSource(self.paged, spec.block_ids)
            segments = spec.scope.segments(len(spec.tokens))
            stored = self.cache.insert(spec.tokens, self.context(spec.scope), segments, kv=source, since=since)
        except Exception:  # a failed save costs a future hit, never the request
            log.exception("prefixcache: save for request %s failed", spec.req_id)
            self.tally.errors["save"] += 1
        self.tally.save_seconds.append(time.perf_counter() - start)
        if stored:
            self.tally.saved_tokens[spec.scope.tenant] += stored
        return stored

    def take_tally(self) -> Tally | None:
        tally, self.tally = self.tally, Tally()
        return None if tally.is_empty() else tally

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None) -> bool:
        """Flush what is queued for slower tiers (within ``timeout`` seconds) and close."""
        self._closed = True
        return self.cache.close(timeout)
