"""Where a batched decode step's time goes (issue #31): ``Batch.step`` at 1, 4, 8 and 16
rows against one row, in float32 and bfloat16, and what a prefill chunk costs with and
without 16 more tokens in it (what fusing the decode rows into a chunk would add).

SmolLM2-135M on this machine's CPU; every row holds ``--tokens`` tokens of KV. Each
figure is the median of ``--steps`` steps after warm-up steps; rounds alternate the
order of the dtypes. Ratios are against the same dtype's one-row step in the same
round: decode tokens/s at N rows over tokens/s at 1 row (what batching can buy on a
closed loop that keeps N rows decoding; with the largest difference of the first row's
logits from its logits decoded alone: every row here is as long as the others, so none
is padded and the difference is the batched products' own; a row padded beside longer
ones drifts further in bfloat16, see docs/server.md), and a chunk's time with 16 tokens
more over the chunk alone (set against a 16-row step: what fusing would save; the 16
tokens here attend to the chunk's KV, not to 16 rows' own, so a fused step would add those reads).

Run:  .venv/bin/python benchmarks/bench_batch_step.py [--rounds 2] [--tokens 600] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from prefixcache.engine.batch import Batch
from prefixcache.engine.model import LoadedModel, load_model
from prefixcache.engine.runner import Sequence

MODELS = Path(__file__).resolve().parent.parent / ".prefixcache" / "models"
FUSED_ROWS = 16


@dataclass(frozen=True)
class Figures:
    dtype: str
    step_ms: dict[int, float]  # rows -> median step time
    drift: dict[int, float]  # rows -> largest difference of row 0's logits from its logits alone
    chunk_ms: dict[int, float]  # chunk tokens -> median forward time
    fused_ms: dict[int, float]  # chunk tokens + FUSED_ROWS -> median forward time


def median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def step_ms(lm: LoadedModel, sequences: list[Sequence], rows: int, steps: int) -> tuple[float, torch.Tensor]:
    """The median time of a step of ``rows`` rows, and row 0's logits after its first step."""
    batch = Batch(lm)
    fed = {batch.join(s.cache, s.length): 5 for s in sequences[:rows]}
    first = batch.step(dict(fed))[0][min(fed)]
    for _ in range(2):
        batch.step(dict(fed))
    return median_ms(lambda: batch.step(dict(fed)), steps), first


def chunk_ms(lm: LoadedModel, ids: torch.Tensor, history: int, tokens: int, repeats: int) -> float:
    """One prefill forward of ``tokens`` after ``history`` tokens of KV."""
    times = []
    for _ in range(repeats):
        cache = DynamicCache(config=lm.model.config)
        with torch.no_grad():
            lm.model(input_ids=ids[:, :history], cache=cache, use_cache=True, logits_to_keep=1)
            started = time.perf_counter()
            lm.model(input_ids=ids[:, history : history + tokens], cache=cache, use_cache=True, logits_to_keep=1)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def measure(dtype: str, rows: list[int], chunks: list[int], tokens: int, steps: int) -> Figures:
    lm = load_model(models_dir=MODELS, device="cpu", dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40_000, (1, tokens + max(chunks) + FUSED_ROWS), generator=generator)
    sequences = []
    for _ in range(max(rows)):
        sequence = Sequence(lm)
        sequence.prefill(torch.randint(100, 40_000, (tokens,), generator=generator).tolist())
        sequences.append(sequence)
    stepped = {n: step_ms(lm, sequences, n, steps) for n in rows}
    alone = stepped[1][1]
    return Figures(
        dtype,
        {n: ms for n, (ms, _) in stepped.items()},
        {n: float((logits - alone).abs().max()) for n, (_, logits) in stepped.items()},
        {c: chunk_ms(lm, ids, tokens // 2, c, 3) for c in chunks},
        {c: chunk_ms(lm, ids, tokens // 2, c + FUSED_ROWS, 3) for c in chunks},
    )


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def report(found: list[Figures], rows: list[int], chunks: list[int]) -> None:
    for dtype in dict.fromkeys(f.dtype for f in found):
        mine = [f for f in found if f.dtype == dtype]
        print(f"\n{dtype}: one decode step of every row")
        for n in rows:
            ms = [f.step_ms[n] for f in mine]
            gain = [n * f.step_ms[1] / f.step_ms[n] for f in mine]
            print(
                f"  {n:2d} rows: {statistics.median(ms):6.1f} ms a step, "
                f"{1000 * n / statistics.median(ms):6.1f} tok/s, against 1 row {spread(gain)}; "
                f"row 0's logits differ from alone by {max(f.drift[n] for f in mine):.2g}"
            )
        for c in chunks:
            alone = [f.chunk_ms[c] for f in mine]
            extra = [f.fused_ms[c] - f.chunk_ms[c] for f in mine]
            apart = [f.step_ms[FUSED_ROWS] for f in mine if FUSED_ROWS in f.step_ms]
            line = (
                f"  chunk of {c:3d}: {statistics.median(alone):6.1f} ms; with {FUSED_ROWS} tokens more "
                f"+{statistics.median(extra):5.1f} ms"
            )
            if apart:
                line += f" (a {FUSED_ROWS}-row step apart: {statistics.median(apart):5.1f} ms)"
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=600, help="KV tokens in every row")
    parser.add_argument("--steps", type=int, default=15, help="timed steps a figure")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="1 round, 64 tokens, rows 1 and 4, one chunk")
    args = parser.parse_args()
    rows, chunks = [1, 4, 8, FUSED_ROWS], [64, 128, 256]
    if args.quick:
        args.rounds, args.tokens, args.steps, rows, chunks = 1, 64, 3, [1, 4], [32]
    if args.tokens < 2 or args.rounds < 1 or args.steps < 1:
        raise SystemExit("--tokens must be >= 2, --rounds and --steps >= 1")
    print(f"SmolLM2-135M, {torch.get_num_threads()} threads, rows of {args.tokens} tokens, {args.rounds} rounds")
    found: list[Figures] = []
    for r in range(args.rounds):
        order = args.dtypes if r % 2 == 0 else args.dtypes[::-1]  # alternate which goes first
        for dtype in order:
            found.append(measure(dtype, rows, chunks, args.tokens, args.steps))
            print(f"round {r + 1}: {dtype} done", flush=True)
    report(found, rows, chunks)


if __name__ == "__main__":
    main()
