"""Strict isolation (``cache.strict_isolation``): refused at load beside every setting that
shares KV across tenants, each named in one message; at run time, every path that would
publish or read the public namespace refused or closed. The timing audit against a
strict server is in tests/test_audit_timing.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixcache.config import CacheConfig, PublishConfig, TierConfig
from prefixcache.hashing import CacheContext
from prefixcache.integrations.vllm.settings import parse_settings
from prefixcache.settings import AuthSettings, Settings, load_settings
from prefixcache.strict import StrictIsolationError
from prefixcache.warm.setup import WarmSetupError, check_public
from support import run_cli
from test_blend_chunks import DOC, open_chunks
from tier_worker import CTX, cache_with, frame_bytes, kv_for, prompt, store

STRICT = "cache.strict_isolation = true forbids every reuse of KV across tenants"
SHARED = "cache.isolation = 'shared'"
PUBLISH = "cache.publish"
POOL = "cache.shared_quota"
ALLOW = "auth.allow_cross_tenant_reuse = true"

# ============================================================================ at load: the configuration


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"isolation": "shared"}, [SHARED]),
        ({"publish": PublishConfig()}, [PUBLISH]),
        ({"isolation": "partitioned", "capacity_tokens": 100, "shared_quota": 10}, [POOL]),
        (
            {"isolation": "partitioned", "capacity_tokens": 100, "shared_quota": 10, "publish": PublishConfig()},
            [PUBLISH, POOL],
        ),
    ],
)
def test_the_cache_refuses_strict_isolation_beside_each_sharing_setting(
    fields: dict[str, Any], named: list[str]
) -> None:
    with pytest.raises(StrictIsolationError) as refused:
        CacheConfig(strict_isolation=True, **fields)
    message = str(refused.value)
    assert message.startswith(STRICT) and "AISVS 5.5.5" in message
    assert [c.split(" (")[0] for c in refused.value.conflicts] == named
    assert all(name in message for name in named)
    CacheConfig(**fields)  # the same settings without strict isolation: as before


def test_strict_isolation_alone_is_valid_with_namespace_or_quotas() -> None:
    assert CacheConfig(strict_isolation=True).isolation == "namespace"
    partitioned = CacheConfig(strict_isolation=True, isolation="partitioned", capacity_tokens=100, quotas={"a": 60})
    assert partitioned.strict_isolation and partitioned.quotas == {"a": 60}
    with pytest.raises(ValueError, match="strict_isolation must be true or false"):
        CacheConfig(strict_isolation="yes")  # type: ignore[arg-type]


# ============================================================================ at load: the server's settings


def strict_env(**extra: str) -> dict[str, str]:
    return {"PREFIXCACHE_CACHE_STRICT_ISOLATION": "true", **{f"PREFIXCACHE_{k.upper()}": v for k, v in extra.items()}}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"cache_isolation": "shared"}, [SHARED]),
        ({"cache_publish": '{"min_tenants": 2}'}, [PUBLISH]),
        ({"cache_isolation": "partitioned", "cache_shared_quota": "1000"}, [POOL]),
        ({"auth_allow_cross_tenant_reuse": "true"}, [ALLOW]),
        ({"cache_isolation": "shared", "auth_allow_cross_tenant_reuse": "true"}, [SHARED, ALLOW]),
        (
            {
                "cache_isolation": "partitioned",
                "cache_shared_quota": "1000",
                "cache_publish": "{}",
                "auth_allow_cross_tenant_reuse": "true",
            },
            [PUBLISH, POOL, ALLOW],
        ),
    ],
)
def test_serve_refuses_to_start_naming_every_sharing_setting(extra: dict[str, str], named: list[str]) -> None:
    with pytest.raises(ValueError, match="forbids every reuse of KV across tenants") as refused:
        load_settings(env=strict_env(**extra))
    message = str(refused.value)
    assert [name for name in (SHARED, PUBLISH, POOL, ALLOW) if name in message] == named
    assert ("these settings allow" if len(named) > 1 else "this setting allows") in message


def test_serve_refuses_it_from_a_file_and_from_objects_alike(tmp_path: Path) -> None:
    path = tmp_path / "prefixcache.toml"
    path.write_text('[cache]\nstrict_isolation = true\nisolation = "shared"\n[auth]\nallow_cross_tenant_reuse = true\n')
    with pytest.raises(ValueError, match=f"{SHARED}.*{ALLOW}"):
        load_settings(path, env={})
    with pytest.raises(ValueError, match=ALLOW):
        Settings(cache=CacheConfig(strict_isolation=True), auth=AuthSettings(allow_cross_tenant_reuse=True))


def test_serve_starts_with_strict_isolation_alone(tmp_path: Path) -> None:
    settings = load_settings(env=strict_env(auth_api_keys="sk-a=acme,sk-b=globex"))
    assert settings.cache.strict_isolation and not settings.cross_tenant_reuse
    path = tmp_path / "prefixcache.toml"
    path.write_text('[cache]\nstrict_isolation = true\nisolation = "partitioned"\n')
    assert load_settings(path, env={}).cache.strict_isolation
    code, out, err = run_cli(["serve", "--config", str(path), "--print-settings"])
    assert code == 0 and '"strict_isolation": true' in out, err


def test_the_vllm_connector_refuses_a_default_tenant_for_unverified_requests() -> None:
    with pytest.raises(ValueError, match="unverified = 'default'") as refused:
        parse_settings({"cache": {"strict_isolation": True}, "unverified": "default"})
    assert str(refused.value).startswith(STRICT)
    with pytest.raises(ValueError, match=f"{SHARED}.*unverified = 'default'"):
        parse_settings({"cache": {"strict_isolation": True, "isolation": "shared"}, "unverified": "default"})
    assert parse_settings({"cache": {"strict_isolation": True}}).cache.strict_isolation
    assert parse_settings({"unverified": "default"}).cache.strict_isolation is False


# ============================================================================ at run time


def mem(blocks: int, **kwargs: object) -> TierConfig:
    return TierConfig(kind="memory", capacity_bytes=blocks * frame_bytes(), **kwargs)  # type: ignore[arg-type]


def disk(path: Path) -> TierConfig:
    return TierConfig(kind="disk", capacity_bytes=1 << 24, path=str(path), fsync="none")


def test_declaring_a_prefix_public_is_refused() -> None:
    refused = pytest.raises(ValueError, match=r"declare_public is refused: cache\.strict_isolation = true")
    with cache_with(mem(64), strict_isolation=True) as cache, refused:
        cache.declare_public(prompt(1), CTX)
    chunks = open_chunks(strict_isolation=True, partial_blocks=True)
    with pytest.raises(ValueError, match="declare_public is refused"):  # blend's public chunks too
        chunks.declare_public(CacheContext("a", "m"), DOC)
    chunks.cache.close()


def test_a_strict_cache_reads_no_public_block_another_server_published(tmp_path: Path) -> None:
    """A disk (or Redis) shared with a server that is not strict may hold public blocks: a
    strict cache on it never looks under the public root; its tenants find their own."""
    tiers = (mem(64, write="through"), disk(tmp_path))
    bob = CacheContext(tenant="bob", model="m")
    public, own = prompt(7), [5, 6, 7, 8, *prompt(8)[4:]]  # NOTE: own shares no block with public
    with cache_with(*tiers) as lax:
        lax.declare_public(public, CTX)
        store(lax, public)
        store(lax, own)
        assert lax.flush(timeout=30)
    with cache_with(*tiers, strict_isolation=True) as strict:
        assert len(strict._ledger.lookup(public, bob, None, probing=True).roots) == 1  # its own root only
        with strict.match(public, bob) as m:
            assert m.cached_tokens == 0
        with strict.match(own, CTX) as m:  # acme's own blocks on the same disk: still its own
            assert m.cached_tokens == len(own)
    with cache_with(*tiers) as control, control.match(public, bob) as m:
        assert m.cached_tokens == len(public)  # the lax server's tenants do read them


def test_warm_public_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "prefixcache.toml"
    path.write_text("[cache]\nstrict_isolation = true\n")
    with pytest.raises(WarmSetupError, match=r"--public is refused: cache\.strict_isolation = true"):
        check_public(load_settings(path, env={}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    code, _, err = run_cli(["warm", "--config", str(path), "--public", str(prompts)])
    assert code == 2 and "--public is refused" in err  # before the model loads


def test_a_strict_cache_still_shares_within_a_tenant() -> None:
    with cache_with(mem(64), strict_isolation=True) as cache:
        store(cache, prompt(1))
        with cache.match(prompt(2), CTX) as m:
            assert m.cached_tokens == 4  # the first block, its own
        with cache.match(prompt(2), CacheContext("bob", "m")) as m:
            assert m.cached_tokens == 0
        assert cache.insert(prompt(3), CTX, kv=kv_for(prompt(3))) == len(prompt(3)) - 4
