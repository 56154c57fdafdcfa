"""``replay --codec``: capacities in bytes of stored frames, turned into tokens by each
codec's ratio at the block size replayed (``codec_sizing``), and the same question asked
from code: the token hit rate a byte budget buys in each codec.

A codec changes only how many tokens the bytes hold; the cache then runs in tokens as
always, so int8 at ``N`` bytes replays exactly like raw at ``tokens_in(N, int8)`` tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from prefixcache.config import CacheConfig, KVLayout
from prefixcache.sim.codec_sizing import stored_ratio, tokens_in
from prefixcache.sim.costmodel import get_model
from prefixcache.sim.inputs import format_bytes, format_capacity
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig, cache_capacity
from prefixcache.sim.summary import summarize
from prefixcache.sim.traces import Request, read_trace


@dataclass(frozen=True, slots=True)
class CodecCapacity:
    """One byte budget in one codec: the tokens its frames hold at one block size."""

    codec: str
    capacity_bytes: float
    block_tokens: int
    tokens: float


def codec_capacities(
    capacity_bytes: Sequence[float], names: Sequence[str], kv: KVLayout, block_tokens: int
) -> list[CodecCapacity]:
    """Every (codec, byte budget) pair, codecs outermost, as tokens."""
    return [
        CodecCapacity(name, b, block_tokens, tokens_in(b, kv, block_tokens, name))
        for name in names
        for b in capacity_bytes
    ]


def codec_note(model: str, kv: KVLayout, capacities: Sequence[CodecCapacity]) -> str:
    """How the byte capacities became tokens, for the report under the table."""
    parts = []
    for block in dict.fromkeys(c.block_tokens for c in capacities):
        for name in dict.fromkeys(c.codec for c in capacities):
            pairs = ", ".join(
                f"{'inf' if math.isinf(c.capacity_bytes) else format_bytes(int(c.capacity_bytes))} = "
                f"{format_capacity(c.tokens)}"
                for c in capacities
                if c.codec == name and c.block_tokens == block
            )
            parts.append(f"{name} ({stored_ratio(kv, block, name):.3f}x at {block}-token blocks) {pairs}")
    return (
        f"Capacities from --capacity-bytes in stored frames of {model} KV ({kv.dtype}, "
        f"{format_bytes(kv.bytes_per_token)} a token raw), tokens by each codec's frame ratio: " + "; ".join(parts)
    )


def replay_configs(
    cache: CacheConfig, capacity_bytes: Sequence[float], names: Sequence[str], kv: KVLayout, block_tokens: int
) -> list[ReplayConfig]:
    """``cache`` at every (codec, byte budget), its capacity in the tokens they hold."""
    return [
        ReplayConfig(_with_capacity(cache, c.tokens), codec=c.codec, stored_bytes=c.capacity_bytes)
        for c in codec_capacities(capacity_bytes, names, kv, block_tokens)
    ]


def _with_capacity(cache: CacheConfig, tokens: float) -> CacheConfig:
    return replace(cache, capacity_tokens=cache_capacity(tokens))


def hit_rates_at_bytes(
    trace: Path,
    capacity_bytes: float,
    names: Iterable[str] = ("raw", "int8", "int4"),
    *,
    model: str = "llama-3-8b",
    policy: str = "lru",
    isolation: str = "shared",
    block_size: int = 16,
    warmup: float = 0.5,
) -> dict[str, float]:
    """The token hit rate (counted requests, after ``warmup``) of ``trace`` with a cache of
    ``capacity_bytes`` of stored frames, per codec: what the benchmarks report. All
    codecs replay in one pass; a pre-hashed trace uses its own block size."""
    kv = get_model(model).kv
    if kv is None:
        raise ValueError(f"model {model!r} has no KV layout")

    def source() -> Iterable[Request]:
        return read_trace(trace)

    summary = summarize(source)
    block = summary.native_block_size or block_size
    codecs = list(dict.fromkeys(names))
    cache = CacheConfig(policy=policy, block_size=block_size, isolation=isolation)
    configs = replay_configs(cache, [capacity_bytes], codecs, kv, block)
    results = replay(source, configs, trace_name=trace.name, warmup=warmup, optimal=False, summary=summary)
    return {c.codec or "raw": r.token_hit_rate for c, r in zip(configs, results, strict=True)}
