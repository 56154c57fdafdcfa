"""Reading a vLLM backend's own KV-event publisher (ZMQ) into the index.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, enabled by
``--kv-events-config``) speaks two sockets:

* a PUB socket: one multipart message per batch, ``[topic, seq, payload]``; ``seq`` is
  an 8-byte big-endian integer counting from 0 in each vLLM process, ``payload`` a
  msgpack ``KVEventBatch``;
* an optional ROUTER replay socket: a DEALER sends ``[b"", start]`` (8 bytes) and gets
  ``[b"", topic, seq, payload]`` for every batch still in the publisher's buffer
  (``buffer_steps`` batches) with ``seq >= start``, then ``[b"", b"", -1, b""]``
  (vLLM 0.32; older versions leave the topic frame out: both are read).

Its payloads are read by ``vllm_events.decode_vllm``, which also credits each chain
to the namespace it serves (a tenant's, by the ``cache_salt`` the gateway set, or
``PRIVATE``): see that module.

vLLM has no incarnation on the wire and no snapshot. The reader numbers vLLM's batch
``s`` as ``s + 1`` within an incarnation of its own, and starts a new incarnation when
the live seq goes backwards (vLLM restarted: its cache is empty, so is the index). On a
gap it asks the replay socket for what it missed; when the buffer no longer holds it
(or there is no replay socket), it clears the backend's index and follows on from the
first batch it can read (``cleared``). Routing then loses hits on what that backend
held before, never correctness: a backend's blocks only lower its cost, and the
backend itself decides what it reuses. For the same reason a store whose parent the
index never saw (its chain began before a clear) is skipped (``orphans``) instead of
resynchronizing.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from prefixcache.fleet.follow import Follower, Verdict
from prefixcache.fleet.index import IndexGap
from prefixcache.fleet.vllm_events import PRIVATE, decode_vllm
from prefixcache.fleet.wire import BackendInfo, BlockStored, Entry, KVEventBatch, Snapshot, WireError

__all__ = ["PRIVATE", "VllmSource", "ZmqReader", "ZmqStats", "decode_vllm"]

log = logging.getLogger("prefixcache.route")

POLL_MS = 200  # how long one wait for a live batch lasts: also how fast a stop is noticed
REPLAY_WAIT_MS = 2_000  # per replayed message; a silent replay socket counts as no replay
RCVHWM = 100_000  # live batches queued before ZMQ drops (a gap the replay closes)
BACKOFF_S = (0.05, 0.2, 1.0, 2.0)
LOG_EVERY_S = 30.0  # at most one warning per kind of trouble in this many seconds

_END = -1


# ---------------------------------------------------------------------- a backend


@dataclass(frozen=True, slots=True)
class VllmSource:
    """A vLLM backend: its HTTP URL, its publisher's endpoints, and the block size and
    model id its keys are computed with (vLLM's own; the router must tokenize alike)."""

    url: str
    endpoint: str
    replay: str | None
    block_size: int
    model: str
    topic: str = ""

    @classmethod
    def parse(cls, spec: str, block_size: int, model: str) -> VllmSource:
        """``URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=NAME]``; raises ``ValueError``."""
        url, sep, rest = spec.partition("=")
        url = url.rstrip("/")
        if not sep or not url.startswith(("http://", "https://")):
            raise ValueError(f"--vllm-backend {spec!r}: expected URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT]")
        endpoint, *options = rest.split(",")
        extra: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("replay", "topic") or key in extra:
                raise ValueError(f"--vllm-backend {spec!r}: unknown or repeated option {option!r}")
            extra[key] = value
        for address in (endpoint, extra.get("replay")):
            if address is not None and not address.startswith(("tcp://", "ipc://")):
                raise ValueError(f"--vllm-backend {spec!r}: {address!r} is not a tcp:// or ipc:// address")
            if address is not None and "*" in address:
                raise ValueError(f"--vllm-backend {spec!r}: connect to vLLM's host, not {address!r}")
        if block_size < 1:
            raise ValueError(f"--block-size must be at least 1, got {block_size}")
        return cls(url, endpoint, extra.get("replay"), block_size, model, extra.get("topic", ""))

    def info(self) -> BackendInfo:
        """What a prefixcache server would say of itself (``/fleet/info``), for vLLM."""
        return BackendInfo(self.url, "", self.endpoint, self.block_size, self.model, 0)


# ---------------------------------------------------------------------- the reader


@dataclass(slots=True)
class ZmqStats:
    received: int = 0  # live batches read
    bad: int = 0  # messages or payloads that are not vLLM's
    cleared: int = 0  # gaps the replay could not close: the backend's index was cleared
    restarts: int = 0  # vLLM's seq went backwards: a new incarnation
    orphans: int = 0  # stores under a block the index never saw, skipped
    other_groups: int = 0  # events of KV cache groups other than 0, left out
    replay_timeouts: int = 0
    other_block_size: int = 0  # stores whose block size is not the router's: never matched


class ZmqReader:
    """Follows a vLLM publisher for ``follower`` (``StreamReader``'s counterpart);
    ``salts``: the tenants' cache salts, by which their chains are credited to them
    (``decode_vllm``; read on each batch, so a table the gateway grows is followed)."""

    _incarnations = itertools.count(1)

    def __init__(
        self,
        follower: Follower,
        source: VllmSource,
        context: zmq.Context[Any] | None = None,
        salts: Mapping[str, str] | None = None,
    ) -> None:
        self.follower, self.source, self.salts = follower, source, salts
        self.ctx = context if context is not None else zmq.Context.instance()
        self.inc = self._new_inc()
        self.last_live: int | None = None  # vLLM's seq of the last live batch
        self.lost = 0
        self.errors = 0
        self.stats = ZmqStats()
        self._dealer: zmq.Socket[bytes] | None = None
        self._logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"route-zmq-{follower.backend}", daemon=True)

    def _new_inc(self) -> str:
        return f"vllm:{self.source.endpoint}#{next(self._incarnations)}"

    def start(self) -> ZmqReader:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def lose_next(self, n: int) -> None:
        """Discard the next ``n`` live batches, as a lossy transport would (for tests)."""
        self.lost += n

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            sub = self.ctx.socket(zmq.SUB)
            try:
                sub.setsockopt(zmq.RCVHWM, RCVHWM)
                sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
                sub.connect(self.source.endpoint)
                while not self._stop.is_set():
                    if sub.poll(POLL_MS):
                        self._live(sub.recv_multipart())
                        failures = 0
            except (zmq.ZMQError, OSError) as exc:
                self.errors += 1
                wait = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                self._warn("error", "kind=%s retry_s=%.2f", type(exc).__name__, wait)
                self._stop.wait(wait)
            finally:
                sub.close(linger=0)
                self._close_dealer()

    def _live(self, frames: list[bytes]) -> None:
        seq = _seq(frames) if len(frames) == 3 else None
        if seq is None:
            self._bad("a live message is not [topic, seq, payload]")
            return
        self.stats.received += 1
        if self.last_live is not None and seq <= self.last_live:
            self.inc = self._new_inc()  # vLLM restarted: its cache starts empty
            self.stats.restarts += 1
            log.info("event=route_vllm_restart backend=%s seq=%d", self.follower.backend, seq)
        self.last_live = seq
        if self.lost > 0:
            self.lost -= 1
            return
        if self.follower.inc != self.inc:  # new, restarted, or forgotten (the backend was down)
            self.follower.load(Snapshot(self.inc, 0, []))
        batch = self._decode(frames[2])
        if batch is None:
            return  # the next batch is a gap, which the replay (or a clear) closes
        entry = Entry(self.inc, seq + 1, batch)
        if self._apply(entry) is Verdict.GAP:
            self._recover(entry)

    def _apply(self, entry: Entry) -> Verdict:
        try:
            verdict = self.follower.offer(entry)
        except ValueError:  # tokens no key can cover (e.g. negative ids): dropped event by event
            verdict = Verdict.RESYNC
        if verdict is Verdict.RESYNC:  # same incarnation: an event the index cannot place
            self._orphans(entry)
            return Verdict.APPLIED
        return verdict

    def _orphans(self, entry: Entry) -> None:
        """Apply ``entry`` event by event, skipping what cannot be placed. The events
        before the one that failed are applied again, which changes nothing (a store is
        idempotent, so are removals and clears in the same order)."""
        f = self.follower
        for event in entry.batch.events:
            try:
                f.index.apply(f.backend, event, f.model)
            except IndexGap:
                self.stats.orphans += 1
            except ValueError as exc:
                self._bad(str(exc))
        f.inc, f.seq = entry.inc, entry.seq
        f.stats.applied += 1

    def _recover(self, entry: Entry) -> None:
        """Close the gap before ``entry`` from the replay socket; what it cannot cover is
        cleared (see the module doc)."""
        f = self.follower
        cleared = False
        for seq, batch in self._replay(f.seq):  # vLLM's seq of our next batch is our seq
            if seq <= f.seq or f.inc != self.inc:
                continue
            if seq != f.seq + 1 or batch is None:
                self._clear(seq - 1 if batch is not None else seq)
                cleared = True
            if batch is not None:
                self._apply(Entry(self.inc, seq, batch))
        if f.seq < entry.seq:
            if f.seq < entry.seq - 1:
                self._clear(entry.seq - 1)
                cleared = True
            self._apply(entry)
        if not cleared:
            f.stats.replays += 1

    def _clear(self, seq: int) -> None:
        self.follower.load(Snapshot(self.inc, seq, []))
        self.stats.cleared += 1
        self._warn("cleared", "seq=%d (the replay buffer did not reach back far enough)", seq)

    def _replay(self, start: int) -> list[tuple[int, KVEventBatch | None]]:
        """The batches the publisher still holds from vLLM's seq ``start`` on, as
        ``(our seq, batch or None when unreadable)``; what came before a timeout."""
        if self.source.replay is None:
            return []
        if self._dealer is None:
            self._dealer = self.ctx.socket(zmq.DEALER)
            self._dealer.connect(self.source.replay)
        dealer = self._dealer
        dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        out: list[tuple[int, KVEventBatch | None]] = []
        while not self._stop.is_set():
            if not dealer.poll(REPLAY_WAIT_MS):
                self.stats.replay_timeouts += 1
                self._warn("replay", "the replay socket %s did not answer", self.source.replay)
                self._close_dealer()  # a late answer must not be read as the next one's
                break
            frames = dealer.recv_multipart()
            seq = _seq(frames, allow_end=True) if len(frames) in (3, 4) and frames[0] == b"" else None
            if seq is None:
                self._bad("a replayed message is not [b'', (topic,) seq, payload]")
            elif seq == _END:
                break
            else:
                out.append((seq + 1, self._decode(frames[-1])))
        return out

    # ------------------------------------------------------------------ helpers

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        try:
            batch, skipped = decode_vllm(payload, self.source.model, self.salts)
        except WireError as exc:
            self._bad(str(exc))
            return None
        self.stats.other_groups += skipped
        sizes = {e.block_size for e in batch.events if isinstance(e, BlockStored)} - {self.source.block_size}
        if sizes:
            self.stats.other_block_size += 1
            self._warn(
                "block_size", "vllm=%s router=%d (pass vLLM's to --block-size)", sorted(sizes), self.source.block_size
            )
        return batch

    def _bad(self, why: str) -> None:
        self.stats.bad += 1
        self._warn("bad", "detail=%s", why)

    def _warn(self, kind: str, fmt: str, *args: object) -> None:
        """Log a trouble at most once per ``LOG_EVERY_S`` for each kind."""
        now = time.monotonic()
        if now - self._logged.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
            self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
            return
        self._logged[kind] = now
        more = self._unlogged.pop(kind, 0)
        log.warning("event=route_vllm_%s backend=%s " + fmt + " unlogged=%d", kind, self.follower.backend, *args, more)

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None


def _seq(frames: list[bytes], allow_end: bool = False) -> int | None:
    """The seq of a message (its second-last frame), or None when malformed."""
    if len(frames[-2]) != 8:
        return None
    seq = int.from_bytes(frames[-2], "big", signed=True)
    return seq if seq >= 0 or (allow_end and seq == _END) else None
