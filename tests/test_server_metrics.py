"""The server's side of observability, live: /metrics and /dashboard/data behind the
admin key, hit tokens on /metrics equal to the cached_tokens the clients were told,
the dashboard's token-source strips from the engine's per-tier loads, and the page at
/ in headless Chromium against the real app."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from browser import Browser
from engine_support import MODEL_ID, LiveServer, engine, layout, model, tiered_cache
from prefixcache.config import TierConfig
from prefixcache.server.app import create_app
from prefixcache.settings import AuthSettings, Settings
from test_ops_dashboard_page import ARTIFACTS, chromium

pytestmark = pytest.mark.model  # the real model: seconds to load, minutes to run

KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}
ADMIN = "adm-0123456789"
SYSTEM = {
    "acme": "You are the help desk of Acme Anvils. Anvils ship in 2 days; returns within 14 days. " * 6,
    "globex": "You answer for Globex Power. Outages are reported on the status page; bills are monthly. " * 6,
}
MEMORY_BLOCKS = 12  # L1 (memory) holds the first 12 blocks of a prompt; deeper blocks are demoted to L2 (disk)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    lm = model()
    tmp = tmp_path_factory.mktemp("cache")
    tiers = (
        TierConfig(kind="memory", capacity_bytes=MEMORY_BLOCKS * 16 * layout(lm).bytes_per_token),
        TierConfig(kind="disk", capacity_bytes=1 << 30, path=str(tmp / "disk")),
    )
    cache = tiered_cache(lm, tmp, tiers=tiers, partial_blocks=True)
    eng = engine(lm, cache)
    server = LiveServer(create_app(eng, Settings(auth=AuthSettings(api_keys=KEYS, admin_key=ADMIN)), cache)).start()
    yield server
    server.stop()
    eng.close()
    cache.close()


def key_of(tenant: str) -> str:
    return next(key for key, name in KEYS.items() if name == tenant)


def ask(live: LiveServer, tenant: str, question: str, stream: bool = False) -> int:
    """One chat request as ``tenant`` through the official client; the cached_tokens it was told."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=key_of(tenant), max_retries=0, timeout=120)
    messages: Any = [{"role": "system", "content": SYSTEM[tenant]}, {"role": "user", "content": question}]
    if not stream:
        answer = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=3, temperature=0)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        return answer.usage.prompt_tokens_details.cached_tokens or 0
    chunks = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details is not None
    return usage[0].prompt_tokens_details.cached_tokens or 0


@pytest.fixture(scope="module")
def traffic(live: LiveServer) -> dict[str, list[int]]:
    """Two tenants, each its own system prompt three or four times: cached_tokens as reported."""
    told: dict[str, list[int]] = {"acme": [], "globex": []}
    for i, (tenant, stream) in enumerate(
        [("acme", False), ("globex", False), ("acme", False), ("globex", True), ("acme", True), ("acme", False)]
    ):
        told[tenant].append(ask(live, tenant, f"Question number {i}: what should I do?", stream))
    return told


def get(live: LiveServer, path: str, key: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(live.url + path, headers=headers, timeout=30)


def by_tenant(text: str, name: str) -> dict[str, float]:
    """The sum of a counter's samples per tenant label, from a scrape's text."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                tenant = sample.labels["tenant"]
                out[tenant] = out.get(tenant, 0.0) + sample.value
    return out


def test_hit_tokens_on_metrics_equal_the_cached_tokens_told_to_each_tenant(
    live: LiveServer, traffic: dict[str, list[int]]
) -> None:
    told = {tenant: sum(counts) for tenant, counts in traffic.items()}
    assert told["acme"] > 0 and told["globex"] > 0  # each tenant hit its own system prompt
    assert all(counts[0] == 0 for counts in traffic.values())  # namespace isolation: nobody else's blocks
    text = get(live, "/metrics").text
    assert by_tenant(text, "prefixcache_hit_tokens_total") == told
    assert by_tenant(text, "prefixcache_tier_hit_tokens_total") == told  # the split by tier adds up
    saved = by_tenant(text, "prefixcache_prefill_seconds_saved_total")
    assert saved["acme"] > 0 and saved["globex"] > 0  # at the per-token prefill time the engine measured
    assert by_tenant(text, "prefixcache_lookups_total") == {t: len(c) for t, c in traffic.items()}
    if shutil.which("promtool"):  # Prometheus's own linter reads the live scrape (Debian package prometheus)
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("path", ["/metrics", "/dashboard/data"])
def test_only_the_admin_key_reads_per_tenant_figures(live: LiveServer, path: str) -> None:
    refused = get(live, path, key=key_of("acme"))  # a valid tenant key is not enough
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "admin_key_required"
    assert refused.json()["error"]["type"] == "permission_error"
    assert "globex" not in refused.text
    for key in (None, "sk-not-a-key"):
        denied = get(live, path, key=key)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert get(live, path).status_code == 200


def test_dashboard_strips_are_the_engines_per_tier_loads(live: LiveServer, traffic: dict[str, list[int]]) -> None:
    data = get(live, "/dashboard/data").json()
    recent = data["recent"]
    assert [r["tenant"] for r in recent] == ["acme", "globex", "acme", "globex", "acme", "acme"]
    for tenant, counts in traffic.items():
        strips = [r["segments"] for r in recent if r["tenant"] == tenant]
        assert [sum(n for source, n in s if source != "computed") for s in strips] == counts
    for r in recent:
        sources = [source for source, _ in r["segments"]]
        assert sources == sorted(sources, key=["L0", "L1", "L2", "computed"].index)  # prompt order: fast to slow
        assert sum(n for _, n in r["segments"]) == r["prompt_tokens"]
    # A system prompt is longer than the memory tier (L1): its deeper blocks came back from disk (L2).
    assert data["tier_tokens"]["L1"] > 0 and data["tier_tokens"]["L2"] > 0
    assert sum(data["tier_tokens"].values()) == data["totals"]["hit_tokens"] == sum(map(sum, traffic.values()))
    assert [t["level"] for t in data["tiers"]] == ["L1", "L2"]
    assert {row["tenant"] for row in data["tenants"]} == {"acme", "globex"}
    assert data["totals"]["prefill_seconds_saved"] > 0


def test_local_mode_keeps_metrics_and_dashboard_open() -> None:
    eng = engine(model())
    server = LiveServer(create_app(eng, Settings())).start()
    try:
        for path in ("/metrics", "/dashboard/data", "/"):
            assert httpx.get(server.url + path).status_code == 200, path
    finally:
        server.stop()
        eng.close()


def test_the_page_is_served_self_contained(live: LiveServer) -> None:
    page = httpx.get(live.url + "/")  # the page holds no figures: it needs no key, its data does
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp  # nothing from outside
    assert 'fetch("dashboard/data"' in page.text


def test_the_dashboard_logs_in_with_a_cookie_never_a_url(live: LiveServer) -> None:
    with httpx.Client(base_url=live.url) as browser:
        assert browser.get("/dashboard/data").status_code == 401
        for key, status in (("sk-not-a-key", 401), (key_of("acme"), 403), ("", 400), ("a\ud800b", 400)):
            body = json.dumps({"key": key})  # ASCII, escapes included: "\ud800" is valid JSON
            refused = browser.post("/dashboard/login", content=body, headers={"content-type": "application/json"})
            assert refused.status_code == status and "set-cookie" not in refused.headers, refused.text
        assert browser.post("/dashboard/login", content=f"key={ADMIN}").status_code == 400  # JSON only, no form
        login = browser.post("/dashboard/login", json={"key": ADMIN})
        assert login.status_code == 204
        cookie = login.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie, cookie
        assert ADMIN not in cookie  # a random session token, not the key
        assert "totals" in browser.get("/dashboard/data").json()
        for path in ("/metrics", "/admin/stats"):  # the cookie opens the page's data only
            assert browser.get(path).status_code == 401
        assert browser.post("/dashboard/logout").status_code == 204
        assert browser.get("/dashboard/data").status_code == 401  # the session is gone on the server too
        browser.cookies.set("prefixcache_session", "forged-0123456789")
        assert browser.get("/dashboard/data").status_code == 401


@pytest.mark.chromium
@pytest.mark.skipif(chromium() is None, reason="chromium not found (Debian package chromium)")
def test_the_real_apps_page_in_headless_chromium(
    live: LiveServer, traffic: dict[str, list[int]], tmp_path: Path
) -> None:
    with Browser(tmp_path / "profile") as browser:
        browser.open(live.url + "/")
        browser.wait_for("document.getElementById('status').textContent.includes('enter the admin key')")
        assert browser.js("document.getElementById('key-form').hidden") is False
        browser.js("document.getElementById('key-input').value = 'sk-not-a-key'")
        browser.js("document.getElementById('key-form').requestSubmit()")
        browser.wait_for("document.getElementById('status').textContent.startsWith('login refused')")
        assert browser.cookies() == []

        browser.js(f"document.getElementById('key-input').value = {ADMIN!r}")
        browser.js("document.getElementById('key-form').requestSubmit()")
        browser.wait_for("document.getElementById('status').textContent.startsWith('live')")
        browser.wait_for("document.querySelectorAll('.request').length === 6")
        dom = browser.js("document.documentElement.outerHTML")
        (session,) = browser.cookies()
        assert session["httpOnly"] and session["sameSite"] == "Strict" and session["value"] != ADMIN
        assert browser.js("document.cookie") == ""  # no script reads the session
        stored = "JSON.stringify([location.href, Object.entries(sessionStorage), Object.entries(localStorage)])"
        assert ADMIN not in browser.js(stored) and ADMIN not in dom
        assert browser.js("document.getElementById('key-form').hidden") is True
        total = sum(map(sum, traffic.values()))
        prompt = get(live, "/dashboard/data").json()["totals"]["prompt_tokens"]
        assert f'id="hit-rate-total">{100 * total / prompt:.1f}%<' in dom
        assert "<td>acme</td><td>4</td>" in dom and "<td>globex</td><td>2</td>" in dom
        assert 'class="segment L1"' in dom and 'class="segment L2"' in dom and 'class="segment computed"' in dom
        errors = [c for c in browser.console if c.get("type") == "error" or "exceptionDetails" in c]
        assert not errors, errors

        browser.open(live.url + "/")  # a reload stays logged in: the cookie, not a stored key
        browser.wait_for("document.getElementById('status').textContent.startsWith('live')")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "server-dashboard.png"
        shot.unlink(missing_ok=True)
        browser.screenshot(shot)
        assert shot.stat().st_size > 10_000


def test_strip_sources_name_tiers_by_kind_and_fold_slower_tiers_into_l2(tmp_path: Path) -> None:
    from prefixcache.server.recording import _segments, tier_levels

    tiers = (
        TierConfig(kind="device", capacity_bytes=1 << 20, name="hbm"),
        TierConfig(kind="memory", capacity_bytes=1 << 20),
        TierConfig(kind="disk", capacity_bytes=1 << 20, path=str(tmp_path / "disk")),
    )
    cache = tiered_cache(model(), tmp_path, tiers=tiers)
    levels = tier_levels(cache)
    cache.close()
    assert levels == {"hbm": "L0", "memory": "L1", "disk": "L2"}  # by what a tier is made of
    # the page colours L0..L2: a fourth tier is drawn with L2; empty sources are left out
    assert _segments({"L3": 16, "L0": 64, "L2": 32, "L1": 0}, 200, 112) == [["L0", 64], ["L2", 48], ["computed", 88]]
    assert _segments({}, 50, 0) == [["computed", 50]]
    assert _segments({"L0": 50}, 50, 50) == [["L0", 50]]
    # a blend: after the exact prefix, the chunks kept (reused) and the computed rest
    assert _segments({"L0": 32}, 200, 32, 100) == [["L0", 32], ["blended", 100], ["computed", 68]]
    assert _segments({}, 120, 0, 120) == [["blended", 120]]
