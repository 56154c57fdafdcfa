"""Tiny models with random weights, built locally, for vLLM's hybrid KV cache manager.

Each builder writes a folder that vLLM for CPU serves alone: a transformers config,
transformers' own random initialisation (seeded) saved as float32 safetensors, and
SmolLM2's tokenizer (the vocabulary covers it: 49152 ids). Building takes about a
second.

- ``build_gemma3``: Gemma-3 text (``Gemma3ForCausalLM``, ``gemma3_text``), 6 layers,
  5 sliding (window 32 tokens) then 1 full. vLLM makes two KV cache groups: full
  attention and sliding window.
- ``build_hybrid``: a Granite-4.0-H-like ``granitemoehybrid`` (Mamba2 + attention, no
  MoE), 4 layers: mamba, attention, mamba, attention. vLLM makes an attention group
  and a Mamba group; with prefix caching on, ``mamba_cache_mode`` becomes "align".
  vLLM raises the block size to 64 (block_size=16 asked) or keeps 128 (default), so
  that the attention page (16 KiB at 64) holds the Mamba state (10112 bytes, padded).

SERVE THE HYBRID WITH ``max_num_batched_tokens`` <= the block size (64 with
``block_size=16`` or 64; 128 with the default) when prefix caching is on. vLLM 0.32's
Mamba2 layer asks for an in-forward "prefill checkpoint" (``num_prefill_checkpoint_blocks=1``,
vllm/model_executor/layers/mamba/mamba_mixer2.py:1098) whenever one prefill chunk
crosses two block boundaries, and the CPU SSD kernel
(vllm/model_executor/layers/mamba/ops/cpu/mamba_ssm.py:10) ignores
``return_intermediate_states``: ``varlen_states[last_chunk_indices_p]``
(mamba_mixer2.py:880) fails with "IndexError: index N is out of bounds for dimension 0
with size 1" on the first prompt longer than two blocks. Chunks of at most one block
never checkpoint in-forward; each step then ends on a block boundary and "align" mode
keeps the boundary states. Every Mamba2 model (granitemoehybrid, bamba, nemotron_h,
falcon_h1, zamba2, mamba2) shares that layer.

``initializer_range=0.2`` for the hybrid: at transformers' default 0.02 its next-token
distribution is nearly uniform (logprob ~ -10.2 = log(1/49152)) and ignores the Mamba
state, so a wrong state load went unseen; at 0.2 a lost Mamba state changes the logprobs.
Greedy tokens of the Gemma-3 model repeat one token; compare logprobs in tests.

Random weights of the usual scale, not ``load_format="dummy"`` (see ``tiny_mm.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SLIDING_WINDOW = 32
VOCAB = 49152  # SmolLM2's tokenizer


def _ids(text_model: Path) -> dict[str, Any]:
    source = json.loads((text_model / "config.json").read_text())
    return {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in source}


def _save(folder: Path, text_model: Path, config: Any, model_cls: Any, seed: int) -> Path:
    import torch
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(str(text_model)).save_pretrained(str(folder))
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(str(folder))
    return folder


def gemma3_config(text_model: Path, layers: int = 6, window: int = SLIDING_WINDOW) -> dict[str, Any]:
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": window,
        # 5 sliding : 1 full, the last layer full
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "dtype": "float32",
        **_ids(text_model),
    }


def build_gemma3(folder: Path, text_model: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny Gemma-3 text model at ``folder``; returns ``folder``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{**gemma3_config(text_model), **overrides})
    return _save(folder, text_model, config, Gemma3ForCausalLM, seed)


def hybrid_config(text_model: Path) -> dict[str, Any]:
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "shared_intermediate_size": 128,
        "num_local_experts": 0,  # dense MLP only
        "num_experts_per_tok": 0,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "mamba_n_heads": 4,
        "mamba_d_head": 32,  # n_heads * d_head == expand * hidden
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 64,
        "position_embedding_type": "rope",
        "initializer_range": 0.2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "dtype": "float32",
        **_ids(text_model),
    }


def build_hybrid(folder: Path, text_model: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny hybrid (Mamba2 + attention) model at ``folder``; returns ``folder``."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(**{**hybrid_config(text_model), **overrides})
    return _save(folder, text_model, config, GraniteMoeHybridForCausalLM, seed)


if __name__ == "__main__":
    import sys

    {"gemma3": build_gemma3, "hybrid": build_hybrid}[sys.argv[1]](Path(sys.argv[2]), Path(sys.argv[3]))
