"""The blend quality gate: the evaluation file validates; the decision rule (top-1 and a
KL no larger than the model's bfloat16 noise floor) holds exactly at its boundary, is
monotonic, and never passes figures without a floor; the store round-trips the floor and
ignores the format from before it; on the real model the floor is measured, a plan that
recomputes everything passes while a plan that recomputes nothing fails, and
``choose_plan`` picks the cheapest passing plan."""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from engine_support import model
from prefixcache.blend import CacheBlend, Epic, EpicBlend, Reused
from prefixcache.blend.gate import BlendSet, choose_plan, evaluate, plan_name, prepare, run_gate, set_key
from prefixcache.blend.gate_cli import DEFAULT_PLANS, parse_plan
from prefixcache.blend.metrics import BLEND_METRICS, BlendMetrics
from prefixcache.engine import LoadedModel
from prefixcache.quality.evalset import KINDS, EvalSetError, Piece, assemble, load_eval_set, parse_eval_set
from prefixcache.quality.verdict import (
    GateFigures,
    GateReport,
    GateStore,
    GateThresholds,
    NoiseFloor,
    cheapest_passing,
    judge,
)

EVAL = Path(__file__).parent / "data" / "blend" / "eval.json"
# query-01: reordering without recompute changes its answer; system-04: a shifted system prompt.
MODEL_ITEMS = ("query-01", "system-04")


FLOOR = NoiseFloor("bfloat16", 10, 1.0, 0.9, 0.002, 0.01)


def figures(
    plan: str = "p",
    top1: float = 1.0,
    em: float = 1.0,
    mean_kl: float = 0.0,
    work: float = 0.5,
    max_kl: float | None = None,
    floor: NoiseFloor | None = FLOOR,
) -> GateFigures:
    max_kl = mean_kl if max_kl is None else max_kl
    return GateFigures(plan, 10, top1, em, mean_kl, max_kl, 100, 10, 5, work, floor)


# -- the evaluation file ----------------------------------------------------------------


def test_eval_file_validates_and_assembles() -> None:
    eval_set = load_eval_set(EVAL)
    assert 20 <= len(eval_set.items) <= 40
    assert {item.kind for item in eval_set.items} == set(KINDS)
    encode = lambda text: tuple(ord(c) for c in text)  # noqa: E731 - one token per character
    frame = lambda system: (f"<sys>{system}</sys><user>", "</user><bot>")  # noqa: E731 - a toy chat template
    lines = {name: [encode(line) for line in text] for name, text in eval_set.chunks.items()}
    for item in eval_set.items:
        pieces = assemble(item, lines, encode, frame)
        assert any(p.chunk is not None for p in pieces)
        if item.system is not None:  # a chat: the template's two texts frame the user's message
            before, after = frame(item.system)
            assert pieces[0] == Piece(encode(before)) and pieces[-1] == Piece(encode(after))
        for p in pieces:
            if p.chunk is not None:  # a reused piece is the chunk's own tokens at its own offset
                whole = [t for line in lines[p.chunk] for t in line]
                assert tuple(whole[p.start : p.start + len(p.tokens)]) == p.tokens
    rag = eval_set.of_kind("reordered_rag").items
    assert len(rag) >= 16 and all(item.system is not None for item in rag)


def test_a_chat_item_needs_the_model_chat_template() -> None:
    item = load_eval_set(EVAL).items[0]
    assert item.system is not None
    with pytest.raises(EvalSetError, match=r"reorder-01 is a chat: assembling it needs the model's chat template"):
        assemble(item, {}, lambda text: ())


def mutate(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *head, last = path.split("/")
    node: Any = doc
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is ...:
        del node[int(last) if isinstance(node, list) else last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("version", 2, r"version must be 1"),
        ("items", [], r"items must be a non-empty list"),
        ("items/0/kind", "poem", r"items\[0\] \(reorder-01\): kind must be one of"),
        ("items/0/cached", ["nowhere"], r"cached names \['nowhere'\] are not in chunks"),
        ("items/0/prompt/1", {"chunk": "tram"}, r"prompt\[1\]: chunk 'tram' is not in this item's cached list"),
        ("items/16/prompt/1/lines", [3, 2], r"items\[16\] \(edit-01\): prompt\[1\]: lines must be \[a, b\]"),
        ("items/0/system", "", r"items\[0\] \(reorder-01\): system must be a non-empty string"),
        ("items/0/prompt/0", {"text": "x", "chunk": "owl"}, r"needs either text or chunk"),
        ("items/0/extra", 1, r"unknown keys \['extra'\]"),
        ("chunks/owl", [], r"chunks.owl: must be a non-empty list"),
        ("items/1/id", "reorder-01", r"duplicate item ids \['reorder-01'\]"),
    ],
)
def test_schema_errors_are_clear(path: str, value: Any, message: str) -> None:
    doc = json.loads(EVAL.read_text())
    with pytest.raises(EvalSetError, match=message):
        parse_eval_set(mutate(doc, path, value))


def test_a_file_that_is_not_json_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "eval.json"
    bad.write_text("{not json")
    with pytest.raises(EvalSetError, match=r"eval\.json: not JSON"):
        load_eval_set(bad)


# -- thresholds, reports, the plan choice -------------------------------------------------


def failed(report: GateReport) -> list[str]:
    return [c.name for c in report.checks if not c.passed]


def test_the_bar_is_the_noise_floor_and_holds_exactly_at_it() -> None:
    t = GateThresholds()
    assert t == GateThresholds(0.98, 0.0, math.inf, 1.0)  # top-1 and the floor; EM and a KL ceiling unset
    at = judge("m", figures(top1=0.98, mean_kl=FLOOR.mean_kl, max_kl=FLOOR.max_kl, em=0.0), t)
    assert at.passed and [c.name for c in at.checks] == ["top1", "mean_kl/floor", "max_kl/floor"]
    report = judge("m", figures(top1=math.nextafter(0.98, 0.0)), t)
    assert failed(report) == ["top1"]
    report = judge("m", figures(mean_kl=math.nextafter(FLOOR.mean_kl, 1.0), max_kl=0.0), t)
    assert failed(report) == ["mean_kl/floor"]
    report = judge("m", figures(mean_kl=0.0, max_kl=math.nextafter(FLOOR.max_kl, 1.0)), t)
    assert failed(report) == ["max_kl/floor"]  # one item worse than bfloat16's worst fails
    assert "bfloat16 floor KL mean 0.002, max 0.01" in report.summary()


def test_figures_without_a_floor_never_pass() -> None:
    report = judge("m", figures(mean_kl=0.0, floor=None), GateThresholds())
    assert failed(report) == ["mean_kl/floor", "max_kl/floor"]
    assert all(math.isnan(c.limit) for c in report.checks if not c.passed)
    assert "no noise floor" in report.summary()
    lenient = GateThresholds(0.0, 0.0, math.inf, floor_factor=math.inf)  # the floor unchecked, by choice
    assert judge("m", figures(floor=None), lenient).passed


def test_optional_bars_an_operator_may_set() -> None:
    t = GateThresholds(min_top1=0.98, min_greedy_em=0.9, max_mean_kl=0.001, floor_factor=2.0)
    assert judge("m", figures(em=0.9, mean_kl=0.001, max_kl=0.02), t).passed  # max: 2 x the floor's 0.01
    report = judge("m", figures(em=math.nextafter(0.9, 0.0), mean_kl=math.nextafter(0.001, 1.0)), t)
    assert failed(report) == ["greedy_em", "mean_kl"]
    for bad in ({"min_top1": 1.5}, {"max_mean_kl": -1.0}, {"floor_factor": math.nan}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GateThresholds(**bad)


shares = st.floats(0.0, 1.0)
kls = st.floats(0.0, 1.0)


@given(shares, kls, kls, shares, kls, kls, kls, kls)
def test_less_divergence_than_a_passing_plan_passes(
    top1: float, mean: float, worst: float, more_top1: float, less_mean: float, less_worst: float, fm: float, fx: float
) -> None:
    floor = NoiseFloor("bfloat16", 10, 1.0, 1.0, fm, fx)
    a = figures(top1=top1, mean_kl=mean, max_kl=worst, floor=floor)
    b = figures(top1=max(top1, more_top1), mean_kl=min(mean, less_mean), max_kl=min(worst, less_worst), floor=floor)
    t = GateThresholds()
    if judge("m", a, t).passed:
        assert judge("m", b, t).passed
        noisier = replace(floor, mean_kl=fm + less_mean, max_kl=fx + less_worst)
        assert judge("m", replace(a, floor=noisier), t).passed  # a noisier model's bar is never stricter
    assert judge("m", a, t).passed == (top1 >= 0.98 and mean <= fm and worst <= fx)


def test_cheapest_passing_report() -> None:
    t = GateThresholds()
    reports = [
        judge("m", figures("a", work=0.3, top1=0.5), t),  # cheapest, fails
        judge("m", figures("b", work=0.6), t),
        judge("m", figures("c", work=0.4), t),
        judge("m", figures("d", work=0.4), t),  # a tie: the first given wins
    ]
    best = cheapest_passing(reports)
    assert best is not None and best.plan == "c"
    assert cheapest_passing(reports[:1]) is None


def test_gate_store_round_trip(tmp_path: Path) -> None:
    store = GateStore(tmp_path / "gate.json")
    assert store.get("k") is None
    store.put("k", figures("x", top1=0.75))
    store.put("j", figures("y"))
    again = GateStore(tmp_path / "gate.json").get("k")
    assert again == figures("x", top1=0.75) and again.floor == FLOOR
    doc = json.loads((tmp_path / "gate.json").read_text())
    assert doc["version"] == 2 and doc["figures"]["k"]["floor"] == asdict(FLOOR)
    with pytest.raises(ValueError, match="no noise floor"):
        store.put("z", figures("z", floor=None))


def test_an_old_store_without_the_floor_is_never_judged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gate.json"
    old = {k: v for k, v in asdict(figures("x")).items() if k != "floor"}  # format 1: figures by key
    path.write_text(json.dumps({"k": old}))
    with caplog.at_level(logging.WARNING, logger="prefixcache.quality"):
        assert GateStore(path).get("k") is None  # not passed: a server measures it again or stays off
    assert "event=gate_store_old" in caplog.text and "entries=1" in caplog.text
    GateStore(path).put("j", figures("y"))  # rewritten as format 2, the old entry dropped
    assert set(json.loads(path.read_text())["figures"]) == {"j"}
    path.write_text(json.dumps({"version": 3, "figures": {}}))
    with pytest.raises(ValueError, match="gate store version 3"):
        GateStore(path).get("k")


def test_the_cli_reads_plans_by_their_store_names() -> None:
    assert parse_plan("epic(k=16)") == Epic(16)
    assert parse_plan("cacheblend(r=30)") == CacheBlend(30.0) == parse_plan("cacheblend(r=30, layer=1)")
    assert parse_plan("epicblend(k=1,r=30,layer=2)") == EpicBlend(1, 30.0, 2)
    for text in DEFAULT_PLANS:
        assert parse_plan(plan_name(parse_plan(text))) == parse_plan(text)
    for bad in ("fast", "epic(r=3)", "cacheblend(k=1)", "epic(k=x)", "cacheblend()"):
        with pytest.raises(ValueError, match="expected one of"):
            parse_plan(bad)


def test_blend_metrics_export_their_names() -> None:
    registry = CollectorRegistry()
    metrics = BlendMetrics(registry)
    metrics.record_gate(judge("m", figures("epic(k=8)", top1=0.5), GateThresholds()))
    metrics.set_enabled("m", "epic(k=8)")
    metrics.set_enabled("m", None)
    assert registry.get_sample_value("prefixcache_blend_gate_passed", {"model": "m", "plan": "epic(k=8)"}) == 0.0
    assert registry.get_sample_value("prefixcache_blend_enabled", {"model": "m", "plan": "epic(k=8)"}) == 0.0
    labels = {"model": "m", "plan": "epic(k=8)"}
    assert registry.get_sample_value("prefixcache_blend_gate_floor_kl_max_nats", labels) == FLOOR.max_kl
    exported = {s.name for family in registry.collect() for s in family.samples}
    gauges = {name for name, kind in BLEND_METRICS.items() if kind == "gauge"}
    assert gauges <= exported


# -- on the real model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    torch.set_num_threads(2)
    return model()


@pytest.fixture(scope="module")
def prepared(lm: LoadedModel) -> BlendSet:
    return prepare(lm, load_eval_set(EVAL).subset(list(MODEL_ITEMS)))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> GateStore:
    return GateStore(tmp_path_factory.mktemp("gate") / "gate.json")


@pytest.mark.model
def test_the_noise_floor_is_measured_with_the_reference(lm: LoadedModel, prepared: BlendSet) -> None:
    floor = prepared.prepared.floor
    assert floor.dtype == "bfloat16" and floor.items == len(MODEL_ITEMS)
    assert 0.0 < floor.mean_kl <= floor.max_kl < 0.05  # bfloat16 is close to float32, and not equal
    assert floor.top1 == 1.0
    assert next(lm.model.parameters()).dtype == torch.float32  # the served model is left as it was


@pytest.mark.model
def test_recomputing_everything_passes_and_recomputing_nothing_fails(
    lm: LoadedModel, prepared: BlendSet, store: GateStore
) -> None:
    assert all(any(isinstance(s, Reused) for s in item.segments) for item in prepared.items)
    everything = run_gate(lm, prepared, CacheBlend(100.0), store=store)
    assert everything.passed, everything.summary()
    assert everything.figures.top1 == everything.figures.greedy_em == 1.0
    assert everything.figures.reused == 0 and everything.figures.recomputed > 0
    assert everything.figures.floor == prepared.prepared.floor
    assert store.get(set_key(prepared.prepared, CacheBlend(100.0))) == everything.figures

    nothing, scores = evaluate(lm, prepared, Epic(0))
    store.put(set_key(prepared.prepared, Epic(0)), nothing)
    changed = {s.id for s in scores if not s.greedy_match}
    assert "query-01" in changed  # the no-recompute plan changes this item's continuation
    report = judge(prepared.prepared.model, nothing, GateThresholds())
    assert not report.passed and nothing.recomputed == 0 and nothing.work < everything.figures.work


@pytest.mark.model
def test_choose_plan_picks_the_cheapest_passing_plan_or_none(
    lm: LoadedModel, prepared: BlendSet, store: GateStore
) -> None:
    # figures come from the store filled above when it ran first, else they are computed
    plans = [CacheBlend(100.0), Epic(0)]
    chosen, reports = choose_plan(lm, prepared, plans, store=store)
    assert chosen == CacheBlend(100.0) and [r.passed for r in reports] == [True, False]
    assert all(isinstance(r, GateReport) for r in reports)

    lenient = GateThresholds(min_top1=0.0, floor_factor=math.inf)
    chosen, _ = choose_plan(lm, prepared, plans, lenient, store=store)
    assert chosen == Epic(0)  # both pass: the one with less work

    chosen, reports = choose_plan(lm, prepared, [Epic(0)], store=store)
    assert chosen is None and not reports[0].passed
