"""prefixcache: a prefix (KV) cache for LLM serving."""

from prefixcache.cache import Match, PrefixCache
from prefixcache.config import CacheConfig, PromotionConfig
from prefixcache.events import BlocksRemoved, BlocksStored, EpochBumped, PrefixPromoted, RemovalReason
from prefixcache.hashing import CacheContext, Segment

__all__ = [
    "BlocksRemoved",
    "BlocksStored",
    "CacheConfig",
    "CacheContext",
    "EpochBumped",
    "Match",
    "PrefixCache",
    "PrefixPromoted",
    "PromotionConfig",
    "RemovalReason",
    "Segment",
]
__version__ = "0.1.0"
