"""Who is asking: a tenant from its API key (never from the body), the operator from
the admin key. Keys are compared in constant time, against every configured key."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from fastapi import Request

from prefixcache.server.errors import APIError
from prefixcache.server.settings import AuthSettings

__all__ = ["LOCAL_TENANT", "Auth"]

LOCAL_TENANT = "local"


class Auth:
    """The three guards the routes depend on: ``tenant``, ``admin`` and ``operator``."""

    def __init__(self, settings: AuthSettings) -> None:
        self.settings = settings

    def _key(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def tenant(self, request: Request) -> str:
        """The caller's tenant, from its API key (never from the body)."""
        auth = self.settings
        tenant: str | None = LOCAL_TENANT
        if not auth.local_mode:
            key = self._key(request)
            tenant = _lookup(auth.api_keys, key) if key is not None else None
        if tenant is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        if auth.tenant_header:  # set by a gateway the operator trusts (configured explicitly)
            tenant = request.headers.get(auth.tenant_header) or tenant
        return tenant

    def admin(self, request: Request) -> None:
        auth = self.settings
        if not auth.admin_key:
            if auth.local_mode:
                return  # local mode: no keys at all, the admin routes are as open as the rest
            raise APIError(403, "admin routes are disabled: set [auth] admin_key", code="admin_disabled")
        key = self._key(request)
        if key is not None and hmac.compare_digest(key.encode(), auth.admin_key.encode()):
            return
        if key is not None and _lookup(auth.api_keys, key) is not None:
            raise APIError(
                403,
                "Admin routes are for the operator: this route needs the admin key, not a tenant's API key.",
                type_="permission_error",
                code="admin_key_required",
            )
        raise APIError(401, "Incorrect admin key provided.", code="invalid_api_key")

    def operator(self, request: Request) -> None:
        """Guard the per-tenant figures (/metrics, /dashboard/data): the admin key only.
        A tenant's own key is recognised and refused with 403, no key or a wrong one is 401."""
        auth = self.settings
        if auth.local_mode and not auth.admin_key:
            return  # a developer's machine: one tenant, nothing to hide from anyone
        key = self._key(request)
        if key is None:
            raise APIError(401, "This route needs the admin key as a Bearer token.", code="invalid_api_key")
        if auth.admin_key and hmac.compare_digest(key.encode(), auth.admin_key.encode()):
            return
        if _lookup(auth.api_keys, key) is not None:
            raise APIError(
                403,
                "Per-tenant figures are for the operator: this route needs the admin key, not a tenant's API key.",
                type_="permission_error",
                code="admin_key_required",
            )
        if not auth.admin_key:
            raise APIError(403, "metrics are disabled: set [auth] admin_key", code="admin_disabled")
        raise APIError(401, "Incorrect admin key provided.", code="invalid_api_key")


def _lookup(keys: Mapping[str, str], key: str) -> str | None:
    """The tenant of ``key``, comparing against every configured key in constant time."""
    found: str | None = None
    for candidate, tenant in keys.items():
        if hmac.compare_digest(candidate.encode(), key.encode()):
            found = tenant
    return found
