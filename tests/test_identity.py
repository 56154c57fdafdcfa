"""The gateway's stamp and the connector's verification (``identity.py``): a tenant is
believed only as the gateway vouched for it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.retention import MAX_RETAIN_S as CACHE_MAX_RETAIN_S
from prefixcache.identity import (
    CLIENT_FIELDS,
    MAX_NAME_CHARS,
    MAX_RETAIN_S,
    PARAMS_KEY,
    RETAIN_KEY,
    RETAIN_PROOF_KEY,
    Identity,
    Unverified,
    Verdict,
    salt_label,
    stamp,
    tenant_proof,
    tenant_salt,
    verify,
    verify_proof,
    verify_retention,
)

SECRET = b"s" * 16
OTHER = b"o" * 16
tenants = st.text(min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.sets(tenants, min_size=2, max_size=50))
def test_distinct_tenants_never_share_a_salt(names: set[str]) -> None:
    salts = {tenant_salt(SECRET, t) for t in names}
    assert len(salts) == len(names)


@settings(max_examples=200, deadline=None)
@given(tenants)
def test_a_salt_is_stable_names_no_tenant_and_depends_on_the_secret(tenant: str) -> None:
    salt = tenant_salt(SECRET, tenant)
    assert salt == tenant_salt(SECRET, tenant) and salt != tenant_salt(OTHER, tenant)
    assert re.fullmatch(r"pc1-[0-9a-f]{32}", salt)  # a digest: no tenant's name, only hex digits
    assert "acme" not in tenant_salt(SECRET, "acme")


@settings(max_examples=200, deadline=None)
@given(tenants, st.dictionaries(st.text(max_size=20), st.integers() | st.text(max_size=10), max_size=6))
def test_verify_accepts_exactly_what_stamp_wrote(tenant: str, body: dict[str, object]) -> None:
    body = body | {"cache_salt": "client's", "kv_transfer_params": {PARAMS_KEY: "victim", "tenant": "victim"}}
    out = stamp(body, tenant, SECRET)
    assert out["kv_transfer_params"] == {PARAMS_KEY: tenant} and out["cache_salt"] == tenant_salt(SECRET, tenant)
    assert {k: v for k, v in out.items() if k not in CLIENT_FIELDS} == {
        k: v for k, v in body.items() if k not in CLIENT_FIELDS
    }
    got = verify(out["kv_transfer_params"], out["cache_salt"], SECRET, "default")
    assert got == Identity(Verdict.VERIFIED, tenant)


@settings(max_examples=100, deadline=None)
@given(st.lists(tenants, min_size=2, max_size=2, unique=True))
def test_a_claim_with_another_tenants_salt_is_refused(pair: list[str]) -> None:
    claimed, owner = pair
    got = verify({PARAMS_KEY: claimed}, tenant_salt(SECRET, owner), SECRET, "default")
    assert got == Identity(Verdict.REFUSED, None)


@pytest.mark.parametrize(
    ("params", "salt", "secret"),
    [
        ({PARAMS_KEY: "acme"}, None, SECRET),  # a claim without salt
        ({PARAMS_KEY: "acme"}, "", SECRET),
        (None, tenant_salt(SECRET, "acme"), SECRET),  # a salt without claim
        ({"tenant": "acme"}, tenant_salt(SECRET, "acme"), SECRET),  # the old claim's key
        ({PARAMS_KEY: "acme"}, tenant_salt(OTHER, "acme"), SECRET),  # another secret's salt
        ({PARAMS_KEY: "acme"}, "acme", SECRET),  # the tenant's name as its salt
        ({PARAMS_KEY: ["acme"]}, tenant_salt(SECRET, "acme"), SECRET),
        ("acme", tenant_salt(SECRET, "acme"), SECRET),
    ],
)
def test_anything_but_the_stamp_is_refused(params: object, salt: object, secret: bytes) -> None:
    assert verify(params, salt, secret, "default") == Identity(Verdict.REFUSED, None)
    assert verify(params, salt, secret, "default", Unverified.DEFAULT) == Identity(Verdict.REFUSED, "default")


def test_without_a_secret_the_salt_is_the_tenant_and_a_claim_is_ignored() -> None:
    assert verify({PARAMS_KEY: "victim"}, "my-salt", None, "default") == Identity(Verdict.SALT, "my-salt")
    assert verify({PARAMS_KEY: "victim"}, None, None, "default") == Identity(Verdict.DEFAULT, "default")
    assert verify({PARAMS_KEY: "victim"}, "", None, "default") == Identity(Verdict.DEFAULT, "default")


def test_short_secrets_and_empty_tenants_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes") as caught:
        tenant_salt(b"short-secret", "acme")
    assert "short-secret" not in str(caught.value)
    with pytest.raises(ValueError, match="non-empty"):
        tenant_salt(SECRET, "")


@settings(max_examples=100, deadline=None)
@given(st.lists(tenants, min_size=2, max_size=2, unique=True))
def test_a_proof_holds_for_its_tenant_under_its_secret_only(pair: list[str]) -> None:
    tenant, other = pair
    proof = tenant_proof(SECRET, tenant)
    assert verify_proof(SECRET, tenant, proof) and re.fullmatch(r"pcp1-[0-9a-f]{64}", proof)
    assert not verify_proof(SECRET, other, proof)  # another tenant's
    assert not verify_proof(OTHER, tenant, proof)  # another secret's
    assert not verify_proof(SECRET, tenant, tenant_salt(SECRET, tenant))  # the salt vLLM sees is no proof
    for forged in (None, "", proof[:-1], proof.upper(), tenant):
        assert not verify_proof(SECRET, tenant, forged)


# Whatever a client sends vLLM: ``verify`` runs inside vLLM's engine core, where an
# exception kills the engine for every tenant (issue #39).
_chars = st.characters() | st.characters(categories=["Cs"])  # lone surrogates too
_texts = st.text(_chars, max_size=12) | st.integers(0, 12_000).map(lambda n: "é" * n) | st.just("pc1-é")
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from([PARAMS_KEY, "x"]) | _texts, inner),
    max_leaves=12,
)
_claims = st.dictionaries(st.just(PARAMS_KEY), _json | st.just("acme"), min_size=1) | _json
_salts = _json | st.builds(lambda t: tenant_salt(SECRET, t), st.text(min_size=1, max_size=8)) | st.just(b"pc1-")


@settings(max_examples=500, deadline=None)
@given(_claims, _salts, st.sampled_from([None, SECRET]), st.sampled_from(list(Unverified)))
def test_verify_never_raises_whatever_the_params_and_salt(
    params: object, salt: object, secret: bytes | None, unverified: Unverified
) -> None:
    got = verify(params, salt, secret, "default", unverified)
    assert isinstance(got, Identity)
    if got.verdict is Verdict.VERIFIED:  # only ever the gateway's stamp
        assert isinstance(params, dict) and salt == tenant_salt(SECRET, params[PARAMS_KEY])
    if got.tenant is not None:  # a tenant is a name every part downstream can encode
        got.tenant.encode("utf-8")
        assert 0 < len(got.tenant) <= MAX_NAME_CHARS


@pytest.mark.parametrize(
    "salt", ["pc1-é", "pc1-\ud800", "\udfff", "é" * 36, "x" * 10_240, b"pc1-", 1, 1.5, True, ["pc1-"], {"a": 1}]
)
def test_a_salt_that_is_no_stamp_is_refused_never_an_error(salt: object) -> None:
    """The first was issue #39's one request that killed vLLM: ``compare_digest`` raises
    on non-ASCII ``str``."""
    claim = {PARAMS_KEY: "acme"}
    assert verify(claim, salt, SECRET, "default") == Identity(Verdict.REFUSED, None)
    assert verify(claim, salt, SECRET, "default", Unverified.DEFAULT) == Identity(Verdict.REFUSED, "default")


@pytest.mark.parametrize("salt", ["\ud800", "a\udfffb", "x" * (MAX_NAME_CHARS + 1)])
def test_without_a_secret_a_salt_no_key_can_carry_is_refused(salt: str) -> None:
    """The salt is the tenant then: one with a lone surrogate (no UTF-8 for the cache keys
    and the lookup socket) or longer than any name is refused, not filed under it."""
    assert verify(None, salt, None, "default") == Identity(Verdict.REFUSED, None)
    assert verify(None, salt, None, "default", Unverified.DEFAULT) == Identity(Verdict.REFUSED, "default")
    assert verify(None, "é" * MAX_NAME_CHARS, None, "default") == Identity(Verdict.SALT, "é" * MAX_NAME_CHARS)


@pytest.mark.parametrize("claim", ["a\ud800", "x" * (MAX_NAME_CHARS + 1)])
def test_a_claim_no_gateway_stamps_is_refused_even_beside_its_own_salt(claim: str) -> None:
    """A lone surrogate or an over-long name has a salt (``tenant_salt`` encodes with
    surrogatepass), but no gateway stamps it: it would fail every part downstream."""
    salt = tenant_salt(SECRET, claim)
    assert verify({PARAMS_KEY: claim}, salt, SECRET, "default") == Identity(Verdict.REFUSED, None)


@settings(max_examples=300, deadline=None)
@given(_json | st.just("acme"), _json | st.just(tenant_proof(SECRET, "acme")))
def test_verify_proof_never_raises_whatever_the_headers(tenant: object, proof: object) -> None:
    assert verify_proof(SECRET, tenant, proof) is (tenant == "acme" and proof == tenant_proof(SECRET, "acme"))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.text(_chars, min_size=1, max_size=300))
def test_a_salts_metrics_label_is_stable_and_tells_nothing_of_it(salt: str) -> None:
    """Without a secret the salt opens its tenant's cache: ``/metrics`` shows a hash."""
    label = salt_label(salt)
    assert label == salt_label(salt) and re.fullmatch(r"salt-[0-9a-f]{16}", label)
    assert salt not in label or salt in "salt-0123456789abcdef"
    assert salt_label("alice") != salt_label("alicf")


# ---------------------------------------------------------------- retention (issue 41)


@settings(max_examples=100, deadline=None)
@given(tenants, st.integers(1, MAX_RETAIN_S))
def test_the_connector_believes_exactly_the_retention_the_gateway_stamped(tenant: str, seconds: int) -> None:
    params = stamp({}, tenant, SECRET, seconds)["kv_transfer_params"]
    assert verify_retention(params, tenant, SECRET) == seconds
    assert verify_retention(params, tenant, OTHER) == 0  # another gateway's secret
    assert verify_retention(params, tenant + "x", SECRET) == 0  # another tenant's
    assert verify_retention(params | {RETAIN_KEY: seconds % MAX_RETAIN_S + 1}, tenant, SECRET) == 0  # raised
    assert verify_retention({PARAMS_KEY: tenant, RETAIN_KEY: seconds}, tenant, SECRET) == 0  # no proof
    assert RETAIN_KEY not in stamp({}, tenant, SECRET)["kv_transfer_params"]  # nothing asked, nothing stamped


def test_without_a_secret_the_retention_asked_is_the_clients_in_range() -> None:
    assert verify_retention({RETAIN_KEY: 300}, "acme", None) == 300
    for bad in (0, -1, MAX_RETAIN_S + 1, 1.5, True, "300", None, [300]):
        assert verify_retention({RETAIN_KEY: bad}, "acme", None) == 0
    assert MAX_RETAIN_S == CACHE_MAX_RETAIN_S  # one bound: what the gateway stamps, the cache takes


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from([RETAIN_KEY, RETAIN_PROOF_KEY, PARAMS_KEY]), _json) | _json,
    st.text(max_size=300),
    st.sampled_from([None, SECRET]),
)
def test_verify_retention_never_raises_whatever_the_params(params: object, tenant: str, secret: bytes | None) -> None:
    got = verify_retention(params, tenant, secret)
    assert isinstance(got, int) and 0 <= got <= MAX_RETAIN_S
