"""Retention for the operator (issue 41): a tenant retaining to its cap is named by
``prefixcache diagnose`` (and one below it is not), the dashboard's data and page show
each tenant's retained bytes against its cap, and the real server (the stand-in model)
shows a tenant that asked ``prompt_cache_retention: "24h"`` on /metrics and the page's data."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine_support import LiveServer
from prefixcache import CacheConfig, CacheContext, PrefixCache
from prefixcache.config import KVLayout, RetentionConfig, TierConfig
from prefixcache.engine import Engine
from prefixcache.ops.collector import CacheCollector
from prefixcache.ops.dashboard import dashboard_data
from prefixcache.ops.diagnose import diagnose
from prefixcache.ops.metrics import RequestRecord, ServingMetrics
from prefixcache.ops.scrape import Scrape, Window
from prefixcache.server.app import create_app
from prefixcache.settings import AuthSettings, ServerSettings, Settings
from standin import STANDIN_ID, standin
from support import run_cli, wait_for
from test_ops_dashboard_page import PAGE, chromium, run_chromium
from tier_worker import BLOCK, SEED, frame_bytes, kv_for, layout

FRAMES = 16


def ctx(tenant: str) -> CacheContext:
    return CacheContext(tenant=tenant, model="m")


def prompt(i: int, blocks: int = 3) -> list[int]:
    return [1000 * (i + 1) + j for j in range(blocks * BLOCK)]


def retaining(spans: int) -> PrefixCache:
    """A memory tier of 16 frames; acme may keep half (8 frames), and retains ``spans``
    prompts of 3 blocks (the fourth block of the third one is past its cap)."""
    config = CacheConfig(
        block_size=BLOCK,
        seed=SEED,
        kv_layout=layout(),
        writer="inline",
        tiers=(TierConfig(kind="memory", capacity_bytes=FRAMES * frame_bytes()),),
        retention=RetentionConfig(share=0.25, tenants={"acme": 0.5}),
    )
    cache = PrefixCache(config)
    for i in range(spans):
        tokens = prompt(i)
        cache.insert(tokens, ctx("acme"), kv=kv_for(tokens))
        cache.retain(tokens, ctx("acme"), 600.0)
    small = prompt(9, 1)
    cache.insert(small, ctx("globex"), kv=kv_for(small))
    cache.retain(small, ctx("globex"), 600.0)  # one frame of its two: below its cap
    return cache


def metrics_text(cache: PrefixCache) -> str:
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    return generate_latest(registry).decode()


# ============================================================================ diagnose


def test_diagnose_names_a_tenant_at_its_cap_and_not_one_below(tmp_path: Path) -> None:
    cache = retaining(3)
    findings = diagnose(Window(Scrape.parse(metrics_text(cache))))
    assert [f.problem for f in findings] == ["tenant 'acme' is at its retention cap"]
    at_cap = findings[0]
    assert at_cap.severity == "info"  # the cap costs acme only: nothing to fix in a hurry
    assert "L1 tier memory: " in at_cap.evidence and "cut its retention 1 times" in at_cap.evidence
    assert "retain_share" in at_cap.action
    path = tmp_path / "metrics.prom"
    path.write_text(metrics_text(cache))
    code, out, _ = run_cli(["diagnose", str(path)])
    assert code == 0, out  # info: diagnose still says nothing needs action
    assert "INFO: tenant 'acme' is at its retention cap" in out and "globex" not in out


def test_diagnose_says_nothing_of_retention_below_the_caps() -> None:
    findings = diagnose(Window(Scrape.parse(metrics_text(retaining(1)))))
    assert not [f for f in findings if "retention" in f.problem]


def test_two_scrapes_count_the_cap_hits_between_them() -> None:
    cache = retaining(3)
    before = Scrape.parse(metrics_text(cache))
    hits_before = next(t.cap_hits for t in cache.stats().retention if t.tenant == "acme")
    for i in range(3, 5):
        tokens = prompt(i)
        cache.insert(tokens, ctx("acme"), kv=kv_for(tokens))
        cache.retain(tokens, ctx("acme"), 600.0)
    findings = diagnose(Window(Scrape.parse(metrics_text(cache)), before, 10.0))
    evidence = next(f.evidence for f in findings if "acme" in f.problem)
    hits = next(t.cap_hits for t in cache.stats().retention if t.tenant == "acme") - hits_before
    assert hits >= 2  # each new span ended older blocks of acme's own
    assert f"cut its retention {hits} times" in evidence and "in the last 10 s" in evidence


# ============================================================================ the dashboard


def serving_for(*tenants: str) -> ServingMetrics:
    serving = ServingMetrics(CollectorRegistry(), top_tenants=1)
    for tenant in tenants:
        serving.record_request(RequestRecord(tenant, "m", "chat", 100, 0))
    return serving


def test_the_dashboard_data_has_each_tenants_retained_bytes_against_its_cap() -> None:
    cache = retaining(3)
    slot = frame_bytes()
    stats = cache.stats()
    (tier,) = stats.tiers
    assert tier.frame_bytes == slot  # the unit of the tier's own byte gauge: its 10 blocks, a slot each
    assert tier.used_bytes == tier.blocks * slot and tier.blocks == 10
    data = dashboard_data(stats, serving_for("acme", "globex"), [])
    retention = data["retention"]
    assert retention["levels"] == [
        {"name": "cache", "unit": "tokens", "binding": True},
        {"name": "memory", "unit": "bytes", "kind": "memory", "level": "L1", "binding": True},
    ]
    acme, other = retention["tenants"]  # globex is folded, as in the tenants table (top 1)
    assert acme["tenant"] == "acme" and other["tenant"] == "other"
    assert acme["held"] == [8 * BLOCK, 8 * slot] and acme["caps"][1] == 8 * slot
    assert acme["at_cap"] and (acme["cap_hits"], acme["capped_tokens"]) == (1, BLOCK)
    assert other["held"] == [BLOCK, slot] and not other["at_cap"]
    json.dumps(data, allow_nan=False)


def test_without_a_cache_the_dashboard_has_no_retention() -> None:
    data = dashboard_data(None, serving_for("acme"), [])
    assert data["retention"] == {"levels": [], "tenants": []}


@pytest.fixture
def retention_page() -> Iterator[str]:
    cache = retaining(3)
    serving = serving_for("acme", "globex")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/":
                body, kind = PAGE.read_bytes(), "text/html; charset=utf-8"
            else:
                body = json.dumps(dashboard_data(cache.stats(), serving, [])).encode()
                kind = "application/json"
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


@pytest.mark.chromium
@pytest.mark.skipif(chromium() is None, reason="chromium not found (Debian package chromium)")
def test_the_page_shows_retained_bytes_per_tenant_in_headless_chromium(retention_page: str, tmp_path: Path) -> None:
    result = run_chromium(tmp_path, "--dump-dom", retention_page)
    dom = result.stdout
    slot = frame_bytes()
    held = f"{8 * slot / 1024:.1f} KiB / {8 * slot / 1024:.1f} KiB"  # the page's own byte format
    assert "<th>cache</th><th>L1 memory</th><th>cap hits</th>" in dom, dom[-3000:]
    assert '<tr class="at-cap"><td>acme<span class="cap-tag">at cap</span></td><td>32 / ' in dom
    assert f"<td>{held}</td><td>1</td><td>0 / 4</td><td>0</td></tr>" in dom
    assert "<tr><td>other</td>" in dom
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console


# ============================================================================ the real server


def memory_frame(kv: KVLayout) -> int:
    """What a full block's frame of ``kv`` takes in a memory tier, as the cache says."""
    tier = TierConfig(kind="memory", capacity_bytes=1 << 20)
    with PrefixCache(CacheConfig(block_size=16, kv_layout=kv, tiers=(tier,))) as probe:
        return probe.stats().tiers[0].frame_bytes


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[LiveServer, PrefixCache]]:
    loaded = dataclasses.replace(standin(), context_length=256)
    tier = TierConfig(kind="memory", capacity_bytes=16 * memory_frame(loaded.kv))
    retention = RetentionConfig(share=0.25, tenants={"acme": 0.5, "globex": 0.0})
    cache = PrefixCache(CacheConfig(block_size=16, kv_layout=loaded.kv, tiers=(tier,), retention=retention))
    keys = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}
    settings = Settings(server=ServerSettings(max_queue=8), auth=AuthSettings(api_keys=keys, admin_key=ADMIN))
    engine = Engine(loaded, STANDIN_ID, cache=cache, max_queue=8, timeout_s=600.0)
    server = LiveServer(create_app(engine, settings, cache), engine).start()
    yield server, cache
    server.stop()
    engine.close()
    cache.close()


ADMIN = "admin-0123456789"


def complete(url: str, key: str, tokens: list[int]) -> httpx.Response:
    body: dict[str, Any] = {"model": STANDIN_ID, "prompt": tokens, "max_tokens": 1, "prompt_cache_retention": "24h"}
    response = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    assert response.status_code == 200, response.text
    return response


@pytest.mark.model
def test_a_tenant_that_retains_to_its_cap_shows_on_the_servers_metrics_and_page(
    live: tuple[LiveServer, PrefixCache],
) -> None:
    server, cache = live
    for i in range(3):  # 3 prompts of 4 blocks: 12 frames against acme's cap of 8
        complete(server.url, "sk-acme-0123456789", [100 + 64 * i + j for j in range(64)])
    refused = complete(server.url, "sk-globex-0123456789", list(range(5000, 5032)))
    assert refused.headers["x-prefixcache-retention"] == "refused"
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def scrape() -> Scrape:
        return Scrape.parse(httpx.get(server.url + "/metrics", headers=admin).text)

    # the prompts' stores (and their retention) run after the answers: wait for the cap
    wait_for(lambda: scrape().series("prefixcache_retention_cap_hits_total", tenant="acme") != {})
    wait_for(lambda: sum(scrape().series("prefixcache_retention_cap_hits_total", tenant="acme").values()) > 0)
    s = scrape()
    (memory,) = cache.stats().tiers
    frame = memory.frame_bytes  # as the tier's byte gauge counts a full block's frame
    tier = {"tenant": "acme", "tier": "memory", "kind": "memory", "level": "L1"}
    assert s.series("prefixcache_retained_bytes", **tier) == s.series("prefixcache_retention_cap_bytes", **tier)
    assert sum(s.series("prefixcache_retained_bytes", **tier).values()) == 8 * frame
    # NOTE: the server refuses a zero share before the cache sees it (server/retention.py),
    # so the cache's refusal counter, and /metrics, do not count it: only the header says it
    assert not sum(s.series("prefixcache_retained_tokens", tenant="globex").values())
    data = httpx.get(server.url + "/dashboard/data", headers=admin).json()
    acme = next(row for row in data["retention"]["tenants"] if row["tenant"] == "acme")
    assert acme["at_cap"] and acme["held"][1] == 8 * frame
    findings = diagnose(Window(s))
    assert "tenant 'acme' is at its retention cap" in [f.problem for f in findings]


def test_the_grafana_dashboard_shows_retained_bytes_per_tenant_and_tier() -> None:
    grafana = json.loads((Path(__file__).resolve().parent.parent / "ops" / "dashboard.json").read_text())
    panel = next(p for p in grafana["panels"] if p["title"].lower().startswith("retained bytes per tenant"))
    exprs = [t["expr"] for t in panel["targets"]]
    assert "sum by (tenant, tier) (prefixcache_retained_bytes)" in exprs
    assert "sum by (tenant, tier) (prefixcache_retention_cap_bytes)" in exprs
