"""Which backend a request goes to: the prefill it would leave, plus the work queued there.

The cost of sending a request of ``P`` whole prompt blocks to backend ``b``::

    cost(b) = P - credit(b) + load_weight * load(b)

    credit(b) = sum over the blocks of the longest prefix b holds of credit[tier]
    load(b)   = sum over b's requests in flight of the prompt blocks each had to
                prefill when it was sent (until its first token comes back)
                + decode_weight for each of them still generating

Everything is in blocks of prefill. ``credit[tier]`` is the share of a block's prefill
that a hit in that tier saves: 1 for device memory, less for a tier the block must first
be loaded from (host RAM, disk, Redis, object storage), since loading costs time too.
A block in a *shared* tier (Redis or S3, reachable by every backend) counts for every
backend. The
prefix must be contiguous from the first block: a block held after a gap saves nothing.

Blocks the router sent a backend moments ago and whose events have not arrived yet
count as ``expected`` (``index.py``), credited like host memory.

The lowest cost wins; ties go to the smaller load, then to the earlier backend in the
order given (so that equal backends share work round-robin when the caller rotates
that order). A request with an *affinity* (the router's hash of its tenant and the
client's ``prompt_cache_key``) goes, when costs tie or no backend holds any of its
prompt yet, to the backend that ranks highest for that affinity (rendezvous hashing:
every request of one tenant's key to the same backend, keys spread evenly, and a
backend that goes moves only its own keys); the KV held always comes first.
``round_robin``, ``least_loaded`` and ``prefix`` (the longest overlap,
load only breaking ties) are the baselines the simulator compares ``cost`` with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

__all__ = ["DEFAULT_CREDIT", "BackendView", "Routing", "Score", "Scorer", "affinity_of", "rendezvous"]

DEFAULT_CREDIT: Mapping[str, float] = MappingProxyType(
    {"device": 1.0, "memory": 0.9, "expected": 0.9, "disk": 0.7, "redis": 0.6, "s3": 0.4}
)


class Routing(StrEnum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX = "prefix"
    COST = "cost"


@dataclass(frozen=True, slots=True)
class BackendView:
    """What the router knows of one backend for one request."""

    name: str
    matched: tuple[str, ...]  # the best tier holding each block of the longest prefix it holds, root-most first
    load: float  # blocks of prefill queued and decode_weight per generating request (see the module doc)


@dataclass(frozen=True, slots=True)
class Score:
    backend: str
    cost: float
    overlap: int  # blocks of the prompt the backend holds
    credit: float
    load: float


@dataclass(frozen=True, slots=True)
class Scorer:
    """The documented cost, with its weights (``[route]`` in the configuration)."""

    credit: Mapping[str, float] = field(default_factory=lambda: DEFAULT_CREDIT)
    load_weight: float = (
        0.25  # chosen on the routing simulator (docs/routing-sim.md): a miss costs the fleet more than a wait
    )
    decode_weight: float = 1.0

    def __post_init__(self) -> None:
        for tier, value in self.credit.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"credit[{tier!r}] must lie in [0, 1], got {value!r}")
        for name in ("load_weight", "decode_weight"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"{name} must be at least 0, got {value!r}")

    def load(self, pending_prefill_blocks: float, generating: int) -> float:
        """A backend's load from its requests in flight (see the module doc)."""
        return pending_prefill_blocks + self.decode_weight * generating

    def score(self, prompt_blocks: int, view: BackendView) -> Score:
        credit = sum(self.credit.get(tier, 0.0) for tier in view.matched)
        cost = prompt_blocks - credit + self.load_weight * view.load
        return Score(view.name, cost, len(view.matched), credit, view.load)

    def choose(
        self,
        routing: Routing,
        prompt_blocks: int,
        views: Sequence[BackendView],
        turn: int = 0,
        affinity: bytes | None = None,
    ) -> Score:
        """The backend ``routing`` picks among ``views`` (in the caller's order); ``turn``
        is the request's number, which round-robin rotates by; ``affinity`` breaks ties
        of the KV-aware routings (see the module doc)."""
        if not views:
            raise ValueError("no backend to route to")
        scores = [self.score(prompt_blocks, v) for v in views]
        if routing is Routing.ROUND_ROBIN:
            return scores[turn % len(scores)]
        if routing is Routing.LEAST_LOADED:
            return min(scores, key=lambda s: s.load)
        prefix = routing is Routing.PREFIX

        def rank(s: Score) -> tuple[float, float]:
            return (-s.overlap, s.load) if prefix else (s.cost, s.load)

        best = min(scores, key=rank)
        if affinity is None:
            return best
        if all(s.overlap == 0 for s in scores):
            return max(scores, key=lambda s: rendezvous(affinity, s.backend))
        ties = [s for s in scores if rank(s)[0] == rank(best)[0]]
        return max(ties, key=lambda s: rendezvous(affinity, s.backend)) if len(ties) > 1 else best


MAX_CACHE_KEY = 1024  # characters of a ``prompt_cache_key`` the router reads (longer: no affinity)


def affinity_of(tenant: str, key: object) -> bytes | None:
    """The affinity of a request: a hash of its tenant (from authentication) and the
    client's ``prompt_cache_key``, so that one tenant's key never shares a backend choice
    with another tenant's same key by construction; None without a usable key (not a
    string, empty, or longer than ``MAX_CACHE_KEY``). A routing hint only: the cache's
    scope is the tenant's, whatever the key."""
    if not isinstance(key, str) or not key or len(key) > MAX_CACHE_KEY:
        return None
    name = tenant.encode("utf-8", "surrogatepass")  # length-prefixed: no two (tenant, key) pairs meet
    text = name + key.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(len(name).to_bytes(4, "little") + text, digest_size=16, person=b"pc-affinity").digest()


def rendezvous(affinity: bytes, backend: str) -> bytes:
    """The weight of ``backend`` for ``affinity`` (highest random weight hashing)."""
    return hashlib.blake2b(affinity + backend.encode(), digest_size=8).digest()
