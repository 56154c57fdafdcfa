"""Candidate policies for the research harness (``sim.Policy``), by name.

``lib:<name>`` runs the library's own policy (``prefixcache.policies``) through the
calls the ledger makes, so the harness can be checked against ``prefixcache replay``.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.policies import POLICIES, make_policy
from research.eviction.sim import Policy, Sim


class Library(Policy):
    """The library's policy, driven as the ledger drives it: ``access_many`` deepest
    first on a hit, ``insert`` deepest first, ``victim`` with the tree's predicate."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lib_name, _, args = name.split(":", 1)[1].partition("(")
        self.kwargs = _kwargs(args)

    def attach(self, sim: Sim) -> None:
        super().attach(sim)
        cap = max(int(sim.capacity if sim.capacity != float("inf") else 1 << 40), 1)
        if self.kwargs:
            self.p = POLICIES[self.lib_name](cap, **self.kwargs)  # type: ignore[call-arg]
        else:
            self.p = make_policy(self.lib_name, cap)
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


def _kwargs(args: str) -> dict[str, float]:
    """``a=1,b=0.5)`` -> {"a": 1, "b": 0.5} (ints stay ints)."""
    out: dict[str, float] = {}
    for item in args.rstrip(")").split(","):
        if item.strip():
            k, v = item.split("=")
            out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else float(v)
    return out


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
    if name.startswith("lib+:"):
        return LibraryWithLeaves(name)
    base, _, args = name.partition("(")
    kwargs = _kwargs(args)
    try:
        factory = REGISTRY[base]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: lib:<name>, {', '.join(sorted(REGISTRY))}") from None
    policy = factory(**kwargs)  # type: ignore[call-arg]
    policy.name = name
    return policy


class LibraryWithLeaves(Library):
    """``lib+:<name>``: the library's policy with the leaf hook the ledger would call
    (``set_leaf``): a chain's blocks but its deepest are not leaves, the block it is
    stored under stops being one, and a block whose last child left becomes one."""

    def __init__(self, name: str) -> None:
        super().__init__(name.replace("lib+:", "lib:", 1))
        self.name = name

    def insert(self, new: list[int]) -> None:
        key, sim = self.sim.key, self.sim
        p = sim.parent[new[0]]
        super().insert(new)
        set_leaf = self.p.set_leaf
        for n in new[:-1]:
            set_leaf(key[n], False)
        if not sim.is_root(p) and sim.nkids[p] == 1:  # it was a leaf until now
            set_leaf(key[p], False)

    def leaf(self, node: int) -> None:
        self.p.set_leaf(self.sim.key[node], True)
