"""The JSON behind the server's dashboard page (``server/static/index.html``).

The server serves it at ``GET /dashboard/data`` (behind the admin key, like
``/metrics``: it holds per-tenant figures); the page polls it every two seconds and
computes live rates from the difference of two polls. Shape (version 1)::

    {
      "version": 1,
      "time": 1795948173.7,                      # unix seconds when it was made
      "totals": {"lookups": 120, "prompt_tokens": 52000, "hit_tokens": 31000, "hit_rate": 0.596,
                 "prefill_seconds_saved": 6.2, "prefill_seconds": 4.2, "saved_share": 0.596,
                 "prefill_seconds_per_token": 0.0002},       # null until the engine measured it
      "tier_tokens": {"L0": 30000, "L2": 1000},  # hit tokens served from each tier, since start
      "cache": {"used_tokens": 9000, "capacity_tokens": 1048576, "blocks": 560, "epoch_bumps": 0,
                "collisions": 0, "published_blocks": 0,
                "evictions": {"capacity": 0, "stale": 0, "ttl": 0, "purge": 0, "replaced": 0, "lost": 0}},
      "tiers": [{"name": "hbm", "kind": "memory", "level": "L0", "used_bytes": 1, "capacity_bytes": 2,
                 "blocks": 1, "hits": 5, "misses": 1, "evictions": 0, "demotions": 0, "errors": 0}],
      "tenants": [{"tenant": "acme", "lookups": 80, "prompt_tokens": 40000, "hit_tokens": 26000,
                   "hit_rate": 0.65, "prefill_seconds_saved": 5.2}],   # most prompt tokens first
      "recent": [{"tenant": "acme", "model": "smollm2", "prompt_tokens": 700,
                  "segments": [["L0", 512], ["L2", 64], ["computed", 124]]}],  # oldest first
      "retention": {                               # what tenants keep retained (ops/retention.py)
        "levels": [{"name": "cache", "unit": "tokens", "binding": true},
                   {"name": "ram", "unit": "bytes", "kind": "memory", "level": "L1", "binding": true}],
        "tenants": [{"tenant": "acme", "held": [4096, 188743680], "caps": [4096, 188743680],
                     "at_cap": true, "expired_tokens": 0, "capped_tokens": 512, "cap_hits": 2,
                     "refused": 0}]}               # most retained first; caps 0 where none binds
    }

Counters are totals since the server started; ``tenants`` uses the same labels as
/metrics (the top N tenants, the rest as ``other``). ``segments`` says where the
prompt's tokens came from: the exact prefix in prompt order, tier by tier; then, for a
tenant in the blend mode, ``blended`` (kept from cached chunks at another position,
never an exact hit) and ``computed`` by prefill (the recomputed tokens among them).
Their lengths sum to ``prompt_tokens``. ``retention`` gives each tenant's retained tokens
in the cache and bytes in each tier, with its caps there (a tier's bytes: its retained
frames times a full block's frame, the tier's ``frame_bytes``), folded under the same labels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefixcache.cache.stats import CacheStats
from prefixcache.events import RemovalReason
from prefixcache.ops.metrics import OTHER, ServingMetrics
from prefixcache.ops.retention import AT_CAP, fold, retention_rows

VERSION = 1
SOURCES = ("L0", "L1", "L2", "blended", "computed")
TIER_FIELDS = ("used_bytes", "capacity_bytes", "blocks", "hits", "misses", "evictions", "demotions")


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _tenants(serving: ServingMetrics) -> list[dict[str, Any]]:
    per: dict[str, dict[str, Any]] = {}
    for (tenant, _model, _endpoint), t in serving.snapshot().items():
        row = per.setdefault(
            tenant, {"tenant": tenant, "lookups": 0, "prompt_tokens": 0, "hit_tokens": 0, "prefill_seconds_saved": 0.0}
        )
        row["lookups"] += t.lookups
        row["prompt_tokens"] += t.prompt_tokens
        row["hit_tokens"] += t.hit_tokens
        row["prefill_seconds_saved"] += t.prefill_seconds_saved
    rows = sorted(per.values(), key=lambda r: (-r["prompt_tokens"], r["tenant"]))
    for row in rows:
        row["hit_rate"] = _ratio(row["hit_tokens"], row["prompt_tokens"])
    return rows


def _recent(entry: Mapping[str, Any]) -> dict[str, Any]:
    pairs = [(str(source), int(n)) for source, n in entry["segments"]]
    for source, n in pairs:
        if source not in SOURCES or n < 0:
            raise ValueError(f"segment {[source, n]}: source must be one of {', '.join(SOURCES)} and n >= 0")
    segments = [[source, n] for source, n in pairs]
    if sum(n for _, n in pairs) != entry["prompt_tokens"]:
        raise ValueError(f"segments {segments} do not sum to prompt_tokens={entry['prompt_tokens']}")
    return {
        "tenant": str(entry["tenant"]),
        "model": str(entry["model"]),
        "prompt_tokens": int(entry["prompt_tokens"]),
        "segments": segments,
    }


def _retention(s: CacheStats | None, serving: ServingMetrics) -> dict[str, Any]:
    if s is None:
        return {"levels": [], "tenants": []}
    tiers = {t.name: t for t in s.tiers}
    levels = []
    for level in s.retention_levels:
        tier = tiers.get(level.name)
        where = {"kind": tier.kind, "level": tier.level} if tier is not None and not level.per_token else {}
        unit = "tokens" if level.per_token else "bytes"
        levels.append({"name": level.name, "unit": unit} | where | {"binding": level.binding})
    labelled = serving.tenants.labelled  # NOTE: the tenants table's labels, so the two rows meet
    rows = fold(retention_rows(s), lambda t: t if t in labelled else OTHER)
    rows.sort(key=lambda r: (-sum(r.held[1:]), -r.held[0] if r.held else 0, r.tenant))
    tenants = [
        {"tenant": r.tenant, "held": list(r.held), "caps": list(r.caps), "at_cap": bool(r.at_cap(AT_CAP))}
        | {"expired_tokens": r.expired_tokens, "capped_tokens": r.capped_tokens}
        | {"cap_hits": r.cap_hits, "refused": r.refused}
        for r in rows
    ]
    return {"levels": levels, "tenants": tenants}


def dashboard_data(
    cache_stats: CacheStats | None,
    serving: ServingMetrics,
    recent: Sequence[Mapping[str, Any]],
    limit: int = 20,
    clock: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """The page's JSON from ``PrefixCache.stats()`` (None: the server runs without a
    cache), the server's metrics and its last requests (oldest first; the last
    ``limit`` are kept)."""
    tenants = _tenants(serving)
    lookups = sum(r["lookups"] for r in tenants)
    prompt = sum(r["prompt_tokens"] for r in tenants)
    hit = sum(r["hit_tokens"] for r in tenants)
    snapshot = serving.snapshot().values()
    saved = sum(t.prefill_seconds_saved for t in snapshot)
    spent = sum(t.prefill_seconds for t in snapshot)
    s = cache_stats
    tiers = [
        {"name": t.name, "kind": t.kind, "level": t.level}
        | {k: getattr(t, k) for k in TIER_FIELDS}
        | {"errors": sum(t.errors.values())}
        for t in (s.tiers if s is not None else ())
    ]
    cache: dict[str, Any] = {
        "used_tokens": s.used_tokens if s else 0,
        "capacity_tokens": s.capacity_tokens if s else 0,
        "blocks": s.blocks if s else 0,
        "epoch_bumps": s.epoch_bumps if s else 0,
        "collisions": s.collisions if s else 0,
        "published_blocks": s.published_blocks if s else 0,
        "evictions": {reason.label: s.removed(reason) if s else 0 for reason in RemovalReason},
    }
    return {
        "version": VERSION,
        "time": clock(),
        "totals": {
            "lookups": lookups,
            "prompt_tokens": prompt,
            "hit_tokens": hit,
            "hit_rate": _ratio(hit, prompt),
            "prefill_seconds_saved": saved,
            "prefill_seconds": spent,
            "saved_share": _ratio(saved, saved + spent),
            "prefill_seconds_per_token": serving.prefill_seconds_per_token,
        },
        "tier_tokens": dict(serving.tier_tokens),
        "cache": cache,
        "tiers": tiers,
        "tenants": tenants,
        "recent": [_recent(entry) for entry in list(recent)[-limit:]] if limit > 0 else [],
        "retention": _retention(s, serving),
    }
