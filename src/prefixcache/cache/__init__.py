"""The cache: the ``PrefixCache`` facade, its match, and the block tree behind it."""

from prefixcache.cache.facade import Match, PrefixCache
from prefixcache.cache.invalidations import Stamp
from prefixcache.cache.peek import Peek

__all__ = ["Match", "Peek", "PrefixCache", "Stamp"]
