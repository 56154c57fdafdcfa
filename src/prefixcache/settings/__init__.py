"""Server settings: one schema, from a TOML file, ``PREFIXCACHE_*`` variables and flags.

Layered by pydantic-settings, each layer over the one before, field by field::

    defaults  <  TOML file (--config, or PREFIXCACHE_CONFIG)  <  PREFIXCACHE_<SECTION>_<FIELD>  <  CLI flags

``[cache]`` is ``CacheConfig`` itself, field for field (tiers, TTL, quotas, publication,
hash, ...; only ``kv_layout`` comes from the model): ``PREFIXCACHE_CACHE_POLICY=lru``,
``PREFIXCACHE_CACHE_TTL_SECONDS=600``, ``PREFIXCACHE_CACHE_TIERS='[{"kind": "memory",
"capacity_bytes": 1073741824}]'`` (JSON for tables and lists). ``PREFIXCACHE_AUTH_API_KEYS``
takes ``"sk-a=acme,sk-b=globex"``. An unknown section, field or variable is an error that
names it and lists the valid ones, so a typo never passes silently.

The defaults serve on one machine and survive a restart: L1 host memory that writes
every block through to an L2 disk under ``./.prefixcache/``, namespace isolation, no
keys (single-tenant local mode). Two servers share what either computed by adding the
same Redis as a third tier, written through from the disk. ``[fleet]`` (off by default)
publishes this server's KV events to a Redis stream for a prefix-aware router.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
import socket
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from prefixcache.config import (
    SECRET,
    CacheConfig,
    KVLayout,
    RetentionConfig,
    local_tiers,
    secret_depth,
    valid_names,
)
from prefixcache.engine.model import DEFAULT_MODEL
from prefixcache.identity import MIN_SECRET_BYTES
from prefixcache.settings.admission import AdmissionSettings
from prefixcache.settings.blend import BlendSettings
from prefixcache.settings.env import CONFIG_VAR, ENV_PREFIX, Env
from prefixcache.settings.redact import masked, scrub
from prefixcache.strict import StrictIsolationError

__all__ = [
    "CONFIG_VAR",
    "ENV_PREFIX",
    "SERVER_CACHE",
    "AuthSettings",
    "BlendSettings",
    "FleetSettings",
    "ModelSettings",
    "ServerSettings",
    "Settings",
    "load_settings",
]


# [cache]: CacheConfig's defaults, but for the tiers (config.local_tiers) and partial blocks
SERVER_CACHE = CacheConfig(partial_blocks=True, tiers=local_tiers(".prefixcache/disk"))
_FROZEN = ConfigDict(extra="forbid", frozen=True)
LOCAL_TENANT = "local"  # the one tenant of local mode (no API keys)


def _address_list(value: object) -> object:
    """``"10.0.0.1, 10.1.0.0/16"`` (an environment variable) as a list; a list as it is."""
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [a.strip() for a in value.split(",") if a.strip()]
    return value


def _check_networks(value: tuple[str, ...]) -> tuple[str, ...]:
    for network in value:
        try:
            ipaddress.ip_network(network)
        except ValueError as exc:  # "... does not appear to be an IPv4 or IPv6 network", "... has host bits set"
            raise ValueError(str(exc)) from None
    return value


class ServerSettings(BaseModel):
    model_config = _FROZEN

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_queue: int = Field(default=64, gt=0)  # requests waiting beyond this get 429 + Retry-After
    request_timeout_s: float = Field(default=120.0, gt=0)  # queue wait + generation
    max_body_bytes: int = Field(default=1 << 20, gt=0)  # larger bodies get 413
    read_timeout_s: float = Field(default=30.0, gt=0)  # a request's head and body must arrive within this
    default_max_tokens: int = Field(default=256, gt=0)  # when a chat request names none (capped by the context)
    cache: bool = True  # off: every prompt is prefilled in full
    flush_timeout_s: float = Field(default=30.0, ge=0)  # on SIGTERM or SIGINT: how long queued writes may take
    allow_open_access: bool = False  # needed to listen beyond loopback with no [auth] api_keys
    # the codec gate's figures (``prefixcache gate-codec --out``): a tier codec other than
    # raw starts only once passed there for the model, unless allow_ungated_codecs (logged)
    codec_gate_file: str = ".prefixcache/codec-gate.json"
    allow_ungated_codecs: bool = False
    # proxies whose X-Forwarded-For and X-Forwarded-Proto are believed (IPs or CIDR networks):
    # the client address that failed logins are throttled by, TLS for the dashboard cookie
    trusted_proxies: Annotated[
        tuple[str, ...], NoDecode, BeforeValidator(_address_list), AfterValidator(_check_networks)
    ] = ()


class ModelSettings(BaseModel):
    model_config = _FROZEN

    name: str = DEFAULT_MODEL  # the bundled SmolLM2, or a local transformers folder
    id: str = ""  # the name clients use and cache keys carry; default: derived from name
    models_dir: str = ".prefixcache/models"  # converted models
    device: str = "auto"  # auto: cuda when present, else cpu
    dtype: str = "float32"  # also the KV payload's dtype

    @property
    def served_id(self) -> str:
        return self.id or (DEFAULT_MODEL if self.name == DEFAULT_MODEL else Path(self.name).name)


def _key_pairs(value: object) -> object:
    """``"sk-a=acme, sk-b=globex"`` (or a JSON object: an environment variable) as a mapping."""
    if not isinstance(value, str):
        return value
    if value.lstrip().startswith("{"):
        return json.loads(value)
    pairs = [p.strip() for p in value.split(",") if p.strip()]
    if any("=" not in p for p in pairs):
        raise ValueError("api_keys must be KEY=TENANT pairs separated by commas (or a table)")
    return dict(p.split("=", 1) for p in pairs)


def _check_keys(value: dict[str, str]) -> dict[str, str]:
    if any(not key or not tenant for key, tenant in value.items()):
        raise ValueError("auth.api_keys maps non-empty keys to non-empty tenant names")
    return value


def _check_secret(value: str) -> str:
    if value and len(value.encode()) < MIN_SECRET_BYTES:  # the message never repeats the value
        raise ValueError(f"must be at least {MIN_SECRET_BYTES} bytes long when set")
    return value


class AuthSettings(BaseModel):
    model_config = _FROZEN

    # NOTE: ``SECRET`` marks a field whose value no error and no dump shows (``redact.py``)
    api_keys: Annotated[dict[str, str], SECRET, NoDecode, BeforeValidator(_key_pairs), AfterValidator(_check_keys)] = (
        Field(default_factory=dict, repr=False)
    )  # key -> tenant
    admin_key: Annotated[str, SECRET] = Field(default="", repr=False)
    tenant_header: str = ""  # a header set by a trusted gateway that names the tenant; off when empty
    # What ``prefixcache route`` sends its vLLM backends as ``Authorization: Bearer`` (vLLM's
    # ``--api-key``): tenants' own keys never go to vLLM; off when empty
    backend_key: Annotated[str, SECRET] = Field(default="", repr=False)
    # The secret ``prefixcache route`` salts each tenant's vLLM requests with and the vLLM
    # connector verifies them by (``identity.py``); needed with --vllm-backend.
    tenant_secret: Annotated[str, SECRET, AfterValidator(_check_secret)] = Field(default="", repr=False)
    # isolation = "shared" with several tenants lets each see (by cached_tokens and by
    # time) what the others sent: refused unless the operator says so here
    allow_cross_tenant_reuse: bool = False
    dashboard_session_s: float = Field(default=8 * 3600, gt=0)  # a dashboard login lasts this long

    @property
    def local_mode(self) -> bool:
        """No API keys: one tenant, no authentication (for a developer's machine)."""
        return not self.api_keys


def _redis_url(value: str) -> str:
    if value and urlsplit(value).scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    return value


class FleetSettings(BaseModel):
    """``[fleet]``: this server's KV events on a Redis stream, for a router (``fleet/publisher.py``)."""

    model_config = _FROZEN

    publish: bool = False  # send KV events to redis_url (and serve /fleet/info and /fleet/snapshot)
    redis_url: Annotated[str, SECRET, AfterValidator(_redis_url)] = Field(
        default="", repr=False
    )  # redis://:pw@host:6379/0
    name: str = ""  # this backend's name on the stream; default: server.host:server.port
    stream_prefix: str = "prefixcache:fleet"  # the stream is <stream_prefix>:events:<name>
    maxlen: int = Field(default=10_000, gt=0)  # entries (batches) the stream keeps: the replay buffer

    @model_validator(mode="after")
    def _reachable(self) -> FleetSettings:
        if self.publish and not self.redis_url:
            raise ValueError("fleet.publish = true needs fleet.redis_url (e.g. redis://127.0.0.1:6379/0)")
        return self


_SOURCES: ContextVar[tuple[Path | None, Mapping[str, str] | None]] = ContextVar("sources", default=(None, None))


class Settings(BaseSettings):
    """Everything ``prefixcache serve`` reads; ``cache`` is the cache's own configuration."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="_",
        env_nested_max_split=1,
        extra="forbid",
        frozen=True,
        nested_model_default_partial_update=True,
    )

    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    cache: CacheConfig = SERVER_CACHE
    auth: AuthSettings = AuthSettings()
    fleet: FleetSettings = FleetSettings()
    blend: BlendSettings = BlendSettings()
    admission: AdmissionSettings = AdmissionSettings()  # [admission]: each tenant's share (settings_admission.py)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path, environ = _SOURCES.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, Env(settings_cls, environ)]
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    @model_validator(mode="after")
    def _reachable(self) -> Settings:
        loopback = self.server.host in ("127.0.0.1", "localhost", "::1") or self.server.host.startswith("127.")
        if not loopback and self.auth.local_mode and not self.server.allow_open_access:
            raise ValueError(
                f"server.host = {self.server.host!r} with no [auth] api_keys lets anyone who reaches the port use "
                "the model and the cache unauthenticated; configure api_keys, or set server.allow_open_access = true "
                "(--allow-open-access)"
            )
        return self

    @model_validator(mode="after")
    def _isolated(self) -> Settings:
        if self.cross_tenant_reuse and not self.auth.allow_cross_tenant_reuse:
            raise ValueError(
                "cache.isolation = 'shared' with several tenants lets every tenant see what the others sent "
                "(cached_tokens and response time reveal it); use 'namespace' or 'partitioned', or set "
                "auth.allow_cross_tenant_reuse = true to accept that"
            )
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _strict(cls, data: Any, handler: ModelWrapValidatorHandler[Settings]) -> Settings:
        """Strict isolation refused with every setting that shares KV across tenants named
        at once: the cache's own (``CacheConfig`` refuses them) and this one of [auth]."""
        try:
            settings = handler(data)
        except ValidationError as exc:
            refused = next((e["ctx"]["error"] for e in exc.errors() if _strict_refusal(e)), None)
            if refused is None or not _allows_reuse(data):
                raise
            raise StrictIsolationError([*refused.conflicts, _ALLOW_REUSE]) from None
        if settings.cache.strict_isolation and settings.auth.allow_cross_tenant_reuse:
            raise StrictIsolationError([_ALLOW_REUSE])
        return settings

    @model_validator(mode="after")
    def _fleet_events(self) -> Settings:
        if self.fleet.publish and self.cache.events_capacity == 0:
            raise ValueError("fleet.publish = true needs the cache's events (cache.events_capacity > 0)")
        return self

    @model_validator(mode="after")
    def _blend_tenants(self) -> Settings:
        known = set(self.auth.api_keys.values()) if not self.auth.local_mode else {LOCAL_TENANT}
        unknown = sorted(set(self.blend.tenants) - known)
        if unknown and not self.auth.tenant_header:  # a gateway's header may name any tenant
            raise ValueError(
                f"blend.tenants names {unknown}, no tenant of this server; valid: {', '.join(sorted(known))}"
            )
        return self

    @model_validator(mode="after")
    def _retention_once(self) -> Settings:
        # NOTE: [cache] is CacheConfig field for field, so cache.retention exists too (the
        # vLLM connector's only spelling); two places for one figure would leave one unread
        if self.admission.sets_retention and self.cache.retention != RetentionConfig():
            raise ValueError(
                "retention shares are set twice, in [admission] (retain_share) and in [cache.retention]; "
                "keep one: [admission] retain_share and [admission.tenants.NAME] retain_share"
            )
        try:
            self.admission.retention(self.cache.retention)  # the cache's own checks, at load rather than at start
        except ValueError as exc:
            raise ValueError(f"[admission] retain_share: {exc}") from None
        return self

    @property
    def cross_tenant_reuse(self) -> bool:
        """Whether tenants share cached prefixes beyond publication (shared isolation, allowed)."""
        return self.cache.isolation == "shared" and (
            len(set(self.auth.api_keys.values())) > 1 or bool(self.auth.tenant_header)
        )

    @property
    def fleet_name(self) -> str:
        """This backend's publisher name: ``fleet.name``, or where it listens."""
        host = self.server.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return self.fleet.name or f"{host}:{self.server.port}"

    def cache_config(self, layout: KVLayout) -> CacheConfig:
        """The cache this server opens: ``[cache]`` with the model's KV layout, every tier
        whole (with blend on, chunks are blocks of this cache and share its tiers), and the
        retention shares of ``[admission]``."""
        if self.cache.kv_layout is not None:
            raise ValueError("cache.kv_layout comes from the model; remove it from the settings")
        retention = self.admission.retention(self.cache.retention)
        return dataclasses.replace(self.cache, kv_layout=layout, retention=retention)


_ALLOW_REUSE = "auth.allow_cross_tenant_reuse = true (it accepts shared isolation's reuse across tenants)"


def _strict_refusal(error: Any) -> bool:
    return isinstance((error.get("ctx") or {}).get("error"), StrictIsolationError)


def _allows_reuse(data: Any) -> bool:
    """Whether the raw settings (a layer's values, before validation) set
    auth.allow_cross_tenant_reuse; False where [auth] is itself invalid (its own error shows)."""
    auth = data.get("auth") if isinstance(data, Mapping) else None
    try:
        return AuthSettings.model_validate(auth if auth is not None else {}).allow_cross_tenant_reuse
    except ValidationError:
        return False


def load_settings(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """Defaults < the TOML at ``path`` (or ``$PREFIXCACHE_CONFIG``) < ``env`` (default:
    ``os.environ``) < ``overrides`` (the command line's flags). A bad setting is a
    ``ValueError`` that names it."""
    import os

    environ = os.environ if env is None else env
    path = path or environ.get(CONFIG_VAR) or None
    if path is not None:
        try:
            tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read the config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path} is not valid TOML: {exc}") from None
    token = _SOURCES.set((Path(path) if path is not None else None, env))
    try:
        layers: dict[str, Any] = {k: dict(v) for k, v in (overrides or {}).items()}
        return Settings(**layers)
    except ValidationError as exc:
        raise ValueError(_explain(exc)) from None
    except SettingsError as exc:  # a variable the environment source could not parse
        section = re.search(r'field "(\w+)"', str(exc))
        raise ValueError(f"invalid setting {section.group(1) if section else ''}.{exc.__cause__}") from None
    finally:
        _SOURCES.reset(token)


def _explain(exc: ValidationError) -> str:
    """The first error, as an operator reads it: which setting, what is wrong, and for
    an unknown name, the valid ones."""
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
    where = ".".join(loc) or "settings"
    if error["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        valid = valid_names(Settings, loc[:-1])
        env = ENV_PREFIX + "_".join(loc).upper()
        return f"unknown setting {where} (in the file, or as {env}); valid: {', '.join(valid)}"
    given = error.get("input")
    message = scrub(str(error["msg"]).removeprefix("Value error, "), Settings, loc, given)
    depth = secret_depth(Settings, loc)
    if depth is not None:  # the setting and what is wrong with it, never its value
        return f"invalid setting {'.'.join(loc[:depth])}: {message}"
    shown = "" if isinstance(given, dict | list | tuple) else f" (got {given!r})"
    return f"invalid setting {where}: {message}{shown}"


def describe(settings: Settings) -> dict[str, Any]:
    """The effective settings, secrets masked (for the startup log), and the tenants the
    API keys name."""
    out: dict[str, Any] = masked(settings)
    out["auth"]["tenants"] = sorted(set(settings.auth.api_keys.values()))
    return out
