"""The codec gate's measurement: what serving a cached prefix from a codec's frames does
to the next token and the answer, against a float32 full prefill of the same prompt.

    per item (the gates' evaluation set, prepared by ``reference.prepare``):
      reference   full float32 prefill: next-token log-probs, greedy-32 (``prepare``)
      floor       full bfloat16 prefill, scored the same way (``prepare``: NoiseFloor)
      codec run   prefill the first ``cached_tokens`` (about 90 %, whole 16-token blocks)
                  -> their KV, block by block through the frame path:
                       codec.encode(key, tokens, block, codec=c) -> codec.decode(frame, key=..)
                  -> the engine's own load (``Sequence.prefill(tokens, cached=kv)``)
                  -> prefill the rest; score next token and greedy-32 (``score_result``)

Everything but the frames is the engine's serving path, in float32: ``raw`` scores KL 0
and top-1 1.0 exactly, so whatever a codec scores is the codec's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixcache.engine.kv import cut_cache, to_numpy
from prefixcache.engine.model import LoadedModel
from prefixcache.engine.runner import Sequence as EngineSequence
from prefixcache.quality.reference import REFERENCE_DTYPE, Prefilled, Prepared, PreparedItem, in_dtype, score_result
from prefixcache.quality.verdict import GateFigures, ItemScore
from prefixcache.storage import codec as frames

__all__ = ["BLOCK_TOKENS", "CACHED_SHARE", "CodecRun", "cached_tokens", "evaluate_codec", "run_codec", "through_codec"]

BLOCK_TOKENS = 16  # the cache's default block: each goes through its own frame
CACHED_SHARE = 0.9  # of a prompt's tokens, served from the cache (rounded down to blocks)

log = logging.getLogger("prefixcache.quality")


def cached_tokens(length: int, share: float = CACHED_SHARE, block: int = BLOCK_TOKENS) -> int:
    """The cached prefix of a prompt of ``length`` tokens: ``share`` of it, rounded down
    to whole blocks, and never the last token (its logits start decoding)."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"the cached share is in (0, 1), got {share}")
    blocks = int(length * share) // block
    while blocks and blocks * block >= length:
        blocks -= 1
    return blocks * block


def through_codec(
    kv: np.ndarray[Any, Any], tokens: Sequence[int], codec: str, *, dtype: str, block: int = BLOCK_TOKENS, key: str
) -> np.ndarray[Any, Any]:
    """``kv`` ([layers, 2, H, T, D], T a multiple of ``block``) after each block was
    stored as a frame of ``codec`` and loaded back, as a tier does; the same dtype."""
    length = kv.shape[3]
    if length % block or length != len(tokens):
        raise ValueError(f"{length} positions of KV for {len(tokens)} tokens, in blocks of {block}")
    out = np.empty_like(kv)
    for start in range(0, length, block):
        name = f"{key}|{start}".encode()
        ids = np.asarray(tokens[start : start + block], dtype="<u4").tobytes()
        part = np.ascontiguousarray(kv[:, :, :, start : start + block])
        frame = frames.encode(name, ids, part, dtype=dtype, codec=codec)
        loaded = frames.decode(frame, key=name, tokens=ids)
        out[:, :, :, start : start + block] = _in_dtype(loaded, out.dtype)
    return out


def _in_dtype(array: np.ndarray[Any, Any], want: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A decoded block in the payload's dtype. NOTE: bfloat16 travels as uint16 words
    (or ml_dtypes' bfloat16): widened to float32 by its bits, never by value."""
    if array.dtype == want:
        return array
    if array.dtype.kind == "u" and array.dtype.itemsize == 2:  # raw bfloat16 words
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(want)


@dataclass(frozen=True, slots=True)
class CodecRun:
    """One item served from ``cached`` tokens of codec frames: its score, and the
    relative error of the dequantised KV (a diagnostic beside the gate's measures)."""

    score: ItemScore
    cached: int
    kv_rel_error: float  # ||decoded - computed|| / ||computed|| over the cached KV


def run_codec(
    reference: LoadedModel, item: PreparedItem, codec: str, steps: int, share: float = CACHED_SHARE
) -> CodecRun:
    """``item`` with its cached prefix served through ``codec``'s frames (module doc);
    ``reference`` runs in float32, as the item's reference was computed."""
    tokens = list(item.tokens)
    cached = cached_tokens(len(tokens), share)
    if cached == 0:
        raise ValueError(f"item {item.id}: {len(tokens)} tokens hold no whole {BLOCK_TOKENS}-token block to cache")
    prefix = EngineSequence(reference)
    prefix.prefill(tokens[:cached])
    computed = to_numpy(cut_cache(prefix.cache, cached))
    loaded = through_codec(computed, tokens[:cached], codec, dtype=reference.kv.dtype, key=f"codec-gate|{item.id}")
    seq = EngineSequence(reference)
    logits = seq.prefill(tokens, cached=loaded)[0]  # NOTE: the engine's load of a cached prefix
    fresh = len(tokens) - cached
    result = Prefilled(logits, seq.cache, cached, 0, fresh, fresh * reference.kv.layers)
    error = float(np.linalg.norm((loaded - computed).ravel()) / max(float(np.linalg.norm(computed.ravel())), 1e-30))
    return CodecRun(score_result(reference, item, result, steps), cached, error)


def evaluate_codec(
    loaded: LoadedModel, prepared: Prepared, codec: str, share: float = CACHED_SHARE
) -> tuple[GateFigures, list[CodecRun]]:
    """A codec's figures over the prepared set (named by the codec, with the set's
    floor), and each item's run. ``work`` is the share of the prompts still prefilled."""
    if codec not in frames.CODECS:
        raise ValueError(f"unknown codec {codec!r}; valid: {', '.join(frames.CODECS)}")
    reference = in_dtype(loaded, REFERENCE_DTYPE)
    runs = [run_codec(reference, item, codec, prepared.steps, share) for item in prepared.items]
    scores = [run.score for run in runs]
    return GateFigures.of(codec, scores, prepared.layers, prepared.floor), runs
