"""Prompts being prefilled whose KV the cache does not hold yet, so that a request that
shares a longer prefix with one of them waits for it instead of computing it twice.

    staged:  cache holds c tokens of B's prompt; A (same context, prefilling) shares p > c + margin
             ──> B follows A: not ready, no work
    A's prompt stored (right after its prefill) or A ended  ──> B is staged again: a hit on p

Four chats of one tenant that open with the same system prompt at once prefill it once,
not four times. A follower whose deadline passes or whose client leaves is taken out
(``unfollow``) and ends at once. Not thread-safe: the engine's I/O workers use it only
under ``CacheIO``'s lock, its one owner (``cacheio.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from prefixcache.hashing import CacheContext

__all__ = ["FOLLOW_MIN_TOKENS", "InFlight", "Prompt", "common_prefix"]

# NOTE: waiting for another prompt's prefill pays when it saves more than a little
# compute; below this many tokens the follower computes them itself
FOLLOW_MIN_TOKENS = 32


class Prompt(Protocol):
    """What ``InFlight`` knows of a job."""

    @property
    def context(self) -> CacheContext: ...

    @property
    def prompt(self) -> Sequence[int]: ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


class InFlight:
    """The leads (prompts being prefilled, not yet stored) and who follows each."""

    def __init__(self) -> None:
        self._leads: dict[Prompt, list[Prompt]] = {}

    def leader(self, job: Prompt, cached: int) -> Prompt | None:
        """The lead whose prompt holds at least ``FOLLOW_MIN_TOKENS`` more of ``job``'s
        than the ``cached`` tokens (the longest such), or None. Only the same context's:
        another tenant's KV is never shared this way."""
        usable = len(job.prompt) - 1  # NOTE: the last prompt token is always prefilled
        best, longest = None, cached + FOLLOW_MIN_TOKENS - 1
        for lead in self._leads:
            if lead.context != job.context:
                continue
            shared = min(common_prefix(lead.prompt, job.prompt), usable)
            if shared > longest:
                best, longest = lead, shared
        return best

    def lead(self, job: Prompt) -> None:
        """``job`` is ready to prefill: later jobs may follow it."""
        self._leads.setdefault(job, [])

    def follow(self, lead: Prompt, job: Prompt) -> None:
        self._leads[lead].append(job)

    def unfollow(self, job: Prompt) -> bool:
        """Take ``job`` out of its lead's followers (it ends before the lead's prompt is
        stored); False when it follows none."""
        for followers in self._leads.values():
            if job in followers:
                followers.remove(job)
                return True
        return False

    def done(self, job: Prompt) -> list[Prompt]:
        """``job``'s prompt is in the cache, or it ended: its followers, to stage again."""
        return self._leads.pop(job, [])

    @property
    def leads(self) -> int:
        return len(self._leads)

    @property
    def followers(self) -> int:
        return sum(len(f) for f in self._leads.values())
