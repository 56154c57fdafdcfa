"""Recompute plans on the real model: a chunk moved back to where it was computed is
exact through every layer, and ``EpicBlend`` recomputes the first ``k`` tokens of each
chunk plus its share of the most deviating others."""

from __future__ import annotations

import pytest
import torch

from engine_support import encode, model
from prefixcache.blend import CacheBlend, Epic, EpicBlend, Fresh, Reused, blend_prefill, prefill_chunk
from prefixcache.blend.plan import lay_out
from prefixcache.blend.prefill import _deviating
from prefixcache.engine import LoadedModel
from prefixcache.engine.kv import cut_cache
from prefixcache.engine.runner import Sequence

pytestmark = pytest.mark.model

DOC = "The Thames is a river in southern England. It flows through Oxford and London before it reaches the North Sea."
OTHER = "Mount Fuji is the highest mountain in Japan. It is an active volcano about one hundred kilometres from Tokyo."
QUESTION = " Question: which sea does the Thames reach? Answer:"


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    torch.set_num_threads(2)
    return model()


def test_a_chunk_rerotated_back_to_its_position_is_a_full_prefill(lm: LoadedModel) -> None:
    """Prefilled alone at positions 300.., then reused at 0 (delta -300 in every layer):
    with nothing before it, the blend is a plain full prefill of chunk and question."""
    doc, question = encode(lm, DOC), encode(lm, QUESTION)
    far = Reused(doc, prefill_chunk(lm, doc, start=300), original_start=300)
    result = blend_prefill(lm, [far, Fresh(question)], Epic(0))
    seq = Sequence(lm)
    logits = seq.prefill(list(doc + question))[0]
    assert (result.reused, result.recomputed) == (len(doc), 0)
    torch.testing.assert_close(result.logits, logits, atol=2e-3, rtol=1e-3)
    n = len(doc) + len(question)
    torch.testing.assert_close(cut_cache(result.cache, n), cut_cache(seq.cache, n), atol=2e-3, rtol=1e-3)


def test_a_slice_of_a_full_prefill_at_its_own_place_is_exact(lm: LoadedModel) -> None:
    """KV cut from a full prefill and reused where it was computed (delta 0) after the
    same fresh head: nothing is approximate, the blend is the full prefill."""
    head, doc, question = encode(lm, OTHER), encode(lm, DOC), encode(lm, QUESTION)
    seq = Sequence(lm)
    logits = seq.prefill(list(head + doc + question))[0]
    kv = cut_cache(seq.cache, len(head) + len(doc))[:, :, :, len(head) :]
    result = blend_prefill(lm, [Fresh(head), Reused(doc, kv, original_start=len(head)), Fresh(question)], Epic(0))
    torch.testing.assert_close(result.logits, logits, atol=2e-3, rtol=1e-3)


def segments(lm: LoadedModel) -> list[Fresh | Reused]:
    doc, other, question = encode(lm, DOC), encode(lm, OTHER), encode(lm, QUESTION)
    return [
        Fresh(encode(lm, "Notes:")),
        Reused(other, prefill_chunk(lm, other)),
        Reused(doc, prefill_chunk(lm, doc)),
        Fresh(question),
    ]


def test_epic_blend_keeps_the_first_k_and_adds_the_deviating_share(lm: LoadedModel) -> None:
    parts = segments(lm)
    layout = lay_out(parts)
    n = layout.length
    positions = torch.arange(n)
    k = torch.randn(1, lm.kv.kv_heads, n, lm.kv.head_dim)
    v = torch.randn(1, lm.kv.kv_heads, n, lm.kv.head_dim)
    cached_k, cached_v = k.clone(), v.clone()
    late = int(layout.starts[2]) + 20  # a token deep in the second chunk deviates most
    cached_k[:, :, late] += 10.0
    keep = _deviating(EpicBlend(4, 1.0), k, v, cached_k, cached_v, positions, layout, n)
    chunk_tokens = int(layout.reused.sum())
    first = layout.reused & (layout.first < 4)
    assert bool(keep[~layout.reused].all()) and bool(keep[first].all())
    assert bool(keep[late])
    others = int((layout.reused & ~first).sum())
    assert int(keep[layout.reused].sum()) == 2 * 4 + CacheBlend(1.0).chosen(others)
    assert chunk_tokens > int(keep[layout.reused].sum())


def test_epic_blend_counts_and_its_limits(lm: LoadedModel) -> None:
    parts = segments(lm)
    n = sum(len(s.tokens) for s in parts)
    fresh = len(parts[0].tokens) + len(parts[3].tokens)
    reused = n - fresh
    only_first = blend_prefill(lm, parts, EpicBlend(6, 0.0))
    assert (only_first.recomputed, only_first.fresh) == (2 * 6, fresh)
    both = blend_prefill(lm, parts, EpicBlend(6, 20.0))
    assert both.recomputed == 2 * 6 + CacheBlend(20.0).chosen(reused - 2 * 6)
    assert both.reused + both.recomputed + both.fresh == n
    everything = blend_prefill(lm, parts, EpicBlend(6, 100.0))
    assert everything.reused == 0 and everything.token_layers == n * lm.kv.layers
    seq = Sequence(lm)
    logits = seq.prefill([t for s in parts for t in s.tokens])[0]
    torch.testing.assert_close(everything.logits, logits, atol=2e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="k must be >= 0"):
        EpicBlend(-1, 10.0)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        EpicBlend(4, 101.0)
    with pytest.raises(ValueError, match="check_layer"):
        blend_prefill(lm, parts, EpicBlend(4, 10.0, check_layer=lm.kv.layers))
