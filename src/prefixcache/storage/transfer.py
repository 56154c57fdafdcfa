"""Moving KV bytes, outside the cache's lock: loading a planned path into one array,
and running the write queue's jobs against the stores.

A load reads every block from the tier the plan names (a queued write's frame first,
for a block whose only copy is on its way down), in runs spread over the I/O threads:
batched ``get_many`` calls, or for a store that places its reads (disk) each frame
straight into its place; it verifies each frame against the block's key and tokens,
and places the blocks along the token axis of the destination. It stops at the first
missing or bad block: what came before it is the true length (invariant 6).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from prefixcache.config import KVLayout
from prefixcache.storage import codec
from prefixcache.storage.base import Frame, TierError, TierFull, TierStore
from prefixcache.storage.placed import Place
from prefixcache.storage.queue import Job, JobKind, WriteQueue

__all__ = ["Loaded", "Outcome", "Read", "Transfer"]

_PARALLEL_COPY_BYTES = 4 << 20  # below this a load's copy stays on the calling thread
_BATCH_BYTES = 1 << 20  # one get_many of a run fetches about this much
_HEADER_ROOM = 4096  # a run's read buffer: one frame's payload and this, more than any header


@dataclass(frozen=True, slots=True)
class Read:
    """One block of a planned load."""

    key: bytes
    tokens: bytes  # the block's tokens as the tree holds them (the frame must carry the same)
    use: int  # how many of its tokens the load takes (fewer for a partial hit)
    tier: int
    queued: bool  # its frame is in the write queue (its only copy is on its way to ``tier``)
    keep: bool  # the frame may be wanted after the load (a promotion or a copy down)


@dataclass(frozen=True, slots=True)
class Loaded:
    """What a load read: ``good`` leading blocks landed in ``kv``; ``frames`` are the raw
    frames of the reads marked ``keep`` (for a promotion or a copy down; None for the
    others), ``failure`` why the read after the good ones ended it."""

    good: int
    kv: np.ndarray
    frames: list[Frame | None]
    failure: str | None  # why block ``good`` could not be used (None when all were good)
    seconds: dict[int, float]  # tier -> time spent fetching and checking its blocks


@dataclass(slots=True)
class _Load:
    """One load's shared state: its threads write disjoint indexes and places."""

    reads: Sequence[Read]
    out: np.ndarray
    offsets: list[int]  # token offset of each read in ``out`` (and the end)
    frames: list[Frame | None]
    failures: list[str | None]


class Outcome(enum.Enum):
    DONE = "done"
    FULL = "full"
    FAILED = "failed"
    NO_FRAME = "no_frame"  # a lazy source was gone (its frame could not be read)
    UNENCODABLE = "unencodable"  # the tier's codec cannot hold these values (not finite, too large)
    SKIPPED = "skipped"  # canceled before it ran


class Transfer:
    """The byte mover of one cache: its stores, its I/O threads, its write queue."""

    def __init__(
        self,
        stores: Sequence[TierStore],
        trusts: Sequence[bool],
        layout: KVLayout,
        queue: WriteQueue,
        io_threads: int,
        codecs: Sequence[str] | None = None,
    ) -> None:
        self.stores = list(stores)
        self.codecs = list(codecs) if codecs is not None else ["raw"] * len(self.stores)  # per tier
        self.trusts = list(trusts)  # per tier: a load may skip the payload checksum
        self.layout = layout
        self.queue = queue
        # NOTE: a pool per tier, so that a load's runs from a fast tier never queue behind
        # runs that wait on a slow one (another tenant's, from a far bucket or a loaded
        # Redis): a slow tier holds its own threads only (design invariant 16)
        self._io = [
            ThreadPoolExecutor(io_threads, thread_name_prefix=f"prefixcache-io-{i}") for i in range(len(self.stores))
        ]
        self._copiers = max(1, min(io_threads, os.cpu_count() or 1))

    # ------------------------------------------------------------------ load

    def destination(self, tokens: int, buffer: np.ndarray | None) -> np.ndarray:
        shape, dtype = self.layout.shape(tokens), codec.WIRE_DTYPES[self.layout.dtype]
        if buffer is None:
            return np.empty(shape, dtype=dtype)
        need = tokens * self.layout.bytes_per_token
        if not isinstance(buffer, np.ndarray) or not buffer.flags.c_contiguous or not buffer.flags.writeable:
            raise ValueError("out must be a writable, C-contiguous numpy array")
        if buffer.nbytes < need:
            raise ValueError(f"out holds {buffer.nbytes} bytes; this load needs {need}")
        return buffer.reshape(-1).view(np.uint8)[:need].view(dtype).reshape(shape)

    def load(self, reads: Sequence[Read], out: np.ndarray) -> Loaded:
        """Read, check and gather ``reads`` into ``out`` (``[layers, 2, heads, >= sum(use), dim]``).

        NOTE: the blocks are split into runs of neighbours in one tier, and each run is
        fetched, checked and copied into its place by one I/O thread: file reads, Redis
        replies, checksums and numpy's copies leave the GIL, so a load uses every core,
        and each frame is copied while it is still in the core's cache. A block's place in
        ``out`` does not depend on the others, so the runs need no order; the load's
        length is then the first bad block's offset."""
        offsets = [0]
        for read in reads:
            offsets.append(offsets[-1] + read.use)
        job = _Load(reads, out, offsets, [None] * len(reads), [None] * len(reads))
        runs = self._runs(reads)
        futures: list[Future[tuple[int, float]]] = [
            self._io[reads[lo].tier].submit(self._run, job, lo, hi) for lo, hi in runs[1:]
        ]
        done = [self._run(job, *runs[0])] if runs else []
        done += [f.result() for f in futures]
        seconds: dict[int, float] = {}
        for tier, took in done:
            seconds[tier] = max(seconds.get(tier, 0.0), took)
        failures = job.failures
        good = next((i for i, failure in enumerate(failures) if failure is not None), len(reads))
        return Loaded(good, out, job.frames, failures[good] if good < len(reads) else None, seconds)

    def _runs(self, reads: Sequence[Read]) -> list[tuple[int, int]]:
        """The load split into index ranges of one tier each, as many as there are copiers
        (or fewer, for a load too small to be worth a thread)."""
        if not reads:
            return []
        total = sum(r.use for r in reads) * self.layout.bytes_per_token
        parts = min(self._copiers, len(reads), max(1, total // _PARALLEL_COPY_BYTES))
        cuts = {len(reads) * j // parts for j in range(parts + 1)}
        cuts.update(i for i in range(1, len(reads)) if reads[i].tier != reads[i - 1].tier)
        bounds = sorted(cuts | {0, len(reads)})
        return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]

    def _run(self, job: _Load, lo: int, hi: int) -> tuple[int, float]:
        """One run of a load, on one thread: its tier and how long it took."""
        started, tier = time.perf_counter(), job.reads[lo].tier
        store = self.stores[tier]
        if store.places_reads and self.codecs[tier] == "raw":  # NOTE: placing copies raw rows
            self._run_placed(job, lo, hi)
            return tier, time.perf_counter() - started
        # NOTE: a store whose frames are fresh bytes (a network's) is fetched in batches of
        # about _BATCH_BYTES: each frame is copied while it is still in the core's cache, and
        # the memory of the frames not kept serves the next batch rather than the whole run
        # being faulted in afresh. A private store's frames are views of what it holds. A
        # store that fetches in parallel (``read_width``, an object store's GETs) gets that
        # many batches at once, or its requests would run one after another.
        frame_bytes = self.layout.bytes_per_token * (len(job.reads[lo].tokens) // 4)
        step = hi - lo if store.private else max(1, _BATCH_BYTES // max(1, frame_bytes)) * store.read_width
        for a in range(lo, hi, step):
            self._fetch_and_copy(job, a, min(hi, a + step))
        return tier, time.perf_counter() - started

    def _fetch_and_copy(self, job: _Load, lo: int, hi: int) -> None:
        """``reads[lo:hi]`` (one tier): queued frames first, then one ``get_many``; each
        frame checked and copied into its place."""
        reads, frames = job.reads, job.frames
        tier = reads[lo].tier
        for i in range(lo, hi):
            if reads[i].queued:
                frames[i] = self.queue.frame(tier, reads[i].key)
        wanted = [i for i in range(lo, hi) if frames[i] is None]
        if wanted:
            try:
                got = self.stores[tier].get_many([reads[i].key for i in wanted])
            except TierError:
                got = [None] * len(wanted)  # counted by the store: misses
            for i, frame in zip(wanted, got, strict=True):
                frames[i] = frame
        out = job.out
        for i in range(lo, hi):
            arr, job.failures[i] = self._decode(reads[i], frames[i])
            if arr is not None:
                if arr.dtype != out.dtype:
                    arr = arr.view(out.dtype)  # bfloat16 as ml_dtypes -> its raw bits
                out[:, :, :, job.offsets[i] : job.offsets[i + 1], :] = arr[:, :, :, : reads[i].use, :]
            if not reads[i].keep:
                frames[i] = None  # NOTE: freed now: its memory serves the next batch

    def _run_placed(self, job: _Load, lo: int, hi: int) -> None:
        """A run from a store that ``places_reads``: each frame read into one buffer and
        its rows into their place in one pass, then checked; a frame to keep is copied
        out of the buffer (a queued one takes the fetching way)."""
        reads, out = job.reads, job.out
        layers, kv, heads, length, dim = out.shape
        item = out.itemsize
        rows, stride = layers * kv * heads, length * dim * item
        store, raw = self.stores[reads[lo].tier], out.reshape(-1).view(np.uint8).data
        buffer = bytearray(max(len(r.tokens) for r in reads[lo:hi]) // 4 * self.layout.bytes_per_token + _HEADER_ROOM)
        for i in range(lo, hi):
            read = reads[i]
            if read.queued:
                self._fetch_and_copy(job, i, i + 1)
                continue
            src_row, copy_row = len(read.tokens) // 4 * dim * item, read.use * dim * item
            place = Place(raw, job.offsets[i] * dim * item, rows, src_row, copy_row, stride)
            try:
                got = store.read_placed(read.key, buffer, place)
            except TierError:
                got = None  # counted by the store: a miss
            if got is None:
                job.failures[i] = "missing"
                continue
            _, job.failures[i] = self._decode(read, got.frame, got.checksum)
            if read.keep and job.failures[i] is None:
                job.frames[i] = bytes(got.frame)  # NOTE: out of the buffer the next read reuses

    def _decode(
        self, read: Read, frame: Frame | None, computed: bytes | None = None
    ) -> tuple[np.ndarray | None, str | None]:
        """The block's KV, a view of its verified frame; or why not. ``computed``: the
        payload's checksum as a placed read computed it (compared, not hashed again)."""
        if frame is None:
            return None, "missing"
        try:
            arr = codec.decode(
                frame,
                key=read.key,
                tokens=read.tokens,
                shape=self.layout.shape(len(read.tokens) // 4),
                dtype=self.layout.dtype,
                check_payload=computed is not None or not (self.trusts[read.tier] and not read.queued),
                computed_checksum=computed,
            )
        except codec.FrameError as exc:
            return None, type(exc).__name__
        return arr, None

    # ------------------------------------------------------------------ write

    def put(self, tier: int, key: bytes, frame: Frame) -> Outcome:
        """One frame into one store, now (an entry write or a promotion into a memory tier),
        in the tier's codec: a frame of another codec is decoded and encoded again here,
        on the thread that moves the bytes (the caller's for a memory tier, else the writer's)."""
        try:
            # NOTE: a frame already in the tier's codec goes as it is (its payload is not
            # hashed again on a request's path); another is checked in full before it is decoded.
            if codec.peek_header(frame).codec != self.codecs[tier]:
                frame = codec.transcode(frame, key=key, codec=self.codecs[tier])
        except codec.Unrepresentable:
            return Outcome.UNENCODABLE
        except codec.FrameError:
            return Outcome.NO_FRAME  # the source's copy is bad: nothing to write
        try:
            self.stores[tier].put(key, frame)
        except TierFull:
            return Outcome.FULL
        except TierError:
            return Outcome.FAILED
        return Outcome.DONE

    def run(self, job: Job) -> Outcome:
        """Run one queued job against its store."""
        if job.canceled:
            return Outcome.SKIPPED
        store = self.stores[job.tier]
        if job.kind is JobKind.DELETE:
            try:
                store.delete(job.key)
            except TierError:
                return Outcome.FAILED
            return Outcome.DONE
        assert job.source is not None
        frame = job.source.frame()
        if frame is None:
            return Outcome.NO_FRAME
        if job.canceled:
            return Outcome.SKIPPED
        return self.put(job.tier, job.key, frame)

    def delete(self, tier: int, key: bytes) -> None:
        with contextlib.suppress(TierError):  # counted by the store; no block owns the key any more
            self.stores[tier].delete(key)

    def close(self) -> None:
        for pool in self._io:
            pool.shutdown(wait=True)
        for store in self.stores:
            store.close()
