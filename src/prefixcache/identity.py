"""The tenant a gateway vouches for, in a form a backend verifies (design invariant 11).

``prefixcache route`` authenticates the client, then rewrites what it forwards to a
vLLM backend so that the client cannot name a tenant::

    client body ──> strip CLIENT_FIELDS ──> cache_salt         = tenant_salt(secret, tenant)
                                            kv_transfer_params = {PARAMS_KEY: tenant}

- ``cache_salt`` is vLLM's own isolation: its prefix cache keys a prompt's first block
  on it, so vLLM's cache is per tenant too. It is a keyed hash (HMAC-SHA256) of the
  tenant: it tells neither the tenant's name nor the secret to whoever reads it.
- The connector (``integrations/vllm``) files the request under the tenant named in
  ``kv_transfer_params`` only when the request's ``cache_salt`` is that tenant's salt
  under the secret both read from their settings (``verify``): a request that did not
  come through the gateway cannot claim a tenant without the secret.

Without a secret (vLLM used alone, no gateway) the connector trusts what vLLM trusts:
the ``cache_salt`` is the tenant, as knowing a salt is what gives access to vLLM's own
prefix cache; the ``kv_transfer_params`` claim is then ignored, never believed.

The retention a client asked for (OpenAI's ``prompt_cache_retention``, Anthropic's
``cache_control``) travels the same way: the gateway stamps it as seconds beside the
claim, with an HMAC binding it to the tenant (``RETAIN_KEY``, ``RETAIN_PROOF_KEY``), and
the connector believes it only with a verified tenant and a proof that checks
(``verify_retention``); without a secret it is the client's ask, as the salt is its
tenant. Either way the tenant's retention cap bounds it (``cache/retention.py``).

A prefixcache server behind the gateway takes the tenant from a header instead
(``auth.tenant_header``), and with a secret configured believes it only beside the
gateway's proof for that tenant (``PROOF_HEADER`` = ``tenant_proof``, ``verify_proof``):

    gateway ──> server:  <tenant_header>: TENANT
                         x-prefixcache-tenant-proof: tenant_proof(secret, TENANT)
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from prefixcache.config import MAX_RETAIN_S

__all__ = [
    "CLIENT_FIELDS",
    "MAX_NAME_CHARS",
    "PARAMS_KEY",
    "PROOF_HEADER",
    "RETAIN_KEY",
    "RETAIN_PROOF_KEY",
    "SECRET_ENV",
    "Identity",
    "Unverified",
    "Verdict",
    "retain_proof",
    "salt_label",
    "stamp",
    "tenant_proof",
    "tenant_salt",
    "verify",
    "verify_proof",
    "verify_retention",
]

SECRET_ENV = "PREFIXCACHE_TENANT_SECRET"  # where the router and the connector read the secret by default
PARAMS_KEY = "prefixcache_tenant"  # kv_transfer_params[PARAMS_KEY]: the tenant the gateway vouches for
# Every body field a client could use to name, derive or share a tenant's cache on vLLM:
# the salt (vLLM's namespace) and kv_transfer_params (what a connector reads).
CLIENT_FIELDS = frozenset({"cache_salt", "kv_transfer_params"})
_SALT_TAG = b"prefixcache/tenant-salt/v1\x00"
_SALT_PREFIX = "pc1-"
PROOF_HEADER = "x-prefixcache-tenant-proof"  # beside the tenant header, to a prefixcache server
_PROOF_TAG = b"prefixcache/tenant-proof/v1\x00"
_PROOF_PREFIX = "pcp1-"
_LABEL_TAG = b"prefixcache/salt-label/v1\x00"
RETAIN_KEY = "prefixcache_retain_s"  # kv_transfer_params[RETAIN_KEY]: seconds the gateway asks to retain
RETAIN_PROOF_KEY = "prefixcache_retain_proof"  # ... and its HMAC, bound to the tenant
_RETAIN_TAG = b"prefixcache/retain/v1\x00"
MIN_SECRET_BYTES = 16
# The longest salt or tenant name believed: a gateway's salt is 36 characters, and a tenant's
# name comes from its settings; a longer one is no stamp of ours (refused, never hashed).
MAX_NAME_CHARS = 256


def _check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the tenant secret must be at least {MIN_SECRET_BYTES} bytes long")


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The ``cache_salt`` of ``tenant``: an HMAC of its name under ``secret``."""
    _check_secret(secret)
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("a tenant is a non-empty string")
    digest = hmac.new(secret, _SALT_TAG + tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
    return _SALT_PREFIX + digest[:32]


def stamp(body: Mapping[str, Any], tenant: str, secret: bytes, retain_s: int | None = None) -> dict[str, Any]:
    """``body`` as the gateway forwards it to vLLM: the client's own ``CLIENT_FIELDS``
    removed, the authenticated tenant's salt and claim set, and the retention it asked
    for (whole seconds) with its proof."""
    out = {k: v for k, v in body.items() if k not in CLIENT_FIELDS}
    out["cache_salt"] = tenant_salt(secret, tenant)
    params: dict[str, Any] = {PARAMS_KEY: tenant}
    if retain_s:
        params[RETAIN_KEY] = retain_s
        params[RETAIN_PROOF_KEY] = retain_proof(secret, tenant, retain_s)
    out["kv_transfer_params"] = params
    return out


def retain_proof(secret: bytes, tenant: str, seconds: int) -> str:
    """The gateway's word that ``tenant`` asked to retain its prompt ``seconds``."""
    _check_secret(secret)
    message = _RETAIN_TAG + tenant.encode("utf-8", "surrogatepass") + b"\x00" + str(seconds).encode()
    return _PROOF_PREFIX + hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify_retention(params: object, tenant: str, secret: bytes | None) -> int:
    """The seconds a request's ``kv_transfer_params`` retain its prompt for ``tenant`` (a
    verified one): 0 when none is asked, or it is no whole number of seconds in range, or
    (with a secret) its proof is not the gateway's for this tenant and value. Never raises:
    it reads what a client sent, inside vLLM's engine core."""
    if not isinstance(params, Mapping):
        return 0
    seconds = params.get(RETAIN_KEY)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 0 < seconds <= MAX_RETAIN_S:
        return 0
    if secret is None:
        return seconds
    proof = params.get(RETAIN_PROOF_KEY)
    if not isinstance(proof, str) or not proof or len(proof) > MAX_NAME_CHARS or _name(tenant) is None:
        return 0
    expected = retain_proof(secret, tenant, seconds).encode()
    return seconds if hmac.compare_digest(expected, proof.encode("utf-8", "surrogatepass")) else 0


class Unverified(Enum):
    """What the connector does with a request whose tenant it cannot verify."""

    BYPASS = "bypass"  # no lookup, no save: the request is served without the cache (the safe default)
    DEFAULT = "default"  # filed under the configured default tenant


class Verdict(Enum):
    VERIFIED = "verified"  # the gateway's claim, proven by the salt
    SALT = "salt"  # no secret configured: the salt is the tenant (vLLM's own trust)
    DEFAULT = "default"  # nothing names a tenant and no secret: the default tenant
    REFUSED = "refused"  # a secret is configured and the claim does not verify


@dataclass(frozen=True, slots=True)
class Identity:
    verdict: Verdict
    tenant: str | None  # None: the request bypasses the cache


def _name(value: object) -> str | None:
    """``value`` when it can name a tenant, else None: a non-empty ``str`` of at most
    ``MAX_NAME_CHARS`` that UTF-8 encodes (no lone surrogate, which neither the cache keys
    nor the lookup socket can carry). Never raises: it reads what a client sent."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


def _claim(params: object) -> str | None:
    return _name(params.get(PARAMS_KEY)) if isinstance(params, Mapping) else None


def verify(
    params: object, salt: object, secret: bytes | None, default: str, unverified: Unverified = Unverified.BYPASS
) -> Identity:
    """The tenant of a request with these ``kv_transfer_params`` and ``cache_salt``.

    NOTE: this runs inside vLLM's engine core, on whatever a client sent (any JSON type,
    any text, any length), where an exception kills vLLM for every tenant: nothing here
    may raise. A salt or claim that is not a name (``_name``) is refused, and the salts
    are compared as bytes (``compare_digest`` raises on a non-ASCII ``str``)."""
    refused = Identity(Verdict.REFUSED, default if unverified is Unverified.DEFAULT else None)
    if salt is None or salt == "":
        named: str | None = None
    elif (named := _name(salt)) is None:
        return refused  # a salt was sent, but none that can key a cache
    if secret is None:
        return Identity(Verdict.SALT, named) if named is not None else Identity(Verdict.DEFAULT, default)
    claim = _claim(params)
    if claim is None or named is None:
        return refused
    if hmac.compare_digest(tenant_salt(secret, claim).encode("ascii"), named.encode("utf-8")):
        return Identity(Verdict.VERIFIED, claim)
    return refused


def tenant_proof(secret: bytes, tenant: str) -> str:
    """The gateway's word that it authenticated ``tenant``, as a prefixcache server checks
    it (``verify_proof``): an HMAC of the name under ``secret``.

    NOTE: another tag than the salt's. The salt travels to vLLM in every body it gets, so
    whoever reads vLLM's requests holds it; the proof goes only to our own servers. Like
    the API key beside it, it is a bearer credential on the gateway's network: it binds
    the tenant, not the request."""
    _check_secret(secret)
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("a tenant is a non-empty string")
    digest = hmac.new(secret, _PROOF_TAG + tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
    return _PROOF_PREFIX + digest


def verify_proof(secret: bytes, tenant: object, proof: object) -> bool:
    """Whether ``proof`` is the gateway's ``tenant_proof`` for ``tenant`` under ``secret``
    (both read from request headers: anything else than a name and a str is no proof)."""
    name = _name(tenant)
    if name is None or not isinstance(proof, str) or not proof or len(proof) > MAX_NAME_CHARS:
        return False
    return hmac.compare_digest(tenant_proof(secret, name).encode(), proof.encode("utf-8", "surrogatepass"))


def salt_label(salt: str) -> str:
    """A salt as a metrics label: ``salt-`` and 16 hex digits of its SHA-256, never the salt.

    Without a gateway secret the salt is the tenant, and knowing it is what opens the
    tenant's cache (vLLM's and ours): it must not appear on ``/metrics``. NOTE: a plain
    hash, not a keyed one, on purpose. A keyed hash needs a key the connector does not
    have without a secret (a random one per process would rename every tenant's series
    at each restart and on each replica); and a plain hash gives away nothing that the
    salt's own strength does not: a salt one could guess from its hash, one can guess
    straight against vLLM's port, while a random salt stays unknown. The operator, who
    knows a tenant's salt, finds its series with this function."""
    digest = hashlib.sha256(_LABEL_TAG + salt.encode("utf-8", "surrogatepass")).hexdigest()
    return "salt-" + digest[:16]
