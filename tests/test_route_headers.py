"""Headers at the gateway: a server in trusted-gateway mode believes a tenant header
only with the gateway's proof."""

from __future__ import annotations

import pytest
from fastapi import Request

from prefixcache.identity import PROOF_HEADER, tenant_proof
from prefixcache.server.auth import Auth
from prefixcache.server.errors import APIError
from prefixcache.server.sessions import Sessions
from prefixcache.server.settings import AuthSettings

SECRET = "a-tenant-secret-of-32-characters"
KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
HEADER = "X-Org"  # the configured auth.tenant_header


def tenant_of(auth: Auth, headers: list[tuple[bytes, bytes]]) -> str:
    return auth.tenant(Request({"type": "http", "method": "POST", "path": "/", "headers": headers}))


def test_a_server_in_trusted_gateway_mode_believes_the_header_only_with_the_proof() -> None:
    settings = AuthSettings(api_keys=KEYS, tenant_header=HEADER, tenant_secret=SECRET)
    auth = Auth(settings, Sessions(60))
    key = (b"authorization", b"Bearer sk-acme")
    assert tenant_of(auth, [key]) == "acme"  # no header: the key's tenant
    proof = tenant_proof(SECRET.encode(), "initech").encode()
    assert tenant_of(auth, [key, (b"x-org", b"initech"), (PROOF_HEADER.encode(), proof)]) == "initech"
    name = "m\u00fcller"  # a name beyond ASCII, as the router sends it (UTF-8)
    utf8 = [key, (b"x-org", name.encode()), (PROOF_HEADER.encode(), tenant_proof(SECRET.encode(), name).encode())]
    assert tenant_of(auth, utf8) == name
    for forged in (
        [(b"x-org", b"initech")],
        [(b"x-org", b"initech"), (PROOF_HEADER.encode(), tenant_proof(SECRET.encode(), "acme").encode())],
        [
            (b"x-org", b"initech"),
            (PROOF_HEADER.encode(), tenant_proof(b"another-secret-of-32-characters!", "initech").encode()),
        ],
    ):
        with pytest.raises(APIError) as caught:
            tenant_of(auth, [key, *forged])
        assert caught.value.status == 401 and caught.value.code == "invalid_tenant_proof"
    with pytest.raises(APIError) as caught:  # the header never replaces the key
        tenant_of(auth, [(b"x-org", b"initech"), (PROOF_HEADER.encode(), proof)])
    assert caught.value.code == "invalid_api_key"
    # without a secret the operator vouches that only the gateway reaches the server
    trusting = Auth(AuthSettings(api_keys=KEYS, tenant_header=HEADER), Sessions(60))
    assert tenant_of(trusting, [key, (b"x-org", b"initech")]) == "initech"
