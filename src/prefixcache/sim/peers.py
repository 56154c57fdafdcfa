"""Running a peer simulator, libCacheSim, on the same key sequence, for comparison.

``libcachesim`` (PyPI, the Python bindings of libCacheSim) is optional: a test extra.
Its fastest input is the binary "oracleGeneral" trace (24-byte little-endian records:
u32 time, u64 object id, u32 size, i64 next access or -1), read by its C loop.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ORACLE_GENERAL = np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
PEER_POLICIES = ("lru", "fifo", "s3fifo")


def write_oracle_general(keys: Sequence[int] | np.ndarray, path: Path) -> None:
    """Write ``keys`` (objects of size 1, in order) as an oracleGeneral trace."""
    records = np.zeros(len(keys), dtype=ORACLE_GENERAL)
    records["t"] = np.arange(len(keys))
    records["id"] = keys
    records["size"] = 1
    records["next"] = -1
    records.tofile(path)


def libcachesim_run(keys: Sequence[int] | np.ndarray, policy: str, capacity: int) -> tuple[float, float]:
    """libCacheSim's miss ratio for ``keys`` in a cache of ``capacity`` objects, run by
    its C loop, and the seconds that loop took. Needs the ``libcachesim`` package."""
    import libcachesim as lcs

    factories = {"lru": lcs.LRU, "fifo": lcs.FIFO, "s3fifo": lcs.S3FIFO}
    if policy not in factories:
        raise ValueError(f"no libCacheSim peer for policy {policy!r}; valid: {', '.join(PEER_POLICIES)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.oracleGeneral"
        write_oracle_general(keys, path)
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        cache = factories[policy](capacity)
        start = time.perf_counter()
        miss_ratio, _ = cache.process_trace(reader)
        seconds = time.perf_counter() - start
        del reader  # NOTE: never close() and then drop the reader: libcachesim frees it twice
    return float(miss_ratio), seconds
