"""Hot-prefix publication: which prefix of a request has become public, so that every
tenant of its model finds it in the public pool.

A prefix becomes public when an operator declares it (``declare_public``), or when
``publish.min_tenants`` distinct tenants have sent it (and it is at least
``publish.min_tokens`` long). Distinct tenants are counted, never requests, so that no
tenant can publish (and so reveal) a prefix by itself. The ledger stores the public
copy; this module only decides how deep it goes.
"""

from __future__ import annotations

from prefixcache.cache.contexts import context_name
from prefixcache.cache.tree import BlockTree, common_tokens
from prefixcache.config import CacheConfig
from prefixcache.hashing import CacheContext, KeyChain
from prefixcache.tenancy import Tenancy

__all__ = ["Publisher"]


class Publisher:
    """The declared prefixes, and the distinct-tenant counts (kept by ``Tenancy``)."""

    def __init__(self, config: CacheConfig, tenancy: Tenancy) -> None:
        self._config = config
        self._tenancy = tenancy
        self._declared: list[tuple[bytes, tuple[object, ...]]] = []

    @property
    def active(self) -> bool:
        """Whether any request may publish (counting is on, or a prefix was declared)."""
        return self._tenancy.publish is not None or bool(self._declared)

    def declare(self, data: bytes, ctx: CacheContext) -> None:
        self._declared.append((data, context_name(ctx)))

    def depth(self, data: bytes, ctx: CacheContext, chain: KeyChain, tree: BlockTree) -> tuple[int, int]:
        """(blocks of this request's prefix that are public, distinct tenants that made the
        deepest of them public; 0 when declared). Counts this request's tenant on the way."""
        bs = self._config.block_size
        n_full = len(data) // 4 // bs
        depth, tenants = self._declared_depth(data, ctx), 0
        promo = self._tenancy.publish
        if promo is not None:
            first = max(1, -(-promo.min_tokens // bs))
            ends = [bs * i for i in range(first, n_full + 1)]
            for i, key in zip(range(first, n_full + 1), chain.many(ends), strict=True):
                node = tree.nodes.get(key)
                if node is not None and node.public:
                    depth = max(depth, i)
                    continue
                seen = self._tenancy.count(key, ctx.tenant)
                if seen >= promo.min_tenants and i > depth:
                    depth, tenants = i, seen
        return depth, tenants

    def _declared_depth(self, data: bytes, ctx: CacheContext) -> int:
        if not self._declared:
            return 0
        name, bs, best = context_name(ctx), self._config.block_size, 0
        for declared, declared_name in self._declared:
            if declared_name == name:
                best = max(best, common_tokens(declared, data) // bs)
        return best
