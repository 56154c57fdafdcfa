"""What ``prefixcache serve`` says when it starts: a few short ``event=...`` lines.

An operator reading the start of the log wants to know what is being served, where,
to whom, on which storage, and what a restart kept; not every setting (those are at
DEBUG, or ``prefixcache serve --print-settings``). Each line stays short enough to read
in a terminal, and no line carries a secret: a tier's URL shows through ``mask_url``,
API keys only as a count, the admin key and the tenant secret only as set or unset.

    event=serve_auth mode=open listen=loopback tenant=local
    event=serve_tier tier=memory kind=memory capacity=2GiB write=through codec=raw
    event=serve_tier tier=disk kind=disk capacity=20GiB write=through codec=raw path=.prefixcache/disk
    event=serve_model name=smollm2-135m-instruct dtype=float32 device=cpu weights=9c1e5d0a2b7f4e33
    event=serve_restart blocks=31 tokens=496 kept=disk:31
    event=serve_ready url=http://127.0.0.1:8000/v1
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixcache.config import TierConfig
from prefixcache.settings import LOCAL_TENANT, Settings
from prefixcache.settings.redact import mask_url

if TYPE_CHECKING:  # NOTE: the engine's imports load torch; this module is read without them
    from prefixcache.cache import PrefixCache
    from prefixcache.engine import LoadedModel

__all__ = ["opened_lines", "settings_lines", "url"]

_DURABLE = ("disk", "redis", "s3")  # tiers whose blocks outlive the process: what a restart finds


def url(settings: Settings) -> str:
    """The server's base URL (an IPv6 host in brackets)."""
    host = settings.server.host
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.server.port}"


def size(n: int) -> str:
    """Bytes as an operator writes them: ``2GiB``, ``512MiB``, ``1.5GiB``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + unit
    return f"{n}B"


def settings_lines(settings: Settings) -> list[str]:
    """The lines known before the model loads: who may use the server, and its tiers."""
    lines = [_auth(settings)]
    if not settings.server.cache:
        return [*lines, "event=serve_tier none (server.cache = false: every prompt is prefilled in full)"]
    return lines + [_tier(tier) for tier in settings.cache.tiers]


def _auth(settings: Settings) -> str:
    auth, server = settings.auth, settings.server
    if auth.tenant_header:
        proof = "set" if auth.tenant_secret else "unset"
        return f"event=serve_auth mode=gateway header={auth.tenant_header} tenant_secret={proof}"
    if auth.local_mode:
        where = "loopback" if not server.allow_open_access else f"{server.host} (allow_open_access)"
        return f"event=serve_auth mode=open listen={where} tenant={LOCAL_TENANT}"
    tenants = len(set(auth.api_keys.values()))
    admin = "set" if auth.admin_key else "unset"
    return f"event=serve_auth mode=api_keys keys={len(auth.api_keys)} tenants={tenants} admin_key={admin}"


def _tier(tier: TierConfig) -> str:
    fields = {
        "tier": tier.label,
        "kind": tier.kind,
        "capacity": size(tier.capacity_bytes),
        "write": tier.write,
        "codec": tier.codec,
    }
    if tier.kind == "device":
        fields["device"] = tier.device
    if tier.path is not None:
        fields["path"] = tier.path
    if tier.url:
        fields["url"] = mask_url(tier.url)
    if tier.bucket is not None:
        fields["bucket"] = f"{tier.bucket}/{tier.prefix}" if tier.prefix else tier.bucket
    if tier.endpoint is not None:
        fields["endpoint"] = mask_url(tier.endpoint)
    return "event=serve_tier " + " ".join(f"{k}={v}" for k, v in fields.items())


def opened_lines(settings: Settings, loaded: LoadedModel, cache: PrefixCache | None) -> list[str]:
    """The lines known once the model is loaded and the cache open: the model as it runs,
    what the durable tiers held from before (the warm restart), and the URL."""
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    served = settings.model.served_id
    name = settings.model.name if settings.model.name == served else f"{settings.model.name} id={served}"
    lines = [f"event=serve_model name={name} dtype={dtype} device={loaded.device} weights={loaded.fingerprint}"]
    if cache is not None:
        stats = cache.stats()
        kept = ",".join(f"{t.name}:{t.blocks}" for t in stats.tiers if t.kind in _DURABLE) or "none"
        lines.append(f"event=serve_restart blocks={stats.blocks} tokens={stats.used_tokens} kept={kept}")
    return [*lines, f"event=serve_ready url={url(settings)}/v1"]
