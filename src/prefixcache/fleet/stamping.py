"""What the router forwards: the authenticated tenant, never the client's word for it
(design invariant 11).

    client body ──> vLLM backend:        identity.stamp: CLIENT_FIELDS replaced by
                                          cache_salt = tenant_salt(secret, tenant),
                                          kv_transfer_params = {PARAMS_KEY: tenant};
                                          media items' client-set ``uuid`` removed
                ──> prefixcache server:  CLIENT_FIELDS removed (it authenticates the
                                          forwarded API key again)
    client headers ──> every backend:    ``FORWARDED`` only (less any the client's
                                          Connection header names); X-Forwarded-For
                                          and -Proto set by the router
                   ──> prefixcache server:  also Authorization or x-api-key (it checks
                                          the key again)
                                          and the tenant header (``auth.tenant_header``)
                                          = the authenticated tenant, with the gateway's
                                          proof (``identity.tenant_proof``) when a
                                          secret is configured

Headers are an allowlist, not a blocklist: a client's ``Cookie``, ``X-Tenant``, tenant
header, ``x-prefixcache-*`` header or anything a backend might one day read never
reaches it. ``X-Forwarded-For`` is replaced by the one address the router knows the
client by (the peer's, or what a proxy of ``server.trusted_proxies`` saw), not appended
to: a chain the client wrote is the client's word, and a backend that logged or limited
by it would believe a forged address. A vLLM
backend gets no tenant's Authorization (its tenants' keys are the router's business; its
port is for the router alone), only the router's own ``auth.backend_key`` when one is set
(vLLM's ``--api-key``), and no tenant header (the body's stamp is its identity).

A content part's ``uuid`` names its media item for vLLM, which then keys the item (its
processor cache, its prefix-cache blocks, and so the connector's keys) by that string
instead of a hash of its bytes: a client could give another image's name to its own
image and be served that image's KV. The router removes it, so vLLM hashes the bytes.

The router forwards only bodies it validated (``validate``): JSON objects. ``body``
still refuses anything else for vLLM (400), which must never get a body unstamped.

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

from prefixcache.api.errors import APIError
from prefixcache.api.messages import Ttl
from prefixcache.api.schemas import RETENTION_24H_S
from prefixcache.identity import (
    CLIENT_FIELDS,
    MIN_SECRET_BYTES,
    PROOF_HEADER,
    SECRET_ENV,
    stamp,
    tenant_proof,
    tenant_salt,
)
from prefixcache.settings import LOCAL_TENANT, Settings

__all__ = ["FORWARDED", "HOP_BY_HOP", "NO_SECRET", "Headers", "Stamper", "hop_by_hop", "route_secret"]

Headers = dict[bytes, bytes]  # lower-case names, raw values (HTTP headers are bytes, not always ASCII)

# What a client may say to every backend (all else is dropped): content negotiation,
# the client's name, the W3C trace context, and its own request id.
FORWARDED = frozenset(
    {
        b"content-type",
        b"accept",
        b"accept-encoding",
        b"user-agent",
        b"traceparent",
        b"tracestate",
        b"x-request-id",
        b"anthropic-version",  # the version of Anthropic's API the client speaks
    }
)
KEY = b"authorization"  # to a prefixcache server only, which authenticates it again
API_KEY = b"x-api-key"  # the same key as Anthropic's clients send it: to a prefixcache server only
# RFC 9110 7.6.1: headers about one connection, never forwarded (nor any header the
# Connection header names).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
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

    def __init__(
        self, secret: bytes | None, tenants: Iterable[str], tenant_header: str = "", backend_key: str = ""
    ) -> None:
        self._secret = secret
        self._backend_key = f"Bearer {backend_key}".encode() if backend_key else b""
        self._tenant_header = tenant_header.lower().encode()
        self.salts: dict[str, str] = {}  # read by the ZMQ readers' threads: only ever added to
        if secret is not None:
            for tenant in tenants:
                self.salts[tenant_salt(secret, tenant)] = tenant

    @classmethod
    def of(cls, settings: Settings, secret: bytes | None) -> Stamper:
        auth = settings.auth
        tenants = set(auth.api_keys.values()) if not auth.local_mode else {LOCAL_TENANT}
        return cls(secret, sorted(tenants), auth.tenant_header, auth.backend_key)

    @property
    def stamps(self) -> bool:
        return self._secret is not None

    def headers(
        self, incoming: Iterable[tuple[bytes, bytes]], tenant: str, vllm: bool, client: str | None, scheme: str
    ) -> Headers:
        """What the client said that ``FORWARDED`` lets through, with the router's own
        X-Forwarded-For (``client``, the address it saw) and -Proto (``scheme``), and to a
        prefixcache server the client's key and the tenant (module doc)."""
        received = list(incoming)
        allowed = FORWARDED if vllm else FORWARDED | {KEY, API_KEY}
        allowed = allowed - hop_by_hop(received)
        out: Headers = {}
        for name, value in received:
            if name.lower() in allowed:
                out.setdefault(name.lower(), value)
        out.setdefault(b"accept-encoding", b"identity")  # else the HTTP client asks for gzip the client may not read
        if client:
            out[b"x-forwarded-for"] = client.encode()
        out[b"x-forwarded-proto"] = scheme.encode()
        if vllm and self._backend_key:
            out[KEY] = self._backend_key
        if self._tenant_header and tenant and not vllm:
            out[self._tenant_header] = tenant.encode("utf-8", "surrogateescape")
            if self._secret is not None:
                out[PROOF_HEADER.encode()] = tenant_proof(self._secret, tenant).encode()
        return out

    def body(self, raw: bytes, body: object, tenant: str, vllm: bool) -> tuple[bytes, Headers]:
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
        stamped = stamp(_without_media_ids(body), tenant, self._secret, retention_asked(body))
        if len(self.salts) < MAX_SALTS:
            self.salts.setdefault(stamped["cache_salt"], tenant)
        return _json(stamped)


def retention_asked(body: dict[str, Any]) -> int | None:
    """The seconds a chat, completion or Messages body asks its prompt be retained, as a
    vLLM backend's connector is told (``identity.stamp``): OpenAI's
    ``prompt_cache_retention``, or the longest ttl of Anthropic's ``cache_control``
    breakpoints, in the seconds each API's schema gives them. NOTE: through vLLM a
    retention keeps the whole prompt (its full blocks): the router cannot place a
    breakpoint on vLLM's tokens. What the backend refuses as invalid was validated before
    this (``validate.py``); still, nothing here raises."""
    seconds = int(RETENTION_24H_S) if body.get("prompt_cache_retention") == "24h" else 0
    ttls = [_ttl(c.get("ttl")) for c in _cache_controls(body) if c.get("type") == "ephemeral"]
    return max([seconds, *ttls]) or None


def _ttl(value: object) -> int:
    if value is None:
        return Ttl.FIVE_MINUTES.seconds  # Anthropic's default
    return Ttl(value).seconds if isinstance(value, str) and value in _TTLS else 0


_TTLS = frozenset(Ttl)


def _cache_controls(body: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[object] = []
    for name in ("system", "tools"):
        if isinstance(body.get(name), list):
            blocks.extend(body[name])
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            blocks.extend(content)
    found = [b.get("cache_control") for b in blocks if isinstance(b, dict)]
    return [c for c in found if isinstance(c, dict)]


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


def hop_by_hop(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The names of ``headers`` (lower-case) that are about one connection only:
    ``HOP_BY_HOP`` and every name their Connection header lists."""
    named = {
        token.strip().lower()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
        if token.strip()
    }
    return HOP_BY_HOP | named


def _json(body: dict[str, Any]) -> tuple[bytes, Headers]:
    # NOTE: ASCII escapes keep any lone surrogate a client's JSON held encodable
    return json.dumps(body, separators=(",", ":")).encode(), {b"content-type": b"application/json"}
