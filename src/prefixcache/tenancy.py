"""Who may reuse whose blocks, and whose capacity a block takes.

=============  =====================  ===============================================
isolation      key namespace          pools
=============  =====================  ===============================================
shared         "" for everyone        one pool, one policy
namespace      the tenant             one pool, one policy (tenants compete for it)
partitioned    the tenant             one pool per tenant, each with its own quota and
                                      policy instance, plus a public pool
=============  =====================  ===============================================

NOTE: namespaces live in the key (the tenant salts the context root), not in separate
code paths: the tree, the search and the policies are the same in every mode.

hot-prefix publication (namespace and partitioned modes, opt-in): the public key of a
prefix -- its key with an empty namespace -- is computed for every request, and the
distinct tenants that sent it are counted. When ``min_tenants`` tenants have sent a
prefix of at least ``min_tokens`` tokens, it is copied under the public root, into the
public pool, where every tenant's search finds it. A single tenant can never reach
the threshold, so it can never make anything of its own visible to others.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from prefixcache.config import CacheConfig, PublishConfig
from prefixcache.policies import EvictionPolicy, make_policy

PUBLIC = ""  # the namespace, owner and pool name of public blocks
GLOBAL = "*"  # the pool name when one pool holds everything


def namespace_of(isolation: str, tenant: str) -> str:
    """The key namespace of ``tenant``'s blocks under ``isolation`` (the table above)."""
    return PUBLIC if isolation == "shared" else tenant


@dataclass(eq=False)
class Pool:
    """A share of capacity (in tokens) with its own eviction policy."""

    name: str
    quota: int
    policy: EvictionPolicy
    used: int = 0
    blocks: int = 0
    evictions: int = 0

    @property
    def over(self) -> int:
        return self.used - self.quota


@dataclass
class Tenancy:
    """The isolation mode of one cache: namespaces, pools and publication counts."""

    config: CacheConfig
    pools: dict[str, Pool] = field(default_factory=dict)
    _candidates: OrderedDict[bytes, set[str]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not self.partitioned:
            self.pools[GLOBAL] = self._new_pool(GLOBAL, self.config.capacity)
        elif self.has_public_pool:
            self.pools[PUBLIC] = self._new_pool(PUBLIC, 0)
            self._rebalance()

    @property
    def mode(self) -> str:
        return self.config.isolation

    @property
    def partitioned(self) -> bool:
        return self.config.isolation == "partitioned"

    @property
    def publish(self) -> PublishConfig | None:
        return self.config.publish

    @property
    def has_public_pool(self) -> bool:
        return self.partitioned and (self.config.publish is not None or self.config.shared_quota is not None)

    def namespace(self, tenant: str) -> str:
        return namespace_of(self.mode, tenant)

    def pool_for(self, tenant: str, public: bool) -> Pool:
        """The pool a block stored by ``tenant`` takes capacity from."""
        if not self.partitioned:
            return self.pools[GLOBAL]
        name = PUBLIC if public else tenant
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = self._new_pool(name, 0)
            self._rebalance()
        return pool

    def _new_pool(self, name: str, quota: int) -> Pool:
        return Pool(name, quota, make_policy(self.config.policy, max(quota, 1)))

    def _rebalance(self) -> None:
        """Quotas: the configured ones, and an equal share of what remains for every
        other pool seen so far. A newcomer shrinks the equal shares; a pool left over
        its quota gives back its own blocks first when capacity runs short."""
        cfg = self.config
        fixed = {name: cfg.to_tokens(q) for name, q in cfg.quotas.items()}
        if cfg.shared_quota is not None:
            fixed[PUBLIC] = cfg.to_tokens(cfg.shared_quota)
        floating = [name for name in self.pools if name not in fixed]
        remaining = cfg.capacity - sum(fixed.values())
        share = remaining // len(floating) if floating else 0
        for name, pool in self.pools.items():
            pool.quota = fixed.get(name, share)
            pool.policy.resize(max(pool.quota, 1))

    def over_quota(self) -> list[Pool]:
        return [p for p in self.pools.values() if p.over > 0]

    # --------------------------------------------------------------- publication

    def count(self, public_key: bytes, tenant: str) -> int:
        """Record that ``tenant`` sent the prefix named ``public_key``; return how many
        distinct tenants have sent it (while it is remembered)."""
        promo = self.config.publish
        assert promo is not None
        cand = self._candidates
        seen = cand.get(public_key)
        if seen is None:
            seen = cand[public_key] = set()
            if len(cand) > promo.max_candidates:
                cand.popitem(last=False)
        else:
            cand.move_to_end(public_key)
        seen.add(tenant)
        return len(seen)

    def forget(self, public_key: bytes) -> None:
        self._candidates.pop(public_key, None)
