"""Types of the compiled replay kernel (``_kernel.c``)."""

from collections.abc import Sequence

POLICIES: tuple[str, ...]

class Tree:
    """``PrefixCache``'s metadata path for replays: ``capacity`` tokens, blocks of ``unit``
    tokens, one pool or (``partitioned``) one per tenant. ``head_unit`` (0: ``unit``) is
    what each of a request's first ``head`` new blocks costs instead (sampled curves)."""

    def __init__(
        self,
        policy: str,
        capacity: int,
        unit: int,
        partitioned: bool = False,
        ttl: float | None = None,
        head_unit: int = 0,
    ) -> None: ...
    def root(self, key: int) -> int: ...
    def access(
        self,
        root: int,
        tenant: int,
        ids: Sequence[int],
        match_blocks: int = -1,
        now: float = 0.0,
        head: int = 0,
        /,
    ) -> int: ...
    def pools(self) -> list[dict[str, int]]: ...
    @property
    def evictions(self) -> int: ...
    @property
    def used(self) -> int: ...
    @property
    def collisions(self) -> int: ...
    @property
    def expired(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    def __len__(self) -> int: ...

def access_all(
    trees: Sequence[Tree], roots: Sequence[int], ids: Sequence[int], now: float, head: int, limit: int = -1, /
) -> list[int]:
    """``trees[i].access(roots[i], 0, ids[:limit], -1, now, head)`` for every i, the ids
    converted once: one request on every miniature (sampled curves)."""
