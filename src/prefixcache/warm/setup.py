"""A local warm's setup: the settings ``serve`` reads, checked for what warm needs, and the
server's own model, cache and engine (``server.main.open_engine``: the codec gate's start
check included), so that the keys warm stores under are the ones a server started on
the same settings computes.

The checks come before the model loads, each naming the setting to change:

- ``[server] cache = false``: nothing would be stored;
- ``--tenant`` must be a tenant the server can serve (one of ``[auth] api_keys``'
  tenants, ``local`` in local mode; any name behind a gateway's ``tenant_header``),
  else its blocks would never be hit;
- every tier but the slowest writes through while warm runs (``through_settings``): a
  write-back tier copies a block down only when it evicts it, so a warm's blocks would
  end with its process; keys and codecs are the settings' own;
- ``--public`` needs an isolation mode with public prefixes: ``namespace``, or
  ``partitioned`` with a public pool (``shared_quota`` or ``[cache.publish]``), and
  no ``strict_isolation``. A public warm is the operator's declaration
  (``PrefixCache.declare_public``), the same one the cache takes from code; nothing a
  tenant sends can make it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from prefixcache.cache import PrefixCache
from prefixcache.engine import Engine
from prefixcache.engine.model import ModelError
from prefixcache.quality.codec_gate import CodecGateRefused
from prefixcache.server.main import open_engine
from prefixcache.settings import LOCAL_TENANT, Settings, load_settings
from prefixcache.warm.inputs import BadLine, WarmItem
from prefixcache.warm.local import Snapshot, snapshot, tier_deltas, warm_engine
from prefixcache.warm.progress import Progress, Tally

__all__ = ["LocalWarm", "WarmSetupError", "check_public", "through_settings", "warm_tenant"]


class WarmSetupError(ValueError):
    """Settings or arguments a local warm cannot run with (the message says what to change)."""


def check_public(settings: Settings) -> None:
    """Refuse ``--public`` where the isolation mode has no public prefixes."""
    cache = settings.cache
    if cache.strict_isolation:
        raise WarmSetupError(
            "--public is refused: cache.strict_isolation = true forbids public prefixes (a tenant's KV stays its "
            "own); warm each tenant with --tenant"
        )
    if cache.isolation == "shared":
        raise WarmSetupError(
            "--public: isolation = 'shared' has no public pool (every tenant already reuses every prefix); "
            "warm without --public"
        )
    if cache.isolation == "partitioned" and cache.publish is None and cache.shared_quota is None:
        raise WarmSetupError(
            "--public: isolation = 'partitioned' without a public pool; set [cache] shared_quota "
            "(or [cache.publish]) to give public prefixes their pool"
        )


def through_settings(settings: Settings) -> Settings:
    """``settings`` with every tier above the slowest writing through (the module's note)."""
    tiers = settings.cache.tiers
    through = tuple(replace(t, write="through") for t in tiers[:-1]) + tiers[-1:]
    if through == tiers:
        return settings
    for tier in tiers[:-1]:
        if tier.write != "through":
            print(f"prefixcache warm: tier {tier.label} writes through for this warm (write = {tier.write!r})")
    return settings.model_copy(update={"cache": replace(settings.cache, tiers=through)})


def warm_tenant(settings: Settings, tenant: str | None) -> str:
    """The tenant a warm stores for: the one named, if the server can ever serve it."""
    auth = settings.auth
    known = sorted(set(auth.api_keys.values())) or [LOCAL_TENANT]
    if tenant is None:
        if len(known) == 1 and auth.local_mode:
            return LOCAL_TENANT
        raise WarmSetupError(f"name the tenant to warm for with --tenant (tenants of [auth] api_keys: {known})")
    if not tenant:
        raise WarmSetupError("--tenant must be a non-empty name")
    if not auth.tenant_header and tenant not in known:
        raise WarmSetupError(
            f"--tenant {tenant!r}: the server serves no such tenant, so nothing warmed for it would ever be hit "
            f"(tenants of [auth] api_keys: {known})"
        )
    return tenant


@dataclass
class LocalWarm:
    """The engine and cache a local warm runs on, and the tiers' state before it."""

    settings: Settings
    engine: Engine
    cache: PrefixCache
    tenant: str
    public: bool
    before: Snapshot

    @classmethod
    def open(cls, config: str | None, model: str | None, tenant: str | None, public: bool) -> LocalWarm:
        overrides: dict[str, Any] = {"model": {"name": model}} if model is not None else {}
        try:
            settings = load_settings(config, overrides=overrides)
        except (ValueError, OSError) as exc:
            raise WarmSetupError(str(exc)) from None
        if not settings.server.cache:
            raise WarmSetupError("[server] cache = false: there is no cache to warm")
        if public:
            check_public(settings)
        name = warm_tenant(settings, tenant)
        settings = through_settings(settings)
        try:
            engine, cache = open_engine(settings)
        except (ModelError, FileNotFoundError, CodecGateRefused) as exc:
            raise WarmSetupError(str(exc)) from None
        assert cache is not None  # server.cache is on
        return cls(settings, engine, cache, name, public, snapshot(cache))

    def run(self, items: Iterator[WarmItem | BadLine], tally: Tally, progress: Progress, skip_bad: bool) -> None:
        warm_engine(
            self.engine,
            self.cache,
            items,
            tally,
            progress.update,
            tenant=self.tenant,
            public=self.public,
            skip_bad=skip_bad,
        )

    def close(self, tally: Tally) -> None:
        """Stop the engine, flush every queued write to the slow tiers, then count what they gained."""
        self.engine.close()
        timeout = self.settings.server.flush_timeout_s
        flushed = self.cache.flush(timeout)
        tally.tiers = tier_deltas(self.cache, self.before)  # NOTE: before close, which lets the tiers go
        if not self.cache.close(timeout if flushed else 0.0):
            writer = self.cache.stats().writer
            abandoned = writer.abandoned if writer is not None else 0
            print(
                f"prefixcache warm: {abandoned} writes did not land within [server] flush_timeout_s "
                f"({self.settings.server.flush_timeout_s} s); a rerun warms them again",
                file=sys.stderr,
            )
