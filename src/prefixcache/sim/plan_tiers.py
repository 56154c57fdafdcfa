"""The planner's split of a capacity across storage tiers, and what each tier's codec
changes: the tokens its bytes hold and the time a hit it serves takes to load.

Tiers are filled fastest first. Tier ``k`` holds ``floor(size_k / stored_bytes_per_token)``
tokens of its codec (``codec_sizing``), up to what the plan still needs; with ``S_k`` the
cumulative tokens of tiers ``1..k`` it serves ``hit_rate(S_k) - hit_rate(S_(k-1))`` of
the counted prompt tokens (an exclusive LRU hierarchy: the most recent in the fastest).

A token it serves costs ``load = transfer + decode`` (stored bytes over its bandwidth,
decoded bytes over its codec's decode rate); it is worth it when that is less than the
prefill GPU time a hit token saves on average.

A model of layer groups (``kv_groups``) stores, raw, its bytes per block over the
block's tokens a token: ``GroupedLayout.stored_bytes_per_token`` at the plan's block size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from prefixcache.config import KVLayout
from prefixcache.kv_groups import AnyLayout
from prefixcache.sim.codec_sizing import RAW, DecodeRate, stored_bytes_per_token, stored_ratio
from prefixcache.sim.plan_inputs import Tier


@dataclass(frozen=True, slots=True)
class TierShare:
    """What one tier holds and serves in the plan."""

    tier: Tier
    capacity_tokens: float  # the part of the plan's capacity it holds (0 when the faster ones suffice)
    kv_bytes: float  # stored bytes (its codec's)
    hit_rate: float  # share of the counted prompt tokens it serves
    load_seconds_per_token: float  # transfer + decode
    worth_it: bool  # loading a token is faster than the prefill it saves (on average)
    transfer_seconds_per_token: float = 0.0  # stored bytes per token / bandwidth
    decode_seconds_per_token: float = 0.0  # decoded bytes per token / the codec's decode rate
    stored_bytes_per_token: float = 0.0


@dataclass(frozen=True, slots=True)
class CodecSize:
    """The plan's capacity stored in one codec: the bytes it takes and the ratio that made them."""

    codec: str
    ratio: float  # raw frame bytes / this codec's, at the plan's block size
    stored_bytes_per_token: float
    kv_bytes: float | None  # None when the target is out of reach


def tier_bounds(tiers: Sequence[Tier], capacity: float | None, kv: AnyLayout, block_tokens: int) -> list[float]:
    """Cumulative tokens of tiers ``1..k``, fastest first, up to ``capacity`` (all they hold
    when it is ``None``: the target is out of reach)."""
    need = math.inf if capacity is None else capacity
    bounds, held = [], 0.0
    for tier in tiers:
        per_token = stored_bytes_per_token(kv, block_tokens, tier.codec)
        held += min(math.floor(tier.size_bytes / per_token), max(need - held, 0.0))
        bounds.append(held)
    return bounds


def tier_shares(
    tiers: Sequence[Tier],
    bounds: Sequence[float],
    rate: Mapping[float, float],
    kv: AnyLayout,
    block_tokens: int,
    per_hit: float | None,
    decode: Mapping[str, DecodeRate],
) -> tuple[TierShare, ...]:
    """Each tier's share, from the cumulative ``bounds`` and the hit ``rate`` at each (and at 0)."""
    shares, previous = [], 0.0
    for tier, bound in zip(tiers, bounds, strict=True):
        per_token = stored_bytes_per_token(kv, block_tokens, tier.codec)
        transfer = per_token / tier.bandwidth
        decoding = 0.0
        if tier.codec != RAW:
            assert isinstance(kv, KVLayout)  # NOTE: codecs are refused for layer groups (PlanInputs)
            decoding = decode[tier.codec].seconds_per_token(kv)
        load = transfer + decoding
        shares.append(
            TierShare(
                tier=tier,
                capacity_tokens=bound - previous,
                kv_bytes=(bound - previous) * per_token,
                hit_rate=rate[bound] - rate[previous],
                load_seconds_per_token=load,
                worth_it=per_hit is not None and load < per_hit,
                transfer_seconds_per_token=transfer,
                decode_seconds_per_token=decoding,
                stored_bytes_per_token=per_token,
            )
        )
        previous = bound
    return tuple(shares)


class Point(Protocol):
    """A measured point of the hit-rate curve (``plan.CurvePoint``)."""

    @property
    def capacity_tokens(self) -> float: ...

    @property
    def token_hit_rate(self) -> float: ...


P = TypeVar("P", bound=Point)


def split(
    hit_rates: Callable[[list[float]], Sequence[P]],
    tiers: Sequence[Tier],
    kv: AnyLayout,
    block_tokens: int,
    capacity: float | None,
    per_hit: float | None,
    points: list[P],
    decode: Mapping[str, DecodeRate],
) -> tuple[tuple[TierShare, ...], float]:
    """Each tier's part of the capacity, fastest first, and the tokens they hold together
    (``math.inf`` without tiers); the hit rates at the tiers' bounds come from ``points``
    where measured, else from ``hit_rates`` (``points`` gains what it reads)."""
    if not tiers:
        return (), math.inf
    bounds = tier_bounds(tiers, capacity, kv, block_tokens)
    known = {p.capacity_tokens: p.token_hit_rate for p in points}
    wanted = sorted({b for b in bounds if b > 0 and b not in known})
    for point in hit_rates(wanted) if wanted else []:
        known[point.capacity_tokens] = point.token_hit_rate
        points.append(point)
    shares = tier_shares(tiers, bounds, {0.0: 0.0, **known}, kv, block_tokens, per_hit, decode)
    return shares, bounds[-1]


def codec_sizes(names: Sequence[str], capacity: float | None, kv: KVLayout, block_tokens: int) -> tuple[CodecSize, ...]:
    """The plan's capacity in stored bytes of each codec named."""
    out = []
    for name in names:
        per_token = stored_bytes_per_token(kv, block_tokens, name)
        kv_bytes = None if capacity is None else capacity * per_token
        out.append(CodecSize(name, stored_ratio(kv, block_tokens, name), per_token, kv_bytes))
    return tuple(out)
