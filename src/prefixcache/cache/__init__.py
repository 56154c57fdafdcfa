"""The cache: the ``PrefixCache`` facade, its match, and the block tree behind it."""

from prefixcache.cache.facade import Match, PrefixCache

__all__ = ["Match", "PrefixCache"]
