"""The Python reference of the miniatures' head cost: the replay kernel's tree
(native/_kernel.c) with ``head_unit``, in Python, for one pool without TTL.

The kernel is held to the real ``PrefixCache`` step for step (tests/sim/test_kernel.py),
but there every block costs ``unit``: the cache has no block that costs other than its
tokens. A sampled curve's miniature (miniatures.py) charges each of a request's first
``head`` new blocks ``head_unit`` instead, which only the kernel can do. ``MiniTree`` is
that tree on the cache's own policies (``prefixcache.policies``), called in the ledger's
order (cache/ledger.py, cache/lifecycle.py: touch deepest first, insert deepest first,
then the leaf news), with the kernel's room rule (``make_room``: evict until the new
blocks fit or nothing may leave, then store those that fit, in order).
tests/sim/test_minitree.py replays random requests through both and compares every
answer and counter; at ``head_unit == unit`` it is the kernel that the cache's own test
already pins down.

NOTE: slow and small on purpose (a dict per node); it exists to be read and compared,
never to replay a trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixcache.policies import EvictionPolicy, make_policy


@dataclass(eq=False, slots=True)
class _Node:
    key: int  # the policy's key: one per path, the same after the path is evicted and stored again
    parent: _Node | None
    block_id: int
    cost: int = 0
    pins: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class MiniTree:
    """``_kernel.Tree(policy, capacity, unit, False, None, head_unit)`` in Python."""

    def __init__(self, policy: str, capacity: int, unit: int, head_unit: int = 0) -> None:
        if capacity < 0 or unit < 1 or head_unit < 0:
            raise ValueError(f"need capacity >= 0, unit >= 1, head_unit >= 0; got {capacity}, {unit}, {head_unit}")
        self.capacity, self.unit = capacity, unit
        self.head_unit = head_unit or unit
        self.policy: EvictionPolicy = make_policy(policy, max(capacity, 1))
        self.used = self.blocks = self.evictions = 0
        self._roots: list[_Node] = []
        self._paths: dict[tuple[int, int], int] = {}  # (parent key, id) -> key, forever: ghosts know a path again
        self._by_key: dict[object, _Node] = {}  # a policy's key -> its node

    def __len__(self) -> int:
        return self.blocks

    def root(self, key: int) -> int:
        """A new context root (``key`` as the kernel takes it; every root is distinct)."""
        self._roots.append(_Node(self._path(-1 - len(self._roots), key), None, key))
        return len(self._roots) - 1

    def access(self, root: int, ids: Sequence[int], match_blocks: int = -1, head: int = 0) -> int:
        """``Tree.access(root, 0, ids, match_blocks, 0.0, head)``: the hit in blocks, after
        the hit is touched and the missing blocks stored (those that fit)."""
        node, path = self._roots[root], list[_Node]()
        for block_id in ids:
            child = node.children.get(block_id)
            if child is None:
                break
            path.append(child)
            node = child
        hit = len(path) if match_blocks < 0 else min(len(path), match_blocks)
        pinned = path[hit - 1] if hit else None
        if pinned is not None:
            pinned.pins += 1
            self.policy.access_many(reversed([n.key for n in path[:hit]]))
        if len(path) < len(ids):
            self._store(path[-1] if path else self._roots[root], ids, len(path), head)
        if pinned is not None:
            pinned.pins -= 1
        return hit

    def _cost(self, i: int, head: int) -> int:
        return self.head_unit if i < head else self.unit

    def _store(self, parent: _Node, ids: Sequence[int], depth: int, head: int) -> None:
        parent.pins += 1
        room = self._make_room(sum(self._cost(i, head) for i in range(depth, len(ids))))
        parent.pins -= 1
        top, linked = parent, list[_Node]()
        for i in range(depth, len(ids)):
            cost = self._cost(i, head)
            if cost > room:
                break
            child = _Node(self._path(parent.key, ids[i]), parent, ids[i], cost)
            parent.children[ids[i]] = self._by_key[child.key] = child
            linked.append(child)
            parent, room = child, room - cost
        self.used += sum(n.cost for n in linked)
        self.blocks += len(linked)
        for n in reversed(linked):
            self.policy.insert(n.key, n.cost)
        if linked and self.policy.tracks_leaves:  # Lifecycle.new_children
            for n in linked[:-1]:
                self.policy.set_leaf(n.key, False)
            if top.parent is not None and len(top.children) == 1:
                self.policy.set_leaf(top.key, False)

    def _make_room(self, need: int) -> int:
        """How much of ``need`` fits, after evicting what must leave (``make_room`` of one
        pool whose quota is the capacity)."""
        need = min(need, self.capacity)
        while True:
            free = self.capacity - self.used
            if free >= need:
                return need
            if not self._evict(need - free):
                return max(free, 0)

    def _evict(self, tokens: int) -> bool:
        """``evict_from``: victims until ``tokens`` are freed; whether any was."""
        freed = 0
        while freed < tokens:
            key = self.policy.victim(self._evictable)
            if key is None:
                return freed > 0
            node = self._by_key.pop(key)
            freed += node.cost
            self._remove(node)
        return True

    def _evictable(self, key: object) -> bool:
        node = self._by_key[key]
        return node.pins == 0 and not node.children

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.block_id]
        if not parent.children and parent.parent is not None and self.policy.tracks_leaves:
            self.policy.set_leaf(parent.key, True)
        self.used -= node.cost
        self.blocks -= 1
        self.evictions += 1

    def _path(self, parent: int, block_id: int) -> int:
        return self._paths.setdefault((parent, block_id), len(self._paths))
