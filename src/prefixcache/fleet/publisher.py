"""A server's KV events on a Redis stream: what a router builds its global index from.

::

    request threads --(cache lock)--> cache event log
                                           |  drain (cache lock, no I/O)
    publisher thread ----------------------+--> KVEventBatch, seq n --XADD--> <prefix>:events:<name>
    GET /fleet/snapshot -- same step, with the residency --> Snapshot(inc, seq = n, ...)

Every ``interval_s`` the thread drains the cache's events, translates the tier moves
(``translate.py``), numbers each batch ``1, 2, ...`` in this incarnation and sends it as
one stream entry, trimmed to about ``maxlen`` entries (the replay buffer). The first
batch of an incarnation is ``AllBlocksCleared`` and the cache's whole residency, so the
stream alone rebuilds the index; so is the batch after the cache's event log overflowed
(events were lost before they were read: the state is sent again, whole).

A disk tier's blocks outlive the process; its tree does not. So that a restarted
server announces what its disk holds (a router would score it cold otherwise), the
publisher keeps a journal of the blocks that enter the disk tier (``journal.py``, in the
tier's folder): the whole-residency batches announce, beside the tree's blocks, the
frames found on open that a journal record names (parents first), and an orphan that
leaves the tier is announced removed like any block.

Redis down or slow: a batch that cannot be sent is dropped, counted
(``prefixcache_fleet_batches_dropped_total``) and logged at most once per
``log_every_s``, and its seq is spent anyway, so a router sees the gap (a seq that is in
no entry) and takes a snapshot. After a failure the publisher waits ``retry_s`` before it
tries again (batches meanwhile are dropped the same way). The cache's lock is never held
while Redis is talked to, and request threads never wait on the publisher.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter
from redis.backoff import NoBackoff
from redis.retry import Retry

from prefixcache.cache import PrefixCache
from prefixcache.events import Drained
from prefixcache.fleet.journal import DiskRecorder, Journal
from prefixcache.fleet.translate import stored_whole, wire_events
from prefixcache.fleet.wire import (
    AllBlocksCleared,
    BackendInfo,
    BlockStored,
    Entry,
    Event,
    KVEventBatch,
    Snapshot,
    encode_entry,
    stream_key,
)

__all__ = ["FleetPublisher", "PublisherConfig"]

log = logging.getLogger("prefixcache.fleet")

MAX_EVENTS = 256  # wire events per batch (one stream entry): a flood is sent as several entries


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Where and how a publisher sends (``[fleet]`` in the server's settings)."""

    redis_url: str
    name: str
    prefix: str = "prefixcache:fleet"
    maxlen: int = 10_000
    interval_s: float = 0.05  # how often the thread drains the cache's events
    timeout_s: float = 0.5  # connect and read timeout of one XADD
    retry_s: float = 1.0  # after a failed XADD, how long batches are dropped without trying
    log_every_s: float = 30.0  # at most one warning per this many seconds while batches are dropped

    @property
    def stream(self) -> str:
        return stream_key(self.prefix, self.name)


class FleetPublisher:
    """Publishes one cache's tier residency as KV events (see the module docstring).

    ``model`` is the model id the cache's contexts carry (what ``BackendInfo`` names);
    ``client`` (default: one from ``config.redis_url``), ``clock`` (``time.monotonic``,
    for retries and log limits), ``wall`` (``time.time``, the batches' ``ts``) and ``inc``
    (default: a random id) are injectable for tests. ``journal``: where the disk tier's
    blocks are recorded for the next incarnation (None: nowhere)."""

    def __init__(
        self,
        cache: PrefixCache,
        config: PublisherConfig,
        model: str,
        *,
        registry: CollectorRegistry | None = None,
        client: redis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        inc: str | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.cache, self.config, self.model = cache, config, model
        self.inc = inc if inc is not None else uuid.uuid4().hex
        self.seq = 0  # the last seq spent (sent or dropped)
        self.block_size = cache.config.block_size
        self._kinds = [t.kind for t in cache.config.tiers]
        self._client = client if client is not None else _client(config)
        self._clock, self._wall = clock, wall
        self._step = threading.Lock()  # one drain-number-send at a time: seqs reach the stream in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dropped_events = -1  # the cache log's drop count at the last drain (-1: nothing drained yet)
        self._retry_at = 0.0
        self._log_at = 0.0
        self._unlogged = 0
        self._recorder = DiskRecorder(journal, self.block_size) if journal is not None else None
        r = registry if registry is not None else CollectorRegistry()
        self.published = Counter(
            "prefixcache_fleet_batches_published", "KV event batches sent to the fleet stream.", registry=r
        )
        self.dropped = Counter(
            "prefixcache_fleet_batches_dropped",
            "KV event batches dropped because Redis could not take them (their seq is a gap).",
            registry=r,
        )

    # ================================================================ what a router asks

    def info(self) -> BackendInfo:
        c = self.config
        return BackendInfo(c.name, self.inc, c.stream, self.block_size, self.model, c.maxlen)

    def snapshot(self) -> Snapshot:
        """The whole index at an exact seq: the pending events are drained with the
        residency in one step under the cache's lock, sent (outside it) as batch ``seq``,
        and the residency is the state after that batch."""
        with self._step:
            drained = self.cache.drain(residency=True)
            self._send_all(self._batches(drained))
            assert drained.resident is not None
            return Snapshot(self.inc, self.seq, self._whole(drained))

    # ================================================================ running

    def publish_pending(self) -> int:
        """One step: drain, translate, send. Returns how many batches it spent (sent or dropped)."""
        with self._step:
            fresh = self._dropped_events < 0
            drained = self.cache.drain(residency=fresh)
            return self._send_all(self._batches(drained))

    def start(self) -> FleetPublisher:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="prefixcache-fleet", daemon=True)
            self._thread.start()
            log.info(
                "event=fleet_publishing stream=%s inc=%s maxlen=%d", self.config.stream, self.inc, self.config.maxlen
            )
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after a last step (what the cache recorded until now). Idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout)
            self._guarded(self.publish_pending)
        self._client.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self._guarded(self.publish_pending)

    def _guarded(self, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception:  # NOTE: a bug here must not end publishing for the server's lifetime
            log.exception("the fleet publisher's step failed")

    # ================================================================ batches

    def _batches(self, drained: Drained) -> list[list[Event]]:
        """The wire events of one drain, cut into batches. After a drain that lost events
        (the log overflowed), or on the first one, the residency (asked for then) is sent
        whole after ``AllBlocksCleared``."""
        lost = self._dropped_events >= 0 and drained.dropped > self._dropped_events
        self._dropped_events = drained.dropped
        events: list[Event]
        self._record(drained)
        if lost and drained.resident is None:
            again = self.cache.drain(residency=True)  # the state after everything, events since included
            self._dropped_events = again.dropped
            self._record(again)
            events = [AllBlocksCleared(), *self._whole(again)]
        elif drained.resident is not None and (lost or self.seq == 0):
            events = [AllBlocksCleared(), *self._whole(drained)]
        else:
            events = list(wire_events(drained.events, self.block_size, self._kinds))
        return [events[i : i + MAX_EVENTS] for i in range(0, len(events), MAX_EVENTS)]

    def _whole(self, drained: Drained) -> list[BlockStored]:
        """The residency of a drain as stores: the tree's blocks, then the disk's orphans
        its journal names."""
        resident = drained.resident or []
        kept = self._recorder.orphans(drained) if self._recorder is not None else []
        return stored_whole([*resident, *kept], self.block_size, self._kinds)

    def _record(self, drained: Drained) -> None:
        if self._recorder is not None:
            self._recorder.observe(drained)

    def _send_all(self, batches: list[list[Event]]) -> int:
        for events in batches:
            self.seq += 1
            self._send(Entry(self.inc, self.seq, KVEventBatch(ts=self._wall(), events=events)))
        return len(batches)

    def _send(self, entry: Entry) -> None:
        now = self._clock()
        reason = "waiting to retry after a failure"
        if now >= self._retry_at:
            try:
                fields: dict[Any, Any] = encode_entry(entry)  # NOTE: redis-py's field types are invariant unions
                self._client.xadd(self.config.stream, fields, maxlen=self.config.maxlen, approximate=True)
            except redis.RedisError as exc:
                self._retry_at = now + self.config.retry_s
                reason = f"{type(exc).__name__}: {exc}"
            else:
                self.published.inc()
                return
        self.dropped.inc()
        self._unlogged += 1
        if now >= self._log_at:
            log.warning(
                "event=fleet_batches_dropped count=%d stream=%s seq=%d (%s): routers will see the gap",
                self._unlogged,
                self.config.stream,
                entry.seq,
                reason,
            )
            self._log_at, self._unlogged = now + self.config.log_every_s, 0


def _client(config: PublisherConfig) -> redis.Redis:
    # NOTE: no retries inside redis-py (they would multiply the timeout): a failed batch is dropped, its seq a gap.
    return redis.Redis.from_url(
        config.redis_url,
        socket_connect_timeout=config.timeout_s,
        socket_timeout=config.timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
