"""Redis Cluster as the shared tier: keys hash-tagged per block, calls split per node, a breaker per node.

A cluster splits the key space into 16,384 hash slots, each owned by one master. A key
whose name holds ``{...}`` is placed by what is between the braces only (its hash tag),
so every Redis key of one block carries the block key as its tag and lands on one node::

    "<namespace>:{<block key, hex>}"            the block's frame (today its only key)
     \\________/ \\__________________/
      deployment   hash tag: CRC16 of the block key's hex picks the slot, so any key
                   of the block ("...}:<part>") would share the slot and the node

The hex keeps the tag free of braces (a raw key byte ``}`` would cut it short), and the
namespace may hold none (the config refuses them), so the first ``{`` is always ours.

Multi-key commands across slots are an error in a cluster (CROSSSLOT), and the blocks of
one chain hash to different slots, so a read of many blocks is split by node: one
pipeline of GETs (or EXISTS, SETs, DELs) per master that owns some of the keys, a
round trip per node, one node after another. The slot map comes from redis-py's
``RedisCluster`` (discovery from ``url`` and ``startup_nodes``); the calls go to each
node's own client, so that one dead node costs only its own keys::

    get_many(k0..k5) --> node A: GET k0 k3   -> frames, verified
                     --> node B: GET k1 k4   -> connection refused: misses (its breaker counts)
                     --> node C: GET k2 k5   -> frames, verified
    the cache loads k0 only (k1 is missing): a shorter match, never a wrong one

Each node has its own ``CircuitBreaker``, so a dead node opens its breaker only and the
others keep serving; the discovery of the slot map has one more (``breaker``). A node
that fails, or a ``MOVED``/``ASK`` reply (the slots moved: a failover, a resharding),
asks for a new slot map, fetched at most once per ``REFRESH_EVERY_S``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import redis
from redis import Redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, RedisClusterException
from redis.retry import Retry

from prefixcache.storage.base import MAX_FRAME_BYTES, TierError, epoch_book
from prefixcache.storage.breaker import CircuitBreaker
from prefixcache.storage.redis import RedisTierBase, _safe_address

__all__ = ["REFRESH_EVERY_S", "RedisClusterStore"]

T = TypeVar("T")

REFRESH_EVERY_S: Final = 1.0  # at most one slot-map refresh a second, however many calls ask

Route = dict[str, tuple[ClusterNode, list[int]]]  # node name -> (node, indices of its keys)


class RedisClusterStore(RedisTierBase):
    """Frames in a Redis Cluster under ``"<namespace>:{<key hex>}"``; reads verified, a
    dead node's keys read as misses. ``url`` is one node (``redis://[user:pass@]host:port``),
    ``startup_nodes`` more (``"host:port"``) to discover the cluster from.

    NOTE: the slot map is fetched on the first call, not here, so that a cluster down at
    start is misses like a single Redis down at start, not an exception at startup.
    """

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        namespace: str,
        *,
        startup_nodes: Sequence[str] = (),
        connect_timeout: float = 0.2,
        read_timeout: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        address = _safe_address(url)
        super().__init__(capacity_bytes, namespace, f"redis-cluster:{address}", max_frame_bytes)
        if "{" in namespace or "}" in namespace:
            raise ValueError("a redis cluster's namespace may not hold { or } (they make the keys' hash tag)")
        self._url = url
        self._startup = [_node(spec) for spec in startup_nodes]
        self._connect_timeout, self._read_timeout = connect_timeout, read_timeout
        self._clock = clock
        self.breaker = CircuitBreaker(clock=clock, name=f"{address} (slot map)")
        self._breakers: dict[str, CircuitBreaker] = {}
        self._breakers_lock = threading.Lock()
        self._client: RedisCluster | None = None
        self._topology = threading.Lock()  # creating or refreshing the slot map (never the books)
        self._stale = False
        self._refreshed_at = -math.inf

    # ------------------------------------------------------------------ keys and slots

    def _rkey(self, key: bytes) -> bytes:
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        return b"%s{%s}" % (self._prefix, key.hex().encode())

    def slot_of(self, key: bytes) -> int:
        """The hash slot of every Redis key of block ``key``."""
        return key_slot(self._rkey(key))

    def node_breakers(self) -> dict[str, CircuitBreaker]:
        """Each node's breaker by ``host:port`` (the nodes called so far)."""
        with self._breakers_lock:
            return dict(self._breakers)

    # ------------------------------------------------------------------ the slot map

    def _cluster(self) -> RedisCluster:
        """The client with a slot map: created on first use, refreshed when stale (both counted
        through ``breaker``; a failed refresh keeps the old map)."""
        client = self._client
        if client is not None and not (self._stale and self._clock() - self._refreshed_at >= REFRESH_EVERY_S):
            return client
        with self._topology:
            if self._client is None:
                self._client = self._guarded(self.breaker, self._connect)
                self._refreshed_at, self._stale = self._clock(), False
            elif self._stale and self._clock() - self._refreshed_at >= REFRESH_EVERY_S:
                self._refreshed_at, self._stale = self._clock(), False
                try:
                    self._guarded(self.breaker, self._client.nodes_manager.initialize)
                except TierError:
                    self._stale = True  # counted; the old map serves meanwhile
            return self._client

    def _connect(self) -> RedisCluster:
        # NOTE: redis-py's cluster client retries with backoff and wants full slot
        # coverage by default; the breakers are our retry policy, and a cluster that lost
        # a master still serves the slots of the others.
        try:
            return RedisCluster(
                url=self._url,
                startup_nodes=list(self._startup),
                require_full_coverage=False,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                socket_connect_timeout=self._connect_timeout,
                socket_timeout=self._read_timeout,
            )
        except RedisClusterException as exc:
            if isinstance(exc.__cause__, redis.ConnectionError | redis.TimeoutError | OSError):
                raise exc.__cause__ from exc  # counted as what it is: no node answered
            raise

    def _breaker(self, node: ClusterNode) -> CircuitBreaker:
        with self._breakers_lock:
            breaker = self._breakers.get(node.name)
            if breaker is None:
                breaker = CircuitBreaker(clock=self._clock, name=f"redis-cluster://{node.name}")
                self._breakers[node.name] = breaker
            return breaker

    # ------------------------------------------------------------------ calls split by node

    def _route(self, client: RedisCluster, rkeys: list[bytes]) -> Route:
        """The keys' indices grouped by the master that owns their slot (an uncovered slot: none)."""
        route: Route = {}
        for i, rkey in enumerate(rkeys):
            try:
                node = client.get_node_from_key(rkey)  # type: ignore[no-untyped-call]
            except RedisClusterException:
                self._stale = True
                continue
            route.setdefault(node.name, (node, []))[1].append(i)
        return route

    def _each_node(
        self, rkeys: list[bytes], command: Callable[[Pipeline, bytes], object]
    ) -> tuple[dict[int, object], bool]:
        """``command`` for every key, one pipeline per node. Returns each answered key's reply
        by index (an error reply is left out, counted) and whether every key was answered."""
        client = self._cluster()
        replies: dict[int, object] = {}
        for node, indices in self._route(client, rkeys).values():
            conn = client.get_redis_connection(node)

            def run(conn: Redis = conn, indices: list[int] = indices) -> list[object]:
                pipe = conn.pipeline(transaction=False)
                for i in indices:
                    command(pipe, rkeys[i])
                answers: list[object] = pipe.execute(raise_on_error=False)
                return answers

            try:
                answers = self._guarded(self._breaker(node), run)
            except TierError:
                self._stale = True  # a failover may have moved its slots to a replica
                continue
            for i, answer in zip(indices, answers, strict=True):
                if isinstance(answer, Exception):
                    self.stats.error("redis", str(answer))
                    self._stale = self._stale or isinstance(answer, AskError)  # MOVED is an AskError
                else:
                    replies[i] = answer
        return replies, len(replies) == len(rkeys)

    def _send(self, batch: dict[bytes, memoryview]) -> None:
        rkeys = list(batch)
        _, whole = self._each_node(rkeys, lambda pipe, rkey: pipe.set(rkey, batch[rkey]))
        if not whole:
            raise TierError("redis cluster: some SETs were not answered (counted by kind)")

    def _fetch(self, rkeys: list[bytes]) -> Sequence[object]:
        limit = self.max_frame_bytes  # NOTE: bounded reads, as ``RedisStore._fetch``
        replies, _ = self._each_node(rkeys, lambda pipe, rkey: pipe.getrange(rkey, 0, limit))
        return [replies.get(i) for i in range(len(rkeys))]

    def _probe(self, rkeys: list[bytes]) -> list[bool]:
        replies, _ = self._each_node(rkeys, lambda pipe, rkey: pipe.exists(rkey))
        return [bool(replies.get(i)) for i in range(len(rkeys))]

    def _remove(self, rkeys: list[bytes]) -> int:
        replies, whole = self._each_node(rkeys, lambda pipe, rkey: pipe.delete(rkey))
        if not whole:
            raise TierError("redis cluster: some DELs were not answered (counted by kind)")
        return sum(n for n in replies.values() if isinstance(n, int))

    def _disconnect(self) -> None:
        with self._topology:
            if self._client is not None:
                self._client.close()

    def _epochs_key(self, book: str = "epochs") -> bytes:
        return b"%s{~%s}" % (self._prefix, epoch_book(book).encode())  # NOTE: its own tag; no block's hex holds "~"

    def _on_epochs(self, key: bytes, op: Callable[[Redis], T]) -> T:
        """``op`` on the master that owns ``key``'s slot, through that node's breaker."""
        client = self._cluster()
        try:
            node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        except RedisClusterException as exc:
            self._stale = True
            raise TierError(f"redis cluster: no node holds the epochs' slot: {exc}") from None
        conn = client.get_redis_connection(node)
        try:
            return self._guarded(self._breaker(node), lambda: op(conn))
        except TierError:
            self._stale = True  # a failover may have moved the slot
            raise


def _node(spec: str) -> ClusterNode:
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"startup_nodes are 'host:port' strings, got {spec!r}")
    return ClusterNode(host, int(port))  # type: ignore[no-untyped-call]
