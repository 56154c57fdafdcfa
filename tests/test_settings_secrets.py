"""Secrets never echoed: a settings error names the secret setting and what is wrong with
it, never its value, whether it came from a variable or the TOML file; the startup log
masks every secret, a URL's password included; and every field whose name says it may
hold a secret carries the mark (``config.SECRET``) that these rules hang on."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from prefixcache.config import field_hint, is_secret, section_of
from prefixcache.settings import Settings, describe, load_settings
from prefixcache.settings.redact import mask_url, scrub

SERVE = [str(Path(sys.executable).with_name("prefixcache")), "serve"]


# (setting named, the secret text that must never show, env, toml)
Case = tuple[str, str, dict[str, str], str]
BAD: list[Case] = [
    ("auth.api_keys", "sk-live-S3CRET1", {"PREFIXCACHE_AUTH_API_KEYS": "sk-live-S3CRET1=acme,sk-live-S3CRET2"}, ""),
    ("auth.api_keys", "sk-live-S3CRET3", {"PREFIXCACHE_AUTH_API_KEYS": '{"sk-live-S3CRET3": 5}'}, ""),
    ("auth.api_keys", "sk-live-S3CRET4", {"PREFIXCACHE_AUTH_API_KEYS": '{"sk-live-S3CRET4": ""}'}, ""),
    ("auth.api_keys", "sk-live-S3CRET5", {}, '[auth]\napi_keys = { "sk-live-S3CRET5" = 5 }\n'),
    ("auth.api_keys", "sk-live-S3CRET6", {}, '[auth]\napi_keys = "sk-live-S3CRET6"\n'),
    ("auth.admin_key", "12345", {}, "[auth]\nadmin_key = 12345\n"),
    ("auth.admin_key", "adm-S3CRET7", {}, '[auth]\nadmin_key = ["adm-S3CRET7"]\n'),
    ("auth.tenant_secret", "short-S3CRET", {"PREFIXCACHE_AUTH_TENANT_SECRET": "short-S3CRET"}, ""),
    ("auth.tenant_secret", "98765432", {}, "[auth]\ntenant_secret = 98765432\n"),
    ("fleet.redis_url", "pw-S3CRET8", {"PREFIXCACHE_FLEET_REDIS_URL": "http://:pw-S3CRET8@127.0.0.1:6379/0"}, ""),
    ("fleet.redis_url", "pw-S3CRET9", {}, '[fleet]\nredis_url = "ftp://u:pw-S3CRET9@host/0"\n'),
    ("fleet.redis_url", "pw-S3CRET10", {}, '[fleet]\nredis_url = ["redis://:pw-S3CRET10@host/0"]\n'),
    (
        "cache.tiers",
        "pw-S3CRET11",
        {
            "PREFIXCACHE_CACHE_TIERS": '[{"kind": "redis", "capacity_bytes": 1024, "cluster": true,'
            ' "url": "redis://:pw-S3CRET11@127.0.0.1:7000/3"}]'
        },
        "",
    ),
    (
        "cache.tiers.url",
        "pw-S3CRET12",
        {},
        '[[cache.tiers]]\nkind = "redis"\ncapacity_bytes = 1024\nurl = ["redis://:pw-S3CRET12@h/0"]\n',
    ),
]


def write_toml(tmp_path: Path, toml: str) -> Path | None:
    if not toml:
        return None
    path = tmp_path / "prefixcache.toml"
    path.write_text(toml)
    return path


@pytest.mark.parametrize(("setting", "secret", "env", "toml"), BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD)])
def test_a_bad_secret_is_named_never_shown(
    tmp_path: Path, setting: str, secret: str, env: dict[str, str], toml: str
) -> None:
    with pytest.raises(ValueError) as refused:
        load_settings(write_toml(tmp_path, toml), env=env)
    message = str(refused.value)
    assert secret not in message, message
    assert re.match(rf"invalid setting {re.escape(setting)}\b", message), message


# One of each source and secret through the real command: what an operator sees on stderr.
SERVED = [BAD[0], BAD[3], BAD[5], BAD[7], BAD[9], BAD[12]]


@pytest.mark.parametrize(("setting", "secret", "env", "toml"), SERVED, ids=[c[0] for c in SERVED])
def test_prefixcache_serve_names_a_bad_secret_never_shows_it(
    tmp_path: Path, setting: str, secret: str, env: dict[str, str], toml: str
) -> None:
    path = write_toml(tmp_path, toml)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    refused = subprocess.run(
        SERVE + (["--config", str(path)] if path else []),
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0
    assert secret not in refused.stderr + refused.stdout
    assert f"invalid setting {setting}" in refused.stderr, refused.stderr


GOOD_TOML = """
[auth]
api_keys = { "sk-live-G00D1" = "acme" }
admin_key = "adm-G00D2"
tenant_secret = "tenant-G00D3-0123456789"
[fleet]
redis_url = "redis://:pw-G00D4@127.0.0.1:1/0"
[[cache.tiers]]
kind = "memory"
capacity_bytes = 1048576
[[cache.tiers]]
kind = "redis"
capacity_bytes = 1048576
url = "redis://user:pw-G00D5@127.0.0.1:1/0?password=pw-G00D6"
"""
GOOD_SECRETS = ("sk-live-G00D1", "adm-G00D2", "tenant-G00D3", "pw-G00D4", "pw-G00D5", "pw-G00D6")


def test_the_startup_log_masks_every_secret(tmp_path: Path) -> None:
    path = write_toml(tmp_path, GOOD_TOML)
    assert path is not None
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    # NOTE: a model that is not there stops the server right after it logged its settings
    run = subprocess.run(
        [*SERVE, "--config", str(path), "--model", str(tmp_path / "no-model")],
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )
    logged = run.stderr + run.stdout
    assert "event=serve_auth mode=api_keys keys=1 tenants=1 admin_key=set" in logged, logged
    assert not [s for s in GOOD_SECRETS if s in logged], logged
    assert "url=redis://user:***@127.0.0.1:1/0?password=***" in logged  # the tier's line
    printed = subprocess.run(
        [*SERVE, "--config", str(path), "--print-settings"], env=clean, capture_output=True, text=True, timeout=120
    )
    assert printed.returncode == 0, printed.stderr
    assert not [s for s in GOOD_SECRETS if s in printed.stdout + printed.stderr], printed.stdout
    shown = json.loads(printed.stdout)  # the full settings, as the DEBUG line has them
    assert shown["fleet"]["redis_url"] == "redis://:***@127.0.0.1:1/0" and shown["auth"]["tenants"] == ["acme"]


def test_describe_masks_secrets_and_keeps_the_rest(tmp_path: Path) -> None:
    settings = load_settings(write_toml(tmp_path, GOOD_TOML), env={})
    shown = describe(settings)
    assert not [s for s in GOOD_SECRETS if s in str(shown)]
    assert shown["auth"]["admin_key"] == "***" and shown["auth"]["tenants"] == ["acme"]
    assert shown["cache"]["tiers"][1]["url"].startswith("redis://user:***@127.0.0.1:1/0")
    assert shown["server"]["port"] == 8000 and shown["cache"]["tiers"][0]["kind"] == "memory"
    assert describe(load_settings(env={}))["auth"]["admin_key"] == ""  # unset stays visibly unset


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://user:pw@host/0", "rediss://user:***@host/0"),
        ("redis://:p%40ss@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
        ("redis://host:6379/0?password=pw&db=1", "redis://host:6379/0?password=***&db=1"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("unix:///run/redis.sock?db=0&password=pw", "unix:///run/redis.sock?db=0&password=***"),
        ("redis://:pw@[::1", "***"),  # does not parse: masked whole
    ],
)
def test_mask_url(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_a_validator_that_quotes_its_input_is_scrubbed() -> None:
    given = {"kind": "redis", "url": "redis://u:pw-QUOTED@h/0", "cluster": True}
    message = scrub("bad url 'redis://u:pw-QUOTED@h/0' (pw-QUOTED)", Settings, ["cache", "tiers"], given)
    assert "pw-QUOTED" not in message and message.startswith("bad url")
    keys = {"api_keys": "sk-live-Q1=acme,sk-live-Q2"}
    assert "sk-live-Q" not in scrub("got sk-live-Q1=acme,sk-live-Q2 and sk-live-Q2", Settings, ["auth"], keys)


# Names that say "secret": an auth token, a key, a password, a URL (which may carry one).
# A number is never one (``min_tokens`` counts tokens); text that is no secret goes here.
NOT_SECRET: frozenset[str] = frozenset()
SECRET_NAME = re.compile(r"key|secret|password|passwd|token|credential|url|dsn", re.IGNORECASE)


def numeric(hint: Any) -> bool:
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    kinds = [a for a in typing.get_args(hint) or (hint,) if a is not type(None)]
    return all(k in (int, float, bool) for k in kinds)


def fields_of(kind: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every (dotted name, annotation) under ``kind``, nested sections included."""
    names: list[str] = (
        list(kind.model_fields) if hasattr(kind, "model_fields") else [f.name for f in dataclasses.fields(kind)]
    )
    out = []
    for name in names:
        hint = field_hint(kind, name)
        out.append((prefix + name, hint))
        inner = section_of(hint)
        if isinstance(inner, type) and (dataclasses.is_dataclass(inner) or hasattr(inner, "model_fields")):
            out += fields_of(inner, f"{prefix}{name}.")
    return out


def test_every_field_named_like_a_secret_is_marked_secret() -> None:
    fields = fields_of(Settings)
    assert len(fields) > 60  # the walk reaches the nested sections (tiers, publish, ...)
    unmarked = [
        name
        for name, hint in fields
        if SECRET_NAME.search(name.rsplit(".", 1)[-1]) and not numeric(hint) and name not in NOT_SECRET
        if not is_secret(hint)
    ]
    assert not unmarked, f"mark these secret (Annotated[..., SECRET]) or list them in NOT_SECRET: {unmarked}"
    marked = sorted(name for name, hint in fields if is_secret(hint))
    assert marked == [
        "auth.admin_key",
        "auth.api_keys",
        "auth.backend_key",
        "auth.tenant_secret",
        "cache.tiers.url",
        "fleet.redis_url",
    ]
    assert typing.get_origin(field_hint(Settings, "auth")) is None  # sections themselves are not secret


def test_admin_stats_and_tier_logs_hold_no_redis_password(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace
    from typing import cast

    import numpy as np
    from starlette.testclient import TestClient

    from prefixcache.cache import PrefixCache
    from prefixcache.config import CacheConfig, KVLayout, TierConfig
    from prefixcache.engine import Engine
    from prefixcache.engine.memory import KVMemory
    from prefixcache.engine.requests import EngineStats
    from prefixcache.hashing import CacheContext
    from prefixcache.server.app import create_app
    from prefixcache.settings import AuthSettings

    caplog.set_level("WARNING")
    layout = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype="float16")
    tiers = (
        TierConfig(kind="memory", capacity_bytes=1 << 20, write="through"),
        TierConfig(kind="redis", capacity_bytes=1 << 20, url="redis://:pw-ST4TS@127.0.0.1:1/0", connect_timeout=0.05),
    )
    cache = PrefixCache(CacheConfig(block_size=4, kv_layout=layout, tiers=tiers, writer="inline"))
    try:
        tokens = list(range(8))
        cache.insert(tokens, CacheContext(tenant="t", model="m"), kv=np.zeros(layout.shape(8), dtype=np.float16))
        assert cache.stats().tiers[1].writes_failed >= 1  # Redis is not there: a write failed, and was logged
        engine = SimpleNamespace(
            model_id="m", queue_depth=lambda: 0, stats=EngineStats(), kv_memory=lambda: KVMemory(None, 0)
        )
        settings = Settings(auth=AuthSettings(api_keys={"sk-acme-0123456789": "acme"}, admin_key="adm-0123456789"))
        with TestClient(create_app(cast(Engine, engine), settings, cache)) as http:
            stats = http.get("/admin/stats", headers={"Authorization": "Bearer adm-0123456789"})
        assert stats.status_code == 200 and "writes_failed" in stats.text
        assert "pw-ST4TS" not in stats.text
        assert "event=tier_error" in caplog.text and "pw-ST4TS" not in caplog.text
    finally:
        cache.close(0)
