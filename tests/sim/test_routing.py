"""Routing in the simulator (``prefixcache replay --backends N --routing ...``): the
fleet replay's behaviour, checked on generated workloads whose answer is known in kind
(not numbers fitted to a trace), its building blocks, and its command line."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from prefixcache.config import CacheConfig
from prefixcache.fleet.scoring import Routing
from prefixcache.sim.costmodel import CostModel, get_gpu, get_model
from prefixcache.sim.fleet import replay_fleet
from prefixcache.sim.fleet_results import FleetSpec, RoutingResult
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig, cache_capacity
from prefixcache.sim.routing import BackendQueue, EventIndex
from prefixcache.sim.traces import read_trace
from prefixcache.sim.workload_spec import WorkloadSpec
from prefixcache.sim.workloads import repeated_prefix, write_jsonl
from support import CONVERSATION, SYNTHETIC, run_cli

slow = pytest.mark.slow
COST = CostModel(get_model("llama-3-8b"), get_gpu("h100"))


def workload(tmp: Path, seed: int = 0, emit: str = "hash_ids", requests: int = 1500) -> Path:
    path = tmp / f"work-{seed}-{emit}-{requests}.jsonl"
    if not path.exists():
        write_jsonl(WorkloadSpec(requests=requests, tenants=4, seed=seed, duration_s=600.0, emit=emit), path)
    return path


def config(capacity: float, isolation: str = "shared", policy: str = "lru") -> ReplayConfig:
    return ReplayConfig(CacheConfig(policy=policy, capacity_tokens=cache_capacity(capacity), isolation=isolation))


def fleet(path: Path, cfg: ReplayConfig, spec: FleetSpec, **kw: Any) -> dict[str, RoutingResult]:
    results = replay_fleet(lambda: read_trace(path), [cfg], spec, COST, **kw)
    return {r.label: r for r in results}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("routing")


# ---------------------------------------------------------------------------- behaviour


@pytest.mark.parametrize(
    ("emit", "capacity", "isolation", "policy"),
    [
        ("hash_ids", 1e5, "shared", "lru"),
        ("tokens", 5e4, "namespace", "s3fifo"),
        ("hash_ids", float("inf"), "partitioned", "lru"),
    ],
)
def test_one_backend_is_the_plain_replay(tmp: Path, emit: str, capacity: float, isolation: str, policy: str) -> None:
    path = workload(tmp, emit=emit, requests=600)
    cfg = config(capacity, isolation, policy)
    (plain,) = replay(lambda: read_trace(path), [cfg], optimal=False, cost=COST, warmup=0.25)
    results = fleet(path, cfg, FleetSpec(1), warmup=0.25)
    assert len(results) == 6  # 4 routings, and the oracles of prefix and cost; no pooled row for one backend
    for r in results.values():
        assert (r.requests, r.lookup_tokens, r.hit_tokens) == (plain.requests, plain.lookup_tokens, plain.hit_tokens)
        assert r.backends[0].evictions == plain.evictions
        assert r.prefill_flops_saved == pytest.approx(plain.prefill_flops_saved)
        assert r.compute_avoided == pytest.approx(plain.prefill_compute_avoided)
        assert r.load_imbalance in (1.0, None)


def test_round_robin_loses_returning_conversations(tmp: Path) -> None:
    """Chat sessions come back turn after turn: the routers that follow the cache send a
    session back where its history is; round-robin scatters it."""
    results = fleet(workload(tmp), config(2e5), FleetSpec(4, oracle=False))
    rr = results["round_robin"].token_hit_rate
    assert rr < results["prefix (events, lag 4)"].token_hit_rate
    assert rr < results["cost (events, lag 4)"].token_hit_rate
    assert results["round_robin"].compute_avoided < results["cost (events, lag 4)"].compute_avoided  # type: ignore[operator]


@pytest.mark.parametrize("seed", [1, 2])
def test_oracle_beats_a_late_view(tmp: Path, seed: int) -> None:
    """Exact knowledge of the caches routes better than events many requests late, and
    the oracle's view is never wrong about the backend it picks."""
    spec = FleetSpec(4, (Routing.COST,), event_lag=32)
    results = fleet(workload(tmp, seed), config(1e5), spec)
    oracle, late = results["cost (oracle)"], results["cost (events, lag 32)"]
    assert oracle.token_hit_rate >= late.token_hit_rate
    assert oracle.stale_routes == 0
    assert late.stale_routes is not None and late.stale_routes > 0


def test_least_loaded_balances_a_hot_prefix(tmp: Path) -> None:
    """Every request shares one long prefix: prefix routing piles them all on the backend
    that holds it; least-loaded spreads them."""
    path = tmp / "hot.jsonl"
    _write(path, repeated_prefix(2048, 512, 400))
    results = fleet(path, config(float("inf")), FleetSpec(4, (Routing.LEAST_LOADED, Routing.PREFIX)))
    least, prefix = results["least_loaded"].load_imbalance, results["prefix (oracle)"].load_imbalance
    assert least is not None and prefix is not None
    assert least < 1.2 < prefix
    assert prefix == pytest.approx(4.0, rel=0.05)  # one backend of four served (nearly) all


def test_backends_add_up_to_the_fleet(tmp: Path) -> None:
    path = workload(tmp, requests=600)
    requests = list(read_trace(path))
    args = ["replay", str(path), "--backends", "3", "--capacity-tokens", "1e5", "--routing", "least_loaded,prefix"]
    code, out, err = run_cli([*args, "--json"])
    assert code == 0, err
    rows = json.loads(out)["fleet"]
    assert [r["label"] for r in rows][-1] == "pooled"
    for row in rows:
        per = row["per_backend"]
        assert sum(b["hit_tokens"] for b in per) == row["hit_tokens"]
        assert sum(b["requests"] for b in per) == row["requests"] == len(requests)
        assert sum(b["lookup_tokens"] for b in per) == sum(r.input_length for r in requests)
        assert row["load_imbalance_definition"].startswith("max / mean")


def test_pooled_is_the_plain_replay_of_n_times_the_capacity(tmp: Path) -> None:
    path = workload(tmp)
    (plain,) = replay(lambda: read_trace(path), [config(3e5)], optimal=False, cost=COST)
    pooled = fleet(path, config(1e5), FleetSpec(3, (Routing.ROUND_ROBIN,)))["pooled"]
    assert pooled.hit_tokens == plain.hit_tokens and pooled.config.capacity_tokens == 3e5


# ---------------------------------------------------------------------------- parts


def test_queue_prefills_one_at_a_time_and_decodes_side_by_side() -> None:
    q = BackendQueue()
    assert q.submit(0.0, 1.0, 5.0, blocks=10) == 1.0
    assert q.submit(0.0, 1.0, 5.0, blocks=4) == 2.0  # waits for the first prefill
    q.advance(0.5)
    assert (q.pending_blocks, q.generating) == (14, 0)
    q.advance(1.5)
    assert (q.pending_blocks, q.generating) == (4, 1)
    q.advance(2.0)
    assert (q.pending_blocks, q.generating) == (0, 2)
    q.advance(7.0)
    assert q.generating == 0
    assert q.submit(8.0, 0.0, 1.0, blocks=0) == 0.0  # a full hit on an idle backend
    assert q.generating == 1


def test_events_reach_the_router_lag_requests_late() -> None:
    index = EventIndex(2, lag=2)
    index.publish(1, [(True, ("a", "b"))])
    for expected in (0, 0, 2):  # seen from the third request after it
        index.next_request()
        assert index.overlap(1, ["a", "b", "c"]) == expected
    assert index.overlap(0, ["a"]) == 0
    index.publish(1, [(False, ("b",))])
    index.next_request(), index.next_request(), index.next_request()
    assert index.overlap(1, ["a", "b"]) == 1
    with pytest.raises(ValueError, match="lag"):
        EventIndex(1, -1)


def test_fleet_spec_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="backends"):
        FleetSpec(0)
    with pytest.raises(ValueError, match="valid: round_robin"):
        FleetSpec(2, ("nearest",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="event_lag"):
        FleetSpec(2, event_lag=-1)


# ---------------------------------------------------------------------------- command line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routing", "prefix"], "--routing needs --backends N"),
        (["--event-lag", "2"], "--event-lag needs --backends N"),
        (["--backends", "0"], "need at least 1 backend"),
        (["--backends", "two"], "not an integer"),
        (["--backends", "2", "--routing", "prefix,nearest"], "valid: cost, least_loaded, prefix, round_robin"),
        (["--backends", "2", "--event-lag", "-1"], "--event-lag must be >= 0"),
        (["--backends", "2", "--ttl", "5"], "does not combine with --ttl"),
        (["--backends", "2", "--mode", "flat"], "does not combine with --mode flat"),
        (["--backends", "2", "--model", "none"], "--model none"),
        (["--backends", "2", "--engine", "native", "--routing", "cost"], "--engine native cannot replay cost"),
    ],
)
def test_bad_flags_say_what_is_wrong(tmp: Path, args: list[str], message: str) -> None:
    code, out, err = run_cli(["replay", str(workload(tmp, requests=50)), *args])
    assert code == 2 and message in err and not out


def test_table_and_html(tmp: Path) -> None:
    html = tmp / "fleet.html"
    args = ["replay", str(workload(tmp)), "--backends", "2", "--routing", "round_robin,cost", "--html", str(html)]
    code, out, err = run_cli([*args, "--event-lag", "1", "--capacity-tokens", "1e5"])
    assert code == 0, err
    for text in ("load imbalance = max/mean", "cost (events, lag 1)", "cost (oracle)", "pooled", "round_robin"):
        assert text in out
    assert "cost (oracle)" in html.read_text() and "<table>" in html.read_text()


# ---------------------------------------------------------------------------- the real traces


@slow
def test_one_backend_is_the_plain_replay_on_mooncake() -> None:
    cfg = config(1e6)
    (plain,) = replay(lambda: read_trace(SYNTHETIC), [cfg], optimal=False, cost=COST)
    for r in fleet(SYNTHETIC, cfg, FleetSpec(1)).values():
        assert r.hit_tokens == plain.hit_tokens


@slow
def test_mooncake_conversations_follow_their_cache() -> None:
    results = fleet(CONVERSATION, config(1e6), FleetSpec(4))
    assert results["round_robin"].token_hit_rate < results["cost (events, lag 4)"].token_hit_rate
    assert all(r.stale_routes == 0 for label, r in results.items() if "oracle" in label)
    assert results["pooled"].token_hit_rate >= results["round_robin"].token_hit_rate


def _write(path: Path, records: Iterable[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
