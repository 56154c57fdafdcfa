"""The codec quality gate: the start check passes a codec measured and passed for the
served model and refuses one failed, never measured, measured for another model, or
read from a corrupt or old file, unless the operator overrides it (logged); raw needs
no gate. On the real model, raw frames serve the reference's answer, int4 diverges
more than int8, and ``prefixcache gate-codec`` stores what a server reads."""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_support import MODELS_DIR, model
from prefixcache import cli
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.engine import LoadedModel
from prefixcache.engine import model as model_module
from prefixcache.quality import codecs as codecs_module
from prefixcache.quality import reference as reference_module
from prefixcache.quality.codec_gate import (
    CodecGateRefused,
    check_codecs,
    codec_key,
    decide_codecs,
    read_codec_figures,
)
from prefixcache.quality.codecs import BLOCK_TOKENS, CodecRun, cached_tokens, evaluate_codec, through_codec
from prefixcache.quality.evalset import EvalSet, load_eval_set
from prefixcache.quality.reference import Prepared, model_fingerprint, prepare
from prefixcache.quality.verdict import GateFigures, GateStore, NoiseFloor
from prefixcache.server.main import build_service
from prefixcache.settings import ModelSettings, ServerSettings, Settings, load_settings

EVAL = Path(__file__).parent / "data" / "blend" / "eval.json"
MODEL = "SmolLM2@0123456789abcdef"
FLOOR = NoiseFloor("bfloat16", 10, 1.0, 0.8, 0.002, 0.01)
TIERS = [("memory", "raw"), ("disk", "int8"), ("redis", "int8")]


def figures(
    codec: str, mean_kl: float, max_kl: float, top1: float = 1.0, floor: NoiseFloor | None = FLOOR
) -> GateFigures:
    return GateFigures(codec, 10, top1, 0.9, mean_kl, max_kl, 900, 0, 100, 0.1, floor)


def stored(tmp_path: Path, *entries: tuple[str, str, GateFigures]) -> Path:
    path = tmp_path / "codec-gate.json"
    store = GateStore(path)
    for model_id, codec, f in entries:
        store.put(codec_key(model_id, codec), f, {"verdict": "recorded", "eval_digest": "x"})
    return path


# -- the decision, without a model ------------------------------------------------------


def test_a_passed_codec_starts_with_one_info_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = stored(tmp_path, (MODEL, "int8", figures("int8", 0.001, 0.01)))  # max exactly at the floor's
    with caplog.at_level(logging.INFO, logger="prefixcache.quality"):
        outcome = check_codecs(MODEL, TIERS, path)
    assert outcome.start and [v.codec for v in outcome.verdicts] == ["int8"]
    (verdict,) = outcome.verdicts
    assert verdict.status == "passed" and verdict.tiers == ("disk", "redis")
    lines = [r for r in caplog.records if "codec_gate" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "codec=int8" in lines[0].getMessage()


def test_raw_tiers_need_no_gate_and_no_file(tmp_path: Path) -> None:
    outcome = check_codecs(MODEL, [("memory", "raw"), ("disk", "raw")], tmp_path / "missing.json")
    assert outcome.start and outcome.verdicts == ()


def test_a_failed_codec_is_refused_with_by_how_much_and_the_command(tmp_path: Path) -> None:
    path = stored(tmp_path, (MODEL, "int4", figures("int4", 0.004, 0.03)))
    with pytest.raises(CodecGateRefused) as refused:
        check_codecs(MODEL, [("disk", "int4")], path)
    text = str(refused.value)
    assert "int4 (tiers disk): failed" in text
    assert "mean_kl/floor 0.004 (needs <= 0.002, 2x the limit)" in text
    assert "max_kl/floor 0.03 (needs <= 0.01, 3x the limit)" in text
    assert f"prefixcache gate-codec --model MODEL --codecs int4 --out {path}" in text  # MODEL: none named
    assert "allow_ungated_codecs" in text


def test_top1_below_its_bar_fails_though_kl_is_low() -> None:
    outcome = decide_codecs(MODEL, [("disk", "int8")], {"int8": figures("int8", 0.0, 0.0, top1=0.97)})
    assert not outcome.start and outcome.verdicts[0].status == "failed"
    assert "top1 0.97 (needs >= 0.98)" in outcome.verdicts[0].reason


def test_a_codec_never_measured_is_refused(tmp_path: Path) -> None:
    path = stored(tmp_path, (MODEL, "int8", figures("int8", 0.0, 0.0)))
    outcome = decide_codecs(
        MODEL, [*TIERS, ("redis", "int4")], read_codec_figures(GateStore(path), MODEL, ["int8", "int4"])[0]
    )
    assert not outcome.start
    assert [(v.codec, v.status) for v in outcome.verdicts] == [("int8", "passed"), ("int4", "absent")]
    assert "never measured" in outcome.message() and "--codecs int4 " in outcome.message()


def test_another_models_figures_do_not_count(tmp_path: Path) -> None:
    other = "SmolLM2@fedcba9876543210"  # the same name, other weights: another fingerprint
    path = stored(tmp_path, (other, "int8", figures("int8", 0.0, 0.0)))
    with pytest.raises(CodecGateRefused, match="never measured"):
        check_codecs(MODEL, TIERS, path)
    assert check_codecs(other, TIERS, path).start


def test_the_override_starts_with_a_warning_per_ungated_codec(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = stored(tmp_path, (MODEL, "int4", figures("int4", 0.5, 0.9)))
    with caplog.at_level(logging.INFO, logger="prefixcache.quality"):
        outcome = check_codecs(MODEL, [("disk", "int4"), ("redis", "int8")], path, allow_ungated=True)
    assert outcome.start and len(outcome.ungated) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("event=codec_gate_overridden" in w for w in warnings)
    assert "status=failed" in warnings[0] and "status=absent" in warnings[1]


def test_figures_without_a_floor_never_pass() -> None:
    outcome = decide_codecs(MODEL, [("disk", "int8")], {"int8": figures("int8", 0.0, 0.0, floor=None)})
    assert not outcome.start and outcome.verdicts[0].status == "failed"


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"version": 99, "figures": {}}), json.dumps({f"{MODEL}|codec=int8": {"plan": "int8"}})],
    ids=["corrupt", "unknown-version", "format-1"],
)
def test_a_corrupt_or_old_file_is_read_as_empty_and_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "codec-gate.json"
    path.write_text(content)
    with pytest.raises(CodecGateRefused) as refused:
        check_codecs(MODEL, TIERS, path)
    assert "never measured" in str(refused.value)
    if "version" in content:
        assert "read as empty" in str(refused.value)


def test_a_malformed_entry_is_read_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "codec-gate.json"
    path.write_text(json.dumps({"version": 2, "figures": {f"{MODEL}|codec=int8": {"plan": "int8", "bogus": 1}}}))
    found, note = read_codec_figures(GateStore(path), MODEL, ["int8"])
    assert found == {} and "read as empty" in note


def test_the_store_keeps_figures_floor_and_record_apart(tmp_path: Path) -> None:
    path = stored(tmp_path, (MODEL, "int8", figures("int8", 0.001, 0.002)))
    store = GateStore(path)
    assert store.get(codec_key(MODEL, "int8")) == figures("int8", 0.001, 0.002)  # the record is not a figure
    assert store.record(codec_key(MODEL, "int8")) == {"verdict": "recorded", "eval_digest": "x"}
    assert store.record(codec_key(MODEL, "int4")) is None


def test_settings_name_the_gate_file_and_the_override(tmp_path: Path) -> None:
    defaults = load_settings(None)
    assert defaults.server.codec_gate_file == ".prefixcache/codec-gate.json"
    assert defaults.server.allow_ungated_codecs is False
    config = tmp_path / "s.toml"
    config.write_text('[server]\ncodec_gate_file = "g.json"\nallow_ungated_codecs = true\n')
    settings = load_settings(str(config))
    assert settings.server.codec_gate_file == "g.json" and settings.server.allow_ungated_codecs


def test_the_cached_prefix_is_whole_blocks_of_about_90_percent() -> None:
    assert cached_tokens(344) == 304 and cached_tokens(160) == 144 and cached_tokens(17) == 0
    assert cached_tokens(32, share=0.99) == 16  # never the last token
    assert all(cached_tokens(n) % BLOCK_TOKENS == 0 and cached_tokens(n) < n for n in range(1, 600))


def test_raw_frames_give_back_the_bytes_and_int4_is_coarser_than_int8() -> None:
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, 2, 3, 32, 8)).astype(np.float32)
    tokens = list(range(32))
    assert np.array_equal(through_codec(kv, tokens, "raw", dtype="float32", key="t"), kv)
    errors = {
        c: float(np.abs(through_codec(kv, tokens, c, dtype="float32", key="t") - kv).max()) for c in ("int8", "int4")
    }
    assert 0.0 < errors["int8"] < errors["int4"]


# -- the real model ---------------------------------------------------------------------

# the first items of the set, and a chat with a shifted system prompt
MODEL_ITEMS = ("reorder-01", "system-04")


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    torch.set_num_threads(2)
    return model()


@pytest.fixture(scope="module")
def model_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The evaluation set of ``MODEL_ITEMS`` alone, as a file ``gate-codec --eval-set`` reads."""
    doc = json.loads(EVAL.read_text())
    doc["items"] = [item for item in doc["items"] if item["id"] in MODEL_ITEMS]
    assert [item["id"] for item in doc["items"]] == list(MODEL_ITEMS)
    path = tmp_path_factory.mktemp("eval") / "eval.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def prepared(lm: LoadedModel, model_set: Path) -> Prepared:
    return prepare(lm, load_eval_set(model_set))


@pytest.fixture(scope="module")
def evaluated(lm: LoadedModel, prepared: Prepared) -> Callable[[str], tuple[GateFigures, list[CodecRun]]]:
    """``evaluate_codec`` on the prepared set, each codec measured once for the module (the
    measurement is deterministic: the same weights, items and codec give the same figures)."""
    return functools.cache(lambda codec: evaluate_codec(lm, prepared, codec))


@pytest.mark.model
def test_raw_frames_serve_the_reference_answer(
    prepared: Prepared, evaluated: Callable[[str], tuple[GateFigures, list[CodecRun]]]
) -> None:
    figures, runs = evaluated("raw")
    assert all(run.kv_rel_error == 0.0 for run in runs)  # the frame path hands back the bytes
    assert figures.top1 == 1.0 and figures.greedy_em == 1.0
    # NOTE: not exactly 0: the engine prefills the suffix over a loaded prefix, which rounds
    # unlike one forward over the whole prompt; far below the bfloat16 floor either way.
    assert 0.0 <= figures.max_kl < 1e-9 < prepared.floor.mean_kl
    assert all(run.cached == cached_tokens(len(item.tokens)) for run, item in zip(runs, prepared.items, strict=True))


@pytest.mark.model
def test_int4_diverges_more_than_int8(
    prepared: Prepared, evaluated: Callable[[str], tuple[GateFigures, list[CodecRun]]]
) -> None:
    int8, runs8 = evaluated("int8")
    int4, runs4 = evaluated("int4")
    assert int8.floor == int4.floor == prepared.floor
    assert 0.0 < int8.mean_kl < int4.mean_kl and int8.max_kl < int4.max_kl
    assert all(a.kv_rel_error < b.kv_rel_error for a, b in zip(runs8, runs4, strict=True))
    assert not math.isnan(int4.mean_kl)


@pytest.mark.model
def test_the_command_stores_what_the_server_reads(
    lm: LoadedModel,
    model_set: Path,
    prepared: Prepared,
    evaluated: Callable[[str], tuple[GateFigures, list[CodecRun]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command, in this process: it loads the model and prepares the set it is given,
    and gets what this module measured already (the same model, set and codecs)."""
    loads: list[Path] = []

    def load_model(models_dir: Path, device: str) -> LoadedModel:
        loads.append(models_dir)
        return lm

    def prepare_set(loaded: LoadedModel, eval_set: EvalSet) -> Prepared:
        assert loaded is lm and [item.id for item in eval_set.items] == list(MODEL_ITEMS)  # --limit 2 of the set
        return prepared

    def evaluate(loaded: LoadedModel, measured: Prepared, codec: str) -> tuple[GateFigures, list[CodecRun]]:
        assert loaded is lm and measured is prepared
        return evaluated(codec)

    monkeypatch.setattr(model_module, "load_model", load_model)
    monkeypatch.setattr(reference_module, "prepare", prepare_set)
    monkeypatch.setattr(codecs_module, "evaluate_codec", evaluate)
    out = tmp_path / "gate.json"
    command = ["gate-codec", "--codecs", "raw,int8", "--limit", "2", "--threads", "2", "--out", str(out)]
    code = cli.main([*command, "--models-dir", str(MODELS_DIR), "--eval-set", str(model_set)])
    stdout = capsys.readouterr().out
    assert code in (0, 1) and loads == [MODELS_DIR]
    assert "noise floor: full prefill in bfloat16" in stdout
    model_id = model_fingerprint(lm)
    store = GateStore(out)
    for codec in ("raw", "int8"):
        got = store.get(codec_key(model_id, codec))
        assert got is not None and got.items == 2 and got.floor is not None
        record = store.record(codec_key(model_id, codec))
        assert record is not None and record["verdict"] in ("pass", "fail") and record["steps"] == 32
    outcome = decide_codecs(model_id, [("disk", "int8")], read_codec_figures(store, model_id, ["int8"])[0])
    assert outcome.verdicts[0].status in ("passed", "failed")  # measured: never absent
    assert (code == 0) == outcome.start


@pytest.mark.model
def test_the_server_starts_only_past_the_gate_or_overridden(
    lm: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = tmp_path / "codec-gate.json"
    tier = TierConfig(kind="memory", capacity_bytes=64 << 20, codec="int8")

    def settings(allow: bool = False) -> Settings:
        return Settings(
            server=ServerSettings(codec_gate_file=str(gate), allow_ungated_codecs=allow),
            model=ModelSettings(models_dir=str(MODELS_DIR), device="cpu"),
            cache=CacheConfig(block_size=16, partial_blocks=True, tiers=(tier,)),
        )

    with pytest.raises(CodecGateRefused, match=r"int8 \(tiers memory\): never measured") as refused:
        build_service(settings())
    assert "gate-codec --model smollm2-135m-instruct --codecs int8 " in str(refused.value)
    with caplog.at_level(logging.WARNING, logger="prefixcache.quality"):
        build_service(settings(allow=True)).close()
    assert any("event=codec_gate_overridden" in r.getMessage() for r in caplog.records)
    GateStore(gate).put(codec_key(model_fingerprint(lm), "int8"), figures("int8", 0.0, 0.0))
    service = build_service(settings())
    try:
        assert service.cache is not None and service.cache.config.tiers[0].codec == "int8"
    finally:
        service.close()
