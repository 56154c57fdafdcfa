"""What the server's blend mode is configured with, and what it tells about a request.

``BlendConfig`` is the ``[blend]`` section once validated (``prefixcache.settings`` builds
it); ``BlendUsage`` is one request's account, carried to the HTTP layer by a
``BlendedDone`` (a ``DoneEvent`` with the account attached), so that ``usage`` and the
metrics say how many prompt tokens a blend reused and recomputed, apart from the exact
prefix-cache hits of ``cached_tokens``. Chunks are blocks of the one cache
(``chunks``): blocks and chunks share every tier, so the mode never raises what the
tiers may take.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from prefixcache.blend.plan import RecomputePlan
from prefixcache.engine.requests import DoneEvent
from prefixcache.quality.reference import GREEDY_STEPS
from prefixcache.quality.verdict import GateThresholds

__all__ = ["BlendConfig", "BlendUsage", "BlendedDone", "Outcome"]


@dataclass(frozen=True, slots=True)
class BlendConfig:
    """The blend mode of one server: who may use it, with which plan, under which gate."""

    tenants: frozenset[str]  # opted in; every other tenant gets exact prefix caching only
    plan: RecomputePlan
    thresholds: GateThresholds
    gate_file: Path  # GateStore: the gate's figures, per model, evaluation set and plan
    eval_set: Path  # the evaluation set the figures must have been measured on
    gate_steps: int = GREEDY_STEPS  # greedy continuation length the figures were measured with
    gate_on_start: bool = False  # measure missing figures when the server starts (slow)
    min_chunk_tokens: int = 24  # a shorter line of the prompt is prefilled, never a chunk
    max_chunk_tokens: int = 512  # a longer line too
    fallback: bool = True  # embedding fallback (all-MiniLM-L6-v2) when exact chunk hashes miss
    min_similarity: float = 0.8  # cosine similarity of a fallback candidate
    min_span_tokens: int = 16  # token alignment: the shortest reused run of a candidate

    def __post_init__(self) -> None:
        if not 1 <= self.min_chunk_tokens <= self.max_chunk_tokens:
            raise ValueError(
                f"need 1 <= min_chunk_tokens <= max_chunk_tokens, got {self.min_chunk_tokens}, {self.max_chunk_tokens}"
            )
        if self.min_span_tokens < 1:
            raise ValueError(f"min_span_tokens must be >= 1, got {self.min_span_tokens}")

    def serves(self, tenant: str) -> bool:
        return tenant in self.tenants


class Outcome(enum.Enum):
    """What the blend mode did for a request of an opted-in tenant."""

    BLENDED = "blended"  # some prompt tokens came from cached chunks
    NO_REUSE = "no_reuse"  # no chunk of the prompt was found: exact prefix caching only
    GATE_OFF = "gate_off"  # the model has not passed its gate: exact prefix caching only


@dataclass(frozen=True, slots=True)
class BlendUsage:
    """One request's blend account, apart from the exact prefix cache.

    ``reused`` prompt tokens kept the cached chunk KV (re-rotated to their position);
    ``recomputed`` had chunk KV but the plan ran them through the model again. Neither
    is ever in ``cached_tokens``, which counts exact prefix-cache hits only.
    ``lookups_*`` count the prompt's candidate chunks by how they were found."""

    outcome: Outcome
    reused: int = 0
    recomputed: int = 0
    lookups_exact: int = 0  # found by content hash
    lookups_similar: int = 0  # found by the embedding fallback, then token alignment
    lookups_missed: int = 0

    def __post_init__(self) -> None:
        if min(self.reused, self.recomputed, self.lookups_exact, self.lookups_similar, self.lookups_missed) < 0:
            raise ValueError(f"blend usage counts are >= 0, got {self}")

    @property
    def blended(self) -> int:
        return self.reused + self.recomputed


NO_BLEND = BlendUsage(Outcome.NO_REUSE)


@dataclass(frozen=True, slots=True)
class BlendedDone(DoneEvent):
    """The end of a request of an opted-in tenant, with its blend account."""

    blend: BlendUsage = NO_BLEND
