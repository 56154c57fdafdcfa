"""The engine's KV memory budget: what a request reserves, and the default budget.

A request reserves its worst case when it takes a slot, and gives it back when it ends:

    reservation = min(prompt + max_tokens, context) x bytes of one token's KV x KV_COPIES

so a slot is given only while the reservations of the requests in flight fit the budget
(``scheduler.py``), and a request whose reservation alone is over the whole budget is
refused at submit (``KVBudgetExceeded``): no mix of prompts can make the engine's KV
outgrow the budget, whatever the slots (``max_active``) allow.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prefixcache.config import KVLayout

__all__ = [
    "KV_COPIES",
    "KV_SHARE",
    "TRIM_BYTES",
    "KVMemory",
    "default_budget",
    "give_back",
    "machine_memory",
    "reservation",
]

# NOTE: a running request holds its KV twice at its peak: the cache its prefill builds,
# and its row in the decode batch, into which that cache is copied when it joins.
KV_COPIES = 2
# The share of the machine's memory the KV of the requests in flight may take by
# default; the rest is the weights', the prefix cache's memory tier's and the process's.
KV_SHARE = 0.5

_CGROUP_MAX = Path("/sys/fs/cgroup/memory.max")
# Freed KV of at least this many bytes at once is handed back to the system (``give_back``).
TRIM_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class KVMemory:
    """The KV budget (None: none) and what the requests in flight reserve of it now, in bytes."""

    budget_bytes: int | None
    reserved_bytes: int


def reservation(kv: KVLayout, context_length: int, tokens: int) -> int:
    """Bytes reserved by a request of ``tokens`` (its prompt and its max_tokens)."""
    return min(tokens, context_length) * kv.bytes_per_token * KV_COPIES


def machine_memory(cgroup: Path = _CGROUP_MAX) -> int:
    """The memory this process may use: the machine's RAM, or its cgroup's limit when lower
    (a container's, whose excess is an out-of-memory kill)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = cgroup.read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def default_budget(memory: Callable[[], int] = machine_memory) -> int:
    """The budget when the settings name none: ``KV_SHARE`` of ``memory()``."""
    return int(memory() * KV_SHARE)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim if name else None  # type: ignore[assignment]
    except (OSError, AttributeError):  # not glibc: its allocator gives memory back its own way
        return None
    return trim


def give_back() -> bool:
    """Return the allocator's free memory to the system, where it can (glibc's
    ``malloc_trim``): the KV buffers a long row freed are not all large enough to be
    returned on their own, and an idle server would keep holding them. Whether it ran."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
