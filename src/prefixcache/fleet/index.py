"""The router's global index: which backend holds which block, in which tiers.

Built only from KV events (``wire``): a ``BlockStored`` names its blocks by the
backend's hashes and carries their tokens; the index keys them by the router's own
chained hash of those tokens (``keys``), scoped by namespace and model, and remembers
each backend's hash to place later children and removals. A block in a *shared*
medium (Redis, which every backend of the fleet reads) counts for every backend.

Lookups see a tenant's own namespace and the public one only: ``matched`` is given the
key chains a request may follow and nothing else, so another tenant's private blocks
never count. A store whose parent the index does not know (an event it missed) is an
``IndexGap``: the caller resynchronizes that backend (``Follower``).

A backend stores a request's blocks only after answering it, and its events reach
the router a moment later: a conversation's next turn, sent the moment the last one
ended, would find nothing. So the router also records where it *sent* each prompt
(``expect``): for ``EXPECT_S`` seconds those keys count for that backend, as the
medium ``EXPECTED`` (credited like host memory), until the events say what is really
there. Events stay the truth: an expectation never removes or overrides a block.

Thread-safe: one lock, held for dictionary work only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prefixcache.fleet.keys import chain_keys, root_key
from prefixcache.fleet.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

__all__ = ["EXPECTED", "EXPECT_S", "GlobalIndex", "IndexGap", "IndexStats"]

EXPECTED = "expected"  # the medium of blocks a backend was sent and has not yet announced
EXPECT_S = 10.0  # how long a routing decision stands in for the events it should bring


class IndexGap(Exception):
    """An event that cannot be placed: the backend's index must be resynchronized."""


@dataclass(slots=True)
class _Held:
    key: bytes  # the router's key
    media: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class IndexStats:
    backends: int
    blocks: int  # distinct router keys held anywhere
    placements: int  # (backend, block) pairs


class GlobalIndex:
    """Blocks by backend, from events; ``rank`` orders media best first (e.g. by credit)."""

    def __init__(
        self,
        shared_media: Iterable[str] = ("redis", "s3"),
        rank: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shared = frozenset(shared_media)
        self._clock = clock
        self._expected: dict[bytes, dict[str, float]] = {}  # router key -> backend -> deadline
        self._sweep_at = 0.0
        self._rank = dict(rank) if rank is not None else {}
        self._lock = threading.Lock()
        self._backends: dict[str, dict[BlockHash, _Held]] = {}
        self._where: dict[bytes, dict[str, set[str]]] = {}  # router key -> backend -> media

    # ------------------------------------------------------------------ events

    def apply(self, backend: str, event: Event, default_model: str) -> None:
        """Apply one event of ``backend``; raises ``IndexGap`` when it cannot be placed."""
        with self._lock:
            blocks = self._backends.setdefault(backend, {})
            if isinstance(event, BlockStored):
                self._stored(backend, blocks, event, default_model)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._remove(backend, blocks, h, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self._clear(backend)

    def _stored(self, backend: str, blocks: dict[BlockHash, _Held], ev: BlockStored, default_model: str) -> None:
        if ev.parent_block_hash is None:
            ns, model = _scope(ev, default_model)
            parent = root_key(ns, model)
        else:
            held = blocks.get(ev.parent_block_hash)
            if held is None:
                raise IndexGap(f"{backend}: a store under a block the index never saw")
            parent = held.key
        if ev.block_size < 1 or len(ev.token_ids) > ev.block_size * len(ev.block_hashes):
            raise IndexGap(f"{backend}: a store whose tokens do not fit its blocks")
        keys = chain_keys(parent, ev.token_ids, ev.block_size)
        medium = ev.medium or ""
        for h, key in zip(ev.block_hashes, keys, strict=False):  # a partial last block has no key
            held = blocks.get(h)
            if held is None or held.key != key:
                if held is not None:
                    self._remove(backend, blocks, h, None)
                held = blocks[h] = _Held(key)
            held.media.add(medium)
            self._where.setdefault(key, {}).setdefault(backend, set()).add(medium)

    def _remove(self, backend: str, blocks: dict[BlockHash, _Held], h: BlockHash, medium: str | None) -> None:
        held = blocks.get(h)
        if held is None:
            return
        gone = set(held.media) if medium is None else {medium} & held.media
        held.media -= gone
        where = self._where.get(held.key)
        if where is not None and backend in where:
            where[backend] -= gone
            if not where[backend]:
                del where[backend]
            if not where:
                del self._where[held.key]
        if not held.media:
            del blocks[h]

    def _clear(self, backend: str) -> None:
        for held in self._backends.get(backend, {}).values():
            where = self._where.get(held.key)
            if where is not None:
                where.pop(backend, None)
                if not where:
                    del self._where[held.key]
        self._backends[backend] = {}

    def clear(self, backend: str) -> None:
        """Forget everything ``backend`` held (before a snapshot, or when it restarts)."""
        with self._lock:
            self._clear(backend)

    def drop(self, backend: str) -> None:
        """``backend`` left the fleet: its blocks (shared ones included) no longer count."""
        with self._lock:
            self._clear(backend)
            del self._backends[backend]

    def expect(self, backend: str, keys: Sequence[bytes]) -> None:
        """``backend`` was sent a prompt with these keys: count them there for a while."""
        now = self._clock()
        with self._lock:
            deadline = now + EXPECT_S
            for key in keys:
                self._expected.setdefault(key, {})[backend] = deadline
            if now >= self._sweep_at:  # amortized: expired expectations leave once per period
                self._sweep_at = now + EXPECT_S
                for key in [k for k, d in self._expected.items() if max(d.values()) <= now]:
                    del self._expected[key]

    # ------------------------------------------------------------------ lookups

    def matched(self, chains: Sequence[Sequence[bytes]], backends: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """For each of ``backends``, the best medium of each block of the longest prefix
        it can use along any of ``chains`` (a tenant's own chain, the public one)."""
        best: dict[str, tuple[str, ...]] = {b: () for b in backends}
        now = self._clock()
        with self._lock:
            for chain in chains:
                for b in backends:
                    run = self._run(chain, b, now)
                    if len(run) > len(best[b]):
                        best[b] = run
        return best

    def _run(self, chain: Sequence[bytes], backend: str, now: float) -> tuple[str, ...]:
        out: list[str] = []
        for key in chain:
            where = self._where.get(key, {})
            media = set(where.get(backend, ()))
            media.update(m for holder in where.values() for m in holder if m in self.shared)
            if self._expected.get(key, {}).get(backend, 0.0) > now:
                media.add(EXPECTED)
            if not media:
                break
            out.append(max(media, key=lambda m: (self._rank.get(m, 0.0), m)))
        return tuple(out)

    def held(self, backend: str) -> int:
        with self._lock:
            return len(self._backends.get(backend, {}))

    def stats(self) -> IndexStats:
        with self._lock:
            placements = sum(len(b) for b in self._backends.values())
            return IndexStats(len(self._backends), len(self._where), placements)


def _scope(ev: BlockStored, default_model: str) -> tuple[str, str]:
    """The (namespace, model) of a chain's first store: ours in ``extra_keys``; a vLLM
    backend's own events carry none (public namespace, the backend's model)."""
    first = ev.extra_keys[0] if ev.extra_keys else None
    if first and len(first) >= 2 and isinstance(first[0], str) and isinstance(first[1], str):
        return first[0], first[1]
    return "", default_model
