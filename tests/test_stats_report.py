"""Bounded per-tenant reports (/admin/stats lists as many tenants by name as /metrics labels)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefixcache.cache.stats import TenantStats, top_tenants


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 1000), max_size=40), st.integers(0, 25))
def test_a_tenant_report_is_bounded_and_loses_no_count(tokens: dict[str, int], n: int) -> None:
    tenants = {name: TenantStats(1, t, t // 2, 1, t // 3) for name, t in tokens.items() if name != "other"}
    report = top_tenants(tenants, n)
    assert len(report) <= n + 1
    assert sum(t.lookup_tokens for t in report.values()) == sum(t.lookup_tokens for t in tenants.values())
    assert sum(t.lookups for t in report.values()) == len(tenants)
    named = [name for name in report if name != "other"]
    if len(tenants) > n:  # the ones named are the busiest
        assert min((tenants[x].lookup_tokens for x in named), default=1 << 30) >= max(
            t.lookup_tokens for x, t in tenants.items() if x not in named
        )
