"""Server settings: one TOML file, ``PREFIXCACHE_*`` environment variables, CLI flags.

Merged in one order, each layer overriding the one before, field by field::

    defaults  <  TOML file (--config, or PREFIXCACHE_CONFIG)  <  PREFIXCACHE_<SECTION>_<FIELD>  <  CLI flags

``PREFIXCACHE_SERVER_PORT=9000``, ``PREFIXCACHE_CACHE_REDIS_URL=redis://...``,
``PREFIXCACHE_AUTH_API_KEYS="sk-a=acme,sk-b=globex"``. An unknown section, field or
variable is an error that lists the valid names, so a typo never passes silently.

The defaults serve on one machine: L1 memory, L2 disk under ``./.prefixcache/``,
namespace isolation, S3-FIFO, no keys (single-tenant local mode); Redis joins as a
further tier when ``cache.redis_url`` is set.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.engine.model import DEFAULT_MODEL

ENV_PREFIX = "PREFIXCACHE_"


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64  # requests waiting beyond this get 429 + Retry-After
    request_timeout_s: float = 120.0  # queue wait + generation
    max_body_bytes: int = 1 << 20  # larger bodies get 413
    default_max_tokens: int = 256  # when a chat request names none (capped by the context)

    def __post_init__(self) -> None:
        _positive(self, "port", "max_queue", "request_timeout_s", "max_body_bytes", "default_max_tokens")
        if self.port > 65535:
            raise ValueError(f"server.port must be <= 65535, got {self.port}")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    name: str = DEFAULT_MODEL  # the bundled SmolLM2, or a local transformers folder
    id: str = ""  # the name clients use and cache keys carry; default: derived from name
    models_dir: str = ".prefixcache/models"  # converted models
    device: str = "auto"  # auto: cuda when present, else cpu
    dtype: str = "float32"  # also the KV payload's dtype

    @property
    def served_id(self) -> str:
        return self.id or (DEFAULT_MODEL if self.name == DEFAULT_MODEL else Path(self.name).name)


@dataclass(frozen=True, slots=True)
class CacheSettings:
    enabled: bool = True
    block_size: int = 16
    policy: str = "s3fifo"
    isolation: str = "namespace"
    partial_blocks: bool = True
    seed: str = "prefixcache"
    memory_bytes: int = 2 << 30  # L1
    disk_bytes: int = 20 << 30  # L2 (0: no disk tier)
    disk_path: str = ".prefixcache/disk"
    redis_url: str = ""  # L2 after disk when set
    redis_bytes: int = 8 << 30
    redis_namespace: str = ""

    def __post_init__(self) -> None:
        _positive(self, "block_size", "memory_bytes")


@dataclass(frozen=True, slots=True)
class AuthSettings:
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant
    admin_key: str = ""
    tenant_header: str = ""  # a header set by a trusted gateway that names the tenant; off when empty

    def __post_init__(self) -> None:
        for key, tenant in self.api_keys.items():
            if not key or not isinstance(tenant, str) or not tenant:
                raise ValueError("auth.api_keys maps non-empty keys to non-empty tenant names")

    @property
    def local_mode(self) -> bool:
        """No API keys: one tenant, no authentication (for a developer's machine)."""
        return not self.api_keys


@dataclass(frozen=True, slots=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)


SECTIONS: Mapping[str, type[Any]] = {
    "server": ServerSettings,
    "model": ModelSettings,
    "cache": CacheSettings,
    "auth": AuthSettings,
}


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def _field_types(cls: type[Any]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse_env(name: str, kind: Any, raw: str) -> Any:
    """A variable's text as the field's type."""
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be a boolean (true/false), got {raw!r}")
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{name} must be a {kind.__name__}, got {raw!r}") from None
    if typing.get_origin(kind) is Mapping or (isinstance(kind, types.GenericAlias) and kind.__origin__ is Mapping):
        pairs = [p.strip() for p in raw.split(",") if p.strip()]
        if any("=" not in p for p in pairs):
            raise ValueError(f"{name} must be KEY=TENANT pairs separated by commas")
        return dict(p.split("=", 1) for p in pairs)
    return raw


def _check_value(where: str, kind: Any, value: Any) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = kind if isinstance(kind, type) else dict
    if expected is dict and isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ValueError(f"{where} must be a {getattr(expected, '__name__', expected)}, got {value!r}")
    return value


def _layer_from_mapping(data: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        if section not in SECTIONS:
            raise ValueError(f"unknown section [{section}] in {where}; valid: {', '.join(SECTIONS)}")
        if not isinstance(values, Mapping):
            raise ValueError(f"[{section}] in {where} must be a table")
        types_ = _field_types(SECTIONS[section])
        for key, value in values.items():
            if key not in types_:
                raise ValueError(f"unknown field {section}.{key} in {where}; valid: {', '.join(types_)}")
            out.setdefault(section, {})[key] = _check_value(f"{section}.{key}", types_[key], value)
    return out


def _layer_from_env(env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    valid = [f"{ENV_PREFIX}{s.upper()}_{f.upper()}" for s, cls in SECTIONS.items() for f in _field_types(cls)]
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == f"{ENV_PREFIX}CONFIG":
            continue
        if name not in valid:
            raise ValueError(f"unknown environment variable {name}; valid: {', '.join(valid)}, {ENV_PREFIX}CONFIG")
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("_")
        out.setdefault(section, {})[key] = _parse_env(name, _field_types(SECTIONS[section])[key], raw)
    return out


def load_settings(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """Defaults < the TOML at ``path`` (or ``$PREFIXCACHE_CONFIG``) < ``env`` < ``overrides`` (CLI flags)."""
    env = os.environ if env is None else env
    layers: list[dict[str, dict[str, Any]]] = []
    path = path or env.get(f"{ENV_PREFIX}CONFIG") or None
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read the config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path} is not valid TOML: {exc}") from None
        layers.append(_layer_from_mapping(data, str(path)))
    layers.append(_layer_from_env(env))
    layers.append(_layer_from_mapping(overrides or {}, "the command line"))
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for section, values in layer.items():
            merged.setdefault(section, {}).update(values)
    try:
        parts = {name: cls(**merged.get(name, {})) for name, cls in SECTIONS.items()}
    except ValueError as exc:
        raise ValueError(f"invalid setting: {exc}") from None
    return Settings(**parts)


def describe(settings: Settings) -> dict[str, dict[str, Any]]:
    """The effective settings, secrets masked (for the startup log and admin stats)."""
    out: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        values = dataclasses.asdict(getattr(settings, name))
        if name == "auth":
            values = {
                "tenants": sorted(set(values["api_keys"].values())),
                "admin_key": "***" if values["admin_key"] else "",
                "tenant_header": values["tenant_header"],
            }
        out[name] = values
    return out
