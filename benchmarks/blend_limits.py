"""What bounds a blended prefill's quality on this model: better token choice, or the
exact-match bar itself? Two measurements on the evaluation set's reordered-RAG prompts.

1. **An oracle choice.** CacheBlend recomputes the reused tokens whose KV deviates most
   at an early layer (``_deviating``). The oracle instead knows each reused token's true
   error: the squared distance of its cached, re-rotated K and V from the full
   prefill's, summed over every layer, which no real plan can know before it computes
   them. Both choose the same number of tokens (CacheBlend's ``r``), so the work is the
   same; only the choice differs. The oracle's choice replaces ``_deviating`` here (a
   study, not a plan: nothing in the library reads it).
2. **The precision floor.** A full prefill with no reuse at all, in bfloat16 (decoding
   in float32 from its cache), against the float32 full prefill: how often a
   perturbation that serving systems take as harmless already changes the 32-token
   greedy answer.

Quality as the gate measures it: top-1 next-token agreement, greedy-32 exact match (to
the end of turn) and the mean KL of the next token; work done is (token, layer) pairs
run over a full prefill's.

    .venv/bin/python benchmarks/blend_limits.py [--threads 2] [--items N] [--rates 30,50,70]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable

import torch
from transformers import DynamicCache

import prefixcache.blend.prefill as prefill
from bench_blend import reordered_rag  # the benchmark's prompts, prepared alike
from prefixcache.blend import BlendResult, CacheBlend, blend_prefill
from prefixcache.blend.gate import BlendItem
from prefixcache.blend.plan import Layout, lay_out
from prefixcache.blend.rope import rotary_of
from prefixcache.engine import LoadedModel
from prefixcache.quality.reference import full_prefill, score_result
from prefixcache.quality.verdict import GateFigures, ItemScore

_deviating = prefill._deviating  # the real choice, kept to compare with


def true_error(lm: LoadedModel, item: BlendItem) -> torch.Tensor:
    """Per position, the squared distance of the blend's starting KV (re-rotated cache;
    zeros where fresh) from the full prefill's, summed over layers, heads and dims."""
    _, seq = full_prefill(lm, item.item.tokens)
    layout = lay_out(item.segments)
    dtype = next(lm.model.parameters()).dtype
    keys, values = prefill._blended_base(item.segments, layout, lm, rotary_of(lm.model), dtype)
    error = torch.zeros(layout.length, dtype=torch.float64)
    for index, layer in enumerate(seq.cache.layers):
        assert layer.keys is not None and layer.values is not None
        for full, base in ((layer.keys, keys[index]), (layer.values, values[index])):
            error += (full.double() - base.double()).pow(2).sum(dim=(0, 1, 3)).cpu()
    return error


def oracle_choice(error: torch.Tensor) -> Callable[..., torch.Tensor]:
    """``_deviating`` with the true error in place of the deviation at the check layer:
    the same rows kept, by another score."""

    def choose(
        plan: CacheBlend,
        k: torch.Tensor,
        v: torch.Tensor,
        cached_k: torch.Tensor,
        cached_v: torch.Tensor,
        positions: torch.Tensor,
        layout: Layout,
        n: int,
    ) -> torch.Tensor:
        return prefill._recompute_top(plan, error.to(positions.device)[positions].float(), positions, layout, n)

    return choose


def low_precision(lm: LoadedModel, item: BlendItem, dtype: torch.dtype, low: LoadedModel) -> BlendResult:
    """A full prefill in ``dtype`` (no reuse), as a result to score in float32."""
    logits, seq = full_prefill(low, item.item.tokens)
    cache = DynamicCache(config=lm.model.config)
    for index, layer in enumerate(seq.cache.layers):
        assert layer.keys is not None and layer.values is not None
        cache.update(layer.keys.float(), layer.values.float(), index)
    layers = lm.kv.layers
    return BlendResult(logits.float(), cache, 0, 0, len(item.item.tokens), len(item.item.tokens) * layers)


def row(label: str, scores: list[ItemScore], layers: int) -> str:
    f = GateFigures.of(label, scores, layers)
    marks = "".join("." if s.greedy_match else "x" for s in scores)
    return f"{label:<34}{f.work:>10.1%}{f.top1:>8.1%}{f.greedy_em:>8.1%}{f.mean_kl:>10.4f}  {marks}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--items", type=int, default=0, help="use the first N reordered-RAG prompts (0: all)")
    parser.add_argument("--rates", default="30,50,70", help="CacheBlend's r values (percent, comma-separated)")
    args = parser.parse_args()
    lm, prepared = reordered_rag(args.threads, args.items)
    layers, steps = prepared.prepared.layers, prepared.prepared.steps
    errors = [true_error(lm, item) for item in prepared.items]
    print(f"{len(prepared.items)} reordered-RAG prompts; greedy answers of up to {steps} tokens")
    print(f"{'choice':<34}{'work':>10}{'top-1':>8}{'EM':>8}{'mean KL':>10}  per prompt (. same answer, x not)")
    for r in (float(x) for x in args.rates.split(",")):
        plan = CacheBlend(r)
        real = [score_result(lm, item.item, blend_prefill(lm, item.segments, plan), steps) for item in prepared.items]
        print(row(f"deviation at layer 1, r={r:g}", real, layers))
        oracle = []
        try:
            for item, error in zip(prepared.items, errors, strict=True):
                prefill._deviating = oracle_choice(error)
                oracle.append(score_result(lm, item.item, blend_prefill(lm, item.segments, plan), steps))
        finally:
            prefill._deviating = _deviating
        print(row(f"oracle: true KV error, r={r:g}", oracle, layers))
    for dtype in (torch.bfloat16, torch.float16):
        low = dataclasses.replace(lm, model=copy.deepcopy(lm.model).to(dtype))
        scores = [score_result(lm, item.item, low_precision(lm, item, dtype, low), steps) for item in prepared.items]
        print(row(f"full prefill in {str(dtype).removeprefix('torch.')}", scores, layers))


if __name__ == "__main__":
    main()
