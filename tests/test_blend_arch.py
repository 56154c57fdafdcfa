"""Blend serves only the models its recompute models: full attention in every layer. A
sliding-window model keeps exact prefix caching (the engine serves it exactly) and blend
stays off whatever its gate says; the quality gates score it on a cache of every position
(tiny configs: nothing is loaded)."""

from __future__ import annotations

from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig

from prefixcache.blend.serve_gate import blend_unserved

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 8}


def test_a_full_attention_model_may_blend() -> None:
    assert blend_unserved(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL)) is None


def test_a_sliding_window_model_never_blends() -> None:
    mistral = MistralConfig(num_hidden_layers=2, num_key_value_heads=2, sliding_window=8, **SMALL)
    gemma = Gemma3TextConfig(num_hidden_layers=6, num_key_value_heads=2, sliding_window=8, **SMALL)
    for config in (mistral, gemma):
        reason = blend_unserved(config)
        assert reason is not None and "sliding-window" in reason
