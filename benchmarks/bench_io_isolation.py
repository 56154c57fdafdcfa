"""One tenant's memory hit while another tenant's shared tier answers slowly: the
engine's cache I/O on several workers, at most two a tenant (the default), against one
worker (the engine before: every tenant's match, load, probe and store on one FIFO
thread), in the same run.

SmolLM2-135M on this machine's CPU, through the ``Engine`` (4 requests in flight), over
a cache of host RAM and a Redis tier (a real ``redis-server`` behind a loopback proxy,
the tests' own). Tenant ``globex`` asks a 512-token prompt whose KV the memory tier holds
whole (its match probes nothing: no block of it is unknown to the tree), ``max_tokens =
1``; its TTFT is the time from ``submit`` to its first event. Unloaded: those requests
alone, one after another. Loaded: the proxy holds every Redis reply 1.5 s (a far region
or a loaded Redis: slow answers, within the tier's read timeout, that never open the
breaker), while two clients of tenant ``acme`` send new 32-token prompts back to back:
each one's match probes Redis for its blocks (the public chain, then its own: two
replies, 3 s), then it prefills. Rounds alternate the order of the two configurations;
every round is printed, with acme's own median TTFT (what its slow tier costs it).

Target (issue 39): globex's median TTFT loaded within 1.5x of its unloaded median.

NOTE: torch runs on one thread (``--threads``). On a 2-core machine shared with other
work, the worker's OpenMP team of two spins against the other processes, and a step's
time swings tenfold from one request to the next (0.05 to 1.7 s for the same memory hit,
measured here at a load average of 2.7): that noise would hide what this measures, the
wait of one tenant's hit behind another tenant's I/O. Both configurations run alike.

Run:  .venv/bin/python benchmarks/bench_io_isolation.py [--rounds 2] [--hits 10] [--threads 1]
(about 7 minutes on a 2-core CPU at the defaults: the baseline's hits wait seconds each.)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.engine import Engine, Event, LoadedModel, Request, SamplingParams, load_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from redis_server import RedisServer, StallingProxy  # noqa: E402 - the tests' helpers, not part of the package

DELAY_S = 1.5  # every Redis reply, loaded
HOT_TOKENS = 512  # globex's prompt, held in memory whole
MISS_TOKENS = 32  # acme's new prompts: two blocks, probed in Redis
FLOOD = 2  # acme's clients
TARGET = 1.5  # loaded / unloaded, median TTFT
ONE = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class Setup:
    name: str
    workers: int
    per_tenant: int


SETUPS = (Setup("8 workers, 2 a tenant", 8, 2), Setup("1 worker (before)", 1, 1))


def ttft(engine: Engine, tokens: list[int], tenant: str) -> float:
    """Seconds from ``submit`` to the request's first event (its token, or its end)."""
    first = threading.Event()

    def sink(event: Event) -> None:
        first.set()

    started = time.perf_counter()
    engine.submit(Request(tokens, tenant, ONE), sink)
    assert first.wait(120), "no answer"
    return time.perf_counter() - started


def hits_of(engine: Engine, hot: list[int], hits: int, rng: random.Random) -> list[float]:
    """globex's TTFTs, ``hits`` requests one after another, a random pause after each
    (loaded, they land at different points of acme's probes; the same pauses unloaded)."""
    out = []
    for _ in range(hits):
        out.append(ttft(engine, hot, "globex"))
        time.sleep(rng.uniform(0.0, DELAY_S / 3))
    return out


def flood(engine: Engine, stop: threading.Event, seed: int, took: list[float]) -> None:
    """acme's client: a new prompt (a miss, probed in Redis) as soon as the last is answered."""
    rng = random.Random(seed)
    while not stop.is_set():
        took.append(ttft(engine, [rng.randrange(100, 49_000) for _ in range(MISS_TOKENS)], "acme"))


def run(lm: LoadedModel, setup: Setup, proxy: StallingProxy, namespace: str, hits: int) -> tuple[float, float, float]:
    """globex's median TTFT (unloaded, loaded) under ``setup``, and acme's meanwhile."""
    layout = KVLayout(layers=lm.kv.layers, kv_heads=lm.kv.kv_heads, head_dim=lm.kv.head_dim, dtype=lm.kv.dtype)
    tiers = (
        TierConfig(kind="memory", capacity_bytes=2 << 30),
        # NOTE: a read timeout above the delay: the slow answers are successes, as a far region's are
        TierConfig(
            kind="redis",
            capacity_bytes=8 << 30,
            url=proxy.url,
            namespace=namespace,
            connect_timeout=10.0,
            read_timeout=10.0,
        ),
    )
    cache = PrefixCache(CacheConfig(block_size=16, kv_layout=layout, tiers=tiers, seed="bench-io"))
    engine = Engine(lm, "bench", cache=cache, max_active=4, io_workers=setup.workers, io_per_tenant=setup.per_tenant)
    rng = random.Random(namespace)
    hot = [rng.randrange(100, 49_000) for _ in range(HOT_TOKENS)]
    try:
        ttft(engine, hot, "globex")  # computed once and stored: a memory hit from now on
        assert engine.wait_idle(120) and cache.flush(120)
        unloaded = hits_of(engine, hot, hits, rng)
        proxy.delay = DELAY_S
        stop, misses = threading.Event(), []
        clients = [threading.Thread(target=flood, args=(engine, stop, i, misses), daemon=True) for i in range(FLOOD)]
        for client in clients:
            client.start()
        time.sleep(DELAY_S / 3)  # acme's first probes are waiting on Redis
        loaded = hits_of(engine, hot, hits, rng)
        stop.set()
        for client in clients:
            client.join(60)
    finally:
        proxy.delay = 0.0  # NOTE: so that the writes still queued for Redis drain at once
        engine.close(60)
        cache.close(60)
    return statistics.median(unloaded), statistics.median(loaded), statistics.median(misses) if misses else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hits", type=int, default=10, help="globex's requests per phase")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (see the NOTE above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(models_dir=ROOT / ".prefixcache" / "models", device="cpu")
    results: dict[str, list[tuple[float, float]]] = {s.name: [] for s in SETUPS}
    with tempfile.TemporaryDirectory(prefix="bench-io-") as workdir:
        redis = RedisServer(Path(workdir)).start()
        proxy = StallingProxy(redis.port)
        try:
            print(f"globex's memory-hit TTFT ({HOT_TOKENS} tokens, median of {args.hits}), acme's Redis at {DELAY_S} s")
            load = os.getloadavg()[0]
            print(f"(torch on {args.threads} thread(s); load average at the start {load:.1f}, {os.cpu_count()} cores)")
            for r in range(args.rounds):
                order = SETUPS if r % 2 == 0 else SETUPS[::-1]
                for setup in order:
                    unloaded, loaded, miss = run(lm, setup, proxy, f"bench-io-{r}-{setup.workers}", args.hits)
                    results[setup.name].append((unloaded, loaded))
                    print(
                        f"  round {r + 1}  {setup.name:<22} unloaded {unloaded * 1000:7.1f} ms   "
                        f"loaded {loaded * 1000:7.1f} ms   {loaded / unloaded:6.2f}x   (acme's misses {miss:.2f} s)"
                    )
        finally:
            proxy.stop()
            redis.stop()
    print("over the rounds (median of the rounds' medians):")
    for setup in SETUPS:
        rows = results[setup.name]
        unloaded = statistics.median(u for u, _ in rows)
        loaded = statistics.median(x for _, x in rows)
        spread = ", ".join(f"{x / u:.2f}x" for u, x in rows)
        print(f"  {setup.name:<22} {loaded / unloaded:6.2f}x unloaded (rounds: {spread})")
    several = [x / u for u, x in results[SETUPS[0].name]]
    verdict = "met" if max(several) <= TARGET else "NOT met"
    worst = max(several)
    print(f"target: {SETUPS[0].name} within {TARGET}x of unloaded in every round: {verdict} (worst {worst:.2f}x)")


if __name__ == "__main__":
    main()
