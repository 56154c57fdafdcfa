"""Hot-prefix publication: which prefix of a request has become public, so that every
tenant of its model finds it in the public pool.

A prefix becomes public when an operator declares it (``declare_public``), or when
``publish.min_tenants`` distinct tenants have sent it (and it is at least
``publish.min_tokens`` long). Distinct tenants are counted, never requests, so that no
tenant can publish (and so reveal) a prefix by itself. The ledger stores the public
copy; this module only decides how deep it goes.
"""

from __future__ import annotations

import xxhash

from prefixcache.cache.contexts import context_name
from prefixcache.cache.tree import BlockTree
from prefixcache.config import CacheConfig
from prefixcache.hashing import CacheContext, KeyChain
from prefixcache.tenancy import Tenancy

__all__ = ["Publisher"]


class Publisher:
    """The declared prefixes, and the distinct-tenant counts (kept by ``Tenancy``)."""

    def __init__(self, config: CacheConfig, tenancy: Tenancy) -> None:
        self._config = config
        self._tenancy = tenancy
        # NOTE: a declared prefix is kept as the digests of its whole-block prefixes, so
        # that how much of a request is declared costs the request's length, not the
        # number of declarations (``prefixcache warm --public`` declares a whole corpus)
        self._declared: set[tuple[tuple[object, ...], bytes]] = set()

    @property
    def active(self) -> bool:
        """Whether any request may publish (counting is on, or a prefix was declared)."""
        return self._tenancy.publish is not None or bool(self._declared)

    def declare(self, data: bytes, ctx: CacheContext) -> None:
        name = context_name(ctx)
        self._declared.update((name, digest) for digest in self._block_digests(data))

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
        """Whole blocks of ``data`` that a declared prefix of its context begins with."""
        if not self._declared:
            return 0
        name, depth = context_name(ctx), 0
        for digest in self._block_digests(data):  # NOTE: prefix-closed: the first miss ends it
            if (name, digest) not in self._declared:
                break
            depth += 1
        return depth

    def _block_digests(self, data: bytes) -> list[bytes]:
        """The digest of ``data``'s first i whole blocks, for each i >= 1."""
        step = 4 * self._config.block_size  # tokens are little-endian uint32
        hasher, out = xxhash.xxh3_128(), []
        for end in range(step, len(data) + 1, step):
            hasher.update(data[end - step : end])
            out.append(hasher.digest())
        return out
