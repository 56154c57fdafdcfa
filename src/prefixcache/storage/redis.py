"""Redis tier (L2, shared): codec frames under deployment-namespaced keys, behind a circuit breaker.

Block keys are deterministic across processes (design.md invariant 2), so every server
pointed at the same Redis computes the same keys and finds the others' blocks with no
shared index: it asks Redis which keys of its hash chain exist (``contains_prefix``)
and fetches them with one MGET. That is how a fleet shares one cache::

    server A --put(k0..k3)--> +----------------------------------+
                              | redis: "<seed>:" + key -> frame  |
    server B --EXISTS k0..k5->| (maxmemory evicts on its own)    |
             --MGET k0..k3--> +----------------------------------+

Every value is a codec frame, verified on the way out (``codec.decode(value, key=key)``),
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
from collections.abc import Callable, Sequence
from typing import ClassVar, Final, Literal, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from prefixcache.storage import codec
from prefixcache.storage.base import Frame, TierError, TierFull, TierStore

__all__ = ["CircuitBreaker", "RedisStore"]

T = TypeVar("T")
BreakerState = Literal["closed", "open", "half_open"]

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


class CircuitBreaker:
    """Closed -> open after ``failure_threshold`` consecutive failures; open -> half-open after a backoff.

    While open, ``allow()`` says no without touching the network. When the backoff has
    passed, one trial call is allowed (half-open): success closes the breaker and resets
    the backoff to ``reset_after``; failure reopens it with the backoff doubled, up to
    ``max_backoff``. The clock is injected so tests (and the simulator) drive it.

    NOTE: a trial that never reports (its caller died) does not wedge the breaker: the
    half-open state restarts the backoff timer, so another trial is allowed after it.
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        reset_after: float = 1.0,
        max_backoff: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "redis",
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not 0 < reset_after <= max_backoff:
            raise ValueError(f"need 0 < reset_after <= max_backoff, got {reset_after} and {max_backoff}")
        self.failure_threshold = failure_threshold
        self.reset_after = reset_after
        self.max_backoff = max_backoff
        self.name = name  # what its log lines call the tier (an address without credentials)
        self._clock = clock
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._failures = 0
        self._backoff = reset_after
        self._since = 0.0  # when the breaker last opened (or half-opened)

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def backoff(self) -> float:
        """Seconds an open breaker waits before its next trial."""
        return self._backoff

    def allow(self) -> bool:
        """Whether a call may go to the network now (a ``True`` in the open state is the trial)."""
        with self._lock:
            if self._state == "closed":
                return True
            now = self._clock()
            if now - self._since < self._backoff:
                return False
            self._state, self._since = "half_open", now
            return True

    def record_success(self) -> None:
        with self._lock:
            was = self._state
            self._state, self._failures, self._backoff = "closed", 0, self.reset_after
        if was != "closed":
            log.warning("event=tier_breaker_closed tier=%s state=closed (reachable again)", self.name)

    def record_failure(self) -> None:
        with self._lock:
            if self._state == "closed":
                self._failures += 1
                opened = self._failures >= self.failure_threshold
                if opened:
                    self._state, self._since = "open", self._clock()
                failures, backoff = self._failures, self._backoff
            else:
                # a failed trial (or a late failure of a call made before the breaker opened)
                if self._state == "half_open":
                    self._backoff = min(self._backoff * 2, self.max_backoff)
                self._state, self._since = "open", self._clock()
                opened, failures, backoff = False, self._failures, self._backoff
        if opened:
            log.warning(
                "event=tier_breaker_open tier=%s state=open failures=%d next_trial_s=%.1f "
                "(its reads are misses and its writes are dropped until it answers)",
                self.name,
                failures,
                backoff,
            )


class RedisStore(TierStore):
    """Frames in Redis under ``"<namespace>:" + key``; reads verified, failures counted as misses.

    ``capacity_bytes`` is a soft budget: the bytes of frames *this process* wrote and has
    not deleted (``TierFull`` past it, so the cache evicts its own blocks first). Redis's
    ``maxmemory`` is the hard cap of the shared instance; what Redis evicts on its own is
    forgotten here when a read or membership test finds it gone. ``len()`` likewise counts
    the keys this process put and has not deleted or seen missing; Redis may hold fewer
    (evicted) or more (other processes' blocks).

    Error kinds counted in ``stats.errors``: ``connection``, ``timeout``, ``redis`` (any
    other Redis error), ``breaker_open`` (a call skipped by the open breaker) and
    ``checksum`` (a value that failed ``codec.decode``; it is deleted, best effort).

    NOTE: ``namespace`` is the deployment seed. It isolates deployments sharing one Redis
    by key prefix; it is not a security boundary (see codec.py on MACs).
    """

    kind: ClassVar[str] = "redis"
    verifies_reads: ClassVar[bool] = True  # get_many decodes every frame it returns

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
    ) -> None:
        super().__init__(capacity_bytes)
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("namespace (the deployment seed) must be a non-empty string")
        self.namespace = namespace
        self.stats.where = f"redis:{_safe_address(url)}"
        self._prefix = f"{namespace}:".encode()
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
        self._sizes: dict[bytes, int] = {}  # key -> frame bytes, for what this process put
        self._used = 0
        self._books = threading.Lock()  # _sizes and _used; never held over a network call
        self._closed = False

    # ------------------------------------------------------------------ accounting

    @property
    def used_bytes(self) -> int:
        """Bytes of the frames this process put and has not deleted (or seen evicted)."""
        return self._used

    def _forget(self, key: bytes) -> None:
        with self._books:
            self._used -= self._sizes.pop(key, 0)

    def _rkey(self, key: bytes) -> bytes:
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        return self._prefix + key

    # ------------------------------------------------------------------ the one door to the network

    def _call(self, op: Callable[[redis.Redis], T]) -> T:
        """Run ``op`` through the breaker; every failure is counted and re-raised as ``TierError``.

        NOTE: a ``ResponseError`` (WRONGTYPE, OOM under ``noeviction``) means Redis answered,
        so it counts as a success for the breaker: only an unreachable or silent Redis opens it.
        NOTE: redis-py drops a connection that failed or timed out, so a late reply is never
        read as the answer to the next command; the frame's own key check backs that up.
        """
        if self._closed:
            raise TierError("redis store is closed")
        if not self.breaker.allow():
            self.stats.error("breaker_open")
            raise TierError("redis skipped: circuit breaker open")
        try:
            result = op(self._client)
        except (redis.TimeoutError, TimeoutError) as exc:
            self._fail("timeout", exc)
            raise TierError(f"redis timed out: {exc}") from exc
        except (redis.ConnectionError, OSError) as exc:
            self._fail("connection", exc)
            raise TierError(f"redis unreachable: {exc}") from exc
        except redis.ResponseError as exc:
            self.stats.error("redis", str(exc))
            self.breaker.record_success()
            raise TierError(f"redis refused: {exc}") from exc
        except redis.RedisError as exc:
            self._fail("redis", exc)
            raise TierError(f"redis failed: {exc}") from exc
        self.breaker.record_success()
        return result

    def _fail(self, kind: str, exc: BaseException) -> None:
        self.stats.error(kind, str(exc))
        self.breaker.record_failure()

    # ------------------------------------------------------------------ writes

    def put(self, key: bytes, frame: Frame) -> None:
        self.put_many([(key, frame)])

    def put_many(self, items: Sequence[tuple[bytes, Frame]]) -> None:
        """SET every frame in one pipeline (one round trip). ``TierFull`` before anything is sent
        when the batch does not fit the budget; ``TierError`` when Redis fails.

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

        def send(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=False)
            for rkey, (_, view) in batch.items():
                pipe.set(rkey, view)
            pipe.execute()

        self._call(send)
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
            removed = self._call(lambda client: client.delete(rkey))
        except TierError:
            return False
        if removed:
            self.stats.deletes += 1
        return bool(removed)

    # ------------------------------------------------------------------ reads

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        """One MGET; each value verified by ``codec.decode(value, key=key)``, ``None`` for any miss.

        NOTE: the frame is verified here, not only by the cache, because a shared Redis
        holds other writers' bytes: a store must never hand out a frame of another block
        or a damaged one. The cache decodes again with tokens, shape and dtype.
        """
        if not keys:
            return []
        rkeys = [self._rkey(key) for key in keys]
        try:
            values: list[bytes | str | None] = self._call(lambda client: client.mget(rkeys))
        except TierError:
            self.stats.misses += len(keys)
            return [None] * len(keys)
        out: list[Frame | None] = []
        bad: list[bytes] = []
        for key, value in zip(keys, values, strict=True):
            frame = self._verified(key, value)
            if frame is None:
                self.stats.misses += 1
                self._forget(key)
                if value is not None:
                    bad.append(self._prefix + key)
            else:
                self.stats.hits += 1
                self.stats.bytes_read += len(frame)
            out.append(frame)
        if bad:
            self._discard(bad)
        return out

    def _verified(self, key: bytes, value: object) -> bytes | None:
        if value is None:
            return None
        if not isinstance(value, bytes):
            self.stats.error("checksum")
            return None
        try:
            codec.decode(value, key=key)
        except codec.FrameError:
            self.stats.error("checksum")
            return None
        return value

    def _discard(self, rkeys: list[bytes]) -> None:
        """DEL bad values, best effort: a failure is counted and the next read finds them bad again."""
        with contextlib.suppress(TierError):
            self._call(lambda client: client.delete(*rkeys))

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
            rkeys = [self._rkey(key) for key in chunk]

            def probe(client: redis.Redis, rkeys: list[bytes] = rkeys) -> list[int]:
                pipe = client.pipeline(transaction=False)
                for rkey in rkeys:
                    pipe.exists(rkey)
                answers: list[int] = pipe.execute()
                return answers

            try:
                answers = self._call(probe)
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
        self._client.close()


def _byte_view(frame: Frame) -> memoryview:
    """``frame`` as flat bytes (redis-py sends a memoryview without copying it into ``bytes``)."""
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if not view.c_contiguous:
        raise TypeError("frame must be a contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")
