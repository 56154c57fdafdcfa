"""Retention's shares in the server's settings (issue 41): ``[admission] retain_share`` and
``[admission.tenants.NAME] retain_share`` become the cache's ``RetentionConfig``; a bad
share, or shares given twice (there and in ``[cache.retention]``), is an error that says
which setting; the connector's ``cache.retention`` is the same figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache import CacheContext, PrefixCache
from prefixcache.config import KVLayout, RetentionConfig
from prefixcache.integrations.vllm.settings import parse_settings
from prefixcache.settings import Settings, load_settings

LAYOUT = KVLayout(2, 1, 4, "float32")
KEYS = '[auth]\napi_keys = { "sk-a" = "acme", "sk-b" = "globex", "sk-c" = "initech" }\n'


def settings_from(tmp_path: Path, toml: str, env: dict[str, str] | None = None) -> Settings:
    path = tmp_path / "prefixcache.toml"
    path.write_text(KEYS + toml)
    return load_settings(path, env=env or {})


def test_admission_shares_become_the_caches_retention(tmp_path: Path) -> None:
    settings = settings_from(
        tmp_path,
        "[admission]\nretain_share = 0.1\n"
        "[admission.tenants.acme]\nretain_share = 0.5\nmax_concurrent = 2\n"
        "[admission.tenants.globex]\nretain_share = 0\n",
    )
    retention = settings.cache_config(LAYOUT).retention
    assert retention == RetentionConfig(share=0.1, tenants={"acme": 0.5, "globex": 0.0})
    assert settings.admission.admission().limits("acme").max_concurrent == 2  # the other limits stay as they were


def test_the_shares_act_in_the_cache_the_settings_open(tmp_path: Path) -> None:
    settings = settings_from(
        tmp_path,
        "[cache]\nblock_size = 4\ncapacity_tokens = 400\ntiers = []\n[admission]\nretain_share = 0.2\n"
        "[admission.tenants.acme]\nretain_share = 0.5\n[admission.tenants.globex]\nretain_share = 0\n",
    )
    cache = PrefixCache(settings.cache_config(LAYOUT))
    assert cache.retain_caps("acme") == (200,)  # its own half
    assert cache.retain_caps("initech") == (80,)  # the default fifth, shared by the tenants without their own
    assert not cache.may_retain("globex")  # 0 refuses
    tokens = list(range(40))
    cache.access(tokens, CacheContext(tenant="globex", model="m"))
    assert cache.retain(tokens, CacheContext(tenant="globex", model="m"), 60.0).outcome.value == "refused"


def test_unset_shares_leave_the_caches_default(tmp_path: Path) -> None:
    settings = settings_from(tmp_path, "[admission]\nmax_concurrent = 3\n")
    assert not settings.admission.sets_retention
    assert settings.cache_config(LAYOUT).retention == RetentionConfig()
    only_a_tenant = settings_from(tmp_path, "[admission.tenants.acme]\nretain_share = 0.3\n")
    assert only_a_tenant.cache_config(LAYOUT).retention == RetentionConfig(share=0.25, tenants={"acme": 0.3})


def test_the_default_share_from_the_environment(tmp_path: Path) -> None:
    settings = settings_from(tmp_path, "", env={"PREFIXCACHE_ADMISSION_RETAIN_SHARE": "0.4"})
    assert settings.cache_config(LAYOUT).retention.share == 0.4


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[admission]\nretain_share = 1.5\n", r"invalid setting admission\.retain_share: retain_share is a share"),
        ("[admission]\nretain_share = -0.1\n", r"admission\.retain_share: .*a number in \[0, 1\]"),
        ("[admission]\nretain_share = true\n", r"admission\.retain_share: .*0 refuses retention"),
        ("[admission]\nretain_share = 'half'\n", r"invalid setting admission\.retain_share"),
        ("[admission.tenants.acme]\nretain_share = 2\n", r"admission\.tenants\.acme\.retain_share: .*\[0, 1\]"),
        ("[admission]\nretain_shares = 0.5\n", r"unknown setting admission\.retain_shares .*valid: .*retain_share"),
        (
            "[admission]\nretain_share = 0.5\n[admission.tenants.acme]\nretain_share = 0.6\n",
            r"\[admission\] retain_share: retention shares add up to 1\.1 .*lower them",
        ),
        (
            "[admission]\nretain_share = 0.3\n[cache.retention]\nshare = 0.2\n",
            r"retention shares are set twice, in \[admission\] .* and in \[cache\.retention\]",
        ),
    ],
)
def test_a_bad_share_names_the_setting(tmp_path: Path, toml: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings_from(tmp_path, toml)


def test_a_share_for_a_tenant_no_key_names_is_refused(tmp_path: Path) -> None:
    settings = settings_from(tmp_path, "[admission.tenants.acmee]\nretain_share = 0.5\n")
    with pytest.raises(ValueError, match=r"admission\.tenants names \['acmee'\].*valid: acme, globex, initech"):
        settings.admission.check_tenants(set(settings.auth.api_keys.values()))


def test_the_connector_takes_the_same_figures_as_cache_retention(tmp_path: Path) -> None:
    """One ``RetentionConfig`` whichever spelling: the server's ``[admission]`` and the
    connector's ``cache.retention`` (it has no ``[admission]``) give equal configurations."""
    server = settings_from(tmp_path, "[admission]\nretain_share = 0.1\n[admission.tenants.acme]\nretain_share = 0.5\n")
    connector = parse_settings({"cache": {"retention": {"share": 0.1, "tenants": {"acme": 0.5}}}})
    assert server.cache_config(LAYOUT).retention == connector.cache.retention
    alone = settings_from(tmp_path, "[cache.retention]\nshare = 0.1\ntenants = { acme = 0.5 }\n")
    assert alone.cache_config(LAYOUT).retention == connector.cache.retention
    with pytest.raises(ValueError, match=r"kv_connector_extra_config cache\.retention"):
        parse_settings({"cache": {"retention": {"share": 1.5}}})
