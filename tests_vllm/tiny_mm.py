"""A tiny Idefics3 model with random weights, built locally, that vLLM for CPU serves.

The folder has what vLLM's Idefics3 processor reads: a config (a tiny SigLIP-like
vision tower, a small Llama with SmolLM2's shapes and vocabulary), SmolLM2's tokenizer
with the image tokens added, an ``Idefics3ImageProcessor`` at the tiny image size
without image splitting, and transformers' own random initialisation (seeded) saved
as safetensors, so that every process serving the folder computes the same KV.

    image 112x112 -> 8x8 patches of 14 -> pixel shuffle by 2 -> 16 <image> tokens,
    placeholder: <fake_token_around_image> <global-img> <image> x 16 <fake_token_around_image>

NOTE: random weights of the usual scale, not ``load_format="dummy"``: vLLM's dummy
weights are the same in every process (each tensor drawn from seed 1234) but uniform
in [-1e-3, 1e-3], norm weights included, so each answer token followed only from the
token before it (31589, 42, 31589, 42, ...) and a black and a white image gave the
same greedy tokens. And not LLaVA: vLLM 0.32's ``llava`` module imports
transformers' Pixtral image processor, which needs torchvision, which ``.venv-vllm``
leaves out (see the Makefile).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IMAGE_SIZE = 112
PATCH = 14
SCALE = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]


def vision_config() -> dict[str, Any]:
    return {
        "model_type": "idefics3_vision",
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
        "num_channels": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }


def text_config(source: dict[str, Any], vocab_size: int, layers: int) -> dict[str, Any]:
    keep = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_parameters",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
    )
    return {
        "model_type": "llama",
        **{k: source[k] for k in keep if k in source},
        "num_hidden_layers": layers,
        "vocab_size": vocab_size,
    }


def build(folder: Path, text_model: Path, layers: int = 4, seed: int = 0) -> Path:
    """Write the model folder at ``folder`` from the text model at ``text_model``
    (its tokenizer and Llama config); returns ``folder``."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(text_model))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    image_processor = Idefics3ImageProcessorPil(
        do_resize=True,
        size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IMAGE_TOKENS)
    processor.save_pretrained(str(folder))
    source = json.loads((text_model / "config.json").read_text())
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        "scale_factor": SCALE,
        "tie_word_embeddings": source.get("tie_word_embeddings", False),
        "pad_token_id": source.get("pad_token_id"),
        "dtype": "float32",
        "vision_config": vision_config(),
        "text_config": text_config(source, len(tokenizer), layers),
    }
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(Idefics3Config(**config)).to(torch.float32)
    model.save_pretrained(str(folder))
    return folder


if __name__ == "__main__":
    import sys

    build(Path(sys.argv[1]), Path(sys.argv[2]))
