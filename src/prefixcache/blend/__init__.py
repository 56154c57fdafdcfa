"""Reuse beyond the exact prefix: cached chunk KV at new positions (re-rotated keys)
with selective recompute (EPIC's first-k rule, CacheBlend's deviation rule, or both)."""

from prefixcache.blend.plan import CacheBlend, Epic, EpicBlend, Fresh, RecomputePlan, Reused, Segment
from prefixcache.blend.prefill import BlendResult, blend_prefill, check_llama, prefill_chunk
from prefixcache.blend.rope import RotaryFrequencies, rerotate, rotary_of

__all__ = [
    "BlendResult",
    "CacheBlend",
    "Epic",
    "EpicBlend",
    "Fresh",
    "RecomputePlan",
    "Reused",
    "RotaryFrequencies",
    "Segment",
    "blend_prefill",
    "check_llama",
    "prefill_chunk",
    "rerotate",
    "rotary_of",
]

from prefixcache.blend.chunks import CHUNK_EXTRA, ChunkKV, Chunks, chunk_context

__all__ += ["CHUNK_EXTRA", "ChunkKV", "Chunks", "chunk_context"]
