"""``PrefixCacheConnector`` over a disk whose reads take ``$PREFIXCACHE_BENCH_READ_DELAY_S``
seconds a block: the slow medium of ``bench_vllm_async.py``.

vLLM imports this module in its worker (``kv_connector_module_path``, with this folder on
``PYTHONPATH``); the delay is injected into the disk store's two read paths, so a load
from disk takes the delay times its blocks whatever thread runs it. A benchmark's stand-in
for a slow medium, not part of the package.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from prefixcache.integrations.vllm.connector import PrefixCacheConnector
from prefixcache.storage.disk import DiskStore

__all__ = ["PrefixCacheConnector"]

DELAY = float(os.environ.get("PREFIXCACHE_BENCH_READ_DELAY_S", "0"))

_get_many = DiskStore.get_many
_read_placed = DiskStore.read_placed


def _slow_get_many(self: DiskStore, keys: Sequence[bytes]) -> Any:
    time.sleep(DELAY * len(keys))
    return _get_many(self, keys)


def _slow_read_placed(self: DiskStore, *args: Any, **kwargs: Any) -> Any:
    time.sleep(DELAY)
    return _read_placed(self, *args, **kwargs)


if DELAY > 0:
    DiskStore.get_many = _slow_get_many  # type: ignore[method-assign]
    DiskStore.read_placed = _slow_read_placed  # type: ignore[method-assign]
