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
        """Read, check and gather ``reads`` into ``out`` (``[layers, 2, heads, >= sum(use), dim]``)."""
        groups: dict[int, list[int]] = {}
        for i, read in enumerate(reads):
            groups.setdefault(read.tier, []).append(i)
        frames: list[Frame | None] = [None] * len(reads)
        seconds = self._fetch(reads, groups, frames)
        arrays: list[np.ndarray] = []
        failure = None
        for i, read in enumerate(reads):
            started = time.perf_counter()
            arr, failure = self._decode(read, frames[i])
            seconds[read.tier] += time.perf_counter() - started
            if arr is None:
                break
            arrays.append(arr)
        self._copy(arrays, [r.use for r in reads], out)
        return Loaded(len(arrays), out, frames, failure, seconds)

    def _fetch(
        self, reads: Sequence[Read], groups: dict[int, list[int]], frames: list[Frame | None]
    ) -> dict[int, float]:
        """One ``get_many`` per tier (queued frames first), the slower tiers in the I/O threads."""

        def fetch(t: int) -> float:
            started = time.perf_counter()
            members = groups[t]
            for i in members:
                if reads[i].queued:
                    frames[i] = self.queue.frame(t, reads[i].key)
            wanted = [i for i in members if frames[i] is None]
            if wanted:
                try:
                    got = self.stores[t].get_many([reads[i].key for i in wanted])
                except TierError:
                    got = [None] * len(wanted)
                for i, frame in zip(wanted, got, strict=True):
                    frames[i] = frame
            return time.perf_counter() - started

        order = sorted(groups)
        futures: dict[int, Future[float]] = {t: self._io.submit(fetch, t) for t in order[1:]}
        seconds = {order[0]: fetch(order[0])} if order else {}
        seconds.update({t: f.result() for t, f in futures.items()})
        return seconds

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

    def _copy(self, arrays: Sequence[np.ndarray], sizes: Sequence[int], out: np.ndarray) -> None:
        """Gather the blocks into ``out`` along the token axis.

        NOTE: each block lands as layers x 2 x kv_heads short runs spread over ``out``,
        a strided gather that one core does at about half the speed of a flat copy; numpy
        releases the GIL while it copies, so the blocks are split among the I/O threads."""
        if not arrays:
            return
        offsets = [0]
        for n in sizes[: len(arrays)]:
            offsets.append(offsets[-1] + n)

        def run(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                arr = arrays[i]
                if arr.dtype != out.dtype:
                    arr = arr.view(out.dtype)  # bfloat16 as ml_dtypes -> its raw bits
                out[:, :, :, offsets[i] : offsets[i + 1], :] = arr[:, :, :, : sizes[i], :]

        parts = min(self._copiers, len(arrays), max(1, out.nbytes // _PARALLEL_COPY_BYTES))
        bounds = [len(arrays) * j // parts for j in range(parts + 1)]
        futures = [self._io.submit(run, bounds[j], bounds[j + 1]) for j in range(1, parts)]
        run(bounds[0], bounds[1])
        for future in futures:
            future.result()

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
