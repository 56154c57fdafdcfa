"""The gateway's stamp and the connector's verification (``identity.py``): a tenant is
believed only as the gateway vouched for it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.identity import (
    CLIENT_FIELDS,
    PARAMS_KEY,
    Identity,
    Unverified,
    Verdict,
    stamp,
    tenant_proof,
    tenant_salt,
    verify,
    verify_proof,
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
