"""Dashboard sessions (server/sessions.py): random tokens, expiry, a bound, logout; the
client's address and TLS through trusted proxies only; failed logins throttled per client."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from starlette.testclient import TestClient

from prefixcache.api.sessions import LoginLimit, LoginThrottle, Sessions, TrustedProxies
from prefixcache.api.transport import uvicorn_config
from prefixcache.engine import Engine
from prefixcache.server.app import create_app
from prefixcache.settings import AuthSettings, ServerSettings, Settings


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


# ------------------------------------------------------------------ proxies and TLS

PROXIES = TrustedProxies(["10.0.0.1", "10.1.0.0/16", "fd00::/64"])


@pytest.mark.parametrize(
    ("peer", "forwarded_for", "client"),
    [
        ("203.0.113.9", None, "203.0.113.9"),  # no proxy
        ("203.0.113.9", "198.51.100.7", "203.0.113.9"),  # an untrusted peer's header is its own word
        ("10.0.0.1", "198.51.100.7", "198.51.100.7"),  # a trusted proxy names the client
        ("10.0.0.1", "1.1.1.1, 198.51.100.7", "198.51.100.7"),  # what the client wrote, left of it, is not believed
        ("10.0.0.1", "198.51.100.7, 10.1.2.3", "198.51.100.7"),  # through two trusted proxies
        ("10.0.0.1", "10.1.2.3", "10.1.2.3"),  # only proxies: the farthest one
        ("10.0.0.1", "", "10.0.0.1"),
        ("10.0.0.1", "garbage, 198.51.100.7:4711", "198.51.100.7"),  # a port is no part of the address
        ("10.0.0.1", "198.51.100.7, garbage", "10.0.0.1"),  # a proxy passed on garbage: it stands
        ("::ffff:10.0.0.1", "[2001:db8::5]:443", "2001:db8::5"),  # v4-mapped peer, bracketed v6 client
        ("fd00::1", "2001:db8::5", "2001:db8::5"),
        (None, "198.51.100.7", ""),  # a unix socket
    ],
)
def test_the_client_is_the_peer_or_what_trusted_proxies_say(
    peer: str | None, forwarded_for: str | None, client: str
) -> None:
    assert PROXIES.client(peer, forwarded_for) == client


@pytest.mark.parametrize(
    ("scheme", "peer", "proto", "secure"),
    [
        ("https", "203.0.113.9", None, True),  # TLS to this server
        ("http", "203.0.113.9", None, False),
        ("http", "203.0.113.9", "https", False),  # an untrusted peer's word
        ("http", "10.0.0.1", "https", True),  # a trusted proxy terminated TLS
        ("http", "10.0.0.1", "HTTPS ", True),
        ("http", "10.0.0.1", "http", False),
        ("http", "10.0.0.1", "https, http", False),  # the trusted hop's own word is the last one
        ("http", None, "https", False),
    ],
)
def test_tls_is_this_servers_or_a_trusted_proxys_word(
    scheme: str, peer: str | None, proto: str | None, secure: bool
) -> None:
    assert PROXIES.secure(scheme, peer, proto) is secure


def test_no_trusted_proxy_by_default() -> None:
    proxies = TrustedProxies([])
    assert proxies.client("127.0.0.1", "198.51.100.7") == "127.0.0.1"
    assert not proxies.secure("http", "127.0.0.1", "https")


# ------------------------------------------------------------------ failed logins


def test_failed_logins_are_throttled_per_client_and_refill() -> None:
    clock = Clock()
    throttle = LoginThrottle(LoginLimit(failures=3, period_s=60.0), clock=clock)
    for _ in range(3):
        assert throttle.retry_after("198.51.100.7") == 0
        throttle.failed("198.51.100.7")
    assert throttle.retry_after("198.51.100.7") == 20  # one failure back every 20 s
    assert throttle.retry_after("198.51.100.8") == 0  # another client is not affected
    clock.now = 19.5
    assert throttle.retry_after("198.51.100.7") == 1
    clock.now = 20.0
    assert throttle.retry_after("198.51.100.7") == 0
    throttle.failed("198.51.100.7")
    assert throttle.retry_after("198.51.100.7") == 20
    clock.now = 200.0  # full again: forgotten
    assert throttle.retry_after("198.51.100.7") == 0 and len(throttle) == 0


def test_an_ipv6_client_is_throttled_by_its_64() -> None:
    throttle = LoginThrottle(LoginLimit(failures=2), clock=Clock())
    throttle.failed("2001:db8:0:1::1")
    throttle.failed("2001:db8:0:1::ffff")  # another address of the same /64
    assert throttle.retry_after("2001:db8:0:1::42") > 0
    assert throttle.retry_after("2001:db8:0:2::1") == 0


def test_the_throttles_memory_is_bounded() -> None:
    clock = Clock()
    throttle = LoginThrottle(LoginLimit(failures=1, clients=100), clock=clock)
    for i in range(10_000):
        throttle.failed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(throttle) == 100
    assert throttle.retry_after("10.0.39.15") > 0  # the latest are remembered
    assert throttle.retry_after("10.0.0.0") == 0  # the oldest forgotten


@pytest.mark.parametrize(("failures", "period", "clients"), [(0, 60.0, 1), (1, 0.0, 1), (1, 60.0, 0)])
def test_bad_login_limits_are_refused(failures: int, period: float, clients: int) -> None:
    with pytest.raises(ValueError, match="login limit"):
        LoginLimit(failures, period, clients)


# ------------------------------------------------------------------ the routes

ADMIN = "adm-0123456789"


def app_for(**server: object) -> Any:
    """The real app; its login routes touch no engine, so none is loaded."""
    settings = Settings(
        server=ServerSettings(**server),  # type: ignore[arg-type]
        auth=AuthSettings(api_keys={"sk-acme-0123456789": "acme"}, admin_key=ADMIN),
    )
    return create_app(cast(Engine, SimpleNamespace(model_id="m")), settings)


def login(http: TestClient, key: str = ADMIN, **headers: str) -> Any:
    return http.post("/dashboard/login", json={"key": key}, headers=headers)


def test_the_cookie_is_secure_over_tls_or_a_trusted_tls_proxy() -> None:
    app = app_for(trusted_proxies=("10.0.0.1",))
    with TestClient(app, base_url="https://testserver", client=("203.0.113.9", 5000)) as http:
        assert "Secure" in login(http).headers["set-cookie"]
        assert "Secure" in http.post("/dashboard/logout").headers["set-cookie"]
    with TestClient(app, base_url="http://testserver", client=("203.0.113.9", 5000)) as http:
        cookie = login(http, **{"X-Forwarded-Proto": "https"}).headers["set-cookie"]
        assert "Secure" not in cookie and "HttpOnly" in cookie  # an untrusted peer's word
    with TestClient(app, base_url="http://testserver", client=("10.0.0.1", 5000)) as http:
        assert "Secure" in login(http, **{"X-Forwarded-Proto": "https"}).headers["set-cookie"]
        assert "Secure" not in login(http).headers["set-cookie"]  # the proxy took plain HTTP


def test_failed_logins_get_429_then_the_right_key_waits_too_other_clients_do_not() -> None:
    app = app_for(trusted_proxies=("10.0.0.1",))
    with TestClient(app, client=("203.0.113.9", 5000)) as attacker:
        statuses = [login(attacker, f"adm-guess-{i:04d}").status_code for i in range(LoginLimit().failures)]
        assert statuses == [401] * LoginLimit().failures
        refused = login(attacker, "adm-guess-last")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert login(attacker).status_code == 429  # the key is not even checked: no oracle
    with TestClient(app, client=("198.51.100.7", 5000)) as operator:
        assert login(operator).status_code == 204
    with TestClient(app, client=("10.0.0.1", 5000)) as proxy:  # behind the proxy: by the forwarded address
        assert login(proxy, **{"X-Forwarded-For": "203.0.113.9"}).status_code == 429
        assert login(proxy, **{"X-Forwarded-For": "198.51.100.8"}).status_code == 204
    with TestClient(app, client=("198.51.100.9", 5000)) as spoofer:  # not a proxy: its header is ignored
        assert login(spoofer, **{"X-Forwarded-For": "203.0.113.9"}).status_code == 204


def test_a_tenant_key_counts_as_a_failed_login_a_malformed_body_does_not() -> None:
    with TestClient(app_for(), client=("203.0.113.9", 5000)) as http:
        for _ in range(LoginLimit().failures + 5):
            assert http.post("/dashboard/login", json={"key": ""}).status_code == 400
        assert login(http).status_code == 204
        for _ in range(LoginLimit().failures):
            assert login(http, "sk-acme-0123456789").status_code == 403
        assert login(http).status_code == 429


def test_serve_leaves_forwarding_headers_to_the_app() -> None:
    config = uvicorn_config(app_for(), Settings())
    assert config.proxy_headers is False
