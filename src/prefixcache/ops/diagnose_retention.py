"""``diagnose``'s retention check: a tenant holding its retention cap (``retention.py``),
in the cache (tokens) or in the tier where the cap binds (bytes), named with where and
how often the cap cut it. Info, not a warning: the cap costs that tenant its own oldest
retention and protects every other tenant; the operator decides whether it deserves more."""

from __future__ import annotations

from prefixcache.ops.findings import Finding, Thresholds
from prefixcache.ops.scrape import Window

__all__ = ["check_retention"]

ACTION = (
    "its clients ask to keep more than its share holds (its oldest retention expires first; no other tenant "
    "loses anything): to let it keep more, give it its own share ([admission.tenants.NAME] retain_share = 0.5) "
    "or grow the cache and its last tier; to refuse its retention, retain_share = 0"
)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _at_cap(w: Window, tenant: str, ratio: float) -> list[str]:
    """Where ``tenant`` holds at least ``ratio`` of its cap: the cache, then each tier."""
    where = []
    held = w.gauge("prefixcache_retained_tokens", tenant=tenant)
    cap = w.gauge("prefixcache_retention_cap_tokens", tenant=tenant)
    if cap > 0 and held >= ratio * cap:
        where.append(f"the cache: {held:,.0f} of {cap:,.0f} tokens")
    for labels, cap_bytes in sorted(w.after.series("prefixcache_retention_cap_bytes", tenant=tenant).items()):
        tier = dict(labels)
        held_bytes = w.gauge("prefixcache_retained_bytes", **tier)
        if cap_bytes > 0 and held_bytes >= ratio * cap_bytes:
            name = f"{tier.get('level', '?')} tier {tier.get('tier', '?')}"
            where.append(f"{name}: {_size(held_bytes)} of {_size(cap_bytes)}")
    return where


def check_retention(w: Window, t: Thresholds) -> list[Finding]:
    tenants = {
        dict(labels).get("tenant", "")
        for name in ("prefixcache_retention_cap_tokens", "prefixcache_retention_cap_bytes")
        for labels in w.after.series(name)
    }
    out = []
    for tenant in sorted(tenants):
        where = _at_cap(w, tenant, t.retain_at_cap)
        if not where:
            continue
        hits = w.delta("prefixcache_retention_cap_hits_total", tenant=tenant)
        ended = w.delta("prefixcache_retention_expired_tokens_total", tenant=tenant, reason="cap")
        out.append(
            Finding(
                "info",
                f"tenant {tenant!r} is at its retention cap",
                f"{'; '.join(where)}; the cap cut its retention {hits:,.0f} times, {ended:,.0f} tokens, {w.span()}",
                ACTION,
            )
        )
    return out
