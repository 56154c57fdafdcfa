"""prefixcache diagnose: saved scrapes of each situation (tests/data/scrapes/, made by
tests/scrape_scenarios.py from real registries) and a live, token-protected /metrics."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from prefixcache import CacheConfig, CacheContext, PrefixCache
from prefixcache.cli import main
from prefixcache.ops.collector import CacheCollector
from prefixcache.ops.diagnose import diagnose, run_diagnose, summary
from prefixcache.ops.metrics import ServingMetrics
from prefixcache.ops.scrape import Scrape, Window
from scrape_scenarios import OUT, SCENARIOS, write

# scenario -> (exit status, the problems it must name; nothing else may be reported)
EXPECTED = {
    "healthy": (0, []),
    "l0_pressure": (1, ["HBM (L0) pressure: L0 tier hbm"]),
    "l1_pressure": (1, ["host RAM (L1) pressure: L1 tier ram"]),
    "low_hit_rate": (1, ["low hit rate (0% of tokens) with no capacity pressure"]),
    "invalidation_storm": (1, ["invalidation storm: 72.0 epoch bumps a minute"]),
    "l2_dead": (1, ["dead tier: L2 tier shared (redis) fails every call"]),
    "l2_slow": (1, ["slow tier: L2 tier shared (redis)"]),
    "crowding": (1, ["tenant 'batchco' crowds the others out"]),
    "writes_lost": (1, ["writes lost: L2 tier disk (disk) does not take what is written to it"]),
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["diagnose", *argv])
    return code, capsys.readouterr().out


def test_every_scenario_has_an_expectation() -> None:
    assert set(EXPECTED) == set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_two_saved_scrapes_name_the_problem_and_the_next_action(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, str(OUT / f"{name}.1.prom"), str(OUT / f"{name}.2.prom"), "--interval", "10")
    status, problems = EXPECTED[name]
    assert code == status, out
    reported = [line for line in out.splitlines() if line.startswith(("CRITICAL:", "WARNING:"))]
    assert len(reported) == len(problems), out
    for problem, line in zip(problems, reported, strict=True):
        assert problem in line
    assert out.count("  next: ") == len(problems)
    if not problems:
        assert "OK: nothing needs action." in out


def test_the_saved_scrapes_are_what_the_generator_writes(tmp_path: Path) -> None:
    for path in write(tmp_path):
        assert path.read_text() == (OUT / path.name).read_text(), (
            f"regenerate: python tests/scrape_scenarios.py ({path.name})"
        )


def test_one_scrape_judges_the_counters_since_start(capsys: pytest.CaptureFixture[str]) -> None:
    """Without an interval there are no rates, but a tier that failed a quarter of its
    calls since start is still named, and a healthy server still passes."""
    code, out = run(capsys, str(OUT / "l2_dead.2.prom"))
    assert code == 1 and "window: since start" in out
    assert "failing tier: L2 tier shared (redis) fails 23.8% of its operations" in out
    assert run(capsys, str(OUT / "healthy.2.prom"))[0] == 0


def test_unreadable_input_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run(capsys, str(tmp_path / "missing.prom"))[0] == 2
    (tmp_path / "bad.prom").write_text("this is { not prometheus\n")
    assert run(capsys, str(tmp_path / "bad.prom"))[0] == 2
    two = str(OUT / "healthy.1.prom"), str(OUT / "healthy.2.prom")
    code, out = run(capsys, *two)
    assert code == 2 and "--interval" in out


def test_a_counter_reset_between_scrapes_counts_from_zero() -> None:
    before = Scrape.parse("prefixcache_epoch_bumps_total 50\n")
    after = Scrape.parse("prefixcache_epoch_bumps_total 3\n")  # the server restarted
    assert Window(after, before, 10).delta("prefixcache_epoch_bumps_total") == 3


# ============================================================================ a live /metrics


@pytest.fixture
def live() -> Iterator[tuple[str, PrefixCache, ServingMetrics]]:
    """A /metrics endpoint behind a bearer token, over a real cache and metrics."""
    cache = PrefixCache(CacheConfig(block_size=16, capacity_tokens=100_000))
    registry = CollectorRegistry()
    serving = ServingMetrics(registry)
    registry.register(CacheCollector(cache))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != "Bearer admin-key":
                self.send_response(401)
                self.end_headers()
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", cache, serving
    server.shutdown()
    server.server_close()


def test_a_live_url_is_scraped_twice_and_judged_on_rates(
    live: tuple[str, PrefixCache, ServingMetrics], capsys: pytest.CaptureFixture[str]
) -> None:
    url, cache, _ = live
    ctx = CacheContext(tenant="acme", model="m")
    prompt = list(range(2000))
    cache.insert(prompt, ctx)

    def storm(seconds: float) -> None:
        """Between the two scrapes: three epoch bumps, each followed by a cold request."""
        assert seconds == 30
        for _ in range(3):
            cache.bump_epoch("m")
            cache.match(prompt, ctx).release()
            cache.insert(prompt, ctx)

    args = argparse.Namespace(source=url, later=None, interval=30.0, token="admin-key")
    assert run_diagnose(args, sleep=storm) == 1
    assert "CRITICAL: invalidation storm: 6.0 epoch bumps a minute" in capsys.readouterr().out


def test_a_live_url_needs_the_token(
    live: tuple[str, PrefixCache, ServingMetrics], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, _ = live
    code, out = run(capsys, url, "--interval", "0")
    assert code == 2 and "401" in out
    code, out = run(capsys, url, "--interval", "0", "--token", "admin-key")
    assert code == 0 and "OK: nothing needs action." in out


def test_thresholds_follow_the_alert_rules() -> None:
    """The same 7,000 evictions/s the L0 alert fires on; at 4,000/s neither says anything."""
    text = 'prefixcache_tier_{}{{tier="hbm",kind="memory",level="L0"}} {}\n'
    gauges = text.format("capacity_bytes", 100) + text.format("used_bytes", 99)

    evicted = 'prefixcache_tier_evictions_total{{tier="hbm",kind="memory",level="L0",reason="{}"}} {}\n'

    def window(evictions: float) -> Window:
        before = Scrape.parse(gauges + evicted.format("capacity", 0) + evicted.format("stale", 0))
        after = gauges + evicted.format("capacity", evictions) + evicted.format("stale", 10**6)  # stale: no pressure
        return Window(Scrape.parse(after), before, 10)

    assert [f.problem for f in diagnose(window(70_000))] == [
        "HBM (L0) pressure: L0 tier hbm (memory) is full and evicting"
    ]
    assert diagnose(window(40_000)) == []


def test_prefill_saved_is_not_measured_until_the_engine_timed_a_prefill() -> None:
    """As the dashboard says "not measured", never "0.0 %" for a rate nobody measured."""
    counters = (
        'prefixcache_prefill_seconds_total{{tenant="a"}} {}\nprefixcache_prefill_seconds_saved_total{{tenant="a"}} {}\n'
    )
    before = Scrape.parse(counters.format(0, 0))

    def lines(per_token: float, spent: float, saved: float) -> list[str]:
        after = counters.format(spent, saved) + f"prefixcache_prefill_seconds_per_token {per_token}\n"
        return [line for line in summary(Window(Scrape.parse(after), before, 10)) if "prefill" in line]

    assert lines(0.0, 4.0, 0.0) == ["prefill time saved: not measured (the engine has not timed a prefill yet)"]
    assert lines(0.0002, 4.0, 1.0) == ["prefill time saved 20.0% (1.0 s saved, 4.0 s spent)"]


def test_vllm_miss_reasons_and_an_unsupported_model_are_named() -> None:
    """Issue 40: a hybrid that hits less than its chain says why, on vLLM's /metrics and in
    `diagnose`; a model whose layer kinds the connector does not store is a warning."""
    text = (
        'prefixcache_vllm_miss_reasons_total{engine="0",reason="window_not_kept"} 7\n'
        'prefixcache_vllm_miss_reasons_total{engine="0",reason="state_not_kept"} 0\n'
        'prefixcache_vllm_bypassed_requests_total{engine="0",reason="unsupported_layers:MLAAttentionSpec"} 3\n'
    )
    found = diagnose(Window(Scrape.parse(text)))
    problems = [(f.severity, f.problem) for f in found]
    assert problems[0] == (
        "warning",
        "the connector does not store this model's layers (MLAAttentionSpec): no request hits",
    )
    assert ("info", "a hybrid's sliding-window blocks were not kept at the boundary a shared prefix ends") in problems
    assert not any("state" in p for _, p in problems)
    assert any("boundary_every_tokens" in f.action for f in found)
