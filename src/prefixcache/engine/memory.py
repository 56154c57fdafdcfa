"""The engine's KV memory budget: what a request reserves, and the default budget.

A request reserves its worst case when it takes a slot, and gives it back when it ends:

    reservation = min(prompt + max_tokens, context) x bytes of one token's KV x KV_COPIES

so a slot is given only while the reservations of the requests in flight fit the budget
(``scheduler.py``), and a request whose reservation alone is over the whole budget is
refused at submit (``KVBudgetExceeded``): no mix of prompts can make the engine's KV
outgrow the budget, whatever the slots (``max_active``) allow.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from prefixcache.config import KVLayout

__all__ = ["KV_COPIES", "KV_SHARE", "default_budget", "machine_memory", "reservation"]

# NOTE: a running request holds its KV twice at its peak: the cache its prefill builds,
# and its row in the decode batch, into which that cache is copied when it joins.
KV_COPIES = 2
# The share of the machine's memory the KV of the requests in flight may take by
# default; the rest is the weights', the prefix cache's memory tier's and the process's.
KV_SHARE = 0.5

_CGROUP_MAX = Path("/sys/fs/cgroup/memory.max")


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
