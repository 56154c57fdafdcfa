"""``[admission]``: how the engine shares itself among tenants, validated into the
engine's ``Admission`` and scheduling arguments (``engine/scheduler.py``).

    [admission]
    max_concurrent = 4            # each tenant's requests queued or running
    max_queued_tokens = 32768     # their prompt tokens
    retain_share = 0.25           # each level of the cache a tenant may keep retained (below)
    kv_memory_bytes = 8589934592  # the KV the requests in flight may reserve (default: half the memory)
    [admission.tenants.acme]      # a key's tenant (auth.api_keys KEY=TENANT): its own limits,
    max_concurrent = 8            # the defaults above for what it does not set
    retain_share = 0.5            # its own share (0: its retention is refused, served without)

A tenant over its share gets 429 with Retry-After (``tenant_busy``) while the others
are served; ``server.max_queue`` still bounds the requests waiting in all.

``kv_memory_bytes`` is the engine's, all tenants together (``engine/memory.py``): a
request reserves its worst case, (prompt + max_tokens) tokens of KV twice, while in
flight; one that does not fit what is left waits, and those after it with it; one over
the whole budget gets 413 ``kv_budget_exceeded``.

Retention (``cache/retention.py``) is a tenant's share of the cache too, so it is set
here, beside the other shares, and becomes the cache's ``RetentionConfig``:
``retain_share`` is split among the tenants that retain at the time and have no share of
their own; a tenant's own ``retain_share`` is its alone. The vLLM connector, which has no
``[admission]``, takes the same figures as ``cache.retention`` (``share``, ``tenants``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from prefixcache.config import RetentionConfig
from prefixcache.engine.cacheio import IO_PER_TENANT, IO_WORKERS
from prefixcache.engine.memory import default_budget
from prefixcache.engine.scheduler import Admission, Order, TenantLimits
from prefixcache.engine.worker import PREFILL_CHUNK_TOKENS

__all__ = ["AdmissionSettings", "TenantAdmission"]

_FROZEN = ConfigDict(extra="forbid", frozen=True)


_SHARE = "retain_share is a share of each cache level, a number in [0, 1] (0 refuses retention)"


def _no_bool(value: object) -> object:
    if isinstance(value, bool):  # NOTE: true would read as 1.0, the whole cache
        raise ValueError(_SHARE)
    return value


def _share(value: float | None) -> float | None:
    if value is not None and not 0 <= value <= 1:
        raise ValueError(_SHARE)
    return value


Share = Annotated[float | None, BeforeValidator(_no_bool), AfterValidator(_share)]


class TenantAdmission(BaseModel):
    """``[admission.tenants.NAME]``: one tenant's limits; unset ones are ``[admission]``'s."""

    model_config = _FROZEN

    max_concurrent: int | None = Field(default=None, ge=1)
    max_queued_tokens: int | None = Field(default=None, ge=1)
    retain_share: Share = None  # its own share of each level for retention; unset: a part of the default


class AdmissionSettings(BaseModel):
    """``[admission]``: each tenant's share of the engine, and how the engine slices its time."""

    model_config = _FROZEN

    max_concurrent: int = Field(default=4, ge=1)  # a tenant's requests queued or running; more get 429
    max_queued_tokens: int = Field(default=32768, ge=1)  # their prompt tokens (a request alone always fits)
    tenants: dict[str, TenantAdmission] = Field(default_factory=dict)  # per tenant: its own limits
    # Requests in flight at once, decoding in one batch; each holds its KV. A tenant holding
    # h slots takes another only while more than h are free (room for one that arrives), so
    # 16 slots would hold 13 of 4 tenants' 4 requests each (max_concurrent): 32 hold them all.
    max_active: int = Field(default=32, ge=1)
    # The prompt tokens of one prefill step: what another request waits behind a long
    # prompt at most, and how often a deadline or a gone client is checked during a prefill.
    prefill_chunk_tokens: int = Field(default=PREFILL_CHUNK_TOKENS, ge=1)
    # Which waiting request gets a free slot: "fair" takes the tenants in turn; "fifo"
    # takes them in arrival order, one queue for all (the behaviour before, to compare).
    order: Literal["fair", "fifo"] = "fair"
    # The cache's match, load and stores run on io_workers threads (a thread waiting on a
    # tier costs no CPU), a tenant on io_per_tenant of them at most: a tenant whose shared
    # tier stalls holds that many, never another tenant's share (engine/ioqueue.py).
    io_workers: int = Field(default=IO_WORKERS, ge=1)
    io_per_tenant: int = Field(default=IO_PER_TENANT, ge=1)
    # The bytes of KV the requests in flight may reserve together, each its worst case
    # (engine/memory.py); unset: half of the machine's memory (or of its cgroup's limit).
    kv_memory_bytes: int | None = Field(default=None, ge=1)
    # The share of each cache level (the cache, each tier) that the tenants without one of
    # their own may keep retained, split among those that retain at the time; unset:
    # ``cache.retention``'s (a quarter by default).
    retain_share: Share = None

    @property
    def sets_retention(self) -> bool:
        """Whether these settings give a retention share (default or a tenant's)."""
        return self.retain_share is not None or any(t.retain_share is not None for t in self.tenants.values())

    def retention(self, base: RetentionConfig) -> RetentionConfig:
        """The cache's ``RetentionConfig``: ``base`` (``cache.retention``) with the shares set here."""
        if not self.sets_retention:
            return base
        own = {name: t.retain_share for name, t in self.tenants.items() if t.retain_share is not None}
        share = self.retain_share if self.retain_share is not None else base.share
        return RetentionConfig(share=share, tenants={**base.tenants, **own})

    def admission(self) -> Admission:
        """The engine's ``Admission``: the defaults, and each listed tenant's with its own overrides."""
        default = TenantLimits(self.max_concurrent, self.max_queued_tokens)
        tenants = {
            name: TenantLimits(
                own.max_concurrent if own.max_concurrent is not None else self.max_concurrent,
                own.max_queued_tokens if own.max_queued_tokens is not None else self.max_queued_tokens,
            )
            for name, own in self.tenants.items()
        }
        return Admission(default, tenants)

    def engine_args(self) -> dict[str, Any]:
        """The ``Engine`` keyword arguments these settings give."""
        return {
            "admission": self.admission(),
            "max_active": self.max_active,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "order": Order(self.order),
            "io_workers": self.io_workers,
            "io_per_tenant": self.io_per_tenant,
            "kv_budget": self.kv_memory_bytes if self.kv_memory_bytes is not None else default_budget(),
        }

    def check_tenants(self, known: Iterable[str]) -> None:
        """Refuse limits for a tenant no key names (a typo would silently leave it the defaults)."""
        names = set(known)
        unknown = sorted(set(self.tenants) - names)
        if unknown:
            raise ValueError(
                f"admission.tenants names {unknown}, no tenant of this server; valid: {', '.join(sorted(names))}"
            )
