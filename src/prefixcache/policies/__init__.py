"""Eviction policies behind one small interface, chosen by name from a registry."""

from __future__ import annotations

from prefixcache.policies.base import Evictable, EvictionPolicy, Key, always
from prefixcache.policies.fifo import FIFOPolicy
from prefixcache.policies.gittins import GittinsPolicy
from prefixcache.policies.lfu import LFUPolicy
from prefixcache.policies.lru import LRUPolicy
from prefixcache.policies.s3fifo import S3FIFOPolicy
from prefixcache.policies.sieve import SievePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, FIFOPolicy, S3FIFOPolicy, SievePolicy, LFUPolicy, GittinsPolicy)
}
"""Every policy by its configuration name."""


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` for a pool of ``capacity`` units.

    An unknown name is a configuration error, so the message lists the valid ones.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        valid = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; valid: {valid}") from None
    return cls(capacity)


__all__ = [
    "POLICIES",
    "Evictable",
    "EvictionPolicy",
    "FIFOPolicy",
    "GittinsPolicy",
    "Key",
    "LFUPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "SievePolicy",
    "always",
    "make_policy",
]
