"""What the ledger decides, handed to the steps that move bytes, and what those steps
hand back to be committed: typed, so that a decision or an outcome cannot be half-read
or confused with another.

::

    owner (lock)  --plan-->  tiered / writer (no lock)  --outcome-->  owner (lock)
    LoadPlan                 transfer.load -> Loaded                  commit_read -> Promotion
    Promotion                promote into tier 0 -> Promoted          commit_promotion
    Chain                    frames, memory puts -> Written           commit_insert
    Job (the queue's)        transfer.run -> Outcome                  commit_write
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.cache.tree import Block, Lookup, Node, Pin, Root, RunSpan
from prefixcache.hashing import CacheContext
from prefixcache.storage.base import Frame
from prefixcache.storage.transfer import Outcome, Read
from prefixcache.tenancy import Pool

__all__ = ["Chain", "Found", "LoadPlan", "Matched", "Probe", "Probed", "Promoted", "Promotion", "Written"]

Found = tuple[Block | None, list[RunSpan]]  # a tree search: the deepest verified block, and its path


@dataclass(slots=True)
class Matched:
    """A match decided: the pin on its deepest block, and what it covers."""

    pin: Pin | None
    block: Block | None  # the pinned block (the partial one when there is one)
    num_blocks: int
    partial_tokens: int
    deepest: Block | None  # the deepest full block (what an insert after it extends)
    tier_tokens: dict[str, int] = field(default_factory=dict)  # with tiers: tokens by the tier of their fastest copy


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
    since: int | None = None  # with tiers: the invalidations seen when it was decided (``invalidations.py``)
    data: bytes = b""  # with ``since``: the tokens from the root, which a prefix purge is compared with

    @property
    def begin(self) -> int:
        return self.parent.end

    @property
    def end(self) -> int:
        return self.blocks[-1].end if self.blocks else self.parent.end


@dataclass(eq=False)
class Probe:
    """A match's look into the tiers that may hold blocks no local tree knows: the keys
    of the lookup's chain ``which`` (0 its own, 1 the public one) after ``parent``.

    ``then``: the request's own chain (from its root, ``after`` blocks in), asked next
    from where this public one ends: a tenant's prompt that continues a published prefix
    is stored as its own blocks hanging under the public ones."""

    lookup: Lookup
    found: Found
    parent: Node | None
    ends: list[int]
    keys: list[bytes]
    tiers: list[int]
    pin: Pin | None
    which: int = 0
    after: int = 0
    then: Probe | None = None


@dataclass(frozen=True, slots=True)
class Probed:
    """What a probe found: ``n`` leading keys of its chain in ``tier``, then ``then_n``
    keys of its ``then`` chain, from where those end, in ``then_tier`` (-1: none)."""

    tier: int = -1
    n: int = 0
    then_tier: int = -1
    then_n: int = 0

    @property
    def blocks(self) -> int:
        return self.n + self.then_n


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


@dataclass(frozen=True, slots=True)
class Promotion:
    """What the commit of a load's reads decided: the indexes in the plan's ``path`` of
    the blocks going up into tier 0 (room reserved), and the ``(index in the reads,
    tier)`` of the copies a ``selective`` tier now owes the tier below (room reserved)."""

    tier_tokens: dict[str, int]
    promote: list[int]
    copies: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Promoted:
    """What moving a ``Promotion``'s bytes did: the ``done`` leading promoted blocks landed
    in a memory tier 0; ``frames`` by index in the plan's ``path``; ``owed`` the copies
    down, with their bytes taken while the path was pinned."""

    done: int
    frames: list[Frame | None]
    owed: list[tuple[Block, int, bytes]]


@dataclass(frozen=True, slots=True)
class Written:
    """What moving a chain's bytes did: a frame per block (none when framing failed), the
    ``landed`` leading blocks written to a memory tier, and the outcome of the write
    that stopped there (``None`` when none failed), counted at the commit."""

    frames: list[bytes]
    landed: int
    failed: Outcome | None = None
