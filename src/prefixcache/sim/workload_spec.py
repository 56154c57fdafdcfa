"""What synthetic traffic to generate: the ``WorkloadSpec``, validated at construction.

Apart from the generator (``workloads``) so that the description of a workload -- its
kinds, their mix, the sizes of every prompt part -- reads on its own, and a bad value
fails when the spec is built, not half way through writing a trace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prefixcache.config import check_int

KINDS = ("chat", "rag", "agent", "scan")
EMITS = ("hash_ids", "tokens")


def _default_mix() -> Mapping[str, float]:
    return MappingProxyType({"chat": 0.4, "rag": 0.25, "agent": 0.2, "scan": 0.15})


@dataclass(frozen=True)
class WorkloadSpec:
    """What traffic to generate. Token counts are per prompt part; ranges are inclusive."""

    requests: int = 10_000
    tenants: int = 8
    seed: int = 0
    duration_s: float = 3600.0  # arrivals spread over this (Poisson, seeded)
    mix: Mapping[str, float] = field(default_factory=_default_mix, hash=False)  # shares of requests by kind
    shared_system_prompt_tokens: int = 1024  # one vendor prompt used by every tenant (chat)
    system_prompt_tokens: int = 512  # each tenant's own system prompt
    turn_tokens: tuple[int, int] = (50, 400)  # new user tokens per chat turn (also RAG questions, agent tasks)
    output_tokens: tuple[int, int] = (50, 500)
    sessions_per_tenant: int = 20  # open chat sessions per tenant; each turn extends one (history grows)
    max_turns: int | None = None  # a session that had this many turns is replaced by a new one (None: never)
    documents: int = 200  # RAG pool shared by all tenants
    document_tokens: tuple[int, int] = (1000, 4000)
    zipf_alpha: float = 1.1  # RAG document popularity
    docs_per_query: int = 2
    tool_prompt_tokens: int = 6000  # agents: a long tool list shared by all agent requests of a tenant
    scan_tokens: tuple[int, int] = (500, 3000)  # one-off prompts, never repeated
    models: tuple[str, ...] = ("model-a",)
    emit: str = "hash_ids"  # "hash_ids" (compact) or "tokens"
    block_size: int = 16  # for emit="hash_ids"
    vocab_size: int = 49_152

    def __post_init__(self) -> None:
        for name, minimum in _COUNTS.items():
            check_int(name, getattr(self, name), minimum)
        for name, minimum in _RANGES.items():
            object.__setattr__(self, name, _check_range(name, getattr(self, name), minimum))
        _check_number("duration_s", self.duration_s)
        _check_number("zipf_alpha", self.zipf_alpha)
        object.__setattr__(self, "mix", _check_mix(self.mix))
        object.__setattr__(self, "models", _check_models(self.models))
        if self.emit not in EMITS:
            raise ValueError(f"emit must be one of {', '.join(EMITS)}, got {self.emit!r}")
        if self.vocab_size > 2**32:
            raise ValueError(f"vocab_size must be <= 2**32 (token ids are uint32), got {self.vocab_size}")
        if self.max_turns is not None:
            check_int("max_turns", self.max_turns, 1)
        if self.docs_per_query > self.documents:
            raise ValueError(f"docs_per_query ({self.docs_per_query}) must be <= documents ({self.documents})")


_COUNTS: Mapping[str, int] = {
    "requests": 0,
    "tenants": 1,
    "seed": 0,
    "shared_system_prompt_tokens": 0,
    "system_prompt_tokens": 0,
    "sessions_per_tenant": 1,
    "documents": 1,
    "docs_per_query": 0,
    "tool_prompt_tokens": 0,
    "block_size": 1,
    "vocab_size": 1,
}
# NOTE: scans need at least one token, or two empty scans would be the same prompt.
_RANGES: Mapping[str, int] = {"turn_tokens": 0, "output_tokens": 0, "document_tokens": 0, "scan_tokens": 1}


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_range(name: str, value: object, minimum: int) -> tuple[int, int]:
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise ValueError(f"{name} must be a (lo, hi) pair of integers, got {value!r}")
    lo, hi = value
    check_int(f"{name}[0]", lo, minimum)
    check_int(f"{name}[1]", hi, minimum)
    if lo > hi:
        raise ValueError(f"{name} must have lo <= hi, got {value!r}")
    return (lo, hi)


def _check_mix(mix: object) -> Mapping[str, float]:
    if not isinstance(mix, Mapping) or not mix:
        raise ValueError(f"mix must be a non-empty mapping of kind -> share, got {mix!r}")
    for kind, share in mix.items():
        if kind not in KINDS:
            raise ValueError(f"mix has unknown kind {kind!r}; valid: {', '.join(KINDS)}")
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < math.inf:
            raise ValueError(f"mix share of {kind!r} must be a positive number, got {share!r}")
    # NOTE: stored in KINDS order, so that specs equal as dicts generate the same bytes.
    return MappingProxyType({kind: float(mix[kind]) for kind in KINDS if kind in mix})


def _check_models(models: object) -> tuple[str, ...]:
    if not isinstance(models, tuple | list) or not models:
        raise ValueError(f"models must be a non-empty tuple of names, got {models!r}")
    for name in models:
        if not isinstance(name, str) or not name:
            raise ValueError(f"models must hold non-empty strings, got {name!r}")
    return tuple(models)
