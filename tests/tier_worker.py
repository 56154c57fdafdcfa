"""KV of known value for the tiered-cache tests, and a second process that writes it.

``kv_for(tokens)`` gives every token position a KV derived from (token id, position),
so a test knows the exact bytes any cached prefix must load back.

Run as a script, it is the *other* server process::

    python tier_worker.py disk DIR N          # store prompts 0..N-1 on a disk tier, close, exit
    python tier_worker.py disk-forever DIR    # store prompts 0, 1, ... printing each; until killed
    python tier_worker.py redis URL N         # store prompts 0..N-1 through to Redis, exit
    python tier_worker.py s3 ENDPOINT N       # store prompts 0..N-1 through to the bucket S3_BUCKET
                                              # (prefix S3_PREFIX) of an S3 API endpoint, exit
    python tier_worker.py slow-disk DIR N     # store prompts 0..N-1 through to a disk that takes
                                              # 50 ms a write (a background writer), print what is
                                              # written and what is queued, then wait to be killed
"""

from __future__ import annotations

import sys
import time

import numpy as np

from fault_stores import faulty
from prefixcache.cache import PrefixCache
from prefixcache.cache.facade import StoreFactory
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.hashing import CacheContext
from prefixcache.storage import codec
from prefixcache.storage.memory import MemoryStore
from prefixcache.storage.open import open_store
from support import WIRE

BLOCK = 4
SEED = "tiers-test"
S3_BUCKET = "prefixcache-tests"
S3_PREFIX = "pc"
CTX = CacheContext(tenant="acme", model="m")


def layout(dtype: str = "float16") -> KVLayout:
    return KVLayout(layers=2, kv_heads=2, head_dim=4, dtype=dtype)


def kv_for(tokens: list[int], dtype: str = "float16") -> np.ndarray:
    """[layers, 2, kv_heads, len(tokens), head_dim]: each value a function of its token
    id, position and coordinates, never NaN, distinct enough to catch any misplaced copy."""
    lay = layout(dtype)
    t = np.asarray(tokens, dtype=np.int64)[None, None, None, :, None]
    pos = np.arange(len(tokens), dtype=np.int64)[None, None, None, :, None]
    coords = (
        np.arange(lay.layers)[:, None, None, None, None] * 7
        + np.arange(2)[None, :, None, None, None] * 5
        + np.arange(lay.kv_heads)[None, None, :, None, None] * 3
        + np.arange(lay.head_dim)[None, None, None, None, :]
    )
    bits = (t * 131 + pos * 17 + coords) % 1999
    if dtype == "bfloat16":
        return (bits + 0x3F00).astype(np.uint16)  # finite bfloat16 bit patterns
    return (bits.astype(np.float64) / 8).astype(WIRE[dtype])


def prompt(i: int, n_blocks: int = 6) -> list[int]:
    """Prompt ``i``: a shared first block, then tokens of its own."""
    return [1, 2, 3, 4] + [1000 * (i + 1) + j for j in range(BLOCK * (n_blocks - 1))]


def frame_bytes(dtype: str = "float16") -> int:
    """One memory-tier slot: a full block's frame, rounded as the store rounds it."""
    return MemoryStore.slot_for(codec.encoded_size(layout(dtype).shape(BLOCK), dtype, 16))


def cache_with(
    *tiers: TierConfig, dtype: str = "float16", store_factory: StoreFactory = open_store, **kwargs: object
) -> PrefixCache:
    """A cache of ``tiers`` whose writes are done when each call returns (``inline``), so
    that what a test sees does not depend on a writer thread's timing; the tests of the
    writer itself pass ``writer=``. Nor on the epoch sync's: the shared tiers' epochs are
    read at open and when a test calls ``sync_epochs`` (a stalled tier's test counts
    every command it swallowed), unless it passes ``epoch_sync_s``."""
    kwargs.setdefault("writer", "inline")
    sync = kwargs.pop("epoch_sync_s", None)
    config = CacheConfig(block_size=BLOCK, seed=SEED, kv_layout=layout(dtype), tiers=tiers, **kwargs)  # type: ignore[arg-type]
    return PrefixCache(config, store_factory=store_factory, epoch_sync_s=sync)  # type: ignore[arg-type]


def store(cache: PrefixCache, tokens: list[int], dtype: str = "float16") -> int:
    return cache.insert(tokens, CTX, kv=kv_for(tokens, dtype))


def s3_tier(endpoint: str, **kwargs: object) -> TierConfig:
    """The tests' s3 tier: their bucket on ``endpoint``, a generous timeout unless told
    (a loaded 2-core machine runs the S3 server too)."""
    kwargs.setdefault("read_timeout", 3.0)
    return TierConfig(
        kind="s3", capacity_bytes=1 << 30, bucket=S3_BUCKET, prefix=S3_PREFIX, endpoint=endpoint, **kwargs
    )  # type: ignore[arg-type]


def main(argv: list[str]) -> None:
    mode, where = argv[0], argv[1]
    big = 1 << 30
    if mode == "redis":
        tiers = (
            TierConfig(kind="memory", capacity_bytes=big, write="through"),
            TierConfig(kind="redis", capacity_bytes=big, url=where),
        )
    elif mode == "s3":
        tiers = (
            TierConfig(kind="memory", capacity_bytes=big, write="through"),
            s3_tier(where),
        )
    else:
        tiers = (
            TierConfig(kind="memory", capacity_bytes=big, write="through"),
            TierConfig(kind="disk", capacity_bytes=big, path=where),
        )
    if mode == "slow-disk":
        slow = cache_with(*tiers, writer="background", store_factory=faulty(("disk",), delay=0.05))
        for i in range(int(argv[2])):
            store(slow, prompt(i))
        stats = slow.stats()
        assert stats.writer is not None
        print(f"stop {stats.tiers[1].blocks} {stats.writer.queued_jobs}", flush=True)
        time.sleep(3600)
    with cache_with(*tiers) as cache:
        if mode == "disk-forever":
            i = 0
            while True:
                store(cache, prompt(i))
                print(i, flush=True)
                i += 1
        for i in range(int(argv[2])):
            store(cache, prompt(i))


if __name__ == "__main__":
    main(sys.argv[1:])
