"""Dashboard sessions (server/sessions.py): random tokens, expiry, a bound, logout."""

from __future__ import annotations

import pytest

from prefixcache.server.sessions import Sessions


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_session_is_valid_until_it_expires_or_closes() -> None:
    clock = Clock()
    sessions = Sessions(ttl_s=60, clock=clock)
    first, second = sessions.open(), sessions.open()
    assert first != second and len(first) >= 40  # 256 random bits, URL-safe
    assert sessions.valid(first) and sessions.valid(second)
    assert not sessions.valid(None) and not sessions.valid("") and not sessions.valid(first[:-1])
    assert not sessions.valid("\ud800")  # a cookie of any text is an invalid session, not an error
    sessions.close(first)
    assert not sessions.valid(first) and sessions.valid(second)
    clock.now = 59.9
    assert sessions.valid(second)
    clock.now = 60.0
    assert not sessions.valid(second) and len(sessions) == 0


def test_at_most_limit_sessions_are_kept_the_oldest_go_first() -> None:
    sessions = Sessions(ttl_s=60, limit=3, clock=Clock())
    tokens = [sessions.open() for _ in range(5)]
    assert [sessions.valid(t) for t in tokens] == [False, False, True, True, True]
    assert len(sessions) == 3


def test_the_table_holds_no_token() -> None:
    sessions = Sessions(ttl_s=60)
    token = sessions.open()
    assert token.encode() not in repr(vars(sessions)).encode()


@pytest.mark.parametrize(("ttl", "limit"), [(0, 1), (-1, 1), (60, 0)])
def test_bad_settings_are_refused(ttl: float, limit: int) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        Sessions(ttl_s=ttl, limit=limit)
