"""Dashboard sessions: the operator types the admin key into the page once, the server
answers with a random session token in an HttpOnly, SameSite=Strict cookie, and the
page's reads of /dashboard/data carry the cookie, never the key. So the key is in no
URL, no browser history, no script-readable storage and no log line.

Tokens live in memory only (a restart logs everyone out), expire after ``ttl_s``, and at
most ``limit`` are kept (the oldest goes first). The table holds their SHA-256, so a
lookup's timing says nothing about a token's characters and a dump holds no usable one.

The cookie is ``Secure`` when the login came over TLS: to this server, or to a proxy in
``server.trusted_proxies`` that says so (``X-Forwarded-Proto``). Failed logins are
throttled per client address (``LoginThrottle``), the address a trusted proxy names in
``X-Forwarded-For`` when the login came through one (``TrustedProxies``); a header from
any other peer is the client's own word, and ignored.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["COOKIE", "LoginLimit", "LoginThrottle", "Sessions", "TrustedProxies"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

COOKIE = "prefixcache_session"


class Sessions:
    """Open, check and close dashboard sessions (thread-safe)."""

    def __init__(self, ttl_s: float, limit: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or limit < 1:
            raise ValueError("a session lasts ttl_s > 0 seconds and at least one may be open")
        self.ttl_s, self.limit, self._clock = ttl_s, limit, clock
        self._expiry: OrderedDict[bytes, float] = OrderedDict()  # token digest -> expiry, oldest first
        self._lock = threading.Lock()

    def open(self) -> str:
        """A new session's token (for the cookie)."""
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._expire()
            self._expiry[_digest(token)] = self._clock() + self.ttl_s
            while len(self._expiry) > self.limit:
                self._expiry.popitem(last=False)
        return token

    def valid(self, token: str | None) -> bool:
        if not token:
            return False
        with self._lock:
            self._expire()
            return _digest(token) in self._expiry

    def close(self, token: str | None) -> None:
        if token:
            with self._lock:
                self._expiry.pop(_digest(token), None)

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._expiry)

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry and next(iter(self._expiry.values())) <= now:
            self._expiry.popitem(last=False)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "replace")).digest()


class TrustedProxies:
    """Who the client is, and whether it came over TLS, believing ``X-Forwarded-For`` and
    ``X-Forwarded-Proto`` only from a peer in ``networks`` (IPs or CIDR networks)."""

    def __init__(self, networks: Sequence[str]) -> None:
        self.networks = tuple(ipaddress.ip_network(n) for n in networks)

    def trusted(self, address: Address | None) -> bool:
        return address is not None and any(address in network for network in self.networks)

    def client(self, peer: str | None, forwarded_for: str | None) -> str:
        """The client's address: the peer's, or behind trusted proxies the right-most
        address of ``X-Forwarded-For`` that is not one of them (each proxy appends the
        address it was reached from; what lies left of it the client may have written)."""
        address = _address(peer)
        if address is None:
            return peer or ""
        hops = [h for h in (forwarded_for or "").split(",") if h.strip()]
        while self.trusted(address) and hops:
            nearer = _address(hops.pop())
            if nearer is None:  # a proxy passed on garbage: the last hop known stands
                break
            address = nearer
        return str(address)

    def secure(self, scheme: str, peer: str | None, forwarded_proto: str | None) -> bool:
        """Whether the request came over TLS: to this server, or to the trusted proxy that
        reached it (the right-most ``X-Forwarded-Proto`` value, the one it set)."""
        if scheme == "https":
            return True
        said = (forwarded_proto or "").rsplit(",", 1)[-1].strip().lower()
        return said == "https" and self.trusted(_address(peer))


def _address(text: str | None) -> Address | None:
    """An address as a peer or a forwarding header gives it: bare, ``[v6]``, or with a port."""
    if not text:
        return None
    text = text.strip()
    if text.startswith("["):
        text = text[1 : text.find("]")] if "]" in text else text
    elif text.count(":") == 1:  # an IPv4 address with a port
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(frozen=True, slots=True)
class LoginLimit:
    """A client's failed logins: ``failures`` at once, refilled evenly over ``period_s``;
    ``clients`` remembered at most (those that failed longest ago are forgotten first)."""

    failures: int = 10
    period_s: float = 60.0
    clients: int = 10_000

    def __post_init__(self) -> None:
        if self.failures < 1 or not self.period_s > 0 or self.clients < 1:
            raise ValueError("a login limit allows failures >= 1 per period_s > 0, for clients >= 1")


class LoginThrottle:
    """A token bucket of failed logins per client (an IPv6 client by its /64, which one
    host commonly has whole). A client whose bucket is empty is refused before its key is
    checked, so that guessing goes no faster than the limit; other clients are not
    affected, and a successful login costs nothing (thread-safe)."""

    def __init__(self, limit: LoginLimit | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit or LoginLimit()
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)
        self._lock = threading.Lock()

    def wait_s(self, client: str) -> float:
        """Seconds until ``client`` may try again (0: now)."""
        with self._lock:
            key = _bucket(client)
            tokens = self._tokens(key)
            if tokens >= self.limit.failures:
                self._buckets.pop(key, None)  # full again: nothing to remember
            return 0.0 if tokens >= 1 else (1 - tokens) * self.limit.period_s / self.limit.failures

    def retry_after(self, client: str) -> int:
        """``wait_s`` as whole seconds for a ``Retry-After`` header (0: no wait)."""
        wait = self.wait_s(client)
        return max(1, math.ceil(wait)) if wait > 0 else 0

    def failed(self, client: str) -> None:
        with self._lock:
            key = _bucket(client)
            self._buckets[key] = (self._tokens(key) - 1, self._clock())
            self._buckets.move_to_end(key)
            while len(self._buckets) > self.limit.clients:
                self._buckets.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._buckets)

    def _tokens(self, key: str) -> float:
        tokens, at = self._buckets.get(key, (float(self.limit.failures), self._clock()))
        refill = (self._clock() - at) * self.limit.failures / self.limit.period_s
        return min(float(self.limit.failures), tokens + refill)


def _bucket(client: str) -> str:
    address = _address(client)
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return client
