"""Server settings: defaults that serve, one merge order, errors that name the culprit."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.engine.model import KVShape
from prefixcache.server.main import cache_config
from prefixcache.server.settings import describe, load_settings


def test_defaults_serve_locally() -> None:
    settings = load_settings(env={})
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 8000)
    assert settings.auth.local_mode and settings.cache.isolation == "namespace" and settings.cache.policy == "s3fifo"
    config = cache_config(settings.cache, KVShape(30, 3, 64, "float32"))
    assert [t.kind for t in config.tiers] == ["memory", "disk"]
    assert config.tiers[1].path == ".prefixcache/disk"
    assert config.kv_layout is not None and config.kv_layout.bytes_per_token == 30 * 2 * 3 * 64 * 4


def test_merge_order_defaults_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "prefixcache.toml"
    path.write_text(
        '[server]\nport = 9000\nhost = "0.0.0.0"\nmax_queue = 8\n'
        '[cache]\nredis_url = "redis://127.0.0.1:6390/0"\npolicy = "lru"\n'
        '[auth]\napi_keys = { "sk-a" = "acme", "sk-b" = "globex" }\nadmin_key = "adm"\n'
    )
    env = {"PREFIXCACHE_SERVER_PORT": "9100", "PREFIXCACHE_CACHE_PARTIAL_BLOCKS": "false", "HOME": "/x"}
    settings = load_settings(path, env=env, overrides={"server": {"port": 9200}})
    assert settings.server.port == 9200  # flag > env > file
    assert settings.server.host == "0.0.0.0" and settings.server.max_queue == 8  # file > defaults
    assert settings.cache.partial_blocks is False  # env > defaults
    assert dict(settings.auth.api_keys) == {"sk-a": "acme", "sk-b": "globex"} and not settings.auth.local_mode
    assert [t.kind for t in cache_config(settings.cache, KVShape(2, 1, 4, "float16")).tiers] == [
        "memory",
        "disk",
        "redis",
    ]
    shown = str(describe(settings))
    assert "sk-a" not in shown and "adm'" not in shown and "acme" in shown  # secrets masked
    from_env = load_settings(env={"PREFIXCACHE_CONFIG": str(path), "PREFIXCACHE_AUTH_API_KEYS": "k1=t1, k2=t2"})
    assert from_env.server.port == 9000 and dict(from_env.auth.api_keys) == {"k1": "t1", "k2": "t2"}


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ("[servr]\nport = 1\n", {}, "unknown section"),
        ("[server]\nprot = 1\n", {}, "unknown field server.prot"),
        ("[server]\nport = 'x'\n", {}, "server.port must be a int"),
        ("[server]\nport = 0\n", {}, "port must be a positive"),
        ("[server]\nport = 70000\n", {}, "65535"),
        ("[server\n", {}, "not valid TOML"),
        ("", {"PREFIXCACHE_SERVER_PROT": "1"}, "unknown environment variable PREFIXCACHE_SERVER_PROT"),
        ("", {"PREFIXCACHE_SERVER_PORT": "eighty"}, "must be a int"),
        ("", {"PREFIXCACHE_CACHE_ENABLED": "maybe"}, "boolean"),
        ("", {"PREFIXCACHE_AUTH_API_KEYS": "nokey"}, "KEY=TENANT"),
        ('[auth]\napi_keys = { "sk-a" = "" }\n', {}, "non-empty tenant"),
    ],
)
def test_bad_settings_name_the_problem(tmp_path: Path, toml: str, env: dict[str, str], message: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=message):
        load_settings(path, env=env)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the config file"):
        load_settings(tmp_path / "nope.toml", env={})
