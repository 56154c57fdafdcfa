"""The backends behind a router: who they are, whether they are up, what they are doing.

Each backend tells the router its name, incarnation, stream, block size and model
(``GET /fleet/info``) and its whole index on demand (``GET /fleet/snapshot``), both
behind the admin key when one is configured. A backend is *up* once its info is known
and while its health checks pass; one that fails ``DOWN_AFTER`` checks in a row, or
refuses a forwarded request, is down: its blocks leave the index (shared ones too),
and when it comes back it is followed again from a snapshot.

A vLLM backend (``source``) has none of that: its info is synthesized from the
router's flags (``VllmSource.info``), its health is vLLM's ``/health``, and its
events come from vLLM's own ZMQ publisher (``zmq.ZmqReader``), salted chains credited
to their tenants by the router's table of salts (``stamping.Stamper.salts``).

Load is the router's own count of what it sent (``Scorer.load``): the prompt blocks
each request had left to prefill, until its first byte comes back, and one
``decode_weight`` per request still streaming.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
import msgspec
import redis

from prefixcache.fleet.follow import Follower
from prefixcache.fleet.index import GlobalIndex
from prefixcache.fleet.streams import StreamReader
from prefixcache.fleet.wire import BackendInfo, Snapshot, WireError
from prefixcache.fleet.zmq import VllmSource, ZmqReader

__all__ = ["DOWN_AFTER", "Backend", "BackendError", "fetch_info", "fetch_snapshot"]

log = logging.getLogger("prefixcache.route")
T = TypeVar("T")

DOWN_AFTER = 2  # failed health checks in a row before a backend is taken out
CONTROL_TIMEOUT_S = 5.0  # info and snapshot requests


class BackendError(Exception):
    """A backend's control endpoint failed or answered something that is not ours."""


def _headers(admin_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {admin_key}"} if admin_key else {}


def _decode(response: httpx.Response, kind: type[T]) -> T:
    if response.status_code != 200:
        raise BackendError(f"{response.request.url} answered {response.status_code}")
    try:
        if "json" in response.headers.get("content-type", ""):
            return msgspec.json.decode(response.content, type=kind)
        return msgspec.msgpack.decode(response.content, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BackendError(f"{response.request.url}: {exc}") from None


def fetch_info(url: str, admin_key: str) -> BackendInfo:
    try:
        response = httpx.get(f"{url}/fleet/info", headers=_headers(admin_key), timeout=CONTROL_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise BackendError(f"{url}/fleet/info: {type(exc).__name__}") from None
    return _decode(response, BackendInfo)


def fetch_snapshot(url: str, admin_key: str) -> Snapshot:
    try:
        response = httpx.get(f"{url}/fleet/snapshot", headers=_headers(admin_key), timeout=CONTROL_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise WireError(f"{url}/fleet/snapshot: {type(exc).__name__}") from None
    try:
        return _decode(response, Snapshot)
    except BackendError as exc:
        raise WireError(str(exc)) from None


@dataclass(slots=True)
class Backend:
    """One backend: its address, what it said of itself, its health and its load."""

    url: str
    admin_key: str = field(repr=False, default="")
    info: BackendInfo | None = None
    up: bool = False
    failures: int = 0
    pending: float = 0.0  # prompt blocks left to prefill of requests awaiting their first byte
    generating: int = 0  # requests streaming their answer
    sent: int = 0
    follower: Follower | None = None
    reader: StreamReader | ZmqReader | None = None
    source: VllmSource | None = None  # a vLLM backend's publisher; None: a prefixcache server
    salts: Mapping[str, str] | None = field(default=None, repr=False)  # a vLLM backend's: cache_salt -> tenant

    @property
    def name(self) -> str:
        return self.info.name if self.info is not None else self.url

    @property
    def health_path(self) -> str:
        return "/healthz" if self.source is None else "/health"

    def attach(self, info: BackendInfo, index: GlobalIndex, client: redis.Redis) -> None:
        """Start following ``info``'s stream into ``index`` (once: a backend keeps its name)."""
        self.info = info
        if self.reader is None:
            self.follower = Follower(info.name, index, info.model)
            if self.source is not None:
                self.reader = ZmqReader(self.follower, self.source, salts=self.salts).start()
                return
            url, key = self.url, self.admin_key
            self.reader = StreamReader(self.follower, client, info.stream, lambda: fetch_snapshot(url, key)).start()

    def mark_down(self, index: GlobalIndex, why: str) -> None:
        if self.up:
            log.warning("event=route_backend_down backend=%s why=%s", self.name, why)
        self.up = False
        if self.follower is not None:
            self.follower.forget()
        elif self.info is not None:
            index.clear(self.info.name)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.stop()
