"""prefixcache: a prefix (KV) cache for LLM serving."""

from prefixcache.cache import Match, PrefixCache
from prefixcache.config import CacheConfig, PublishConfig
from prefixcache.events import BlocksRemoved, BlocksStored, EpochBumped, PrefixPublished, RemovalReason
from prefixcache.hashing import CacheContext, Segment

__all__ = [
    "BlocksRemoved",
    "BlocksStored",
    "CacheConfig",
    "CacheContext",
    "EpochBumped",
    "Match",
    "PrefixCache",
    "PrefixPublished",
    "PublishConfig",
    "RemovalReason",
    "Segment",
]
__version__ = "0.1.0"
