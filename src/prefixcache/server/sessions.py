"""Dashboard sessions: the operator types the admin key into the page once, the server
answers with a random session token in an HttpOnly, SameSite=Strict cookie, and the
page's reads of /dashboard/data carry the cookie, never the key. So the key is in no
URL, no browser history, no script-readable storage and no log line.

Tokens live in memory only (a restart logs everyone out), expire after ``ttl_s``, and at
most ``limit`` are kept (the oldest goes first). The table holds their SHA-256, so a
lookup's timing says nothing about a token's characters and a dump holds no usable one.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["COOKIE", "Sessions"]

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
