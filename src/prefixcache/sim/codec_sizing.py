"""What a tier's codec changes for the planner and the simulator: how many tokens a
byte budget holds, and what loading a hit costs on top of its transfer.

Capacity is counted in stored bytes (a frame's length), so a codec that stores a
block in fewer bytes holds more tokens in the same budget. With ``ratio`` the codec's
stored ratio (raw frame bytes over codec frame bytes, ``codec.stored_ratio``, from the
KV layout at the block size replayed) and ``b`` the raw KV bytes a token holds::

    stored_bytes_per_token = b / ratio          # raw: exactly b, today's figure
    tokens(N bytes)        = floor(N / stored_bytes_per_token)

A hit from a codec tier moves the stored bytes, then decodes them into the engine's
dtype::

    load_seconds_per_token = stored_bytes_per_token / bandwidth + b / decode_rate

``decode_rate`` (decoded bytes a second) is given (``--decode-rate int8=8GB/s``) or
measured here, on the spot, by decoding a synthetic block of the plan's layout with the
real ``codec.decode``. A raw frame is handed over as a view (nothing to decode): its
decode time is zero.

NOTE: the ratio is taken from whole frames, headers included, at the block size the
trace is replayed at: small blocks carry more per-block overhead (the header, int8's
per-channel key scales), so int8 stores fewer tokens per byte at 16-token blocks than at
512-token ones, and the figures say so rather than quote one ratio for all.

A model of layer groups (``kv_groups.GroupedLayout``) is sized raw: ``b`` is then its
bytes per block over the block's tokens (``GroupedLayout.stored_bytes_per_token``);
the codecs, which quantize one uniform layout's KV frames, are refused for it
(``check_grouped_codecs``).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from prefixcache.config import KVLayout
from prefixcache.kv_groups import AnyLayout, GroupedLayout
from prefixcache.storage import codec

RAW = "raw"
KEY_LEN = 32
"""Key length of the frames whose ratio is planned with (the header holds the key)."""
MEASURE_SECONDS = 0.03
"""How long the decode micro-benchmark runs, per codec and layout."""
MEASURE_MAX_TOKENS = 32
MEASURE_MAX_BYTES = 1 << 20
"""The measured block's tokens at most, and its decoded bytes at most (at least one
token): a 512-token block of a large model is tens of MiB, too much for a benchmark of a
few tens of ms; the rate per byte depends on it far less than on the machine."""


def codecs() -> tuple[str, ...]:
    """The codecs frames can be stored in (``codec.CODECS``)."""
    return tuple(codec.CODECS)


def check_codec(name: str, what: str = "codec") -> str:
    """``name`` if it is a codec, else a ValueError listing the valid ones."""
    valid = codecs()
    if name not in valid:
        raise ValueError(f"{what}: unknown codec {name!r}; valid: {', '.join(valid)}")
    return name


def stored_ratio(kv: KVLayout, block_tokens: int, name: str) -> float:
    """Raw frame bytes over ``name``'s frame bytes for one block (1.0 for raw, exactly)."""
    if check_codec(name) == RAW:
        return 1.0
    return float(codec.stored_ratio(kv.shape(block_tokens), kv.dtype, name, key_len=KEY_LEN))


def check_grouped_codecs(layout: AnyLayout, names: Iterable[str], model: str = "the model") -> None:
    """A ValueError when ``names`` (codecs) holds any but raw and ``layout`` has groups."""
    others = sorted(set(names) - {RAW})
    if isinstance(layout, GroupedLayout) and others:
        raise ValueError(
            f"codec(s) {', '.join(others)}: the codecs quantize the KV frames of a uniform layout, and "
            f"{model} has layer groups ({layout.label()}); plan it raw"
        )


def stored_bytes_per_token(kv: AnyLayout, block_tokens: int, name: str) -> float:
    """Stored bytes a token takes in ``name`` (raw: the layout's bytes per token, exactly;
    a grouped layout's bytes per block over its tokens, raw only)."""
    if isinstance(kv, GroupedLayout):
        check_grouped_codecs(kv, [check_codec(name)])
        return kv.stored_bytes_per_token(block_tokens)
    if check_codec(name) == RAW:
        return float(kv.bytes_per_token)
    return kv.bytes_per_token / stored_ratio(kv, block_tokens, name)


def tokens_in(capacity_bytes: float, kv: KVLayout, block_tokens: int, name: str) -> float:
    """Tokens whose ``name`` frames fit in ``capacity_bytes`` (rounded down; ``inf`` stays).

    NOTE: raw divides integers, as ``inputs.bytes_to_tokens`` always has, so a raw
    capacity is the same number of tokens to the last one."""
    if math.isinf(capacity_bytes):
        return math.inf
    if check_codec(name) == RAW:
        return float(int(capacity_bytes) // kv.bytes_per_token)
    return float(math.floor(capacity_bytes / stored_bytes_per_token(kv, block_tokens, name)))


# ---------------------------------------------------------------------------- decode rates


@dataclass(frozen=True, slots=True)
class DecodeRate:
    """How fast a codec's frames decode, in decoded (engine dtype) bytes a second, and
    where the figure came from: ``"given"`` (a flag or the tiers file) or ``"measured"``."""

    codec: str
    bytes_per_second: float  # math.inf for raw: nothing to decode
    source: str

    def __post_init__(self) -> None:
        check_codec(self.codec)
        rate = self.bytes_per_second
        if isinstance(rate, bool) or not isinstance(rate, int | float) or math.isnan(rate) or rate <= 0:
            raise ValueError(f"decode rate of {self.codec} must be > 0, got {rate!r}")
        if self.source not in ("given", "measured", "none"):
            raise ValueError(f"decode rate source must be given, measured or none, got {self.source!r}")

    def seconds_per_token(self, kv: KVLayout) -> float:
        """Seconds to decode one token's KV (its bytes in the engine's dtype)."""
        return 0.0 if math.isinf(self.bytes_per_second) else kv.bytes_per_token / self.bytes_per_second


Measure = Callable[[KVLayout, int, str], float]
"""(layout, block tokens, codec) -> decoded bytes a second: how the planner measures."""


def decode_rate(name: str, kv: KVLayout, block_tokens: int, given: Mapping[str, float], measure: Measure) -> DecodeRate:
    """The rate the plan uses for ``name``: raw decodes nothing; a given figure wins over
    a measurement."""
    if check_codec(name) == RAW:
        return DecodeRate(RAW, math.inf, "none")
    if name in given:
        return DecodeRate(name, given[name], "given")
    return DecodeRate(name, measure(kv, block_tokens, name), "measured")


@functools.lru_cache(maxsize=64)
def measure_decode_rate(kv: KVLayout, block_tokens: int, name: str) -> float:
    """Decoded bytes a second of ``codec.decode`` on a synthetic block of ``kv``, the best
    of repeated decodes over about ``MEASURE_SECONDS``.

    NOTE: cached per process (the layout, block size and codec are the whole key): a
    plan asks once per tier of a codec, a test session many times, and the figure of one
    machine does not change within a run. The values are random normals, the typical
    shape of K and V, so that a codec with value-dependent work is not flattered."""
    check_codec(name)
    tokens = max(1, min(block_tokens, MEASURE_MAX_TOKENS, MEASURE_MAX_BYTES // kv.bytes_per_token))
    shape = kv.shape(tokens)
    values = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    data, wire = _engine_array(values, kv.dtype)
    key = bytes(KEY_LEN)
    ids = np.arange(tokens, dtype="<u4").tobytes()
    frame = codec.encode(key, ids, data, dtype=wire, codec=name)
    best, spent, runs = math.inf, 0.0, 0
    while spent < MEASURE_SECONDS or runs < 2:
        start = time.perf_counter()
        codec.decode(frame, key=key)
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return tokens * kv.bytes_per_token / max(best, 1e-9)


def _engine_array(values: np.ndarray, dtype: str) -> tuple[np.ndarray, str]:
    """``values`` in the layout's dtype, as the codec takes it (bfloat16 as its bits)."""
    if dtype == "bfloat16":
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncation: fine for a benchmark
        return bits, "bfloat16"
    return values.astype(np.float16 if dtype == "float16" else np.float32), dtype
