"""Moving KV bytes, outside the cache's lock: loading a planned path into one array,
and running the write queue's jobs against the stores.

A load reads every block from the tier the plan names (a queued write's frame first,
for a block whose only copy is on its way down), one batched ``get_many`` per tier,
the slower tiers in I/O threads; it verifies each frame against the block's key and
tokens, and copies the blocks into the destination along the token axis. It stops at
the first missing or bad block: what came before it is the true length (invariant 6).
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
from prefixcache.storage.queue import Job, JobKind, WriteQueue

__all__ = ["Loaded", "Outcome", "Read", "Transfer"]

_PARALLEL_COPY_BYTES = 4 << 20  # below this a load's copy stays on the calling thread


@dataclass(frozen=True, slots=True)
class Read:
    """One block of a planned load."""

    key: bytes
    tokens: bytes  # the block's tokens as the tree holds them (the frame must carry the same)
    use: int  # how many of its tokens the load takes (fewer for a partial hit)
    tier: int
    queued: bool  # its frame is in the write queue (its only copy is on its way to ``tier``)


@dataclass(slots=True)
class Loaded:
    """What a load read: ``good`` leading blocks landed in ``kv``; ``frames`` are the raw
    frames read (kept for promotion), ``failures`` the reads that ended it, by kind."""

    good: int
    kv: np.ndarray
    frames: list[Frame | None]
    failure: str | None  # why block ``good`` could not be used (None when all were good)
    seconds: dict[int, float]  # tier -> time spent fetching and checking its blocks


class Outcome(enum.Enum):
    DONE = "done"
    FULL = "full"
    FAILED = "failed"
    NO_FRAME = "no_frame"  # a lazy source was gone (its frame could not be read)
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
    ) -> None:
        self.stores = list(stores)
        self.trusts = list(trusts)  # per tier: a load may skip the payload checksum
        self.layout = layout
        self.queue = queue
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="prefixcache-io")
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
        frames: list[Frame | None] = [None] * len(reads)
        failures: list[str | None] = [None] * len(reads)
        runs = self._runs(reads)
        seconds: dict[int, float] = {}

        def run(lo: int, hi: int) -> tuple[int, float]:
            started = time.perf_counter()
            self._fetch(reads, lo, hi, frames)
            for i in range(lo, hi):
                arr, failures[i] = self._decode(reads[i], frames[i])
                if arr is not None:
                    if arr.dtype != out.dtype:
                        arr = arr.view(out.dtype)  # bfloat16 as ml_dtypes -> its raw bits
                    out[:, :, :, offsets[i] : offsets[i + 1], :] = arr[:, :, :, : reads[i].use, :]
            return reads[lo].tier, time.perf_counter() - started

        futures: list[Future[tuple[int, float]]] = [self._io.submit(run, lo, hi) for lo, hi in runs[1:]]
        done = [run(*runs[0])] if runs else []
        done += [f.result() for f in futures]
        for tier, took in done:
            seconds[tier] = max(seconds.get(tier, 0.0), took)
        good = next((i for i, failure in enumerate(failures) if failure is not None), len(reads))
        return Loaded(good, out, frames, failures[good] if good < len(reads) else None, seconds)

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

    def _fetch(self, reads: Sequence[Read], lo: int, hi: int, frames: list[Frame | None]) -> None:
        """The frames of ``reads[lo:hi]`` (one tier): queued frames first, then one ``get_many``."""
        tier = reads[lo].tier
        for i in range(lo, hi):
            if reads[i].queued:
                frames[i] = self.queue.frame(tier, reads[i].key)
        wanted = [i for i in range(lo, hi) if frames[i] is None]
        if not wanted:
            return
        try:
            got = self.stores[tier].get_many([reads[i].key for i in wanted])
        except TierError:
            return  # counted by the store: misses
        for i, frame in zip(wanted, got, strict=True):
            frames[i] = frame

    def _decode(self, read: Read, frame: Frame | None) -> tuple[np.ndarray | None, str | None]:
        """The block's KV, a view of its verified frame; or why not."""
        if frame is None:
            return None, "missing"
        try:
            arr = codec.decode(
                frame,
                key=read.key,
                tokens=read.tokens,
                shape=self.layout.shape(len(read.tokens) // 4),
                dtype=self.layout.dtype,
                check_payload=not (self.trusts[read.tier] and not read.queued),
            )
        except codec.FrameError as exc:
            return None, type(exc).__name__
        return arr, None

    # ------------------------------------------------------------------ write

    def put(self, tier: int, key: bytes, frame: Frame) -> Outcome:
        """One frame into one store, now (an entry write or a promotion into a memory tier)."""
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
        self._io.shutdown(wait=True)
        for store in self.stores:
            store.close()
