"""Server settings: defaults that serve and survive a restart, one merge order, ``[cache]``
equal to ``CacheConfig`` field for field, errors that name the culprit and the valid names."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.config import CacheConfig, KVLayout, PublishConfig, RetentionConfig, TierConfig
from prefixcache.settings import SERVER_CACHE, describe, load_settings

SMOLLM2 = KVLayout(30, 3, 64, "float32")


def test_defaults_serve_locally_and_write_through_to_disk() -> None:
    settings = load_settings(env={})
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 8000)
    assert settings.auth.local_mode and settings.cache.isolation == "namespace"
    config = settings.cache_config(SMOLLM2)
    assert [(t.kind, t.write) for t in config.tiers] == [("memory", "through"), ("disk", "through")]
    assert config.tiers[1].path == ".prefixcache/disk" and config.writer == "background"
    assert config.kv_layout is not None and config.kv_layout.bytes_per_token == 30 * 2 * 3 * 64 * 4
    assert config == dataclasses.replace(SERVER_CACHE, kv_layout=SMOLLM2)


def test_merge_order_defaults_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "prefixcache.toml"
    path.write_text(
        '[server]\nport = 9000\nhost = "0.0.0.0"\nmax_queue = 8\n'
        '[cache]\npolicy = "lru"\nttl_seconds = 600\n'
        '[[cache.tiers]]\nkind = "memory"\ncapacity_bytes = 1048576\nwrite = "through"\n'
        '[[cache.tiers]]\nkind = "disk"\ncapacity_bytes = 8388608\npath = "/tmp/x"\nfsync = "full"\nwrite = "through"\n'
        '[[cache.tiers]]\nkind = "redis"\ncapacity_bytes = 8388608\nurl = "redis://127.0.0.1:6390/0"\n'
        '[auth]\napi_keys = { "sk-a" = "acme", "sk-b" = "globex" }\nadmin_key = "adm"\n'
    )
    env = {"PREFIXCACHE_SERVER_PORT": "9100", "PREFIXCACHE_CACHE_PARTIAL_BLOCKS": "false", "HOME": "/x"}
    settings = load_settings(path, env=env, overrides={"server": {"port": 9200}})
    assert settings.server.port == 9200  # flag > env > file
    assert settings.server.host == "0.0.0.0" and settings.server.max_queue == 8  # file > defaults
    assert settings.cache.partial_blocks is False  # env > defaults
    assert (settings.cache.policy, settings.cache.ttl_seconds) == ("lru", 600)  # file
    assert [(t.kind, t.write) for t in settings.cache.tiers] == [
        ("memory", "through"),
        ("disk", "through"),
        ("redis", "back"),
    ]
    assert settings.cache.tiers[1].fsync == "full"
    assert dict(settings.auth.api_keys) == {"sk-a": "acme", "sk-b": "globex"} and not settings.auth.local_mode
    shown = str(describe(settings))
    assert "sk-a" not in shown and "adm'" not in shown and "acme" in shown  # secrets masked
    from_env = load_settings(env={"PREFIXCACHE_CONFIG": str(path), "PREFIXCACHE_AUTH_API_KEYS": "k1=t1, k2=t2"})
    assert from_env.server.port == 9000 and dict(from_env.auth.api_keys) == {"k1": "t1", "k2": "t2"}


def test_every_cache_field_is_a_setting_by_file_and_by_variable(tmp_path: Path) -> None:
    """``[cache]`` is ``CacheConfig`` one to one: each field but the model's layout can be
    set in the file and as a variable, tables and lists as JSON."""
    values: dict[str, tuple[str, object]] = {
        "block_size": ("32", 32),
        "capacity_tokens": ("123456", 123456),
        "policy": ("sieve", "sieve"),
        "isolation": ("partitioned", "partitioned"),
        "partial_blocks": ("false", False),
        "hash": ("sha256", "sha256"),
        "seed": ("fleet-1", "fleet-1"),
        "vocab_size": ("49152", 49152),
        "ttl_seconds": ("90.5", 90.5),
        "quotas": ('{"acme": 1000}', {"acme": 1000}),
        "shared_quota": ("500", 500),
        "publish": ('{"min_tenants": 4, "min_tokens": 64}', PublishConfig(min_tenants=4, min_tokens=64)),
        "events_capacity": ("10", 10),
        "tiers": ('[{"kind": "memory", "capacity_bytes": 4096, "write": "selective", "write_after_hits": 3}]',
                  (TierConfig(kind="memory", capacity_bytes=4096, write="selective", write_after_hits=3),)),
        "io_threads": ("2", 2),
        "writer": ("inline", "inline"),
        "write_queue_bytes": ("1048576", 1048576),
        "retention": ('{"share": 0.5, "tenants": {"acme": 0.25}}', RetentionConfig(share=0.5, tenants={"acme": 0.25})),
        "strict_isolation": ("false", False),  # true refuses shared_quota and publish (test_strict_isolation.py)
    }  # fmt: skip
    others = {f.name for f in dataclasses.fields(CacheConfig)} - {"kv_layout", "capacity_bytes", "bytes_per_token"}
    assert set(values) == others  # (capacity in bytes is the same setting in another unit: below)
    env = {f"PREFIXCACHE_CACHE_{name.upper()}": raw for name, (raw, _) in values.items()}
    config = load_settings(env=env).cache
    for name, (_, want) in values.items():
        assert getattr(config, name) == want, name
    in_bytes = load_settings(
        env={"PREFIXCACHE_CACHE_CAPACITY_BYTES": "1000", "PREFIXCACHE_CACHE_BYTES_PER_TOKEN": "10"}
    )
    assert in_bytes.cache.capacity == 100
    path = tmp_path / "p.toml"
    path.write_text(
        '[cache]\nhash = "blake3"\nquotas = { "acme" = 7 }\nisolation = "partitioned"\n'
        "[cache.publish]\nmin_tenants = 5\n"
    )
    config = load_settings(path, env={}).cache
    assert (config.hash, dict(config.quotas), config.publish) == (
        "blake3",
        {"acme": 7},
        PublishConfig(min_tenants=5),
    )


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ("[servr]\nport = 1\n", {}, "unknown setting servr .*valid: server, model, cache, auth"),
        ("[server]\nprot = 1\n", {}, "unknown setting server.prot .*valid: host, port"),
        ("[cache]\npolcy = 'lru'\n", {}, "unknown setting cache.polcy .*valid: block_size, .*policy"),
        (
            "[[cache.tiers]]\nkind = 'disk'\ncapacity_bytes = 1\npth = 'x'\n",
            {},
            "cache.tiers.pth .*valid: kind, .*path",
        ),
        ("[cache]\npolicy = 'mru'\n", {}, "invalid setting cache: unknown policy 'mru'; valid: fifo"),
        ("[cache]\nkv_layout = { layers = 1, kv_heads = 1, head_dim = 1 }\n", {}, None),
        ("[server]\nport = 'x'\n", {}, "invalid setting server.port"),
        ("[server]\nport = 0\n", {}, "invalid setting server.port"),
        ("[server]\nport = 70000\n", {}, "65535"),
        ("[server\n", {}, "not valid TOML"),
        ("", {"PREFIXCACHE_SERVER_PROT": "1"}, "unknown setting server.prot .*PREFIXCACHE_SERVER_PROT"),
        ("", {"PREFIXCACHE_NOPE": "1"}, "unknown setting nope"),
        ("", {"PREFIXCACHE_SERVER_PORT": "eighty"}, "invalid setting server.port"),
        ("", {"PREFIXCACHE_SERVER_CACHE": "maybe"}, "invalid setting server.cache"),
        ("", {"PREFIXCACHE_CACHE_TIERS": "[{]"}, "PREFIXCACHE_CACHE_TIERS|cache.tiers"),
        ("", {"PREFIXCACHE_AUTH_API_KEYS": "nokey"}, "KEY=TENANT"),
        ('[auth]\napi_keys = { "sk-a" = "" }\n', {}, "non-empty tenant"),
    ],
)
def test_bad_settings_name_the_problem(tmp_path: Path, toml: str, env: dict[str, str], message: str | None) -> None:
    path = tmp_path / "p.toml"
    path.write_text(toml)
    if message is None:  # valid settings, but not a cache the server can open: the layout is the model's
        with pytest.raises(ValueError, match="kv_layout comes from the model"):
            load_settings(path, env=env).cache_config(SMOLLM2)
        return
    with pytest.raises(ValueError, match=message):
        load_settings(path, env=env)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the config file"):
        load_settings(tmp_path / "nope.toml", env={})


def test_shared_isolation_with_several_tenants_needs_the_operators_word() -> None:
    shared = {"PREFIXCACHE_CACHE_ISOLATION": "shared"}
    with pytest.raises(ValueError, match=r"allow_cross_tenant_reuse = true"):
        load_settings(env=shared | {"PREFIXCACHE_AUTH_API_KEYS": "sk-a=acme,sk-b=globex"})
    with pytest.raises(ValueError, match=r"allow_cross_tenant_reuse = true"):
        load_settings(env=shared | {"PREFIXCACHE_AUTH_TENANT_HEADER": "x-tenant"})  # tenants named by a gateway
    allowed = load_settings(
        env=shared
        | {"PREFIXCACHE_AUTH_API_KEYS": "sk-a=acme,sk-b=globex", "PREFIXCACHE_AUTH_ALLOW_CROSS_TENANT_REUSE": "1"}
    )
    assert allowed.cross_tenant_reuse
    one_tenant = load_settings(env=shared | {"PREFIXCACHE_AUTH_API_KEYS": "sk-a=acme,sk-a2=acme"})
    assert not one_tenant.cross_tenant_reuse  # two keys of one tenant share nothing across tenants
    assert not load_settings(env={"PREFIXCACHE_AUTH_API_KEYS": "sk-a=acme,sk-b=globex"}).cross_tenant_reuse


def test_prefixcache_serve_refuses_it_at_start_up() -> None:
    env = {
        **os.environ,
        "PREFIXCACHE_CACHE_ISOLATION": "shared",
        "PREFIXCACHE_AUTH_API_KEYS": "sk-a=acme,sk-b=globex",
    }
    refused = subprocess.run(
        [str(Path(sys.executable).with_name("prefixcache")), "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "allow_cross_tenant_reuse" in refused.stderr


def test_listening_beyond_loopback_without_keys_needs_the_operators_word() -> None:
    with pytest.raises(ValueError, match=r"allow_open_access"):
        load_settings(env={"PREFIXCACHE_SERVER_HOST": "0.0.0.0"})
    assert load_settings(env={"PREFIXCACHE_SERVER_HOST": "0.0.0.0", "PREFIXCACHE_SERVER_ALLOW_OPEN_ACCESS": "1"})
    assert load_settings(env={"PREFIXCACHE_SERVER_HOST": "0.0.0.0", "PREFIXCACHE_AUTH_API_KEYS": "sk-a=acme"})
    assert load_settings(env={"PREFIXCACHE_SERVER_HOST": "127.0.0.2"})  # loopback


def test_prefixcache_serve_names_a_model_it_cannot_load_without_a_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    refused = subprocess.run(
        [str(Path(sys.executable).with_name("prefixcache")), "serve", "--model", str(missing)],
        env={**os.environ, "PREFIXCACHE_CONFIG": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stderr
    assert str(missing) in refused.stderr and "config.json" in refused.stderr
    assert "Traceback" not in refused.stderr
