"""The records of the chunk store: what its ledger keeps per chunk and per tier
(``chunk_ledger``), and what its callers get back (``chunks``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from prefixcache.policies import EvictionPolicy, make_policy

__all__ = ["ORPHAN", "Chunk", "ChunkKV", "ChunkStats", "Drop", "Pinned", "Pool", "Read", "TierBook"]

ORPHAN = "\x00orphan"  # the pool of frames a disk held at open, owner unknown until a get adopts them


@dataclass(frozen=True, slots=True)
class ChunkKV:
    """A chunk's KV, ``[layers, 2, kv_heads, tokens, head_dim]``, positions from 0."""

    key: bytes
    tokens: int
    kv: np.ndarray
    public: bool
    tier: str


@dataclass(frozen=True, slots=True)
class Pinned:
    """Chunks held in place for a blended prefill: ``keys[i]`` is ``None`` where chunk i
    was not stored when pinned."""

    keys: tuple[bytes | None, ...]


@dataclass(frozen=True, slots=True)
class ChunkStats:
    """Counters since open. ``removed`` counts chunks that left the store, by
    ``RemovalReason.label``; ``tier_evictions`` frames a full tier's policy pushed out."""

    chunks: int
    bytes: int
    pinned: int
    hits: int
    misses: int
    collisions: int
    errors: MappingProxyType[str, int]
    removed: MappingProxyType[str, int]
    tier_bytes: tuple[int, ...]
    tier_evictions: tuple[int, ...]


@dataclass(eq=False, slots=True)
class Chunk:
    """One chunk's books. ``namespace`` is ``None`` for an orphan (its tokens unknown)."""

    key: bytes
    namespace: str | None
    owner: str | None
    model: str | None
    adapter: str | None
    data: bytes
    frame_bytes: int
    held: set[int] = field(default_factory=set)
    pending: set[int] = field(default_factory=set)
    pins: int = 0
    expires: float = math.inf
    removed: bool = False

    @property
    def orphan(self) -> bool:
        return self.namespace is None


@dataclass(frozen=True, slots=True)
class Drop:
    """A frame to delete from a tier, outside the lock."""

    key: bytes
    tier: int


@dataclass(frozen=True, slots=True)
class Read:
    """A pinned chunk and the tiers to read it from, fast to slow."""

    chunk: Chunk
    tiers: tuple[int, ...]


@dataclass(eq=False)
class Pool:
    used: int
    policy: EvictionPolicy


@dataclass(eq=False)
class TierBook:
    """One tier's capacity and pools. ``slot`` is a slab tier's slot size: every frame
    takes a whole slot, and a frame longer than a slot does not go there."""

    capacity: int
    slot: int | None
    policy: str
    used: int = 0
    evictions: int = 0
    pools: dict[str, Pool] = field(default_factory=dict)

    def charge(self, frame_bytes: int) -> int:
        return self.slot if self.slot is not None else frame_bytes

    def fits(self, frame_bytes: int) -> bool:
        return (self.slot is None or frame_bytes <= self.slot) and self.charge(frame_bytes) <= self.capacity

    def pool(self, name: str) -> Pool:
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = Pool(0, make_policy(self.policy, max(self.capacity, 1)))
        return pool
