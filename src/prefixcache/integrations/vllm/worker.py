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
from prefixcache.hashing import CacheContext, Segment
from prefixcache.integrations.vllm.groups import NULL_BLOCK, Found, KVGroup, KVGroups, digests
from prefixcache.integrations.vllm.hybrid import GroupBlocks
from prefixcache.integrations.vllm.paged import GroupedKV, PagedKV, PagedSource
from prefixcache.integrations.vllm.scope import Scope

__all__ = ["ConnectorWorker", "LoadSpec", "SaveSpec", "Tally", "VoidLoad"]

log = logging.getLogger("prefixcache.vllm")


@dataclass(frozen=True)
class LoadSpec:
    """Load ``tokens`` (block-aligned, the prefix to reuse) for ``req_id``: its blocks
    ``first_block ..`` go into vLLM blocks ``block_ids`` (by KV cache group; the blocks
    before are vLLM's own prefix-cache hits, a sliding group's skipped ones its null block)."""

    req_id: str
    scope: Scope
    tokens: tuple[int, ...]
    first_block: int
    block_ids: tuple[tuple[int, ...], ...]


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
    in vLLM blocks ``block_ids`` (by KV cache group, one per block of ``tokens``).
    ``since_block``: the blocks before it were sent before; ``computed``: the tokens vLLM
    had computed before this step (a sliding group's blocks before that window may be
    freed and given to another request: never read); ``reached``: after it (a state group
    holds the state at a boundary only where a step ended)."""

    req_id: str
    scope: Scope
    tokens: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    since_block: int = 0
    computed: int = 0
    reached: int = 0


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
    misses: Counter[str] = field(default_factory=Counter)  # ``MissReason`` value -> requests that hit less

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
            "misses": dict(self.misses),
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
            misses=Counter(data.get("misses", {})),
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
            self.misses + other.misses,
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
            or self.misses
        )


class ConnectorWorker:
    """Owns the ``PrefixCache`` of one vLLM worker and the view of its paged KV, by KV
    cache group (``groups.py``): a one-group model's blocks are keyed as they always were;
    a hybrid's full groups are chains of their own, its sliding and state groups' blocks
    kept at boundaries (``hybrid.py``)."""

    def __init__(
        self, config: CacheConfig, paged: GroupedKV | PagedKV, model: str, groups: KVGroups | None = None
    ) -> None:
        if isinstance(paged, PagedKV):
            paged = GroupedKV([paged])
        self.paged = paged
        self.model = model
        self.groups = groups or KVGroups.uniform(paged.block_size)
        if len(self.groups.groups) != len(paged.groups):
            raise ValueError(f"{len(self.groups.groups)} KV cache groups described, {len(paged.groups)} registered")
        self.cache = PrefixCache(
            dataclasses.replace(config, block_size=paged.block_size, partial_blocks=False, kv_layout=paged.kv_layout)
        )
        self.partial = GroupBlocks(self.cache, self.groups, paged)
        self.tally = Tally()
        self._contexts: dict[tuple[str, str | None], CacheContext] = {}
        self._closed = False

    def context(self, scope: Scope) -> CacheContext:
        key = (scope.tenant, scope.adapter)
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = scope.context(self.model)
        return ctx

    def _digests(self, tokens: Sequence[int] | np.ndarray, scope: Scope) -> list[bytes]:
        return digests(tokens, self.paged.block_size, [(m.offset, f"{m.key}:{m.length}") for m in scope.media])

    def lookup(self, tokens: Sequence[int] | np.ndarray, scope: Scope) -> Found:
        """How many leading tokens (whole blocks) the cache can resume from for this scope,
        and why fewer than the chain it holds; asks without side effects (vLLM may ask
        again for a request that stays waiting)."""
        base, n = self.context(scope), self.paged.block_size
        segments = scope.segments(len(tokens))
        full = min(self.cache.peek(tokens, self.groups.context(base, g), segments).num_blocks for g in self.groups.full)
        if not self.groups.partial or not full:
            return Found(full * n)
        blocks, reason = self.partial.resumable(base, tokens, full, self._digests(tokens[: full * n], scope))
        return Found(blocks * n, reason)

    def load(self, spec: LoadSpec) -> list[int]:
        """Fill the spec's vLLM blocks now; returns those it could not fill (for vLLM to recompute)."""
        return self.commit(self.fetch(spec))

    def fetch(self, spec: LoadSpec) -> Loaded:
        """Match, read and place the spec's blocks: the part of a load that may run on
        an I/O thread while vLLM's step goes on (it touches the cache, which has its own
        lock, and only the vLLM blocks allocated to this request; not the tally). A
        hybrid's load is whole or nothing: vLLM takes no block-level errors from it."""
        n = self.paged.block_size
        start = time.perf_counter()
        done, error = 0, False  # blocks of the spec placed in vLLM's memory
        tiers: dict[str, int] = {}
        try:
            base = self.context(spec.scope)
            segments = spec.scope.segments(len(spec.tokens))
            want = len(spec.block_ids[0])
            for g in self.groups.full:
                placed, got_tiers = self._fetch_chain(spec, g, base, segments)
                done = placed if g is self.groups.full[0] else min(done, placed)
                tiers = tiers or got_tiers
            if self.groups.partial and (done < want or not self._fetch_partial(spec, base)):
                done, tiers = 0, {}
        except Exception:  # a failed load is a miss for those blocks, never a failed request
            log.exception("prefixcache: load for request %s failed", spec.req_id)
            done, tiers, error = 0, {}, True
        return Loaded(spec, done, _first_tokens(tiers, done * n), time.perf_counter() - start, error)

    def _fetch_partial(self, spec: LoadSpec, base: CacheContext) -> bool:
        digests = self._digests(spec.tokens, spec.scope)
        return self.partial.load(base, spec.tokens, spec.first_block, spec.block_ids, digests)

    def _fetch_chain(
        self, spec: LoadSpec, group: KVGroup, base: CacheContext, segments: list[Segment]
    ) -> tuple[int, dict[str, int]]:
        """Load a full group's chain into its blocks: the leading blocks placed, and the tiers
        they came from."""
        n, ids = self.paged.block_size, spec.block_ids[group.index]
        with self.cache.match(spec.tokens, self.groups.context(base, group), segments) as m:
            if m.num_blocks <= spec.first_block:
                return 0, {}
            got = self.cache.load(m, first_block=spec.first_block)  # vLLM holds the blocks before
            end = min(got.tokens // n, spec.first_block + len(ids))
            if end <= spec.first_block:
                return 0, {}
            kv = got.kv[:, :, :, : (end - spec.first_block) * n, :]
            self.paged[group.index].scatter(kv, ids[: end - spec.first_block])
            return end - spec.first_block, dict(got.tier_tokens)  # only once placed: a failed copy is a miss

    def commit(self, loaded: Loaded) -> list[int]:
        """Count a finished load; returns the vLLM blocks it could not fill (of every group)."""
        spec, n = loaded.spec, self.paged.block_size
        if loaded.error:
            self.tally.errors["load"] += 1
        for tier, tokens in loaded.tier_tokens.items():
            self.tally.hit_tokens[(spec.scope.tenant, tier)] += tokens
        self.tally.load_seconds.append(loaded.seconds)
        failed = [b for ids in spec.block_ids for b in ids[loaded.blocks :] if b != NULL_BLOCK]
        lost = len(spec.block_ids[0]) - loaded.blocks
        if lost > 0:
            self.tally.lost_tokens[spec.scope.tenant] += lost * n
        return failed

    def save(self, spec: SaveSpec, since: Stamp | None = None) -> int:
        """Store the spec's blocks; returns the tokens newly stored (of the first full
        group's chain). ``since``: the stamp of the request (``PrefixCache.insert``):
        nothing a purge or bump after it covers."""
        start = time.perf_counter()
        stored = 0
        try:
            base = self.context(spec.scope)
            segments = spec.scope.segments(len(spec.tokens))
            for g in self.groups.full:
                source = PagedSource(self.paged[g.index], spec.block_ids[g.index])
                ctx = self.groups.context(base, g)
                got = self.cache.insert(spec.tokens, ctx, segments, kv=source, since=since)
                stored = got if g is self.groups.full[0] else stored
                if spec.scope.retain_s:  # the gateway's, verified (``scope_of``); the tenant's cap bounds it
                    self.cache.retain(spec.tokens, ctx, spec.scope.retain_s, segments)
            if self.groups.partial:
                self.partial.save(
                    base,
                    spec.tokens,
                    spec.block_ids,
                    since_block=spec.since_block,
                    computed=spec.computed,
                    reached=spec.reached,
                    digests=self._digests(spec.tokens, spec.scope),
                    since=since,
                    retain_s=spec.scope.retain_s,
                )
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
