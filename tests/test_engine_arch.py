"""Packed steps only where they are exact (``engine/arch.py``), checked at start.

Every rope type transformers ships: a short prompt packed beside the longest one the
engine serves gets the logits, the greedy tokens and the KV it gets alone, as a chunk
and as a decoding row. The two whose frequencies follow the forward's largest position
("dynamic", "longrope") are served only up to where they are static: longrope's context
is its original_max_position_embeddings, a longer prompt gets a 400, and the start log
says why. Hybrid models (recurrent layers), layer kinds and rope types the engine does
not know are refused at start with an error that names them. Tiny random models built
here (``tiny_support``), loaded as the server loads them."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, FalconConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from prefixcache.engine import ContextLengthError, Engine, Request, SamplingParams
from prefixcache.engine.arch import ROPE_BOUNDS, ArchError, serving
from prefixcache.engine.batch import Batch
from prefixcache.engine.kv import cut_cache
from prefixcache.engine.model import ModelError
from prefixcache.engine.runner import Chunk, Sequence
from tiny_support import SMALL, load, save, tokens

ORIGINAL = 32  # original_max_position_embeddings where a rope type has one; the models' own context is 64
ROTARY = SMALL["head_dim"] // 2  # frequencies of a head
ROPES: dict[str, dict[str, Any]] = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 2.0, "original_max_position_embeddings": ORIGINAL},
    "longrope": {
        "short_factor": [1.0] * ROTARY,
        "long_factor": [4.0] * ROTARY,
        "original_max_position_embeddings": ORIGINAL,
    },
    "llama3": {
        "factor": 2.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "proportional": {"partial_rotary_factor": 0.5},
}
ONE = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def llama(rope_type: str) -> LlamaConfig:
    return LlamaConfig(**SMALL, rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **ROPES[rope_type]})


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(torch.allclose(got, expected, atol=2e-5, rtol=1e-4))


def test_every_rope_type_transformers_ships_is_judged() -> None:
    """A transformers that ships a new rope type fails here until the type is judged (and
    is refused meanwhile: ``test_an_unknown_rope_type_is_refused``)."""
    assert set(ROPE_BOUNDS) == set(ROPE_INIT_FUNCTIONS) | {"default"} == set(ROPES)


@pytest.mark.parametrize("rope_type", sorted(ROPES))
def test_a_short_prompt_beside_the_longest_gets_its_answer_alone(rope_type: str, tmp_path: Path) -> None:
    loaded = load(save(tmp_path / rope_type, llama(rope_type)))
    context = loaded.context_length
    assert context == (ORIGINAL if rope_type == "longrope" else SMALL["max_position_embeddings"])
    short, longest = tokens(8, seed=1), tokens(context, seed=2)
    alone = Sequence(loaded)
    expected = alone.prefill(short, keep=len(short))

    batch, packed = Batch(loaded), Sequence(loaded)
    _, (got, _) = batch.step({}, [Chunk(packed, short, len(short)), Chunk(Sequence(loaded), longest, 1)])
    assert close(got, expected), (got - expected).abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert torch.allclose(cut_cache(packed.cache, len(short)), cut_cache(alone.cache, len(short)), atol=1e-6)

    # the same prompt decoding, as a row of the step that carries the longest prompt
    row = batch.join(packed.cache, len(short))
    token = int(expected[-1].argmax())
    rows, _ = batch.step({row: token}, [Chunk(Sequence(loaded), longest, 1)])
    assert close(rows[row], alone.step(token))
    with pytest.raises(ValueError, match="past the"):
        batch.check(Chunk(Sequence(loaded), [*longest, 1], 1))


def test_a_prompt_past_a_static_rope_is_refused_and_the_start_log_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="prefixcache.engine.model"):
        loaded = load(save(tmp_path / "longrope", llama("longrope")))
    said = [r for r in caplog.records if "original_max_position_embeddings of 32" in r.getMessage()]
    assert said and said[0].levelno == logging.WARNING and "'longrope'" in said[0].getMessage()
    engine = Engine(loaded, "tiny")
    try:
        with pytest.raises(ContextLengthError) as refused:
            engine.submit(Request(tokens(ORIGINAL, seed=3), "acme", ONE), lambda event: None)
        assert refused.value.status == 400 and f"{ORIGINAL} tokens" in refused.value.message
        assert "'longrope' RoPE" in refused.value.message  # the 400 names the property, not only the number
        assert "original_max_position_embeddings" in refused.value.message
        engine.check_length(ORIGINAL - 1, 1)  # the longest prompt it serves
    finally:
        engine.close()


def test_dynamic_ntk_is_served_up_to_max_position_embeddings_and_says_so() -> None:
    arch = serving(llama("dynamic"))
    assert arch.context_length == SMALL["max_position_embeddings"]
    assert "'dynamic' RoPE is static only up to its max_position_embeddings of 64" in arch.describe()


HYBRIDS: dict[str, tuple[dict[str, Any], str]] = {
    "lfm2": ({"full_attn_idxs": [1]}, "conv"),
    "qwen3_next": ({"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
    "falcon_h1": ({}, "hybrid"),
    "granitemoehybrid": ({"layer_types": ["mamba", "attention"]}, "linear_attention"),
    "jamba": ({"attn_layer_period": 2, "attn_layer_offset": 1}, "linear_attention"),
    "bamba": ({"attn_layer_indices": [1]}, "linear_attention"),
}


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_hybrid_model_is_refused_naming_its_layer_kinds(model_type: str) -> None:
    extra, kind = HYBRIDS[model_type]
    config = AutoConfig.for_model(model_type, num_hidden_layers=2, **extra)
    with pytest.raises(ArchError, match=f"hybrid model .*{kind}"):
        serving(config)


def test_a_hybrid_model_is_refused_at_start_before_its_weights(tmp_path: Path) -> None:
    config = AutoConfig.for_model("lfm2", **{**SMALL, "full_attn_idxs": [1]})
    folder = save(tmp_path / "lfm2", config)
    with pytest.raises(ModelError, match=r"hybrid model \(layers: conv x 1, full_attention x 1\).*serve-vllm"):
        load(folder)


def test_a_layer_kind_the_engine_does_not_know_is_refused() -> None:
    config = LlamaConfig(**SMALL)
    config.layer_types = ["full_attention", "mystery_attention"]
    with pytest.raises(ArchError, match="mystery_attention"):
        serving(config)
    chunked = AutoConfig.for_model("llama4_text", num_hidden_layers=4)
    with pytest.raises(ArchError, match="chunked_attention"):
        serving(chunked)


def test_an_unknown_rope_type_is_refused() -> None:
    config = LlamaConfig(**SMALL)
    config.rope_parameters = {"rope_type": "mystery", "rope_theta": 10000.0}
    with pytest.raises(ArchError, match="rope_type 'mystery'"):
        serving(config)


def test_alibi_is_refused() -> None:
    with pytest.raises(ArchError, match="ALiBi"):
        serving(FalconConfig(alibi=True, num_hidden_layers=2))


def test_a_plain_model_is_served_whole() -> None:
    arch = serving(llama("default"))
    assert arch.windows == (None, None) and arch.bound is None
    assert arch.context_length == SMALL["max_position_embeddings"]


def test_a_model_transformers_runs_on_eager_attention_is_refused_at_load(tmp_path: Path) -> None:
    """Gemma 2's logit soft-capping makes transformers pick eager attention, which the
    packed steps cannot run: a ``ModelError`` at load that names it, not a ``ValueError``
    when the engine is built."""
    from transformers import Gemma2Config

    gemma2 = Gemma2Config(**(SMALL | {"sliding_window": 8}))
    with pytest.raises(ModelError, match="'eager' attention"):
        load(save(tmp_path / "gemma2", gemma2))


def test_the_quality_gates_refuse_a_hybrid_model_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The codec and blend gates measure our engine: a model it refuses, they refuse, naming
    why and where such a model is served (issue 40)."""
    from prefixcache.blend import gate_cli
    from prefixcache.cli import main

    config = AutoConfig.for_model("lfm2", **{**SMALL, "full_attn_idxs": [1]})
    folder = save(tmp_path / "lfm2", config)
    for run in (
        lambda: main(["gate-codec", "--model", str(folder), "--out", str(tmp_path / "gate.json")]),
        lambda: gate_cli.main(["--model", str(folder), "--store", str(tmp_path / "blend.json")]),
    ):
        with pytest.raises(SystemExit) as exited:
            run()
        assert exited.value.code == 2
        assert re.search(r"hybrid model .*serve-vllm", capsys.readouterr().err)
