"""Who is asking: a tenant from its API key (never from the body; a Bearer token, or on
Anthropic's routes ``x-api-key`` too), the operator from the admin key. Keys are compared
in constant time, against every configured key.

Behind a gateway the operator trusts (``auth.tenant_header``), the key is the gateway's
(or the client's, which the gateway passes on) and the tenant is the header's. With a
``tenant_secret`` the header is believed only beside the gateway's proof for that tenant
(``identity.PROOF_HEADER``, ``identity.verify_proof``): a client that reaches the server
past the gateway, or through it (which replaces both headers), cannot name a tenant.
Without a secret the header is believed as it comes: the operator vouches that only the
gateway reaches the server.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from fastapi import Request

from prefixcache.api.errors import APIError
from prefixcache.api.sessions import COOKIE, Sessions
from prefixcache.identity import PROOF_HEADER, verify_proof
from prefixcache.settings import LOCAL_TENANT, AuthSettings

__all__ = ["API_KEY_HEADER", "LOCAL_TENANT", "Auth"]

API_KEY_HEADER = "x-api-key"  # where Anthropic's clients send the key


class Auth:
    """The guards the routes depend on: ``tenant``, ``admin``, ``operator`` and ``dashboard``."""

    def __init__(self, settings: AuthSettings, sessions: Sessions) -> None:
        self.settings, self.sessions = settings, sessions

    @classmethod
    def at_gateway(cls, settings: AuthSettings, sessions: Sessions) -> Auth:
        """The guards of the gateway itself (``prefixcache route``), which owns the tenant:
        it reads the servers' settings, whose ``tenant_header`` names what the gateway sends
        them. A client's own header is believed only beside a proof (a gateway in front of
        this one, holding ``tenant_secret``); without a secret nothing vouches for it, and
        the tenant comes from the client's key alone."""
        if settings.tenant_header and not settings.tenant_secret:
            settings = settings.model_copy(update={"tenant_header": ""})
        return cls(settings, sessions)

    def _key(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def tenant(self, request: Request) -> str:
        """The caller's tenant, from its API key (never from the body)."""
        return self._tenant(request, self._key(request))

    def messages_tenant(self, request: Request) -> str:
        """The caller's tenant on Anthropic's routes, whose clients send the key as
        ``x-api-key`` (or, given an auth token, as a Bearer token); the key is looked up
        as ``tenant`` looks up a Bearer key, and ``x-api-key`` wins when both are sent."""
        key = request.headers.get(API_KEY_HEADER, "").strip()
        return self._tenant(request, key or self._key(request))

    def _tenant(self, request: Request, key: str | None) -> str:
        auth = self.settings
        tenant: str | None = LOCAL_TENANT
        if not auth.local_mode:
            tenant = _lookup(auth.api_keys, key) if key is not None else None
        if tenant is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        if auth.tenant_header:  # set by a gateway the operator trusts (configured explicitly)
            tenant = self._gateway_tenant(request) or tenant
        return tenant

    def _gateway_tenant(self, request: Request) -> str | None:
        """The tenant the gateway's header names, once its proof holds (module doc)."""
        auth = self.settings
        named = _header_text(request, auth.tenant_header)
        if named is None:
            return None
        secret = auth.tenant_secret.encode()
        if secret and not verify_proof(secret, named, request.headers.get(PROOF_HEADER)):
            raise APIError(
                401,
                f"The {auth.tenant_header} header comes without the gateway's proof ({PROOF_HEADER}).",
                code="invalid_tenant_proof",
            )
        return named

    def admin(self, request: Request) -> None:
        """Guard the routes that change or read the whole cache (/admin/*)."""
        if not self._open_to_all():
            self.admin_key(self._key(request), "Admin routes are for the operator")

    def operator(self, request: Request) -> None:
        """Guard the per-tenant figures (/metrics, /dashboard/data) the same way."""
        if not self._open_to_all():
            self.admin_key(self._key(request), "Per-tenant figures are for the operator")

    def dashboard(self, request: Request) -> None:
        """The dashboard's data: a session cookie from the page's login, or the admin key."""
        if not self.sessions.valid(request.cookies.get(COOKIE)):
            self.operator(request)

    def admin_key(self, key: str | None, whose: str) -> None:
        """Accept the admin key only: none or a wrong one is 401; a tenant's own key is
        recognised and refused with 403, so that a tenant learns it has no access rather
        than that its key is wrong."""
        auth = self.settings
        if key is None:
            raise APIError(401, "This route needs the admin key as a Bearer token.", code="invalid_api_key")
        if auth.admin_key and hmac.compare_digest(key.encode(), auth.admin_key.encode()):
            return
        if _lookup(auth.api_keys, key) is not None:
            raise APIError(
                403,
                f"{whose}: this route needs the admin key, not a tenant's API key.",
                type_="permission_error",
                code="admin_key_required",
            )
        if not auth.admin_key:
            raise APIError(403, "operator routes are disabled: set [auth] admin_key", code="admin_disabled")
        raise APIError(401, "Incorrect admin key provided.", code="invalid_api_key")

    def _open_to_all(self) -> bool:
        """A developer's machine (no API keys, no admin key): one tenant, nothing to hide."""
        return self.settings.local_mode and not self.settings.admin_key


def _header_text(request: Request, name: str) -> str | None:
    """Header ``name`` as text (UTF-8, as the router sends a tenant's name); None when
    absent or empty. The server's framework reads header bytes as Latin-1."""
    value = request.headers.get(name)
    if not value:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        return value


def _lookup(keys: Mapping[str, str], key: str) -> str | None:
    """The tenant of ``key``, comparing against every configured key in constant time."""
    found: str | None = None
    for candidate, tenant in keys.items():
        if hmac.compare_digest(candidate.encode(), key.encode()):
            found = tenant
    return found
