"""Eviction policies behind one small interface, chosen by name from a registry."""

from __future__ import annotations

from prefixcache.policies.base import Evictable, EvictionPolicy, Key, always
from prefixcache.policies.fifo import FIFOPolicy
from prefixcache.policies.gittins import GittinsPolicy
from prefixcache.policies.lfuda import LFUDAPolicy
from prefixcache.policies.lru import LRUPolicy
from prefixcache.policies.s3fifo import S3FIFOPolicy
from prefixcache.policies.sieve import SievePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, FIFOPolicy, S3FIFOPolicy, SievePolicy, LFUDAPolicy, GittinsPolicy)
}
"""Every policy by its configuration name."""

RETIRED: dict[str, str] = {
    "lfu": (
        "plain LFU never ages: a block hit often once keeps its count forever, so the cache "
        "fills with blocks nobody asks for any more (far below LRU on conversation and agent "
        "traffic: research/eviction/RESULTS.md); use 'lfuda' (LFU with dynamic aging) or "
        "'gittins'"
    ),
}
"""Names that once were policies, with why they left and what to use instead."""


def check_policy(name: str, what: str = "eviction policy") -> None:
    """A ``ValueError`` unless ``name`` is a policy: a retired name says why it left, an
    unknown one lists the valid names (both are configuration errors)."""
    if name in POLICIES:
        return
    valid = ", ".join(sorted(POLICIES))
    if name in RETIRED:
        raise ValueError(f"{what} {name!r} was retired: {RETIRED[name]} (valid: {valid})")
    raise ValueError(f"unknown {what} {name!r}; valid: {valid}")


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` for a pool of ``capacity`` units."""
    check_policy(name)
    return POLICIES[name](capacity)


__all__ = [
    "POLICIES",
    "RETIRED",
    "Evictable",
    "EvictionPolicy",
    "FIFOPolicy",
    "GittinsPolicy",
    "Key",
    "LFUDAPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "SievePolicy",
    "always",
    "check_policy",
    "make_policy",
]
