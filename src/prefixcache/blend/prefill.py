"""A blended prefill: reused chunks' KV at new positions, with selective recompute.

The model runs layer by layer over the *active* positions only: every fresh token,
the reused tokens the plan recomputes, and the prompt's last token (its logits start
decoding). Each layer holds one blended K/V for the whole prompt: the re-rotated
cached K/V of the reused positions, overwritten by the fresh K/V of the positions
computed at that layer. Active queries attend causally to that blended K/V of all
earlier positions, so the work of a layer grows with the active tokens, not with the
prompt; a plan that recomputes every token is a full prefill.

Written against transformers' Llama modules (projections, rotary embedding, RMSNorm,
MLP), called one by one; other architectures are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM, apply_rotary_pos_emb

from prefixcache.blend.plan import CacheBlend, Epic, EpicBlend, Layout, RecomputePlan, Reused, Segment, lay_out
from prefixcache.blend.rope import RotaryFrequencies, rerotate, rotary_of
from prefixcache.engine.kv import cut_cache
from prefixcache.engine.model import LoadedModel


@dataclass(frozen=True, slots=True)
class BlendResult:
    """The outcome of a blended prefill. ``reused + recomputed + fresh`` is the prompt's
    length; ``token_layers`` counts (token, layer) pairs run through a decoder layer
    (a full prefill runs ``length * layers``)."""

    logits: torch.Tensor  # [vocab], float32, CPU: the next token after the prompt
    cache: DynamicCache  # the blended K/V of every prompt position: decoding continues from it
    reused: int  # tokens whose cached KV was kept (re-rotated) in every layer after the plan's choice
    recomputed: int  # reused tokens run through the model again
    fresh: int  # tokens of Fresh segments
    token_layers: int

    @property
    def length(self) -> int:
        return self.reused + self.recomputed + self.fresh


def check_llama(model: Any) -> None:
    """Refuse anything but a Llama causal LM built from transformers' Llama modules."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if (
        not isinstance(model, LlamaForCausalLM)
        or getattr(model.config, "model_type", None) != "llama"
        or layers is None
        or not all(type(layer) is LlamaDecoderLayer for layer in layers)
    ):
        name = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise NotImplementedError(f"blended prefill supports the Llama architecture only, not {name!r}")


@torch.inference_mode()
def blend_prefill(loaded: LoadedModel, segments: Sequence[Segment], plan: RecomputePlan) -> BlendResult:
    """Prefill the prompt made of ``segments`` with the reuse and recompute of ``plan``."""
    model: Any = loaded.model
    check_llama(model)
    layout = lay_out(segments)
    n = layout.length
    if n > loaded.context_length:
        raise ValueError(f"the prompt has {n} tokens, over the model's context of {loaded.context_length}")
    layers = list(model.model.layers)
    if not isinstance(plan, Epic) and plan.check_layer >= len(layers):
        raise ValueError(f"check_layer {plan.check_layer} is past the model's {len(layers)} layers")
    dtype = next(model.parameters()).dtype
    device = loaded.device
    keys, values = _blended_base(segments, layout, loaded, rotary_of(model), dtype)

    reused = layout.reused.to(device)
    active = _first_active(layout, plan).to(device)
    active[n - 1] = True
    positions = active.nonzero().squeeze(1)
    ids = torch.tensor(layout.tokens, dtype=torch.long, device=device)
    hidden = model.model.embed_tokens(ids[positions])[None]
    everywhere = torch.arange(n, device=device)
    # NOTE: the active positions change at most once (at the check layer), so their
    # rotary angles and causal mask are made once per change, not once per layer.
    cos, sin = model.model.rotary_emb(hidden, position_ids=positions[None])
    allowed = positions[:, None] >= everywhere[None, :]  # causal, by position
    check = _check_layer(plan)
    token_layers = 0
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        token_layers += int(positions.numel())
        x = layer.input_layernorm(hidden)
        shape = (1, x.shape[1], -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keep = None
        if index == check and not isinstance(plan, Epic):
            keep = _deviating(plan, k, v, keys[index], values[index], positions, layout, n)
        keys[index].index_copy_(2, positions, k)
        values[index].index_copy_(2, positions, v)
        if keep is not None:
            q, hidden, positions = q[:, :, keep], hidden[:, keep], positions[keep]
            cos, sin, allowed = cos[:, keep], sin[:, keep], allowed[keep]
        out = F.scaled_dot_product_attention(
            q, keys[index], values[index], attn_mask=allowed, scale=attn.scaling, enable_gqa=True
        )
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, hidden.shape[1], -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    last = model.model.norm(hidden[:, -1:])
    logits: torch.Tensor = model.lm_head(last)[0, -1].float().cpu()
    cache = DynamicCache(config=model.config)
    for index in range(len(layers)):
        cache.update(keys[index], values[index], index)
    fresh = int((~layout.reused).sum())
    recomputed = int(reused[positions].sum())
    return BlendResult(logits, cache, n - fresh - recomputed, recomputed, fresh, token_layers)


def _first_active(layout: Layout, plan: RecomputePlan) -> torch.Tensor:
    """Positions that enter layer 0: fresh ones plus the reused ones the plan starts with."""
    if isinstance(plan, Epic):
        return ~layout.reused | (layout.first < plan.k)
    return torch.ones(layout.length, dtype=torch.bool)  # deviation plans: everyone until check_layer


def _check_layer(plan: RecomputePlan) -> int:
    """The layer after which a deviation plan drops the rows it does not recompute (-1: none)."""
    return -1 if isinstance(plan, Epic) else plan.check_layer


def _deviating(
    plan: CacheBlend | EpicBlend,
    k: torch.Tensor,
    v: torch.Tensor,
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    positions: torch.Tensor,
    layout: Layout,
    n: int,
) -> torch.Tensor:
    """Which active rows go on past the check layer: ``_recompute_top`` by squared K and V
    deviation from the re-rotated cache."""
    deviation = (k - cached_k[:, :, positions]).float().pow(2).sum(dim=(0, 1, 3))
    deviation += (v - cached_v[:, :, positions]).float().pow(2).sum(dim=(0, 1, 3))
    return _recompute_top(plan, deviation, positions, layout, n)


def _recompute_top(
    plan: CacheBlend | EpicBlend, scores: torch.Tensor, positions: torch.Tensor, layout: Layout, n: int
) -> torch.Tensor:
    """Which active rows (``positions``, scored by ``scores``) go on past the check layer:
    fresh rows, the last position, the first ``k`` tokens of each chunk (``EpicBlend``)
    and, of the other reused rows, the top ``r`` % by score."""
    candidates = layout.reused.to(positions.device)[positions]
    keep = ~candidates | (positions == n - 1)
    if isinstance(plan, EpicBlend):
        first = candidates & (layout.first.to(positions.device)[positions] < plan.k)
        keep |= first
        candidates &= ~first
    count = (plan.deviation if isinstance(plan, EpicBlend) else plan).chosen(int(candidates.sum()))
    if count > 0:
        scores = torch.where(candidates, scores, torch.full_like(scores, -1.0))
        keep[scores.topk(count).indices] = True
    return keep


def _blended_base(
    segments: Sequence[Segment], layout: Layout, loaded: LoadedModel, freqs: RotaryFrequencies, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer K and V ([layers, 1, kv_heads, length, head_dim]) holding the re-rotated
    cached KV of every reused position (zeros elsewhere, overwritten by compute)."""
    spec = loaded.kv
    shape = (spec.layers, 1, spec.kv_heads, layout.length, spec.head_dim)
    keys = torch.zeros(shape, dtype=dtype, device=loaded.device)
    values = torch.zeros(shape, dtype=dtype, device=loaded.device)
    for segment, start in zip(segments, layout.starts, strict=True):
        if not isinstance(segment, Reused):
            continue
        got = tuple(segment.kv.shape)
        want = (spec.layers, 2, spec.kv_heads, len(segment.tokens), spec.head_dim)
        if got != want:
            raise ValueError(f"a Reused segment's kv is {got}; this model needs {want}")
        kv = segment.kv.to(device=loaded.device)
        end = start + len(segment.tokens)
        keys[:, 0, :, start:end] = rerotate(kv[:, 0], start - segment.original_start, freqs).to(dtype)
        values[:, 0, :, start:end] = kv[:, 1].to(dtype)
    return keys, values


@torch.inference_mode()
def prefill_chunk(loaded: LoadedModel, tokens: Sequence[int], start: int = 0) -> torch.Tensor:
    """The KV payload ([layers, 2, kv_heads, T, head_dim], CPU) of ``tokens`` prefilled
    alone at positions ``start..``: what the cache keeps as a chunk for a ``Reused`` segment."""
    if not tokens:
        raise ValueError("a chunk needs at least one token")
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=loaded.device)
    positions = torch.arange(start, start + len(tokens), device=loaded.device)[None]
    cache = DynamicCache(config=loaded.model.config)
    loaded.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    return cut_cache(cache, len(tokens))
