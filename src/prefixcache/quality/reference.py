"""What every quality gate measures against: the evaluation set prepared on a model.

    eval set --prepare--> per item: the prompt (a chat in the model's own template),
                          its float32 full-prefill reference (next-token log-probs,
                          greedy continuation);
                          the noise floor: a bfloat16 full prefill of every item, scored
                          against that reference as any way of serving is (NoiseFloor)
    a way of serving  --> a ``Prefill`` of the item (its logits and cache)
                      --score_result--> ItemScore (top-1, KL, greedy match, work)

The codec gate serves a cached prefix through a codec's frames (``codecs.py``), the
blend gate reuses chunks at new positions (``blend/gate.py``); both are scored here, the
same way, and keyed by ``model_fingerprint``: the weights' content (``prefixcache.weights``),
so that a fine-tune of the same size never inherits its base model's verdicts.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from prefixcache.engine.chat import chat_frame
from prefixcache.engine.kv import cut_cache, fill_cache
from prefixcache.engine.model import LoadedModel, dtype_of
from prefixcache.engine.runner import Sequence as FullPrefill
from prefixcache.quality.evalset import EvalSet, Piece, assemble
from prefixcache.quality.verdict import FLOOR_DTYPE, ItemScore, NoiseFloor

__all__ = [
    "GREEDY_STEPS",
    "Prefill",
    "Prefilled",
    "Prepared",
    "PreparedItem",
    "full_prefill",
    "full_prefill_in",
    "greedy_continue",
    "in_dtype",
    "model_fingerprint",
    "prepare",
    "score_result",
]

GREEDY_STEPS = 32
REFERENCE_DTYPE = "float32"

log = logging.getLogger("prefixcache.quality")


def model_fingerprint(loaded: LoadedModel) -> str:
    """The model as gate verdicts are keyed: its folder's name (for the people reading the
    file) and its weights' fingerprint (``LoadedModel.fingerprint``: config.json and the
    weight files by content, and the dtype), so a verdict holds for these bytes only."""
    return f"{Path(loaded.source).name}@{loaded.fingerprint}"


class Prefill(Protocol):
    """What a way of serving an item leaves to score: the next token's logits and the
    cache decoding continues from, with the counts of its work (``blend.BlendResult``
    has them too)."""

    @property
    def logits(self) -> torch.Tensor: ...  # [vocab], float32, CPU
    @property
    def cache(self) -> DynamicCache: ...
    @property
    def reused(self) -> int: ...
    @property
    def recomputed(self) -> int: ...
    @property
    def fresh(self) -> int: ...
    @property
    def token_layers(self) -> int: ...  # (token, layer) pairs run through a decoder layer
    @property
    def length(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prefill outside the blend mode (a full one, one over a cached prefix)."""

    logits: torch.Tensor
    cache: DynamicCache
    reused: int  # tokens whose KV came from elsewhere than this prefill
    recomputed: int
    fresh: int
    token_layers: int

    @property
    def length(self) -> int:
        return self.reused + self.recomputed + self.fresh


@dataclass(frozen=True, slots=True)
class PreparedItem:
    """One prompt, assembled, with what a full prefill of it gives."""

    id: str
    kind: str
    tokens: tuple[int, ...]
    pieces: tuple[Piece, ...]  # the prompt as the set assembles it: fresh runs and chunk slices
    reference: torch.Tensor  # [vocab] float64 log-probs of the next token, full prefill
    greedy: tuple[int, ...]  # the full prefill's greedy continuation


@dataclass(frozen=True, slots=True)
class Prepared:
    model: str  # model_fingerprint
    eval_digest: str
    steps: int
    layers: int
    items: tuple[PreparedItem, ...]
    floor: NoiseFloor  # a bfloat16 full prefill of the same items against the reference
    chunks: Mapping[str, tuple[int, ...]]  # the tokens of every chunk the items use, lines end to end


def full_prefill(loaded: LoadedModel, tokens: Sequence[int]) -> tuple[torch.Tensor, FullPrefill]:
    """Next-token logits of a plain prefill, and the sequence holding its cache."""
    seq = FullPrefill(loaded)
    return seq.prefill(list(tokens))[0], seq


def prepare(loaded: LoadedModel, eval_set: EvalSet, steps: int = GREEDY_STEPS) -> Prepared:
    """Assemble each item (a chat in the model's own template), compute its float32
    full-prefill reference, and the noise floor: the same items prefilled in full in
    bfloat16, scored against that reference."""
    encode = _encoder(loaded)
    reference = in_dtype(loaded, REFERENCE_DTYPE)
    low = in_dtype(loaded, FLOOR_DTYPE)
    used = sorted({name for item in eval_set.items for name in item.cached})
    lines = {name: [encode(line) for line in eval_set.chunks[name]] for name in used}
    items = []
    floor: list[ItemScore] = []
    for item in eval_set.items:
        pieces = tuple(assemble(item, lines, encode, lambda system: chat_frame(loaded.tokenizer, system)))
        tokens = tuple(t for piece in pieces for t in piece.tokens)
        logits, seq = full_prefill(reference, tokens)
        greedy = greedy_continue(reference, seq.cache, logits, steps)
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        ready = PreparedItem(item.id, item.kind, tokens, pieces, log_probs, tuple(greedy))
        items.append(ready)
        floor.append(score_result(reference, ready, full_prefill_in(reference, low, tokens), steps))
    noise = NoiseFloor.of(FLOOR_DTYPE, floor)
    log.info(
        "event=gate_floor items=%d dtype=%s kl_mean=%.5f kl_max=%.5f top1=%.3f greedy_em=%.3f",
        noise.items,
        noise.dtype,
        noise.mean_kl,
        noise.max_kl,
        noise.top1,
        noise.greedy_em,
    )
    chunks = {name: tuple(t for line in lines[name] for t in line) for name in used}
    return Prepared(model_fingerprint(loaded), eval_set.digest, steps, loaded.kv.layers, tuple(items), noise, chunks)


def in_dtype(loaded: LoadedModel, dtype: str) -> LoadedModel:
    """``loaded`` with its weights in ``dtype``: itself when they already are, else a copy
    (the served model is never touched)."""
    if loaded.kv.dtype == dtype:
        return loaded
    model: Any = copy.deepcopy(loaded.model)
    model.to(dtype_of(dtype))
    return dataclasses.replace(loaded, model=model, kv=dataclasses.replace(loaded.kv, dtype=dtype))


def full_prefill_in(reference: LoadedModel, low: LoadedModel, tokens: Sequence[int]) -> Prefilled:
    """A full prefill by ``low`` (no reuse), as a result ``score_result`` compares like
    any other: next-token logits in float32, its cache cast to ``reference``'s dtype.
    NOTE: decoding then runs in ``reference``, as it does after any way of serving: only
    the prefill differs from the reference's, so the floor is the prefill's noise alone."""
    logits, seq = full_prefill(low, tokens)
    n = len(tokens)
    # NOTE: a cache of every position (no config): a sliding layer's window is the masks' to
    # apply, as in the engine (``runner.full_cache``)
    cache = fill_cache(cut_cache(seq.cache, n), None, reference.device, dtype_of(reference.kv.dtype))
    return Prefilled(logits.float(), cache, 0, 0, n, n * reference.kv.layers)


@torch.inference_mode()
def greedy_continue(loaded: LoadedModel, cache: DynamicCache, logits: torch.Tensor, steps: int) -> list[int]:
    """Up to ``steps`` greedy tokens after a prefill that left ``cache`` and next-token
    ``logits``, ending with the first end-of-sequence token if one comes: the answer a
    server would send, which stops there (the cache grows by the tokens fed back)."""
    out: list[int] = []
    eos = loaded.eos_ids
    for step in range(steps):
        token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
        if step + 1 < steps:
            ids = torch.tensor([[token]], dtype=torch.long, device=loaded.device)
            result = loaded.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            logits = result.logits[0, -1].float()
    return out


def score_result(loaded: LoadedModel, item: PreparedItem, result: Prefill, steps: int) -> ItemScore:
    """Compare a prefill of ``item`` with its full-prefill reference (decodes ``steps``
    tokens from the result's cache, which grows)."""
    served = torch.log_softmax(result.logits.double(), dim=-1)
    kl = float((item.reference.exp() * (item.reference - served)).sum().clamp_min(0.0))
    greedy = greedy_continue(loaded, result.cache, result.logits, steps)
    return ItemScore(
        id=item.id,
        kind=item.kind,
        top1=int(result.logits.argmax()) == item.greedy[0],
        kl=kl,
        greedy_match=tuple(greedy) == item.greedy,
        length=result.length,
        reused=result.reused,
        recomputed=result.recomputed,
        fresh=result.fresh,
        token_layers=result.token_layers,
    )


def _encoder(loaded: LoadedModel) -> Callable[[str], tuple[int, ...]]:
    def encode(text: str) -> tuple[int, ...]:
        return tuple(loaded.tokenizer.encode(text, add_special_tokens=False))

    return encode
