"""Time to first token on SmolLM2-135M (CPU) with 0, 50, 90 and 100 % of the prompt cached.

Each prompt is random tokens; the cached share is inserted first (its KV from a real
prefill) into a memory-tier cache, then the engine serves the whole prompt with
``max_tokens=1``. TTFT is the engine's own prefill time (match + load + suffix prefill
+ first logits). Run: ``.venv/bin/python benchmarks/bench_ttft.py``.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.engine import Engine, Request, SamplingParams, load_model
from prefixcache.engine.kv import cut_cache
from prefixcache.engine.runner import Sequence

SIZES = (512, 1024, 2048)
SHARES = (0.0, 0.5, 0.9, 1.0)
REPEATS = 3


def main() -> None:
    lm = load_model(models_dir=Path(__file__).resolve().parent.parent / ".prefixcache" / "models", device="cpu")
    layout = KVLayout(layers=lm.kv.layers, kv_heads=lm.kv.kv_heads, head_dim=lm.kv.head_dim, dtype=lm.kv.dtype)
    rng = random.Random(0)
    print(f"TTFT on {lm.source} (cpu, float32), median of {REPEATS}")
    print(f"{'prompt':>7} {'cached':>7} {'TTFT ms':>9} {'speedup':>8}")
    with tempfile.TemporaryDirectory():
        for size in SIZES:
            base = None
            for share in SHARES:
                times = []
                for rep in range(REPEATS + 1):  # the first run warms up
                    cache = PrefixCache(
                        CacheConfig(
                            block_size=16,
                            kv_layout=layout,
                            partial_blocks=True,
                            tiers=(TierConfig(kind="memory", capacity_bytes=1 << 30),),
                        )
                    )
                    engine = Engine(lm, "bench", cache=cache)
                    tokens = [rng.randrange(100, 49_000) for _ in range(size)]
                    cached = int(size * share)
                    if cached:
                        seq = Sequence(lm)
                        seq.prefill(tokens[:cached])
                        cache.insert(tokens[:cached], engine.context("t"), kv=cut_cache(seq.cache, cached))
                    done = engine.generate(Request(tokens, "t", SamplingParams(1, 0.0))).result(300)
                    engine.close()
                    cache.close()
                    if rep:
                        times.append(done.usage.prefill_s)
                ttft = statistics.median(times)
                base = base or ttft
                print(f"{size:>7} {share:>7.0%} {ttft * 1000:>9.1f} {base / ttft:>7.1f}x")


if __name__ == "__main__":
    main()
