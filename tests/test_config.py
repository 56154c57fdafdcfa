"""Configuration: every bad value fails at construction, naming its field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from prefixcache import CacheConfig, CacheContext, PrefixCache, PublishConfig
from prefixcache.config import TierConfig
from prefixcache.policies import POLICIES


def bad(field: str, **kwargs: Any) -> str:
    """The message of the ValueError that ``CacheConfig(**kwargs)`` raises, after
    checking that it names ``field``."""
    with pytest.raises(ValueError) as info:
        CacheConfig(**kwargs)
    message = str(info.value)
    assert field in message, message
    return message


# --- block size ------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "16", None])
def test_block_size_must_be_a_positive_integer(value: object) -> None:
    bad("block_size", block_size=value)


def test_block_size_one_is_valid() -> None:
    assert CacheConfig(block_size=1).block_size == 1


# --- names from registries -------------------------------------------------------


def test_unknown_policy_lists_the_valid_ones() -> None:
    message = bad("policy", policy="arc")
    assert "'arc'" in message
    for name in POLICIES:
        assert name in message, message


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_registered_policy_is_accepted(name: str) -> None:
    assert CacheConfig(policy=name).policy == name


def test_unknown_isolation_lists_the_valid_ones() -> None:
    message = bad("isolation", isolation="private")
    for mode in ("shared", "namespace", "partitioned"):
        assert mode in message, message


def test_unknown_hash_lists_the_valid_ones() -> None:
    message = bad("hash", hash="md5")
    assert "'md5'" in message
    assert "xxh3_128" in message and "sha256" in message


# --- capacity --------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_capacity_tokens_must_be_a_non_negative_integer(value: object) -> None:
    bad("capacity_tokens", capacity_tokens=value)


def test_capacity_in_tokens_and_in_bytes_together_is_an_error() -> None:
    message = bad("capacity_tokens", capacity_tokens=100, capacity_bytes=1000, bytes_per_token=10)
    assert "capacity_bytes" in message


def test_capacity_bytes_needs_bytes_per_token() -> None:
    message = bad("capacity_bytes", capacity_bytes=1000)
    assert "bytes_per_token" in message


@pytest.mark.parametrize("value", [0, -4, 1.5])
def test_bytes_per_token_must_be_positive(value: object) -> None:
    bad("bytes_per_token", capacity_bytes=1000, bytes_per_token=value)


def test_negative_capacity_bytes() -> None:
    bad("capacity_bytes", capacity_bytes=-1, bytes_per_token=10)


def test_capacity_in_bytes_is_converted_to_tokens() -> None:
    config = CacheConfig(capacity_bytes=1000, bytes_per_token=10)
    assert config.capacity == 100
    assert CacheConfig(capacity_bytes=1005, bytes_per_token=10).capacity == 100  # rounded down
    assert CacheConfig(capacity_tokens=321).capacity == 321


def test_a_cache_sized_in_bytes_holds_at_most_that_many_tokens() -> None:
    cache = PrefixCache(CacheConfig(block_size=8, capacity_bytes=1000, bytes_per_token=10))
    ctx = CacheContext(tenant="acme")
    for i in range(40):
        cache.insert(range(i * 100, i * 100 + 16), ctx)
        assert cache.stats().used_tokens <= 100
    stats = cache.stats()
    assert stats.capacity_tokens == 100
    assert stats.used_tokens == 96  # 12 blocks of 8: the most that fit in 100 tokens
    assert stats.evictions > 0


# --- partitioned quotas ----------------------------------------------------------


def test_quotas_outside_partitioned_mode_are_an_error() -> None:
    for isolation in ("shared", "namespace"):
        bad("quotas", isolation=isolation, capacity_tokens=100, quotas={"a": 10})
        bad("shared_quota", isolation=isolation, capacity_tokens=100, shared_quota=10)


def test_a_partitioned_quota_above_capacity() -> None:
    bad("quotas", isolation="partitioned", capacity_tokens=100, quotas={"a": 101})


def test_partitioned_quotas_summing_above_capacity() -> None:
    bad("quotas", isolation="partitioned", capacity_tokens=100, quotas={"a": 60, "b": 41})
    bad("quotas", isolation="partitioned", capacity_tokens=100, quotas={"a": 60}, shared_quota=41)


def test_quotas_summing_to_capacity_are_valid() -> None:
    config = CacheConfig(isolation="partitioned", capacity_tokens=100, quotas={"a": 60}, shared_quota=40)
    assert dict(config.quotas) == {"a": 60}


def test_quotas_in_bytes_are_checked_against_capacity_in_bytes() -> None:
    common: dict[str, Any] = dict(isolation="partitioned", capacity_bytes=1000, bytes_per_token=10)
    assert CacheConfig(quotas={"a": 600, "b": 400}, **common).capacity == 100
    bad("quotas", quotas={"a": 600, "b": 401}, **common)


def test_negative_quota() -> None:
    bad("quotas", isolation="partitioned", capacity_tokens=100, quotas={"a": -1})


def test_negative_shared_quota() -> None:
    bad("shared_quota", isolation="partitioned", capacity_tokens=100, shared_quota=-1)


def test_quota_tenant_name_must_be_non_empty() -> None:
    bad("quota", isolation="partitioned", capacity_tokens=100, quotas={"": 10})


def test_quotas_cannot_be_changed_through_the_config() -> None:
    source = {"a": 10}
    config = CacheConfig(isolation="partitioned", capacity_tokens=100, quotas=source)
    source["a"] = 1000  # the caller's dict is copied, not kept
    assert config.quotas["a"] == 10
    with pytest.raises(TypeError):
        config.quotas["a"] = 1000  # type: ignore[index]


# --- publication -------------------------------------------------------------------


def test_publish_with_shared_isolation_is_an_error() -> None:
    bad("publish", isolation="shared", publish=PublishConfig())


@pytest.mark.parametrize("isolation", ["namespace", "partitioned"])
def test_publish_is_valid_with_isolation(isolation: str) -> None:
    config = CacheConfig(isolation=isolation, publish=PublishConfig(min_tenants=2, min_tokens=16))
    assert config.publish is not None and config.publish.min_tenants == 2


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("min_tenants", {"min_tenants": 1}),
        ("min_tenants", {"min_tenants": 0}),
        ("min_tenants", {"min_tenants": 2.5}),
        ("min_tokens", {"min_tokens": 0}),
        ("max_candidates", {"max_candidates": 0}),
    ],
)
def test_publish_config_rejects(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=field):
        PublishConfig(**kwargs)


# --- the rest --------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, -0.5, "10"])
def test_ttl_seconds_must_be_positive(value: object) -> None:
    bad("ttl_seconds", ttl_seconds=value)


def test_ttl_seconds_accepts_int_and_float() -> None:
    assert CacheConfig(ttl_seconds=1).ttl_seconds == 1
    assert CacheConfig(ttl_seconds=0.25).ttl_seconds == 0.25


@pytest.mark.parametrize("value", ["", 7])
def test_seed_must_be_a_non_empty_string(value: object) -> None:
    bad("seed", seed=value)


@pytest.mark.parametrize("value", [0, -5, 1.0])
def test_vocab_size_must_be_positive(value: object) -> None:
    bad("vocab_size", vocab_size=value)


def test_events_capacity_must_be_non_negative() -> None:
    bad("events_capacity", events_capacity=-1)
    assert CacheConfig(events_capacity=0).events_capacity == 0


def test_defaults_are_valid() -> None:
    config = CacheConfig()
    assert config.block_size == 16
    assert config.capacity > 0
    assert config.policy in POLICIES


def test_config_is_frozen() -> None:
    config = CacheConfig(block_size=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.policy = "lru"  # type: ignore[misc]
    publish = PublishConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        publish.min_tenants = 1  # type: ignore[misc]
    assert config.block_size == 16


def test_replace_revalidates() -> None:
    config = CacheConfig(block_size=16)
    assert dataclasses.replace(config, block_size=4).block_size == 4
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(config, block_size=0)


# --- the s3 tier -------------------------------------------------------------------


def s3(**kwargs: Any) -> TierConfig:
    return TierConfig(**{"kind": "s3", "capacity_bytes": 1 << 30, "bucket": "kv-cache", **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"bucket": None}, "needs bucket"),
        ({"bucket": "Has_Upper"}, "S3 bucket name"),
        ({"bucket": "ab"}, "S3 bucket name"),
        ({"prefix": "a//b"}, "no empty parts"),
        ({"endpoint": "s3.example.com"}, "http:// or https://"),
        ({"endpoint": "ftp://s3.example.com"}, "http:// or https://"),
        ({"concurrency": 0}, "concurrency must be >= 1"),
        ({"namespace": "a/b"}, "no '/'"),
    ],
)
def test_bad_s3_tiers_fail_at_construction_saying_why(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        s3(**kwargs)


def test_an_s3_endpoint_never_carries_credentials_and_the_error_never_shows_them() -> None:
    with pytest.raises(ValueError, match="may not carry credentials") as info:
        s3(endpoint="https://AKIAEXAMPLE:hunter2secret@s3.example.com")
    assert "hunter2secret" not in str(info.value) and "AKIAEXAMPLE" not in str(info.value)


@pytest.mark.parametrize("field", ["bucket", "endpoint", "region", "profile", "prefix"])
def test_s3_fields_on_another_tier_are_refused(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} applies to an s3 tier only"):
        TierConfig(kind="memory", capacity_bytes=1, **{field: "kv-cache"})


def test_a_valid_s3_tier_is_an_l2_tier() -> None:
    tier = s3(endpoint="http://127.0.0.1:9000", prefix="prefixcache/prod", region="eu-west-1", codec="int8")
    assert tier.level == "L2" and tier.concurrency == 16 and tier.label == "s3"
