"""Blended prefill on the real model: re-rotated keys are the keys computed at the new
position, recomputing every token is a full prefill, reuse at the original position
is a cached prefill, and quality rises with the recompute budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from engine_support import encode, model
from prefixcache.blend import (
    BlendResult,
    CacheBlend,
    Epic,
    Fresh,
    RecomputePlan,
    Reused,
    blend_prefill,
    check_llama,
    prefill_chunk,
    rerotate,
    rotary_of,
)
from prefixcache.engine import LoadedModel
from prefixcache.engine.chat import chat_frame
from prefixcache.engine.kv import cut_cache
from prefixcache.engine.runner import Sequence
from prefixcache.quality.reference import greedy_continue

pytestmark = pytest.mark.model

DOCS = (
    "The Thames is a river in southern England. It flows through Oxford and London before it reaches the North Sea.",
    "Mount Fuji is the highest mountain in Japan. It is an active volcano about one hundred kilometres from Tokyo.",
    "The honey bee lives in colonies with a single queen. Worker bees collect nectar and pollen from flowers.",
    "Copper is a soft metal that conducts heat and electricity well. It is used in wires, pipes and coins.",
)
QUESTIONS = (
    " Question: which sea does the Thames reach? Answer:",
    " Question: how far is Mount Fuji from Tokyo? Answer:",
    " Question: what do worker bees collect? Answer:",
    " Question: what is copper used for? Answer:",
)


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    torch.set_num_threads(2)
    return model()


def full(lm: LoadedModel, tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits and KV payload of a plain full prefill."""
    seq = Sequence(lm)
    logits = seq.prefill(list(tokens))[0]
    return logits, cut_cache(seq.cache, len(tokens))


def counts_add_up(result: BlendResult, length: int) -> None:
    assert result.reused + result.recomputed + result.fresh == result.length == length
    assert result.cache.get_seq_length() == length


# -- re-rotation ---------------------------------------------------------------------


def test_rotations_compose_and_zero_is_identity(lm: LoadedModel) -> None:
    freqs = rotary_of(lm.model)
    keys = torch.randn(2, 3, 7, freqs.head_dim)
    twice = rerotate(rerotate(keys, 37, freqs), 250, freqs)
    torch.testing.assert_close(twice, rerotate(keys, 287, freqs), atol=1e-4, rtol=1e-4)
    back = rerotate(rerotate(keys, 500, freqs), -500, freqs)
    torch.testing.assert_close(back, keys, atol=1e-4, rtol=1e-4)
    assert torch.equal(rerotate(keys, 0, freqs), keys)
    per_token = rerotate(keys, torch.arange(7), freqs)
    torch.testing.assert_close(per_token[:, :, 3], rerotate(keys, 3, freqs)[:, :, 3])
    half = rerotate(keys.to(torch.bfloat16), 5, freqs)
    assert half.dtype == torch.bfloat16


def test_layer0_keys_rerotated_equal_keys_computed_there(lm: LoadedModel) -> None:
    chunk = encode(lm, DOCS[0])
    at_p = prefill_chunk(lm, chunk, start=3)
    at_q = prefill_chunk(lm, chunk, start=211)
    moved = rerotate(at_p[0, 0], 211 - 3, rotary_of(lm.model))
    torch.testing.assert_close(moved, at_q[0, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(at_p[0, 1], at_q[0, 1], atol=1e-5, rtol=1e-5)  # values carry no position


def test_rerotation_uses_the_models_scaled_frequencies() -> None:
    """A llama3-scaled rope: the frequencies come from the module, not from a theta."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    tiny: Any = LlamaForCausalLM(config).eval()
    freqs = rotary_of(tiny)
    assert freqs.rope_type == "llama3"
    assert torch.equal(freqs.inv_freq, tiny.model.rotary_emb.inv_freq.float())
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        hidden = tiny.model.layers[0].input_layernorm(tiny.model.embed_tokens(ids))
        raw = tiny.model.layers[0].self_attn.k_proj(hidden).view(1, 4, 1, 16).transpose(1, 2)

        def at(start: int) -> torch.Tensor:
            cos, sin = tiny.model.rotary_emb(raw, torch.arange(start, start + 4)[None])
            return raw * cos[:, None] + torch.cat((-raw[..., 8:], raw[..., :8]), -1) * sin[:, None]

        torch.testing.assert_close(rerotate(at(2), 90, freqs), at(92), atol=1e-4, rtol=1e-4)


def test_errors_of_rerotation(lm: LoadedModel) -> None:
    freqs = rotary_of(lm.model)
    with pytest.raises(ValueError, match="head_dim"):
        rerotate(torch.zeros(3, 5, freqs.head_dim + 2), 1, freqs)
    with pytest.raises(ValueError, match="per-token deltas"):
        rerotate(torch.zeros(3, 5, freqs.head_dim), torch.arange(4), freqs)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(ValueError, match="no rotary embedding"):
        rotary_of(gpt2)
    with pytest.raises(NotImplementedError, match="Llama architecture only"):
        check_llama(gpt2)


# -- blended prefill -----------------------------------------------------------------


_CHUNKS: dict[int, Reused] = {}


def cached_doc(lm: LoadedModel, doc: int) -> Reused:
    """Document ``doc`` prefilled alone at position 0 (once per test run)."""
    if doc not in _CHUNKS:
        tokens = encode(lm, DOCS[doc])
        _CHUNKS[doc] = Reused(tokens, prefill_chunk(lm, tokens))
    return _CHUNKS[doc]


def reordered(lm: LoadedModel, first: int, second: int, question: int) -> tuple[list[Any], tuple[int, ...]]:
    """Cached "doc first", "doc second" prefilled alone, now as "second, first, question"."""
    a, b, q = cached_doc(lm, first), cached_doc(lm, second), encode(lm, QUESTIONS[question])
    return [b, a, Fresh(q)], b.tokens + a.tokens + q


def test_recompute_of_all_tokens_is_a_full_prefill(lm: LoadedModel) -> None:
    segments, tokens = reordered(lm, 0, 1, 0)
    logits, kv = full(lm, tokens)
    for plan in (Epic(10_000), CacheBlend(100.0)):
        result = blend_prefill(lm, segments, plan)
        counts_add_up(result, len(tokens))
        assert result.reused == 0 and result.fresh == len(segments[2].tokens)
        assert result.token_layers == len(tokens) * lm.kv.layers
        torch.testing.assert_close(result.logits, logits, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(cut_cache(result.cache, len(tokens)), kv, atol=2e-3, rtol=1e-3)


def test_reuse_at_the_original_position_is_a_cached_prefill(lm: LoadedModel) -> None:
    prefix, suffix = encode(lm, DOCS[2]), encode(lm, QUESTIONS[2])
    kv = prefill_chunk(lm, prefix)
    result = blend_prefill(lm, [Reused(prefix, kv), Fresh(suffix)], Epic(0))
    seq = Sequence(lm)
    logits = seq.prefill(list(prefix + suffix), cached=kv)[0]
    counts_add_up(result, len(prefix) + len(suffix))
    assert (result.reused, result.recomputed, result.fresh) == (len(prefix), 0, len(suffix))
    assert result.token_layers == len(suffix) * lm.kv.layers  # only the suffix ran
    torch.testing.assert_close(result.logits, logits, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(
        cut_cache(result.cache, len(prefix + suffix)), cut_cache(seq.cache, len(prefix + suffix)), atol=2e-3, rtol=1e-3
    )


def test_a_reused_last_token_is_recomputed_for_its_logits(lm: LoadedModel) -> None:
    head, chunk = encode(lm, "Notes:"), encode(lm, DOCS[3])
    result = blend_prefill(lm, [Fresh(head), Reused(chunk, prefill_chunk(lm, chunk))], Epic(0))
    counts_add_up(result, len(head) + len(chunk))
    assert result.recomputed == 1


def agreement(lm: LoadedModel, plans: list[RecomputePlan]) -> list[float]:
    prompts = [(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 0, 3)]
    hits = [0] * len(plans)
    for first, second, question in prompts:
        segments, tokens = reordered(lm, first, second, question)
        want = int(full(lm, tokens)[0].argmax())
        for index, plan in enumerate(plans):
            result = blend_prefill(lm, segments, plan)
            counts_add_up(result, len(tokens))
            hits[index] += int(result.logits.argmax()) == want
    return [hit / len(prompts) for hit in hits]


def test_quality_rises_with_the_recompute_budget(lm: LoadedModel) -> None:
    """Top-1 agreement with a full prefill over reordered-document prompts; CacheBlend at
    r = 100 recomputes every token (its equality to a full prefill is tested above)."""
    none, epic, blend, everything = agreement(lm, [Epic(0), Epic(8), CacheBlend(30.0), CacheBlend(100.0)])
    assert none <= epic <= everything and none <= blend <= everything, (none, epic, blend)
    assert everything == 1.0


def test_bad_inputs_are_refused(lm: LoadedModel) -> None:
    chunk = encode(lm, DOCS[0])
    kv = prefill_chunk(lm, chunk)
    with pytest.raises(ValueError, match="empty"):
        blend_prefill(lm, [], Epic(0))
    with pytest.raises(ValueError, match="at least one token"):
        Fresh(())
    with pytest.raises(ValueError, match="tokens"):
        Reused(chunk[:-1], kv)
    with pytest.raises(ValueError, match="this model needs"):
        blend_prefill(lm, [Reused(chunk, kv[:, :, :1]), Fresh((1,))], Epic(0))
    with pytest.raises(ValueError, match="original_start"):
        Reused(chunk, kv, original_start=-1)
    for r in (-0.5, 100.5, float("nan")):
        with pytest.raises(ValueError, match=r"\[0, 100\]"):
            CacheBlend(r)
    with pytest.raises(ValueError, match="k must be >= 0"):
        Epic(-1)
    with pytest.raises(ValueError, match="check_layer"):
        blend_prefill(lm, [Reused(chunk, kv), Fresh((1,))], CacheBlend(10.0, check_layer=lm.kv.layers))


def test_greedy_continuation_stops_at_the_end_of_turn(lm: LoadedModel) -> None:
    before, after = chat_frame(lm.tokenizer, "Answer in a few words.")
    seq = Sequence(lm)
    logits = seq.prefill(list(encode(lm, before + "What is the capital of France?" + after)))[0]
    out = greedy_continue(lm, seq.cache, logits, 64)
    assert out[-1] in lm.eos_ids and not set(out[:-1]) & lm.eos_ids  # the answer a server sends, no more
    assert len(out) < 64
