"""A fast stand-in for the real model: SmolLM2's own tokenizer and chat template on a
small llama with seeded random weights, saved once as a transformers folder that
``load_model`` takes like any model folder. Its prefill is real attention over real
tokens, only smaller, so the server around it (schemas, errors, cache, timing) is the
real one; its answers are noise, so tests that check what the model says use SmolLM2."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

from engine_support import MODELS_DIR, models_lock
from prefixcache.engine import LoadedModel, load_model
from prefixcache.engine.model import DEFAULT_MODEL, resolve_model

STANDIN_ID = "standin-llama"
_SHAPE = {  # prefill cost grows with the prompt as in the real model, a few times cheaper per token
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def standin_folder() -> Path:
    """The stand-in's folder under the git-ignored models dir, built on first use."""
    with models_lock():
        return _build()


def _build() -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    real = resolve_model(DEFAULT_MODEL, MODELS_DIR)
    folder = MODELS_DIR / STANDIN_ID
    marker = folder / "standin.json"
    if marker.is_file() and json.loads(marker.read_text()) == _SHAPE:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    base = json.loads((real / "config.json").read_text())
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters", "rms_norm_eps")
    config = LlamaConfig(**{k: base[k] for k in keep if k in base}, **_SHAPE, tie_word_embeddings=True)
    config.max_position_embeddings = 2048
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    for name in _TOKENIZER_FILES:
        if (real / name).is_file():
            shutil.copy(real / name, folder / name)
    marker.write_text(json.dumps(_SHAPE))  # last: a folder without it is rebuilt
    return folder


@functools.cache
def standin() -> LoadedModel:
    """The stand-in, loaded on CPU once per test process."""
    return load_model(str(standin_folder()), device="cpu")
