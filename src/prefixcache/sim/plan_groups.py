"""What a plan says of a model of layer groups (``kv_groups``): each group's bytes per
block at the plan's block size, their sum per token (the figure the capacity and the
tiers are sized with), the full-KV equivalent, and what one prompt of the trace's mean
length needs resumed at its end alone (vLLM's HMA keeps that on the GPU). A uniform
model's plan prints none of it: its lines are what they always were (``plan_report``).
"""

from __future__ import annotations

from typing import Any

from prefixcache.kv_groups import GroupedLayout, LayerKind
from prefixcache.sim.plan import Plan


def group_lines(plan: Plan, kv: GroupedLayout) -> list[str]:
    """The KV lines of the text report for a grouped layout."""
    block, model = plan.block_size, plan.inputs.cost.model.name
    out = [
        f"  KV of {model}: {kv.layers} layers in {len(kv.groups)} groups, stored per {block:,}-token block "
        "(what a hit at any block boundary needs):"
    ]
    for g in kv.groups:
        if g.kind is LayerKind.STATE:
            kept = "one state"
        elif g.kind is LayerKind.SLIDING:
            kept = f"the last {g.tokens_kept(block):,} of {block:,} tokens"
        else:
            kept = f"{block:,} tokens"
        out.append(f"    {g.label()}: {kept} = {g.bytes_per_block(block):,} bytes")
    full = kv.full_bytes_per_token
    out.append(
        f"    = {kv.bytes_per_block(block):,} bytes a block = {plan.bytes_per_token:,.0f} bytes/token "
        f"(full-KV equivalent: {full:,} bytes/token, every attention layer keeping every token)"
    )
    mean = round(plan.mean_prompt_tokens)
    if mean > 0:
        per_token = kv.prefix_bytes(mean) / mean
        out.append(
            f"    one prompt of the trace's mean {mean:,} tokens resumed at its end alone (vLLM's HMA on the GPU): "
            f"{per_token:,.0f} bytes/token{_versus(per_token, plan.bytes_per_token)}"
        )
    return out


def _versus(value: float, stored: float) -> str:
    if value <= 0 or stored <= 0 or value == stored:
        return ""
    return f" ({stored / value:.2f}x less than stored per block)" if value < stored else ""


def group_json(plan: Plan, kv: GroupedLayout) -> dict[str, Any]:
    """The JSON fields of a grouped layout (the ``kv_layout`` entry and its figures)."""
    mean = round(plan.mean_prompt_tokens)
    return {
        "kv_layout": {
            "layers": kv.layers,
            "groups": [
                {
                    "kind": g.kind.value,
                    "layers": g.layers,
                    "kv_heads": g.kv_heads,
                    "head_dim": g.head_dim,
                    "dtype": g.dtype,
                    "window": g.window,
                    "state_bytes": g.state_bytes,
                    "bytes_per_block": g.bytes_per_block(plan.block_size),
                }
                for g in kv.groups
            ],
        },
        "bytes_per_block": kv.bytes_per_block(plan.block_size),
        "full_kv_bytes_per_token": kv.full_bytes_per_token,
        "mean_prompt_tokens": plan.mean_prompt_tokens,
        "prefix_bytes_per_token_at_mean_prompt": kv.prefix_bytes(mean) / mean if mean > 0 else None,
    }
