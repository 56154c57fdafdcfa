"""The block tree: key -> block, each block with its parent, children and tokens.

::

    Root(ctx A, ns "")          Root(ctx A, ns "acme")        <- one sentinel per context root (``Root``)
      |-- b0 [public] --- b1 [public] --- b2 [acme] --- b3 [acme]
      |                              \\-- b2' [globex]
      \\-- ...

A block is the KV of ``block_size`` tokens (or fewer, for a partial tail) that extends
its parent's prefix. Every block's key covers its context and its whole prefix (see
``hashing``), but a hit is never taken on the key alone: ``find`` checks the tokens of
the whole path, the path's context root and the namespace of the deepest block, so a
hash collision is a counted miss, never a wrong answer (invariant 3).

Prefix-closure makes binary search valid: a block is in the tree only while its parent
is, so "the prefix of d blocks is cached" is monotone in d.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Union

from prefixcache.hashing import KeyChain, Segments

if TYPE_CHECKING:
    from prefixcache.cache.residency import Residency
    from prefixcache.tenancy import Pool

_extra_of = attrgetter("extra")


class Root:
    """A context root: the sentinel every block of one context (model, adapter, tokenizer,
    namespace, epochs) hangs under, so that every real block has a parent.

    ``members`` counts the blocks that name it as their root: an empty, unpinned root
    leaves the root table (``contexts.py``), so contexts seen once do not accumulate."""

    __slots__ = ("children", "ctx_enc", "ctx_name", "key", "members", "owner", "pins", "public", "stale")

    is_root = True
    parent = None
    end = 0
    n_segments = 0
    run = None
    num_tokens = 0

    def __init__(
        self, key: bytes, namespace: str, public: bool, ctx_name: tuple[object, ...] = (), ctx_enc: bytes = b""
    ):
        self.key = key
        self.children: dict[bytes, Block] = {}
        self.owner = namespace  # the namespace its blocks live in ("" for the public one)
        self.public = public
        self.pins = 0
        self.members = 0
        self.stale = False  # its epoch was bumped
        self.ctx_name = ctx_name  # its name in the root table
        self.ctx_enc = ctx_enc  # the exact encoding of its context (epochs included)

    @property
    def root(self) -> Root:
        return self

    def __repr__(self) -> str:
        return f"Root({self.key.hex()[:12]}, ns={self.owner!r}, members={self.members}, pins={self.pins})"


Node = Union["Block", Root]


class Block:
    """A node of the tree: the KV of ``block_size`` tokens (fewer for a partial tail)
    that extends its parent's prefix."""

    __slots__ = (
        "children",
        "doomed",
        "end",
        "extra",
        "key",
        "last_access",
        "n_segments",
        "owner",
        "parent",
        "pins",
        "pool",
        "public",
        "res",
        "retain_mask",
        "retain_s",
        "retain_until",
        "retainer",
        "root",
        "run",
        "run_index",
        "tokens",
    )

    is_root = False

    def __init__(
        self,
        key: bytes,
        parent: Node,
        tokens: bytes,
        root: Root,
        owner: str,
        public: bool,
        extra: bytes = b"",
        end: int | None = None,
    ) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[bytes, Block] = {}
        self.tokens = tokens  # little-endian uint32 token ids of this block only
        self.extra = extra  # encoding of the segments that start in this block
        self.root = root
        self.owner = owner  # the tenant that stored it ("" for public blocks)
        self.public = public
        self.end: int = end if end is not None else parent.end + len(tokens) // 4
        self.n_segments = 0  # segments starting in the prefix up to ``end``
        self.pins = 0
        self.pool: Pool | None = None  # None until stored, and after removal
        self.last_access = 0.0
        self.doomed = ""  # why it was removed while pinned (a RemovalReason): unlinked, freed on release
        self.run: Run | None = None  # the chain stored with it
        self.run_index = 0
        self.res: Residency | None = None  # with storage tiers: where its bytes are
        self.retainer: str | None = None  # the tenant whose retention keeps it (``retention.py``)
        self.retain_until = 0.0
        self.retain_s = 0.0
        self.retain_mask = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    def __repr__(self) -> str:
        return f"Block({self.key.hex()[:12]}, end={self.end}, owner={self.owner!r}, pins={self.pins})"


class Pin:
    """Pins on some nodes: pinned blocks are never evicted (invariant 5), a pinned root
    never leaves the root table. Taken at construction, released once: by ``release``
    (the ledger's ``unpin`` frees what was removed meanwhile) or at the end of a
    ``with`` block, for pins that live inside one hold of the cache's lock."""

    __slots__ = ("nodes", "released")

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = tuple(nodes)
        self.released = False
        for node in self.nodes:
            node.pins += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            for node in self.nodes:
                node.pins -= 1
                assert node.pins >= 0

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Run:
    """The chain of blocks one ``insert`` stored under one parent, with their tokens
    and keys side by side.

    NOTE: a path from a root enters a run only through its first block, and blocks
    leave a run only from its end (children before parents), so the part of a run on
    any path is a prefix of it. Verifying, listing and touching a path therefore
    costs one comparison and one list slice per run, not a Python step per block:
    this is what keeps ``match`` of a 4,096-token prompt in tens of microseconds.
    """

    __slots__ = ("begin", "blocks", "keys", "parent", "src")

    def __init__(self, parent: Node, blocks: list[Block], src: bytes) -> None:
        self.parent = parent
        self.begin = parent.end  # token offset of the run's first block
        self.blocks = blocks
        self.keys = [b.key for b in blocks]
        self.src = src  # tokens of all its blocks, little-endian uint32
        for i, block in enumerate(blocks):
            block.run, block.run_index = self, i

    def truncate(self, index: int) -> None:
        """Blocks from ``index`` on have left the tree."""
        del self.blocks[index:]
        del self.keys[index:]
        self.src = self.src[: 4 * (self.blocks[-1].end - self.begin)] if self.blocks else b""


RunSpan = tuple[Run, int]  # a run and how many of its leading blocks are on a path


def runs_to(block: Node | None) -> list[RunSpan]:
    """The runs of the path from the root down to ``block``, deepest first."""
    spans: list[RunSpan] = []
    while block is not None and block.run is not None:
        run = block.run
        spans.append((run, block.run_index + 1))
        block = run.parent
    return spans


def blocks_of(spans: list[RunSpan]) -> list[Block]:
    """The blocks of a path, root-most first."""
    path: list[Block] = []
    for run, n in reversed(spans):
        path.extend(run.blocks[:n])
    return path


def keys_of(spans: list[RunSpan]) -> list[bytes]:
    """The keys of a path, deepest first."""
    keys: list[bytes] = []
    for run, n in spans:
        keys.extend(reversed(run.keys[:n]))
    return keys


def always_alive(_block: Block) -> bool:
    """The liveness test when no TTL is configured."""
    return True


def path_to(block: Node) -> list[Block]:
    """The blocks from the root (excluded) down to ``block``, root-most first."""
    return blocks_of(runs_to(block))


def postorder(top: Node) -> Iterator[Block]:
    """Every block under ``top`` (and ``top`` itself unless it is a root), children
    before parents: the only order in which a subtree can be removed without orphans."""
    stack: list[tuple[Node, bool]] = [(top, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            if not node.is_root:
                yield node  # type: ignore[misc]
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in list(node.children.values()))


def common_tokens(a: bytes, b: bytes) -> int:
    """Length, in tokens, of the longest common prefix of two token byte strings."""
    n = min(len(a), len(b)) // 4
    if a[: 4 * n] == b[: 4 * n]:
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Lookup:
    """One request's view of the tree: the key chains it may match (its own namespace,
    then the public one), in order of preference, and the roots they belong to."""

    __slots__ = ("chains", "data", "roots", "segments", "visible")

    def __init__(self, data: bytes, segments: Segments, chains: Sequence[KeyChain], roots: Sequence[Root]):
        self.data = data
        self.segments = segments
        self.chains = chains
        self.roots = roots
        # NOTE: roots are compared by their exact context encoding, neither by identity (a
        # root dropped while empty and made again for the same context and epoch is the
        # same root) nor by key (a weak hash could give two contexts one key).
        self.visible = frozenset(r.ctx_enc for r in roots)

    def can_see(self, block: Block) -> bool:
        return block.root.ctx_enc in self.visible


class BlockTree:
    """Key -> block, plus the search that turns a prompt into its longest cached path."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, Block] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def link(self, block: Block) -> None:
        """Make ``block`` findable and attach it under its parent."""
        self.nodes[block.key] = block
        block.parent.children[block.key] = block

    def unlink(self, block: Block) -> None:
        """Make ``block`` unfindable (idempotent); it stays attached to its parent."""
        if self.nodes.get(block.key) is block:
            del self.nodes[block.key]

    def detach(self, block: Block) -> None:
        """Take a childless block out of the tree for good."""
        assert not block.children, "detaching a block with children would orphan them"
        key, nodes, parent = block.key, self.nodes, block.parent
        if nodes.get(key) is block:
            del nodes[key]
        if parent.children.get(key) is block:
            del parent.children[key]

    # ----------------------------------------------------------------- search

    def deepest(self, lookup: Lookup, n_blocks: int, block_size: int, alive: Callable[[Block], bool]) -> Block | None:
        """Binary search for the deepest cached full block, by key alone (unverified)."""
        get, key_fns = self.nodes.get, [chain.at for chain in lookup.chains]
        check = alive is not always_alive
        lo, hi, best = 0, n_blocks, None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            end = mid * block_size
            for key_at in key_fns:
                node = get(key_at(end))
                if node is not None and (not check or alive(node)):
                    lo, best = mid, node
                    break
            else:
                hi = mid - 1
        return best

    def verify(self, lookup: Lookup, spans: list[RunSpan]) -> bool:
        """Does this path really hold the request's tokens and segments, under a root and
        in a namespace the request may see?"""
        if not spans:
            return True
        last_run, n = spans[0]
        deepest = last_run.blocks[n - 1]
        if not lookup.can_see(deepest) or spans[-1][0].parent.root.ctx_enc not in lookup.visible:
            return False
        data = lookup.data
        for run, n in spans:
            src = run.src if n == len(run.blocks) else run.src[: 4 * (run.blocks[n - 1].end - run.begin)]
            if not data.startswith(src, 4 * run.begin):
                return False
        end = deepest.end
        segs = lookup.segments
        count = segs.count_before(end) if segs.starts else 0
        if deepest.n_segments != count:
            return False
        return count == 0 or b"".join(map(_extra_of, blocks_of(spans))) == segs.prefix_enc[count]

    def walk(self, lookup: Lookup, n_blocks: int, block_size: int, alive: Callable[[Block], bool]) -> list[Block]:
        """The slow, block-by-block verified walk, used after ``verify`` rejected the
        fast path (a hash collision): it stops at the first block that is missing or
        whose parent, tokens, segments or namespace do not match."""
        path: list[Block] = []
        parent: Node | None = None  # None: the first block must hang under a visible root
        ends = [block_size * (i + 1) for i in range(n_blocks)]
        per_chain = [chain.many(ends) for chain in lookup.chains]
        data, segs = lookup.data, lookup.segments
        for i, end in enumerate(ends):
            chunk = data[4 * (end - block_size) : 4 * end]
            extra = segs.enc_between(end - block_size, end)
            found = None
            for keys in per_chain:
                node = self.nodes.get(keys[i])
                if (
                    node is not None
                    and alive(node)
                    and lookup.can_see(node)
                    and (
                        node.parent is parent
                        if parent is not None
                        else node.parent.is_root and node.parent.ctx_enc in lookup.visible  # type: ignore[union-attr]
                    )
                    and node.tokens == chunk
                    and node.extra == extra
                ):
                    found = node
                    break
            if found is None:
                break
            path.append(found)
            parent = found
        return path

    @staticmethod
    def partial(
        lookup: Lookup,
        parents: Sequence[Node],
        begin: int,
        block_size: int,
        alive: Callable[[Block], bool],
    ) -> tuple[Block | None, int]:
        """The child of ``parents`` sharing the longest token prefix with the request's
        block at ``begin`` (token-granular reuse, like SGLang's radix tree). Only blocks
        the request may see and whose segments agree are candidates."""
        data = lookup.data
        want = data[4 * begin : 4 * min(begin + block_size, len(data) // 4)]
        if not want:
            return None, 0
        segs = lookup.segments
        extra = segs.enc_between(begin, begin + block_size) if segs.starts else b""
        best, best_len = None, 0
        first = want[:4]
        for parent in parents:
            for child in parent.children.values():
                if child.tokens[:4] != first or child.extra != extra or child.doomed:
                    continue
                if not (lookup.can_see(child) and alive(child)):
                    continue
                n = common_tokens(child.tokens, want)
                if n > best_len:
                    best, best_len = child, n
        return best, best_len
