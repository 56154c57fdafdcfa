"""What the server counts per finished request: the metrics by tenant x model x
endpoint (``ops/metrics.py``), its measured prefill speed, and the last requests'
token-source strips for the dashboard (exact tiers, blended chunks, computed)."""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from prefixcache.blend.metrics import BlendMetrics
from prefixcache.blend.serve_types import BlendedDone
from prefixcache.cache import PrefixCache
from prefixcache.engine import DoneEvent
from prefixcache.ops.metrics import PrefillRate, RequestRecord, ServingMetrics

__all__ = ["RECENT_REQUESTS", "STRIP_LEVELS", "Recorder"]

log = logging.getLogger(__name__)

RECENT_REQUESTS = 20  # kept for the dashboard's token-source strips
STRIP_LEVELS = ("L0", "L1", "L2")  # the page's colours; slower tiers are drawn as L2


class Endpoint(enum.StrEnum):
    """The generation route a request came by: its ``endpoint`` label in the metrics."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    MESSAGES = "messages"


class Recorder:
    """Counts finished requests into the server's metrics."""

    def __init__(
        self, registry: CollectorRegistry, model_id: str, cache: PrefixCache | None, blend: BlendMetrics | None = None
    ) -> None:
        self.model_id = model_id
        self.metrics = ServingMetrics(registry)
        self.blend = blend if blend is not None else BlendMetrics(registry)
        self.prefill_rate = PrefillRate()
        self.tier_levels = tier_levels(cache)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)

    def record(self, tenant: str, endpoint: Endpoint, done: DoneEvent, arrived: float, ttft: float) -> None:
        usage = done.usage
        levels: dict[str, int] = {}  # tier name -> level (L0 fastest), as /metrics and the page name them
        for name, n in usage.tier_tokens.items():
            level = self.tier_levels.get(name, name)
            levels[level] = levels.get(level, 0) + n
        blend = done.blend if isinstance(done, BlendedDone) else None
        reused = blend.reused if blend is not None else 0
        # a strip only where the counts add up (the record below logs a tier mismatch)
        if sum(levels.values()) == usage.cached_tokens and reused <= usage.prompt_tokens - usage.cached_tokens:
            self.recent.append(
                {
                    "tenant": tenant,
                    "model": self.model_id,
                    "prompt_tokens": usage.prompt_tokens,
                    "segments": _segments(levels, usage.prompt_tokens, usage.cached_tokens, reused),
                }
            )
        try:
            computed = usage.prompt_tokens - usage.cached_tokens
            whole = usage.cached_tokens == 0 and (blend is None or blend.blended == 0)  # every token prefilled
            rate = self.prefill_rate.observe(usage.prefill_s, computed) if whole else None
            if rate is not None:
                self.metrics.set_prefill_seconds_per_token(rate)
            record = RequestRecord(
                tenant=tenant,
                model=self.model_id,
                endpoint=endpoint.value,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
                tier_tokens=levels,
                queue_seconds=usage.queue_s,
                ttft_seconds=ttft,
                total_seconds=time.monotonic() - arrived,
                prefill_seconds=usage.prefill_s,
            )
            label = self.metrics.record_request(record)
            if blend is not None:
                fresh = usage.prompt_tokens - usage.cached_tokens - blend.blended
                self.blend.record_request(label, self.model_id, blend, fresh)
        except ValueError:  # metrics must never fail a request
            log.exception("recording metrics failed")


def tier_levels(cache: PrefixCache | None) -> dict[str, str]:
    """Tier name -> level (``L0`` device, ``L1`` host RAM, ``L2`` disk and Redis)."""
    tiers = cache.config.tiers if cache is not None else ()
    return {tier.label: tier.level for tier in tiers}


def _segments(levels: Mapping[str, int], prompt_tokens: int, cached_tokens: int, blended: int = 0) -> list[list[Any]]:
    """Where a prompt's tokens came from: ``[["L0", 96], ["L1", 32], ["blended", 50], ["computed", 20]]``.

    The exact prefix comes first, in prompt order; then the tokens a blend kept from
    cached chunks (``blended``: reused, never the recomputed ones, which are computed)
    and the computed rest, as totals, since chunks and fresh text alternate after it.

    NOTE: tiers are prefix-closed (design invariant 4): a block's ancestors sit in its
    tier or a faster one, so along a loaded prefix the tiers only get slower and the
    sources can be listed fastest first without knowing each block's position."""
    folded: dict[str, int] = {}
    for level, n in sorted(levels.items(), key=lambda item: _level_rank(item[0])):
        source = level if level in STRIP_LEVELS else STRIP_LEVELS[-1]
        folded[source] = folded.get(source, 0) + n
    segments: list[list[Any]] = [[source, n] for source, n in folded.items() if n]
    if blended:
        segments.append(["blended", blended])
    if prompt_tokens > cached_tokens + blended:
        segments.append(["computed", prompt_tokens - cached_tokens - blended])
    return segments


def _level_rank(level: str) -> int:
    return int(level[1:]) if level[:1] == "L" and level[1:].isdigit() else 1 << 30
