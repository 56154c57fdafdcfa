"""Redis tier (L2, shared): codec frames under deployment-namespaced keys, behind a circuit breaker.

Block keys are deterministic across processes (design.md invariant 2), so every server
pointed at the same Redis computes the same keys and finds the others' blocks with no
shared index: it asks Redis which keys of its hash chain exist (``contains_prefix``)
and fetches them with one MGET. That is how a fleet shares one cache::

    server A --put(k0..k3)--> +----------------------------------+
                              | redis: "<seed>:" + key -> frame  |
    server B --EXISTS k0..k5->| (maxmemory evicts on its own)    |
             --MGET k0..k3--> +----------------------------------+

Every value is a codec frame, verified on the way out (``codec.verify(value, key=key)``),
so a frame written by one node is checked by another and bad bytes are a counted miss
(invariants 6 and 8). Every failure of Redis (down, slow, refusing) is a counted miss
for reads and a ``TierError`` for writes, never an exception out of a read and never
wrong bytes. A ``CircuitBreaker`` turns a dead or stalled Redis into immediate misses, so
a request pays at most a few read timeouts before the store stops touching the network.

A store holds no policy (``storage/base.py``): Redis may evict by its own ``maxmemory``
policy at any time, and that is just a miss.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, Final, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from prefixcache.storage import codec
from prefixcache.storage.base import (
    EPOCH_NAME,
    EPOCH_RECORD_BYTES,
    EPOCH_RECORDS,
    MAX_FRAME_BYTES,
    Frame,
    TierError,
    TierFull,
    TierStore,
    epoch_book,
)
from prefixcache.storage.breaker import CircuitBreaker

__all__ = ["EXISTS_CHUNK", "CircuitBreaker", "RedisStore", "RedisTierBase"]

T = TypeVar("T")

# NOTE: contains_prefix asks in chunks and stops at the first chunk with a hole: a long
# chain costs one round trip per chunk, and a short match does not pay for the whole chain.
EXISTS_CHUNK: Final = 128


log = logging.getLogger("prefixcache.tiers")


def _safe_address(url: str) -> str:
    """``url`` without its credentials, for log lines."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisTierBase(TierStore):
    """What every Redis tier shares: the byte budget and key books, the key layout, frame
    verification, and the mapping of every Redis failure to a counted ``TierError``.
    Subclasses move the bytes (``_send``, ``_fetch``, ``_probe``, ``_remove``): one server
    (``RedisStore``) or a cluster (``storage/redis_cluster.py``).

    ``capacity_bytes`` is a soft budget: the bytes of frames *this process* wrote and has
    not deleted (``TierFull`` past it, so the cache evicts its own blocks first). Redis's
    ``maxmemory`` is the hard cap of the shared instance; what Redis evicts on its own is
    forgotten here when a read or membership test finds it gone. ``len()`` likewise counts
    the keys this process put and has not deleted or seen missing; Redis may hold fewer
    (evicted) or more (other processes' blocks).

    Error kinds counted in ``stats.errors``: ``connection``, ``timeout``, ``redis`` (any
    other Redis error), ``breaker_open`` (a call skipped by the open breaker) and
    ``checksum`` (a value that failed ``codec.verify``; it is deleted, best effort).

    NOTE: ``namespace`` is the deployment seed. It isolates deployments sharing one Redis
    by key prefix; it is not a security boundary (see codec.py on MACs).
    """

    kind: ClassVar[str] = "redis"
    verifies_reads: ClassVar[bool] = True  # get_many decodes every frame it returns

    def __init__(self, capacity_bytes: int, namespace: str, where: str, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        super().__init__(capacity_bytes)
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("namespace (the deployment seed) must be a non-empty string")
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")
        # NOTE: a value is read no further than one byte past this (GETRANGE): a longer one
        # is no frame of this tier, whoever wrote it, and never costs more memory than a frame
        self.max_frame_bytes = max_frame_bytes
        self.namespace = namespace
        self.stats.where = where
        self._prefix = f"{namespace}:".encode()
        self._sizes: dict[bytes, int] = {}  # key -> frame bytes, for what this process put
        self._used = 0
        self._books = threading.Lock()  # _sizes and _used; never held over a network call
        self._closed = False

    # ------------------------------------------------------------------ what a subclass does

    def _rkey(self, key: bytes) -> bytes:
        """The Redis key of block ``key`` (the only key a block uses)."""
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        return self._prefix + key

    @abstractmethod
    def _send(self, batch: dict[bytes, memoryview]) -> None:
        """SET every Redis key to its frame; ``TierError`` when any SET may have failed."""

    @abstractmethod
    def _fetch(self, rkeys: list[bytes]) -> Sequence[object]:
        """The values of ``rkeys`` in order, ``None`` for absent or unreachable ones."""

    @abstractmethod
    def _probe(self, rkeys: list[bytes]) -> list[bool]:
        """Which of ``rkeys`` exist (an unreachable one does not)."""

    @abstractmethod
    def _remove(self, rkeys: list[bytes]) -> int:
        """DEL ``rkeys``; how many were there."""

    def _disconnect(self) -> None:
        """Drop the connections."""

    # ------------------------------------------------------------------ accounting

    @property
    def used_bytes(self) -> int:
        """Bytes of the frames this process put and has not deleted (or seen evicted)."""
        return self._used

    def _forget(self, key: bytes) -> None:
        with self._books:
            self._used -= self._sizes.pop(key, 0)

    # ------------------------------------------------------------------ the door to the network

    def _guarded(self, breaker: CircuitBreaker, op: Callable[[], T]) -> T:
        """Run ``op`` through ``breaker``; every failure is counted and re-raised as ``TierError``.

        NOTE: a ``ResponseError`` (WRONGTYPE, OOM under ``noeviction``) means Redis answered,
        so it counts as a success for the breaker: only an unreachable or silent Redis opens it.
        NOTE: redis-py drops a connection that failed or timed out, so a late reply is never
        read as the answer to the next command; the frame's own key check backs that up.
        """
        if self._closed:
            raise TierError("redis store is closed")
        if not breaker.allow():
            self.stats.error("breaker_open")
            raise TierError(f"redis skipped: circuit breaker of {breaker.name} open")
        try:
            result = op()
        except (redis.TimeoutError, TimeoutError) as exc:
            self._fail(breaker, "timeout", exc)
            raise TierError(f"redis timed out: {exc}") from exc
        except (redis.ConnectionError, OSError) as exc:
            self._fail(breaker, "connection", exc)
            raise TierError(f"redis unreachable: {exc}") from exc
        except redis.ResponseError as exc:
            self.stats.error("redis", str(exc))
            breaker.record_success()
            raise TierError(f"redis refused: {exc}") from exc
        except (redis.RedisError, RedisClusterException) as exc:
            self._fail(breaker, "redis", exc)
            raise TierError(f"redis failed: {exc}") from exc
        breaker.record_success()
        return result

    def _fail(self, breaker: CircuitBreaker, kind: str, exc: BaseException) -> None:
        self.stats.error(kind, str(exc))
        breaker.record_failure()

    # ------------------------------------------------------------------ writes

    def put(self, key: bytes, frame: Frame) -> None:
        self.put_many([(key, frame)])

    def put_many(self, items: Sequence[tuple[bytes, Frame]]) -> None:
        """SET every frame, pipelined. ``TierFull`` before anything is sent when the batch
        does not fit the budget; ``TierError`` when Redis fails.

        NOTE: on a failure some SETs of the batch may still have landed (a timeout says
        nothing about what the server did). Nothing is accounted for them here; they are
        valid frames under their own keys, so a later read serves them correctly or
        Redis evicts them. ``TierError`` tells the cache to assume none was stored.
        """
        batch = {self._rkey(key): (key, _byte_view(frame)) for key, frame in items}
        if not batch:
            return
        with self._books:
            grow = sum(view.nbytes - self._sizes.get(key, 0) for key, view in batch.values())
            used = self._used
        if used + grow > self.capacity_bytes:
            raise TierFull(f"{self._used} + {grow} bytes would pass the {self.capacity_bytes}-byte budget")
        self._send({rkey: view for rkey, (_, view) in batch.items()})
        with self._books:
            for key, view in batch.values():
                self._used += view.nbytes - self._sizes.get(key, 0)
                self._sizes[key] = view.nbytes
                self.stats.puts += 1
                self.stats.bytes_written += view.nbytes

    def delete(self, key: bytes) -> bool:
        """DEL the key; ``False`` when it was not there or Redis failed (counted)."""
        rkey = self._rkey(key)
        self._forget(key)  # NOTE: even on failure: an undeletable key must not hold the budget forever
        try:
            removed = self._remove([rkey])
        except TierError:
            return False
        if removed:
            self.stats.deletes += 1
        return bool(removed)

    # ------------------------------------------------------------------ reads

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        """The frames of ``keys``, each verified by ``codec.verify(value, key=key)``, ``None`` for any miss.

        NOTE: the frame is verified here, not only by the cache, because a shared Redis
        holds other writers' bytes: a store must never hand out a frame of another block
        or a damaged one. The cache decodes again with tokens, shape and dtype.
        """
        if not keys:
            return []
        rkeys = [self._rkey(key) for key in keys]
        try:
            values = self._fetch(rkeys)
        except TierError:
            self.stats.misses += len(keys)
            return [None] * len(keys)
        out: list[Frame | None] = []
        bad: list[bytes] = []
        for key, rkey, value in zip(keys, rkeys, values, strict=True):
            frame = self._verified(key, value)
            if frame is None:
                self.stats.misses += 1
                self._forget(key)
                if value is not None and value != b"":  # "": absent (GETRANGE), nothing to delete
                    bad.append(rkey)
            else:
                self.stats.hits += 1
                self.stats.bytes_read += len(frame)
            out.append(frame)
        if bad:
            self._discard(bad)
        return out

    def _verified(self, key: bytes, value: object) -> bytes | None:
        if value is None or value == b"":  # NOTE: GETRANGE answers a missing key with ""
            return None
        if not isinstance(value, bytes) or len(value) > self.max_frame_bytes:
            self.stats.error("checksum")
            return None
        try:
            codec.verify(value, key=key)
        except codec.FrameError:
            self.stats.error("checksum")
            return None
        return value

    def _discard(self, rkeys: list[bytes]) -> None:
        """DEL bad values, best effort: a failure is counted and the next read finds them bad again."""
        with contextlib.suppress(TierError):
            self._remove(rkeys)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        return self.contains_prefix([key]) == 1

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` exist: pipelined EXISTS in chunks, stopping at the first hole.

        NOTE: not the base class's binary search. Redis evicts by its own policy, which
        knows nothing of chains: it may drop a parent and keep its child, so a chain in
        Redis is not prefix-closed and a binary search could step over a hole. Counting
        leading hits is exact, and a chunk of EXISTS costs one round trip like one probe.
        A membership test is not a read: the frame is verified only by ``get_many``.
        """
        held = 0
        for start in range(0, len(keys), EXISTS_CHUNK):
            chunk = keys[start : start + EXISTS_CHUNK]
            try:
                answers = self._probe([self._rkey(key) for key in chunk])
            except TierError:
                return held
            for key, exists in zip(chunk, answers, strict=True):
                if not exists:
                    self._forget(key)
                    return held
                held += 1
        return held

    def __len__(self) -> int:
        """Keys this process put and has not deleted or seen missing (Redis may have evicted some)."""
        return len(self._sizes)

    def close(self) -> None:
        """Drop the connections; later reads are misses and later writes raise ``TierError``."""
        if self._closed:
            return
        self._closed = True
        self._disconnect()

    # ------------------------------------------------------------------ epoch records

    epoch_sync: ClassVar[bool] = True  # other servers write it too: re-read while the cache runs

    def _epochs_key(self, book: str = "epochs") -> bytes:
        """The hash of one book's records (``base.EPOCH_BOOKS``), field <name> -> record.
        NOTE: no block's key: a block's is the namespace and a digest of 8 bytes or more
        (hex in braces in a cluster), never "~epochs" (7 bytes) nor "~generations" (12 bytes:
        no registered hash gives a digest of that length)."""
        return self._prefix + b"~" + epoch_book(book).encode()

    def _on_epochs(self, key: bytes, op: Callable[[redis.Redis], T]) -> T:
        """Run ``op`` on the connection that holds ``key``, through its breaker."""
        raise NotImplementedError

    def read_epochs(self, book: str = "epochs") -> list[tuple[str, bytes]]:
        """The records of the book's hash (``base.EpochKeeper``), filtered in Redis by a
        script, so that no longer or misnamed one, and no more than ``EPOCH_RECORDS``,
        crosses the network (those left there are counted ``epoch``)."""
        key = self._epochs_key(book)
        reply = self._on_epochs(key, lambda c: c.eval(_READ_EPOCHS, 1, key, EPOCH_RECORD_BYTES, EPOCH_RECORDS))
        if not isinstance(reply, list) or not reply or not isinstance(reply[0], int) or len(reply) % 2 != 1:
            self.stats.error("epoch", "the epoch script's reply is not a list of records")
            return []
        if reply[0]:
            self.stats.error("epoch", f"{reply[0]} records too long or misnamed, left unread")
        found: list[tuple[str, bytes]] = []
        for name, record in zip(reply[1::2], reply[2::2], strict=True):
            if isinstance(name, bytes) and isinstance(record, bytes) and EPOCH_NAME.fullmatch(name.decode("latin-1")):
                found.append((name.decode("ascii"), record))
            else:
                self.stats.error("epoch", "a misnamed record")
        return found

    def write_epoch(self, name: str, record: bytes, book: str = "epochs") -> None:
        """HSET the record: one command, so a reader sees it whole or not at all."""
        if not EPOCH_NAME.fullmatch(name):
            raise ValueError(f"not an epoch record's name: {name!r}")
        key = self._epochs_key(book)
        self._on_epochs(key, lambda c: c.hset(key, name, record))


# The epochs hash's fields named for a record (32 bytes) whose value is short enough, at
# most ARGV[2] of them; the first element counts those left out. The hash is whatever a
# writer of the Redis made it: only what this returns leaves Redis.
_READ_EPOCHS: Final = """
local out, left = {0}, 0
local all = redis.call('HGETALL', KEYS[1])
local limit, most = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, #all, 2 do
  if #all[i] == 32 and #all[i + 1] <= limit and (#out - 1) / 2 < most then
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  else
    left = left + 1
  end
end
out[1] = left
return out
"""


class RedisStore(RedisTierBase):
    """Frames in one Redis under ``"<namespace>:" + key``; reads verified, failures counted as misses.

    One breaker guards the server; every call is one round trip (a pipeline or an MGET).
    """

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        namespace: str,
        *,
        connect_timeout: float = 0.2,
        read_timeout: float = 0.2,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        super().__init__(capacity_bytes, namespace, f"redis:{_safe_address(url)}", max_frame_bytes)
        self.breaker = breaker if breaker is not None else CircuitBreaker(clock=clock, name=_safe_address(url))
        # NOTE: redis-py retries failed commands by default (with backoff), which would
        # multiply the read deadline; the breaker is our retry policy, so retries are 0.
        self._client: redis.Redis = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout,
            socket_timeout=read_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )

    def _call(self, op: Callable[[redis.Redis], T]) -> T:
        """Run ``op`` on the client through the breaker (the one door to the network)."""
        return self._guarded(self.breaker, lambda: op(self._client))

    def _send(self, batch: dict[bytes, memoryview]) -> None:
        def send(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=False)
            for rkey, view in batch.items():
                pipe.set(rkey, view)
            pipe.execute()

        self._call(send)

    def _fetch(self, rkeys: list[bytes]) -> Sequence[object]:
        # NOTE: GETRANGE, so that no value is read past a frame (``_verified``); in one
        # MULTI, so that the replies are built in one go as an MGET's are: a plain pipeline
        # lets a Redis under maxmemory evict the keys still to be read while the first
        # replies wait in its output buffer. A Redis that cannot make room at all refuses a
        # MULTI (an error reply: misses, counted ``redis``)
        def fetch(client: redis.Redis) -> list[object]:
            pipe = client.pipeline(transaction=True)
            for rkey in rkeys:
                pipe.getrange(rkey, 0, self.max_frame_bytes)
            return pipe.execute()

        return self._call(fetch)

    def _probe(self, rkeys: list[bytes]) -> list[bool]:
        def probe(client: redis.Redis) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.exists(rkey)
            return [bool(n) for n in pipe.execute()]

        return self._call(probe)

    def _remove(self, rkeys: list[bytes]) -> int:
        removed: int = self._call(lambda client: client.delete(*rkeys))
        return removed

    def _disconnect(self) -> None:
        self._client.close()

    def _on_epochs(self, key: bytes, op: Callable[[redis.Redis], T]) -> T:
        return self._call(op)


def _byte_view(frame: Frame) -> memoryview:
    """``frame`` as flat bytes (redis-py sends a memoryview without copying it into ``bytes``)."""
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if not view.c_contiguous:
        raise TypeError("frame must be a contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")
