"""The connector's settings: vLLM's ``kv_connector_extra_config``, one typed schema.

``cache`` is ``CacheConfig`` field for field, exactly the server's ``[cache]`` table
(tiers, policies, write policies, TTL, quotas, publication, hash); ``block_size`` and
the KV layout come from vLLM. An unknown key is an error that names it and the valid
ones. Example::

    --kv-transfer-config '{"kv_connector": "PrefixCacheConnector",
      "kv_connector_module_path": "prefixcache.integrations.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cache": {"tiers": [
          {"kind": "memory", "capacity_bytes": 4294967296, "write": "through"},
          {"kind": "disk", "capacity_bytes": 107374182400, "path": "/var/cache/prefixcache"}]}}}'
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prefixcache.config import CacheConfig, local_tiers, valid_names
from prefixcache.identity import MIN_SECRET_BYTES, SECRET_ENV, Unverified
from prefixcache.strict import StrictIsolationError
from prefixcache.weights import model_key  # the connector's key: one fingerprint everywhere

__all__ = ["VLLM_CACHE", "ConnectorSettings", "model_key", "parse_settings", "read_secret"]

log = logging.getLogger("prefixcache.vllm")

VLLM_CACHE = CacheConfig(tiers=local_tiers(".prefixcache/vllm-disk"))  # the rest: CacheConfig's defaults


class ConnectorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cache: CacheConfig = VLLM_CACHE
    default_tenant: str = Field(default="default", min_length=1)  # a request with no cache_salt (and no secret)
    # The environment variable holding the secret shared with ``prefixcache route``
    # (``identity.py``); when it is set, a tenant is taken only as the gateway vouched for it.
    tenant_secret_env: str = Field(default=SECRET_ENV, min_length=1)
    unverified: Unverified = (
        Unverified.BYPASS
    )  # a request whose tenant does not verify: no cache, or the default tenant
    model_id: str = (
        ""  # the model's name in cache keys (its weights' hash is always added); default: vLLM's served name
    )
    lookup_timeout_s: float = Field(default=1.0, gt=0)  # the scheduler waits no longer for a lookup
    # Loads run on I/O threads while vLLM's steps go on, the request waiting alone
    # (vLLM's async load); off, they run inside the step, before its forward pass.
    async_load: bool = True
    load_threads: int = Field(default=2, ge=1, le=64)  # concurrent async loads
    # A hybrid model (sliding-window or recurrent layers beside full attention) resumes
    # only where its other groups' blocks were kept: at each save's end and every this
    # many tokens of a prompt (0: save ends only; default: 4 windows, at least 1,024).
    boundary_every_tokens: int | None = Field(default=None, ge=0)
    socket_dir: str = ""  # where the worker's lookup socket lives; default $XDG_RUNTIME_DIR or /tmp
    flush_timeout_s: float = Field(default=30.0, ge=0)  # on shutdown: how long queued writes may take
    # A tier codec other than raw is lossy; the quality gate (``prefixcache gate-codec``)
    # measures our own engine, not the model vLLM serves, so the connector takes one only
    # when the operator says they have measured it (or accept it): logged at start.
    allow_ungated_codecs: bool = False


def parse_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """``kv_connector_extra_config`` as settings; a bad key or value is a ``ValueError``."""
    try:
        settings = ConnectorSettings(**dict(extra or {}))
    except ValidationError as exc:
        error = exc.errors()[0]
        refused = (error.get("ctx") or {}).get("error")
        if isinstance(refused, StrictIsolationError):  # named with the connector's own, at once
            raise StrictIsolationError(refused.conflicts + _strict_conflicts(dict(extra or {}))) from None
        where = ".".join(str(p) for p in error["loc"] if not isinstance(p, int)) or "settings"
        if error["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            names = [str(p) for p in error["loc"] if not isinstance(p, int)][:-1]
            valid = ", ".join(n for n in valid_names(ConnectorSettings, names) if n != "kv_layout")
            raise ValueError(f"unknown kv_connector_extra_config key {where}; valid: {valid}") from None
        raise ValueError(f"invalid kv_connector_extra_config {where}: {error['msg']}") from None
    if settings.cache.kv_layout is not None:
        raise ValueError("kv_connector_extra_config cache.kv_layout comes from vLLM; remove it")
    _check_codecs(settings)
    conflicts = _strict_conflicts(dict(extra or {})) if settings.cache.strict_isolation else []
    if conflicts:
        raise StrictIsolationError(conflicts)
    return settings


def _strict_conflicts(extra: Mapping[str, Any]) -> list[str]:
    """The connector's settings that strict isolation refuses (the cache's refuse themselves)."""
    if str(extra.get("unverified", "")).lower() != Unverified.DEFAULT.value:
        return []
    return ["unverified = 'default' (requests whose tenant does not verify share default_tenant's KV)"]


def _check_codecs(settings: ConnectorSettings) -> None:
    """A lossy tier codec only with ``allow_ungated_codecs`` (see the field), then logged."""
    lossy = [f"{t.label}: {t.codec}" for t in settings.cache.tiers if t.codec != "raw"]
    if not lossy:
        return
    if not settings.allow_ungated_codecs:
        raise ValueError(
            f"lossy tier codecs ({', '.join(lossy)}) have no quality gate inside vLLM: measure the "
            "model's weights with `prefixcache gate-codec --model PATH` (docs/codecs.md), then set "
            "kv_connector_extra_config allow_ungated_codecs: true; or use codec 'raw'"
        )
    log.warning("event=codec_gate_overridden where=vllm codecs=%s", ",".join(lossy))


def read_secret(settings: ConnectorSettings) -> bytes | None:
    """The gateway's secret from the environment variable the settings name; None when
    unset (the connector then trusts the cache salt, as vLLM does). Never logged."""
    value = os.environ.get(settings.tenant_secret_env, "")
    if not value:
        return None
    secret = value.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"${settings.tenant_secret_env} must be at least {MIN_SECRET_BYTES} bytes long")
    return secret
