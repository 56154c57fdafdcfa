"""What the server's blend mode is configured with, and what it tells about a request.

``BlendConfig`` is the ``[blend]`` section once validated (``server/settings.py`` builds
it); ``BlendUsage`` is one request's account, carried to the HTTP layer by a
``BlendedDone`` (a ``DoneEvent`` with the account attached), so that ``usage`` and the
metrics say how many prompt tokens a blend reused and recomputed, apart from the exact
prefix-cache hits of ``cached_tokens``. ``split_tiers`` divides the tiers of
``[cache]`` between the block cache and the chunk store, so that the mode never raises
what the tiers may take.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

from prefixcache.blend.gate import GREEDY_STEPS, GateThresholds
from prefixcache.blend.plan import RecomputePlan
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.engine.requests import DoneEvent
from prefixcache.hashing import get_hash
from prefixcache.storage import codec
from prefixcache.storage.memory import MemoryStore

__all__ = ["BlendConfig", "BlendUsage", "BlendedDone", "Outcome", "TierSplit", "split_tiers"]


@dataclass(frozen=True, slots=True)
class BlendConfig:
    """The blend mode of one server: who may use it, with which plan, under which gate."""

    tenants: frozenset[str]  # opted in; every other tenant gets exact prefix caching only
    plan: RecomputePlan
    thresholds: GateThresholds
    gate_file: Path  # GateStore: the gate's figures, per model, evaluation set and plan
    eval_set: Path  # the evaluation set the figures must have been measured on
    gate_steps: int = GREEDY_STEPS  # greedy continuation length the figures were measured with
    gate_on_start: bool = False  # measure missing figures when the server starts (slow)
    min_chunk_tokens: int = 24  # a shorter line of the prompt is prefilled, never a chunk
    max_chunk_tokens: int = 512  # a longer line too (the chunk store's slot size)
    fallback: bool = True  # embedding fallback (all-MiniLM-L6-v2) when exact chunk hashes miss
    min_similarity: float = 0.8  # cosine similarity of a fallback candidate
    min_span_tokens: int = 16  # token alignment: the shortest reused run of a candidate
    chunk_share: float = 0.25  # of each tier's capacity, for the chunk store (the block cache keeps the rest)

    def __post_init__(self) -> None:
        if not 0.0 < self.chunk_share < 1.0:
            raise ValueError(f"chunk_share must be above 0 and below 1, got {self.chunk_share}")
        if not 1 <= self.min_chunk_tokens <= self.max_chunk_tokens:
            raise ValueError(
                f"need 1 <= min_chunk_tokens <= max_chunk_tokens, got {self.min_chunk_tokens}, {self.max_chunk_tokens}"
            )
        if self.min_span_tokens < 1:
            raise ValueError(f"min_span_tokens must be >= 1, got {self.min_span_tokens}")

    def serves(self, tenant: str) -> bool:
        return tenant in self.tenants


@dataclass(frozen=True, slots=True)
class TierSplit:
    """The tiers of ``[cache]`` divided: tier by tier, ``cache``'s capacity plus
    ``chunks``' is the configured one (``chunks`` is None when the mode is off)."""

    cache: CacheConfig  # the block cache's
    chunks: CacheConfig | None  # the chunk store's: same kinds, paths and policies, ``chunk_share`` of the bytes


def split_tiers(config: CacheConfig, blend: BlendConfig | None) -> TierSplit:
    """``config`` whole when ``blend`` is None; else each tier's ``capacity_bytes`` split,
    ``chunk_share`` of it (rounded down) to the chunk store and the rest to the block
    cache. A side too small for one frame of a tier (a chunk of ``max_chunk_tokens``, a
    block of ``block_size`` tokens) is an error that names the tier and the setting."""
    if blend is None:
        return TierSplit(config, None)
    layout = config.kv_layout
    if layout is None:
        raise ValueError("splitting the tiers needs the cache's kv_layout")
    key_len = len(get_hash(config.hash)().digest())
    chunk_frame = _slot(layout, blend.max_chunk_tokens, key_len)
    block_frame = _slot(layout, config.block_size, key_len)
    cache_tiers: list[TierConfig] = []
    chunk_tiers: list[TierConfig] = []
    for tier in config.tiers:
        chunk_bytes = int(tier.capacity_bytes * blend.chunk_share)
        cache_bytes = tier.capacity_bytes - chunk_bytes
        where = f"blend.chunk_share = {blend.chunk_share} of tier {tier.label!r} ({tier.capacity_bytes} bytes)"
        if chunk_bytes < chunk_frame:
            raise ValueError(
                f"{where} gives the chunk store {chunk_bytes} bytes, less than one chunk of blend.max_chunk_tokens = "
                f"{blend.max_chunk_tokens} ({chunk_frame} bytes): raise the tier's capacity_bytes or "
                "blend.chunk_share, or lower blend.max_chunk_tokens"
            )
        if cache_bytes < block_frame:
            raise ValueError(
                f"{where} leaves the block cache {cache_bytes} bytes, less than one block of {config.block_size} "
                f"tokens ({block_frame} bytes): raise the tier's capacity_bytes or lower blend.chunk_share"
            )
        cache_tiers.append(dataclasses.replace(tier, capacity_bytes=cache_bytes))
        chunk_tiers.append(dataclasses.replace(tier, capacity_bytes=chunk_bytes))
    try:
        cache = dataclasses.replace(config, tiers=tuple(cache_tiers))
    except ValueError as exc:  # e.g. partitioned quotas above the capacity the smaller tiers now derive
        raise ValueError(f"blend.chunk_share = {blend.chunk_share} leaves the block cache too small: {exc}") from None
    derived = config.capacity_tokens is None and config.capacity_bytes is None
    # NOTE: the chunk store's partitioned pools take the fractions of its tiers that the
    # quotas are of the block cache's capacity, so the capacity is the block cache's.
    capacity = cache.capacity_units if derived else cache.capacity_tokens
    chunks = dataclasses.replace(cache, tiers=tuple(chunk_tiers), capacity_tokens=capacity)
    return TierSplit(cache, chunks)


def _slot(layout: KVLayout, tokens: int, key_len: int) -> int:
    """What one frame of ``tokens`` tokens takes in a tier (a memory tier's slot)."""
    return MemoryStore.slot_for(codec.encoded_size(layout.shape(tokens), layout.dtype, key_len))


class Outcome(enum.Enum):
    """What the blend mode did for a request of an opted-in tenant."""

    BLENDED = "blended"  # some prompt tokens came from cached chunks
    NO_REUSE = "no_reuse"  # no chunk of the prompt was found: exact prefix caching only
    GATE_OFF = "gate_off"  # the model has not passed its gate: exact prefix caching only


@dataclass(frozen=True, slots=True)
class BlendUsage:
    """One request's blend account, apart from the exact prefix cache.

    ``reused`` prompt tokens kept the cached chunk KV (re-rotated to their position);
    ``recomputed`` had chunk KV but the plan ran them through the model again. Neither
    is ever in ``cached_tokens``, which counts exact prefix-cache hits only.
    ``lookups_*`` count the prompt's candidate chunks by how they were found."""

    outcome: Outcome
    reused: int = 0
    recomputed: int = 0
    lookups_exact: int = 0  # found by content hash
    lookups_similar: int = 0  # found by the embedding fallback, then token alignment
    lookups_missed: int = 0

    def __post_init__(self) -> None:
        if min(self.reused, self.recomputed, self.lookups_exact, self.lookups_similar, self.lookups_missed) < 0:
            raise ValueError(f"blend usage counts are >= 0, got {self}")

    @property
    def blended(self) -> int:
        return self.reused + self.recomputed


NO_BLEND = BlendUsage(Outcome.NO_REUSE)


@dataclass(frozen=True, slots=True)
class BlendedDone(DoneEvent):
    """The end of a request of an opted-in tenant, with its blend account."""

    blend: BlendUsage = NO_BLEND
