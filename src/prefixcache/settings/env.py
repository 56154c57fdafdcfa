"""The environment layer of the server's settings: pydantic-settings' source for
``PREFIXCACHE_<SECTION>_<FIELD>`` variables, taught the configuration's dataclasses."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource

from prefixcache.identity import SECRET_ENV

__all__ = ["COMMAND_VARS", "CONFIG_VAR", "ENV_PREFIX", "Env", "UnknownSetting"]

ENV_PREFIX = "PREFIXCACHE_"
CONFIG_VAR = f"{ENV_PREFIX}CONFIG"
COMMAND_VARS = f"{ENV_PREFIX}AUDIT_"  # read by `prefixcache audit-timing` (its keys), not settings


class UnknownSetting(ValueError):
    """A ``PREFIXCACHE_*`` variable that names no section."""


class Env(EnvSettingsSource):
    """pydantic-settings' environment source, taught two things: to look inside the
    configuration's stdlib dataclasses for nested fields (so ``PREFIXCACHE_CACHE_TIERS``
    is parsed as a list), and to read a given mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        environ = self._environ
        loaded = super()._load_env_vars() if environ is None else {k.lower(): v for k, v in environ.items()}
        outside = (CONFIG_VAR.lower(), SECRET_ENV.lower())  # the secret's own variable, shared with the connector
        return {k: v for k, v in loaded.items() if k not in outside and not k.startswith(COMMAND_VARS.lower())}

    def __call__(self) -> dict[str, Any]:
        sections = tuple(self.settings_cls.model_fields)
        prefix = ENV_PREFIX.lower()
        for name in self.env_vars:
            rest = name[len(prefix) :] if name.startswith(prefix) else None
            if rest is not None and not any(rest.startswith(f"{section}_") for section in sections):
                raise UnknownSetting(f"unknown setting {rest} (as {name.upper()}); valid: {', '.join(sections)}")
        return super().__call__()

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError as exc:
            raise ValueError(f"{field_name}: not valid JSON ({exc})") from None

    def next_field(
        self, field: FieldInfo | Any | None, key: str, case_sensitive: bool | None = None
    ) -> FieldInfo | None:
        found = super().next_field(field, key, case_sensitive)
        annotation = field.annotation if isinstance(field, FieldInfo) else field
        if found is not None or not dataclasses.is_dataclass(annotation):
            return found
        hints = typing.get_type_hints(annotation)
        name = key if case_sensitive else key.lower()
        return FieldInfo.from_annotation(hints[name]) if name in hints else None
