"""Requests that wait for another's prompt: the leader chosen is the same context's, holds
enough more of the prompt than the cache, and the longest; unit tests on ``InFlight``."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from prefixcache.engine.inflight import FOLLOW_MIN_TOKENS, InFlight, common_prefix
from prefixcache.hashing import CacheContext

ACME = CacheContext(tenant="acme", model="m", tokenizer="m")
GLOBEX = CacheContext(tenant="globex", model="m", tokenizer="m")


@dataclass(eq=False)
class Fake:
    prompt: list[int]
    context: CacheContext = field(default=ACME)


@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30))
def test_common_prefix_is_the_longest_shared_start(a: list[int], b: list[int]) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


def test_a_request_follows_the_longest_lead_of_its_own_context() -> None:
    inflight = InFlight()
    system = list(range(100))
    short, long_, other = Fake(system[:50]), Fake([*system, 7, 7]), Fake([*system, 1], GLOBEX)
    for lead in (short, long_, other):
        inflight.lead(lead)
    job = Fake([*system, 9, 9])
    assert inflight.leader(job, cached=0) is long_  # shares 100, not 50; globex's is never shared
    assert inflight.leader(job, cached=100 - FOLLOW_MIN_TOKENS + 1) is None  # too little more than the cache
    assert inflight.leader(Fake(system, GLOBEX), cached=0) is other
    assert inflight.leader(Fake(system[:10]), cached=0) is None  # a short prompt: not worth waiting
    inflight.follow(long_, job)
    assert inflight.done(long_) == [job] and inflight.done(long_) == []
    assert inflight.leader(job, cached=0) is short
    assert inflight.leads == 2


def test_the_last_prompt_token_is_never_counted_as_shared() -> None:
    inflight = InFlight()
    prompt = list(range(FOLLOW_MIN_TOKENS))
    inflight.lead(Fake([*prompt, 5]))
    assert inflight.leader(Fake(prompt), cached=0) is None  # 31 usable tokens: under the margin
    assert inflight.leader(Fake([*prompt, 5, 6]), cached=0) is not None
