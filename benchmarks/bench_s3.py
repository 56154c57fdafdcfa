"""Load of a 2,048-token prefix from the object-store tier, against a plain parallel GET of
the same objects; and what the planner says of such a tier.

SmolLM2-135M in float32 (30 layers, 3 KV heads, head_dim 64), 16-token blocks: the
prefix is 128 objects of one frame each (about 737 KB). A real S3 API server (moto in
server mode, the tests' helper) runs on loopback.

- "load": ``cache.match`` + ``cache.load`` through a ``PrefixCache`` whose one tier is
  the s3 tier: every object fetched (parallel GETs on the store's pool), verified by the
  codec, and copied into one ``[layers, 2, kv_heads, 2048, head_dim]`` array.
- "plain GET": the same 128 objects fetched with the same client (an ``S3Store`` opened
  from the same settings: same obstore client, same credentials, same timeouts) at the
  same concurrency, bytes only: no verification, no copy.

Order alternates and each is repeated; the median, spread and ratio are printed (target:
the load at least 70 % of the plain GET's throughput). The loopback figures are bound
by moto (Python) sharing the machine's cores with the client; they are not a region's.

Then ``prefixcache plan`` on the Mooncake synthetic trace with ``--tier
memory:64G:20GB/s`` and an s3 tier at the bandwidth measured here and at 1 GB/s, a
planning figure for one server in the bucket's region (stated, not measured: see
docs/storage.md), to show whether the tier beats recomputing: for llama-3-8b, and for
llama-3-70b, whose prefill costs more per token of KV.

Run:  .venv/bin/python benchmarks/bench_s3.py [--repeats 9] [--no-plan]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import obstore  # noqa: E402

from prefixcache.cache import PrefixCache  # noqa: E402
from prefixcache.config import CacheConfig, KVLayout, TierConfig  # noqa: E402
from prefixcache.hashing import CacheContext  # noqa: E402
from prefixcache.storage.open import open_store  # noqa: E402
from prefixcache.storage.s3 import S3Store  # noqa: E402
from s3_server import ENV, MotoServer  # noqa: E402  (the tests' helper: a real server on loopback)

LAYOUT = KVLayout(layers=30, kv_heads=3, head_dim=64, dtype="float32")
BLOCK = 16
TOKENS = list(range(2048))
CONCURRENCY = 16
TARGET = 0.70
CTX = CacheContext(tenant="bench", model="smollm2-135m")
TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
REGION_BANDWIDTH = "1GB/s"  # stated for a real region, not measured here (docs/storage.md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-plan", action="store_true", help="skip the planner runs")
    args = parser.parse_args()
    os.environ.update(ENV)
    with tempfile.TemporaryDirectory() as tmp:
        server = MotoServer(Path(tmp)).start()
        try:
            measured = bench_load(server.endpoint, args.repeats)
        finally:
            server.stop()
    if not args.no_plan:
        plan("llama-3-8b", f"{measured:.2f}GB/s", "measured here, loopback")
        plan("llama-3-8b", REGION_BANDWIDTH, "stated for a real region, not measured")
        plan("llama-3-70b", REGION_BANDWIDTH, "the same tier, a model whose prefill costs more a token")


def bench_load(endpoint: str, repeats: int) -> float:
    """The two ways side by side; returns the load's median GB/s."""
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench-kv")
    tier = TierConfig(
        kind="s3", capacity_bytes=1 << 34, bucket="bench-kv", prefix="bench", endpoint=endpoint,
        read_timeout=10.0, concurrency=CONCURRENCY,
    )  # fmt: skip
    kv = np.random.default_rng(0).standard_normal(LAYOUT.shape(len(TOKENS))).astype(np.float32)
    config = CacheConfig(block_size=BLOCK, kv_layout=LAYOUT, tiers=(tier,), seed="bench")
    with PrefixCache(config) as cache:
        assert cache.insert(TOKENS, CTX, kv=kv) == len(TOKENS)
        assert cache.flush(timeout=120)
        plain_store = open_store(tier, 0, "bench")
        assert isinstance(plain_store, S3Store)
        listed = [o["path"] for chunk in obstore.list(plain_store._client, "bench/bench/") for o in chunk]
        assert len(listed) == len(TOKENS) // BLOCK
        pool = ThreadPoolExecutor(CONCURRENCY)
        out = np.empty_like(kv)

        def load() -> int:
            with cache.match(TOKENS, CTX) as m:
                loaded = cache.load(m, out)
            assert loaded.tokens == len(TOKENS)
            return kv.nbytes

        def plain() -> int:
            return sum(pool.map(lambda p: len(obstore.get(plain_store._client, p).bytes()), listed))

        assert load() and np.array_equal(out, kv)
        wire = plain()  # warm: connections open on both clients
        rates: dict[str, list[float]] = {"load": [], "plain GET": []}
        runs = {"load": load, "plain GET": plain}
        for rep in range(repeats):
            for name in ("load", "plain GET") if rep % 2 == 0 else ("plain GET", "load"):
                start = time.perf_counter()
                nbytes = runs[name]()
                rates[name].append(nbytes / (time.perf_counter() - start) / 1e9)
        pool.shutdown()
        plain_store.close()
    print(
        f"2,048-token prefix of SmolLM2-135M float32: {len(listed)} objects, {wire / 1e6:.1f} MB on the wire, "
        f"{CONCURRENCY} GETs at a time, moto on loopback, {repeats} runs each, alternating"
    )
    for name, got in rates.items():
        print(f"  {name:>9}: {statistics.median(got):5.3f} GB/s (min {min(got):5.3f}, max {max(got):5.3f})")
    ratio = statistics.median(rates["load"]) / statistics.median(rates["plain GET"])
    verdict = "met" if ratio >= TARGET else "NOT met"
    print(f"  load / plain GET: {ratio:.0%} (target {TARGET:.0%}: {verdict})")
    return statistics.median(rates["load"])


def plan(model: str, bandwidth: str, said: str) -> None:
    """``prefixcache plan`` with an s3 tier of ``bandwidth``: its tier table and verdict."""
    cmd = [
        str(ROOT / ".venv" / "bin" / "prefixcache"), "plan", str(TRACE), "--model", model,
        "--target-hit-rate", "0.5", "--tier", "memory:64G:20GB/s", "--tier", f"s3:10T:{bandwidth}",
    ]  # fmt: skip
    print(f"\n$ prefixcache plan {TRACE.name} --model {model} --target-hit-rate 0.5 "
          f"--tier memory:64G:20GB/s --tier s3:10T:{bandwidth}    # {said}")  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    lines = done.stdout.splitlines()
    keep = [i for i, line in enumerate(lines) if line.startswith(("Tiers,", "  tier ", "  memory", "  s3", "  total"))]
    keep += [i for i, line in enumerate(lines) if "too slow" in line and i not in keep]
    for i in sorted(keep):
        print(lines[i])
    if done.returncode:
        print(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"plan failed: {done.returncode}")


if __name__ == "__main__":
    main()
