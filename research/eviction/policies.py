"""Candidate policies for the research harness (``sim.Policy``), by name.

``lib:<name>`` runs the library's own policy (``prefixcache.policies``) through the
calls the ledger makes, so the harness can be checked against ``prefixcache replay``.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.policies import make_policy
from research.eviction.sim import Policy, Sim


class Library(Policy):
    """The library's policy, driven as the ledger drives it: ``access_many`` deepest
    first on a hit, ``insert`` deepest first, ``victim`` with the tree's predicate."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lib_name = name.split(":", 1)[1]

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        cap = sim.capacity if sim.capacity != float("inf") else 1 << 40
        self.p = make_policy(self.lib_name, max(int(cap), 1))
        self.node: dict[int, int] = {}  # stable key -> resident node

    def hit(self, path: list[int]) -> None:
        key = self.sim.key
        self.p.access_many([key[n] for n in reversed(path)])

    def insert(self, new: list[int]) -> None:
        key = self.sim.key
        for n in reversed(new):
            self.node[key[n]] = n
            self.p.insert(key[n], 1)

    def victim(self, pinned: int) -> int | None:
        nkids, node = self.sim.nkids, self.node
        k = self.p.victim(lambda k: nkids[node[k]] == 0 and node[k] != pinned)
        return None if k is None else node.pop(k)


REGISTRY: dict[str, Callable[[], Policy]] = {}


def register(name: str) -> Callable[[Callable[[], Policy]], Callable[[], Policy]]:
    def deco(factory: Callable[[], Policy]) -> Callable[[], Policy]:
        REGISTRY[name] = factory
        return factory

    return deco


def make(name: str) -> Policy:
    """A policy by name: ``lib:<library name>``, or a registered candidate, optionally
    with keyword parameters: ``name(a=1,b=0.5)``."""
    if name.startswith("lib:"):
        return Library(name)
    base, _, args = name.partition("(")
    kwargs: dict[str, float] = {}
    if args:
        for item in args.rstrip(")").split(","):
            if item.strip():
                k, v = item.split("=")
                kwargs[k.strip()] = float(v)
    try:
        factory = REGISTRY[base]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: lib:<name>, {', '.join(sorted(REGISTRY))}") from None
    policy = factory(**kwargs)  # type: ignore[call-arg]
    policy.name = name
    return policy
