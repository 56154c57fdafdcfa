"""The scheduler's books of one request and one step (``scheduler.py``), vLLM-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixcache.integrations.vllm.scope import Scope
from prefixcache.integrations.vllm.worker import LoadSpec, SaveSpec, VoidLoad

__all__ = ["LoadMade", "StepPlan", "Tracked", "by_group"]


@dataclass
class Tracked:
    scope: Scope
    prompt: tuple[int, ...]
    block_ids: list[list[int]]  # vLLM's block ids, by KV cache group
    saved: int  # prompt tokens already sent to be saved (or loaded from the cache)


@dataclass(frozen=True, slots=True)
class LoadMade:
    first: int  # the first block loaded (vLLM holds the ones before)
    block_ids: tuple[int, ...]  # vLLM blocks the load fills, from ``first`` on (one group: see ``load_failed``)


@dataclass
class StepPlan:
    """What the worker does this step (vLLM's connector metadata)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    voids: list[VoidLoad] = field(default_factory=list)


def by_group(blocks: Any) -> list[list[int]]:
    """The block ids of vLLM's ``KVCacheBlocks``, by KV cache group (or ``blocks`` as given:
    a sequence of groups' ids)."""
    groups = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    return [list(ids) for ids in groups]
