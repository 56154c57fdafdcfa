"""Tiny random models for the engine's architecture tests: any transformers config, its
weights from transformers' own init (seeded), saved with a word-level tokenizer of its
own into a folder that ``load_model`` reads, so that no test needs a download or the
real model's files. Two layers, a vocabulary of 96: a model loads and runs in well
under a second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from prefixcache.engine import LoadedModel, load_model

VOCAB = 96
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "bos_token_id": None,  # NOTE: no end token: an answer runs to its max_tokens, whatever the weights
    "eos_token_id": None,
    "pad_token_id": None,
}


def tokenizer() -> PreTrainedTokenizerFast:
    """One word per token id, ``t0`` to ``t95``."""
    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0")


def save(folder: Path, config: Any, seed: int = 7) -> Path:
    """A model of ``config`` with seeded random weights, and the tokenizer, at ``folder``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(folder))
    tokenizer().save_pretrained(str(folder))
    return folder


def load(folder: Path) -> LoadedModel:
    """``folder``'s model as the server loads it, on the CPU."""
    return load_model(str(folder), models_dir=folder.parent / "models", device="cpu")


def tokens(count: int, seed: int) -> list[int]:
    """``count`` token ids in [1, VOCAB), different for each seed."""
    generator = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(1, VOCAB, (count,), generator=generator)]
