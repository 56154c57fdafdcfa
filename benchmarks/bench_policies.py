"""What the eviction policies cost: replay time on both engines, and per access in the cache.

1. Replay seconds on the Mooncake conversation trace (tree mode, blocks of 512, warm-up
   0.5) at 1M, 3M and 10M tokens: lru, s3fifo and gittins on the native engine (the
   compiled kernel, best of ``--repeats``), gittins on the python engine (the real
   ``PrefixCache``, one run), in this process on the same parsed requests; the ratio
   native / python for gittins, and whether both engines gave the same hit tokens and
   evictions (they must).
2. The cost per access in the ``PrefixCache`` itself, as benchmarks/bench_match.py
   measures a match: ``PrefixCache.access`` (match, store what is missing, release) of
   1,024-token prompts (one of 64 shared 512-token prefixes, then a fresh tail) on a
   full cache of 4,096 blocks of 16 tokens, so every access hits, stores and evicts;
   microseconds per access for lru, s3fifo and gittins, and each as a ratio to lru.

Run:  .venv/bin/python benchmarks/bench_policies.py [TRACE] [--repeats 3] [--capacities 1e6,3e6,1e7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from prefixcache import CacheConfig, CacheContext, PrefixCache
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig, ReplayResult
from prefixcache.sim.summary import TraceSummary, summarize
from prefixcache.sim.traces import Request, read_trace

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE.parent / "tests" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
POLICIES = ("lru", "s3fifo", "gittins")
VOCAB = 49_152


def replay_once(
    requests: list[Request], summary: TraceSummary, policy: str, capacity: float, engine: str
) -> tuple[float, ReplayResult]:
    cfg = ReplayConfig(CacheConfig(policy=policy, capacity_tokens=int(capacity), block_size=512))
    start = time.perf_counter()
    (result,) = replay(lambda: requests, [cfg], optimal=False, summary=summary, engine=engine, warmup=0.5)
    assert result.engine == engine, result.engine
    return time.perf_counter() - start, result


def bench_replays(path: Path, capacities: list[float], repeats: int) -> None:
    requests = list(read_trace(path, "mooncake"))  # parsed once, outside the timing
    summary = summarize(lambda: requests)
    print(f"{path.name}: {len(requests):,} requests; replay seconds (native: best of {repeats})")
    for capacity in capacities:
        row = []
        native: dict[str, tuple[float, ReplayResult]] = {}
        for policy in POLICIES:
            runs = [replay_once(requests, summary, policy, capacity, "native") for _ in range(repeats)]
            native[policy] = min(runs, key=lambda run: run[0])
            row.append(f"{policy} {native[policy][0]:6.2f}")
        py_s, py = replay_once(requests, summary, "gittins", capacity, "python")
        nat_s, nat = native["gittins"]
        same = (nat.hit_tokens, nat.evictions) == (py.hit_tokens, py.evictions)
        print(
            f"  {capacity:8.0e} tokens: native {' | '.join(row)} s; gittins python {py_s:6.2f} s;"
            f" gittins native / python {nat_s / py_s:.3f} ({py_s / nat_s:.0f}x faster);"
            f" {'same' if same else 'DIFFERENT'} hit tokens ({py.hit_tokens:,}) and evictions ({py.evictions:,})"
        )


def per_access_us(policy: str, rng: random.Random, rounds: int = 5, per_round: int = 300) -> float:
    """Median over ``rounds`` of the mean time of one ``access`` on a full cache."""
    bs, prefix, tail = 16, 512, 512
    prefixes = [[rng.randrange(VOCAB) for _ in range(prefix)] for _ in range(64)]
    prompts = [
        rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(tail)] for _ in range(rounds * per_round + 600)
    ]
    cache = PrefixCache(CacheConfig(policy=policy, block_size=bs, capacity_tokens=4096 * bs))
    ctx = CacheContext(tenant="bench", model="m")
    for tokens in prompts[:600]:  # full, and past the policy's first tables
        cache.access(tokens, ctx)
    assert cache.stats().evictions > 0
    runs = []
    for r in range(rounds):
        batch = prompts[600 + r * per_round : 600 + (r + 1) * per_round]
        start = time.perf_counter()
        for tokens in batch:
            cache.access(tokens, ctx)
        runs.append((time.perf_counter() - start) / per_round * 1e6)
    return statistics.median(runs)


def bench_access() -> None:
    print("PrefixCache.access, 1,024-token prompts on a full cache of 4,096 blocks of 16 (median us/access):")
    costs = {policy: per_access_us(policy, random.Random(7)) for policy in POLICIES}
    for policy, us in costs.items():
        print(f"  {policy:>8}: {us:7.1f} us/access   ratio to lru {us / costs['lru']:5.2f}x")
    print(f"  gittins / s3fifo: {costs['gittins'] / costs['s3fifo']:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the native engine (best counts)")
    parser.add_argument("--capacities", default="1e6,3e6,1e7", help="tokens, comma-separated")
    args = parser.parse_args()
    bench_replays(args.trace, [float(c) for c in args.capacities.split(",")], args.repeats)
    bench_access()


if __name__ == "__main__":
    main()
