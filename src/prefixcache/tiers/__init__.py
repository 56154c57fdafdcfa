"""Tier stores: where a block's KV bytes live (memory, disk, ...), behind one interface."""

from prefixcache.tiers.base import Frame, TierError, TierFull, TierStats, TierStore
from prefixcache.tiers.disk import DiskStore
from prefixcache.tiers.memory import MemoryStore
from prefixcache.tiers.null import NullStore

__all__ = ["DiskStore", "Frame", "MemoryStore", "NullStore", "TierError", "TierFull", "TierStats", "TierStore"]
