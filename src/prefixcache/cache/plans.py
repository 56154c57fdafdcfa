"""What the ledger decides, handed to the steps that move bytes and back to its commits:
typed, so that a decision cannot be half-read or confused with another."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.cache.tree import Block, Node, Pin, Root, RunSpan
from prefixcache.hashing import CacheContext
from prefixcache.storage.transfer import Read
from prefixcache.tenancy import Pool

__all__ = ["Chain", "Found", "LoadPlan", "Matched", "Probe"]

Found = tuple[Block | None, list[RunSpan]]  # a tree search: the deepest verified block, and its path


@dataclass(slots=True)
class Matched:
    """A match decided: the pin on its deepest block, and what it covers."""

    pin: Pin | None
    block: Block | None  # the pinned block (the partial one when there is one)
    num_blocks: int
    partial_tokens: int
    deepest: Block | None  # the deepest full block (what an insert after it extends)


@dataclass(eq=False)
class Chain:
    """New blocks one insert decided, under ``parent``, not yet in the tree: their pool
    room is reserved, and (with tiers) the tier each enters is ``tiers[i]``."""

    parent: Node
    root: Root
    blocks: list[Block]
    pool: Pool
    ctx: CacheContext
    public: bool
    pin: Pin  # the parent and the root, so that neither leaves before the commit
    reserved: int  # tokens reserved in the pool (and the cache)
    tiers: list[int] = field(default_factory=list)
    tenants: int = -1  # >= 0: a published prefix, made public by that many tenants (0: declared)

    @property
    def begin(self) -> int:
        return self.parent.end

    @property
    def end(self) -> int:
        return self.blocks[-1].end if self.blocks else self.parent.end


@dataclass(eq=False)
class Probe:
    """A match's look into the tiers that may hold blocks no local tree knows."""

    found: Found
    parent: Node | None
    ends: list[int]
    keys: list[bytes]
    tiers: list[int]
    pin: Pin | None


@dataclass(eq=False)
class LoadPlan:
    """A load decided: ``reads`` are the blocks ``path[first:]`` (as far as a tier holds
    them), whose tokens begin at ``start``; ``requested`` is the whole match's length."""

    path: list[Block]
    reads: list[Read]
    requested: int
    pin: Pin
    first: int = 0
    start: int = 0
