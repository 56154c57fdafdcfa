"""dashboard.py (the JSON of the server's / page) and the page itself in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from prefixcache import CacheConfig, CacheContext, PrefixCache
from prefixcache.ops.dashboard import dashboard_data
from prefixcache.ops.metrics import RequestRecord, ServingMetrics
from support import StatsSource, tier_stats

PAGE = Path(__file__).resolve().parent.parent / "src" / "prefixcache" / "server" / "static" / "index.html"
ARTIFACTS = Path(__file__).resolve().parent.parent / "build" / "test-artifacts"


def traffic() -> tuple[PrefixCache, ServingMetrics, list[dict[str, Any]]]:
    """Three tenants send a shared-prefix prompt twice through a real cache."""
    cache = PrefixCache(CacheConfig(block_size=16, capacity_tokens=100_000, partial_blocks=False))
    serving = ServingMetrics(CollectorRegistry(), top_tenants=2)
    serving.set_prefill_seconds_per_token(0.001)
    recent: list[dict[str, Any]] = []
    for tenant in ("acme", "globex", "acme", "initech", "globex", "acme"):
        ctx = CacheContext(tenant=tenant, model="smollm2")
        prompt = list(range(1000, 1200))
        with cache.match(prompt, ctx) as m:
            cached = m.cached_tokens
        tiers = {"L0": cached} if cached else {}
        serving.record_request(RequestRecord(tenant, "smollm2", "chat", 200, cached, tiers, 0, 0.1, 1))
        cache.insert(prompt, ctx)
        segments = [["L0", cached], ["computed", 200 - cached]] if cached else [["computed", 200]]
        recent.append({"tenant": tenant, "model": "smollm2", "prompt_tokens": 200, "segments": segments})
    # a blended request (the blend mode keeps reordered chunks, never counted as hits)
    recent.append(
        {"tenant": "acme", "model": "smollm2", "prompt_tokens": 200, "segments": [["blended", 150], ["computed", 50]]}
    )
    return cache, serving, recent


def test_dashboard_data_adds_up() -> None:
    cache, serving, recent = traffic()
    data = dashboard_data(cache.stats(), serving, recent, limit=4, clock=lambda: 1234.5)
    assert data["version"] == 1 and data["time"] == 1234.5
    totals = data["totals"]
    # each tenant misses once (200 tokens), then hits its 12 full blocks (192 tokens)
    assert (totals["lookups"], totals["prompt_tokens"], totals["hit_tokens"]) == (6, 1200, 3 * 192)
    assert totals["hit_rate"] == pytest.approx(576 / 1200)
    assert totals["saved_share"] == pytest.approx(576 / 1200)
    assert totals["prefill_seconds_saved"] == pytest.approx(0.576)
    assert data["tier_tokens"] == {"L0": 576}
    # top 2 tenants keep their label (acme and globex came first); initech is folded
    assert [(r["tenant"], r["prompt_tokens"]) for r in data["tenants"]] == [
        ("acme", 600),
        ("globex", 400),
        ("other", 200),
    ]
    assert data["cache"]["used_tokens"] == cache.stats().used_tokens
    assert set(data["cache"]["evictions"]) == {"capacity", "stale", "purge", "ttl", "replaced", "lost"}
    assert data["tiers"] == []
    assert [r["tenant"] for r in data["recent"]] == ["initech", "globex", "acme", "acme"]
    assert data["recent"][-1]["segments"] == [["blended", 150], ["computed", 50]]
    json.dumps(data, allow_nan=False)  # the page gets strict JSON


def test_dashboard_data_reports_tiers_by_level() -> None:
    _, serving, _ = traffic()
    tier = tier_stats("ram", "memory", capacity_bytes=100, used_bytes=40, errors={"io": 2, "checksum": 1})
    stats = StatsSource(tiers=(tier, replace(tier, name="disk", kind="disk", level="L2"))).stats()
    data = dashboard_data(stats, serving, [])
    assert [(t["level"], t["name"], t["errors"], t["used_bytes"]) for t in data["tiers"]] == [
        ("L1", "ram", 3, 40),
        ("L2", "disk", 3, 40),
    ]


@pytest.mark.parametrize("segments", [[["L3", 200]], [["L0", 100], ["computed", 99]], [["L0", -1], ["computed", 201]]])
def test_a_bad_recent_request_is_refused(segments: list[list[Any]]) -> None:
    _, serving, _ = traffic()
    with pytest.raises(ValueError):
        dashboard_data(None, serving, [{"tenant": "a", "model": "m", "prompt_tokens": 200, "segments": segments}])


# ============================================================================ the page in Chromium


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture
def page_server() -> Iterator[str]:
    """The page at / and dashboard_data at /dashboard/data, the way the server will serve them."""
    cache, serving, recent = traffic()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/":
                body, kind = PAGE.read_bytes(), "text/html; charset=utf-8"
            elif self.path == "/dashboard/data":
                body = json.dumps(dashboard_data(cache.stats(), serving, recent)).encode()
                kind = "application/json"
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


HEADLESS = (  # a quiet, throwaway headless Chromium (tests/browser.py starts it with these too)
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    browser = chromium()
    assert browser is not None
    flags = [
        *HEADLESS,
        "--enable-logging=stderr",
        "--v=0",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
    ]
    return subprocess.run([browser, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.chromium
@pytest.mark.skipif(chromium() is None, reason="chromium not found (Debian package chromium)")
def test_the_page_shows_live_numbers_in_headless_chromium(page_server: str, tmp_path: Path) -> None:
    result = run_chromium(tmp_path, "--dump-dom", page_server)
    dom = result.stdout
    assert 'id="hit-rate">48.0%<' in dom, dom[-3000:]  # 576 of 1200 tokens
    assert "live · updated" in dom
    assert "<td>acme</td><td>3</td><td>600</td><td>384</td><td>64.0%</td>" in dom
    assert dom.count('class="request"') == 7
    assert dom.count('class="segment L0"') == 3 and dom.count('class="segment computed"') == 7
    assert dom.count('class="segment blended"') == 1 and "0 + 150 blended / 200" in dom
    assert "blended (cached chunks)" in dom  # the legend
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    run_chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,1100", "--hide-scrollbars", page_server)
    assert shot.stat().st_size > 10_000
