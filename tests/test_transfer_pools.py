"""A load's runs from a fast tier never wait behind another load's runs that wait on a
slow one: the byte mover has a thread pool per tier (``storage/transfer.py``), so one
tenant's loads from a stalled Redis or bucket hold that tier's threads only, never the
threads that copy another tenant's memory hit (design invariant 16). Waits are on
events; the 60 s bounds only turn a hang into a failure."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from prefixcache.config import KVLayout
from prefixcache.storage import transfer as transfer_module
from prefixcache.storage.base import Frame
from prefixcache.storage.memory import MemoryStore
from prefixcache.storage.queue import WriteQueue
from prefixcache.storage.transfer import Read, Transfer
from support import SHAPE, TOKENS, frame_of, key_of, random_kv

LAYOUT = KVLayout(layers=SHAPE[0], kv_heads=SHAPE[2], head_dim=SHAPE[4], dtype="float16")
BLOCK = SHAPE[3]


class Stalled(MemoryStore):
    """A memory slab whose reads wait for ``go``: a tier that answers, slowly."""

    def __init__(self) -> None:
        super().__init__(1 << 20, 1024)
        self.go = threading.Event()
        self.waiting = threading.Semaphore(0)  # released once per read that waits

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        self.waiting.release()
        assert self.go.wait(60), "never let go"
        return super().get_many(keys)


def reads(tier: int, first: int, n: int) -> list[Read]:
    return [Read(key_of(i), TOKENS, BLOCK, tier, False, False) for i in range(first, first + n)]


def test_a_load_from_a_fast_tier_never_waits_for_a_stalled_tiers_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer_module, "_PARALLEL_COPY_BYTES", 1)  # every load splits into runs
    fast, slow = MemoryStore(1 << 20, 1024), Stalled()
    for i in range(8):
        fast.put(key_of(i), frame_of(i))
        slow.put(key_of(100 + i), frame_of(100 + i))
    mover = Transfer([fast, slow], [True, True], LAYOUT, WriteQueue(1 << 20), io_threads=2)
    mover._copiers = 2  # NOTE: two runs a load, whatever this machine's cores
    stalled = [
        threading.Thread(target=lambda: mover.load(reads(1, 100, 4), mover.destination(4 * BLOCK, None)), daemon=True)
        for _ in range(2)
    ]
    try:
        for thread in stalled:
            thread.start()
        for _ in range(4):  # two loads, two runs each: the callers' and both of the slow tier's threads
            assert slow.waiting.acquire(timeout=60)
        done: list[transfer_module.Loaded] = []
        hit = threading.Thread(
            target=lambda: done.append(mover.load(reads(0, 0, 8), mover.destination(8 * BLOCK, None)))
        )
        hit.start()
        hit.join(60)
        assert done and done[0].good == 8 and not slow.go.is_set()  # served while the slow tier still stalls
        expected = np.concatenate([random_kv("float16", i) for i in range(8)], axis=3)
        assert done[0].kv.tobytes() == expected.tobytes()  # bit for bit (NaN payloads included)
    finally:
        slow.go.set()
        for thread in stalled:
            thread.join(60)
        mover.close()
