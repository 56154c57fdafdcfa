"""The model part of every key is the weights' contents (``prefixcache.weights``), not the
name they are served under: new weights in the same folder, or a fine-tune of the same
size under the same name, never hit the old weights' blocks in a disk tier that outlived
the server, nor inherit their codec or blend verdicts; the same bytes in two folders
share their KV. Tiny random llamas (transformers' init, SmolLM2's tokenizer), two
layers, so that a test serves several of them in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine_support import MODELS_DIR
from prefixcache.blend.gate import gate_key
from prefixcache.blend.serve_gate import read_gate
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.engine import LoadedModel, Request, SamplingParams, load_model
from prefixcache.engine.model import DEFAULT_MODEL, resolve_model
from prefixcache.quality.codec_gate import CodecGateRefused, codec_key
from prefixcache.quality.evalset import load_eval_set
from prefixcache.quality.reference import model_fingerprint
from prefixcache.quality.verdict import GateFigures, GateStore, NoiseFloor
from prefixcache.server.main import Service, build_service
from prefixcache.settings import BlendSettings, ModelSettings, ServerSettings, Settings

pytestmark = pytest.mark.model  # SmolLM2's tokenizer files (the converted model's folder)

EVAL = Path(__file__).parent / "data" / "blend" / "eval.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
ONE = SamplingParams(max_tokens=1, temperature=0.0)
PROMPT = [(7 * i + 3) % 4000 + 100 for i in range(80)]  # five whole blocks of 16
FLOOR = NoiseFloor("bfloat16", 10, 1.0, 1.0, 0.002, 0.02)


def tiny_llama(folder: Path, seed: int) -> Path:
    """A two-layer llama with seeded random weights at ``folder`` (rewritten if there):
    every seed gives files of the same names and sizes, different bytes."""
    real = resolve_model(DEFAULT_MODEL, MODELS_DIR)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    shutil.rmtree(folder, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        if (real / name).is_file():
            shutil.copy(real / name, folder / name)
    return folder


def settings(folder: Path, tmp: Path, tier: TierConfig | None = None, **server: object) -> Settings:
    disk = TierConfig(kind="disk", capacity_bytes=64 << 20, path=str(tmp / "disk"), write="through")
    return Settings(
        server=ServerSettings(**server),  # type: ignore[arg-type]
        model=ModelSettings(name=str(folder), models_dir=str(tmp / "models"), device="cpu"),
        cache=CacheConfig(block_size=16, tiers=(tier or disk,)),
    )


def cached(folder: Path, tmp: Path) -> int:
    """Serve ``PROMPT`` once on ``folder``'s weights, over the one disk tier at ``tmp``;
    the prompt tokens that came from the cache. The service is closed (writes flushed)."""
    service: Service = build_service(settings(folder, tmp))
    try:
        done = service.engine.generate(Request(list(PROMPT), "local", ONE)).result(timeout=120)
        return done.usage.cached_tokens
    finally:
        service.close()


def test_new_weights_in_the_same_folder_miss_the_old_blocks(tmp_path: Path) -> None:
    folder = tiny_llama(tmp_path / "deploy" / "llama", seed=1)
    assert cached(folder, tmp_path) == 0
    assert cached(folder, tmp_path) >= 64  # a restart on the same weights hits: the tier outlived the server
    size = (folder / "model.safetensors").stat().st_size
    tiny_llama(folder, seed=2)  # the deploy: new weights, same name, same sizes
    assert (folder / "model.safetensors").stat().st_size == size
    assert cached(folder, tmp_path) == 0  # never the old weights' KV


def test_same_bytes_in_two_folders_share_kv_and_other_bytes_never(tmp_path: Path) -> None:
    v1 = tiny_llama(tmp_path / "models" / "v1" / "llama", seed=3)
    v2 = tmp_path / "models" / "v2" / "llama"
    shutil.copytree(v1, v2)
    v3 = tiny_llama(tmp_path / "models" / "v3" / "llama", seed=4)  # another fleet's llama, the same size
    assert cached(v1, tmp_path) == 0
    assert cached(v3, tmp_path) == 0  # served under the same name "llama": other bytes, other keys
    assert cached(v2, tmp_path) >= 64  # the same bytes elsewhere: the same KV, shared


def load(folder: Path, tmp: Path) -> LoadedModel:
    return load_model(str(folder), tmp / "models", device="cpu")


def passed_figures(name: str) -> GateFigures:
    return GateFigures(name, 10, 1.0, 1.0, 0.001, 0.01, 900, 0, 100, 0.1, FLOOR)


def test_a_fine_tune_of_the_same_size_gets_no_codec_verdict_of_its_base(tmp_path: Path) -> None:
    base = tiny_llama(tmp_path / "base" / "llama", seed=5)
    tuned = tiny_llama(tmp_path / "tuned" / "llama", seed=6)
    gate = tmp_path / "codec-gate.json"
    GateStore(gate).put(codec_key(model_fingerprint(load(base, tmp_path)), "int8"), passed_figures("int8"))
    tier = TierConfig(kind="memory", capacity_bytes=16 << 20, codec="int8")
    build_service(settings(base, tmp_path, tier, codec_gate_file=str(gate))).close()  # passed for the base
    tuned_id = model_fingerprint(load(tuned, tmp_path))
    with pytest.raises(CodecGateRefused, match=r"int8 \(tiers memory\): never measured") as refused:
        build_service(settings(tuned, tmp_path, tier, codec_gate_file=str(gate)))
    assert f"for model {tuned_id} " in str(refused.value)  # the refusal names the fine-tune's fingerprint


def test_a_fine_tune_of_the_same_size_gets_no_blend_verdict_of_its_base(tmp_path: Path) -> None:
    base = load(tiny_llama(tmp_path / "base" / "llama", seed=7), tmp_path)
    tuned = load(tiny_llama(tmp_path / "tuned" / "llama", seed=8), tmp_path)
    blend = BlendSettings(tenants=("local",), plan="epic", k=4, gate_file=str(tmp_path / "g.json"), eval_set=str(EVAL))
    config = blend.config()
    key = gate_key(model_fingerprint(base), load_eval_set(EVAL).digest, config.gate_steps, config.plan)
    GateStore(config.gate_file).put(key, passed_figures("epic(k=4)"))
    assert read_gate(config, base, "llama").passed
    tuned_gate = read_gate(config, tuned, "llama")
    assert tuned_gate.report is None and not tuned_gate.passed
    assert model_fingerprint(tuned) in tuned_gate.reason
