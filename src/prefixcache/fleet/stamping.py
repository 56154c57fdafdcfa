"""What the router forwards: the authenticated tenant, never the client's word for it
(design invariant 11).

    client body ──> vLLM backend:        identity.stamp: CLIENT_FIELDS replaced by
                                          cache_salt = tenant_salt(secret, tenant),
                                          kv_transfer_params = {PARAMS_KEY: tenant};
                                          media items' client-set ``uuid`` removed
                ──> prefixcache server:  CLIENT_FIELDS removed (it authenticates the
                                          forwarded API key again)
    client headers ──> every backend:    hop-by-hop headers and every x-prefixcache-*
                                          header removed; the tenant header (when one
                                          is configured) set to the authenticated tenant

A content part's ``uuid`` names its media item for vLLM, which then keys the item (its
processor cache, its prefix-cache blocks, and so the connector's keys) by that string
instead of a hash of its bytes: a client could give another image's name to its own
image and be served that image's KV. The router removes it, so vLLM hashes the bytes.

A body that is not a JSON object goes to a prefixcache server as it came (the server
answers it in its own words), but never to vLLM unstamped: the router answers it 400.

The salt of each tenant the router stamps is also its key into ``salts`` (salt ->
tenant), by which the vLLM event decoding credits a salted chain to its tenant
(``vllm_events``): the configured tenants from the start, and a tenant named by a
trusted gateway's header (``auth.tenant_header``) once it is first stamped, before vLLM
can have stored anything under its salt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from prefixcache.identity import CLIENT_FIELDS, MIN_SECRET_BYTES, SECRET_ENV, stamp, tenant_salt
from prefixcache.server.errors import APIError
from prefixcache.server.settings import LOCAL_TENANT, Settings

__all__ = ["HOP_HEADERS", "NO_SECRET", "Stamper", "route_secret"]

HOP_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding", "keep-alive"})
OWN_HEADERS = "x-prefixcache-"  # the router's and servers' own headers: never a client's to set
MEDIA_ID = "uuid"  # a content part's client-chosen name for its media item (vLLM keys on it)
MAX_SALTS = 100_000  # tenants named by a gateway's header beyond this are not followed on vLLM
NO_SECRET = (
    "--vllm-backend needs the tenant secret the vLLM connector verifies tenants with: set auth.tenant_secret "
    f"([auth] tenant_secret, or PREFIXCACHE_AUTH_TENANT_SECRET; else ${SECRET_ENV}), at least {MIN_SECRET_BYTES} "
    "bytes, the same for every router and vLLM connector"
)


def route_secret(settings: Settings, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The tenant secret: ``auth.tenant_secret``, else ``$PREFIXCACHE_TENANT_SECRET`` (the
    connector's default variable); None when neither is set. Raises ``ValueError`` for a
    short one, without ever repeating it."""
    if settings.auth.tenant_secret:
        return settings.auth.tenant_secret.encode()
    value = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    if value and len(value.encode()) < MIN_SECRET_BYTES:
        raise ValueError(f"${SECRET_ENV} must be at least {MIN_SECRET_BYTES} bytes long")
    return value.encode() if value else None


class Stamper:
    """The router's rewriting of a request, per backend kind (see the module doc)."""

    def __init__(self, secret: bytes | None, tenants: Iterable[str], tenant_header: str = "") -> None:
        self._secret = secret
        self._tenant_header = tenant_header.lower()
        self._drop = HOP_HEADERS | ({self._tenant_header} if tenant_header else frozenset())
        self.salts: dict[str, str] = {}  # read by the ZMQ readers' threads: only ever added to
        if secret is not None:
            for tenant in tenants:
                self.salts[tenant_salt(secret, tenant)] = tenant

    @classmethod
    def of(cls, settings: Settings, secret: bytes | None) -> Stamper:
        auth = settings.auth
        tenants = set(auth.api_keys.values()) if not auth.local_mode else {LOCAL_TENANT}
        return cls(secret, sorted(tenants), auth.tenant_header)

    @property
    def stamps(self) -> bool:
        return self._secret is not None

    def headers(self, incoming: Iterable[tuple[str, str]], tenant: str = "") -> dict[str, str]:
        """The client's headers less those it may not set; a backend that trusts the
        configured tenant header (the servers' own setting) gets it from the router's
        authentication, never the client's value."""
        out = {k: v for k, v in incoming if k.lower() not in self._drop and not k.lower().startswith(OWN_HEADERS)}
        if self._tenant_header and tenant:
            out[self._tenant_header] = tenant
        return out

    def body(self, raw: bytes, body: object, tenant: str, vllm: bool) -> tuple[bytes, dict[str, str]]:
        """The body to forward and the headers it adds; ``body`` is ``raw`` parsed (a
        dict when it is a JSON object). Raises ``APIError`` 400 for a vLLM backend when
        ``body`` is not an object, ``ValueError`` when no secret is configured."""
        if not vllm:
            if not isinstance(body, dict) or not CLIENT_FIELDS & body.keys():
                return raw, {}
            return _json({k: v for k, v in body.items() if k not in CLIENT_FIELDS})
        if self._secret is None:
            raise ValueError(NO_SECRET)
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object.", code="invalid_body")
        stamped = stamp(_without_media_ids(body), tenant, self._secret)
        if len(self.salts) < MAX_SALTS:
            self.salts.setdefault(stamped["cache_salt"], tenant)
        return _json(stamped)


def _without_media_ids(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with no chat content part naming its media item (``MEDIA_ID``)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and MEDIA_ID in p for p in content):
            parts = [{k: v for k, v in p.items() if k != MEDIA_ID} if isinstance(p, dict) else p for p in content]
            message = {**message, "content": parts}
        out.append(message)
    return {**body, "messages": out}


def _json(body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    # NOTE: ASCII escapes keep any lone surrogate a client's JSON held encodable
    return json.dumps(body, separators=(",", ":")).encode(), {"content-type": "application/json"}
