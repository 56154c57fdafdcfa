"""Compressed KV codecs per storage tier (issue #29): what each codec buys in bytes and
costs in time, every figure against a baseline measured in the same process.

1. Bytes per 16-token block and compression ratio per codec, for SmolLM2-135M's layout
   (30 layers, 3 KV heads, head_dim 64) in float32 (our engine's dtype) and in bfloat16
   (what vLLM stores). Sizes are whole frames, header and key included, from
   ``codec.encoded_size``: what a tier's capacity counts. Each ratio names its
   baseline: raw frames of the same dtype, and raw bfloat16 frames (the cheap lossy
   choice a user could make instead of a codec).
2. Encode and decode throughput per codec, in GB/s of decoded KV, beside a memcpy of the
   raw frames (``np.copyto`` into reused buffers). Encode is ``codec.encode`` of every
   block; decode is ``codec.decode`` (verify, dequantise) and the copy of the block into
   its place in one ``[layers, 2, kv_heads, tokens, head_dim]`` array, which is what a
   load does with it. Rounds alternate the order; median and min-max of the rounds.
3. Load of a 2,048-token prefix through ``PrefixCache`` (match + load into a reused
   array) from a cache whose only tier is memory, disk or Redis in each codec, time per
   load against raw's in the same round. Disk is measured warm (page cache holding the
   files) and cold: before each cold load the tier's files are synced and dropped from
   this machine's page cache with ``posix_fadvise(DONTNEED)`` (a virtual disk's host
   may still cache them: on such a machine "cold" is the guest's view). Redis is a
   ``redis-server`` this script starts on loopback (tests/redis_server.py). Then time
   to first token on SmolLM2 (the real engine, CPU) for a prompt whose first 90 % (whole
   blocks) is loaded from each tier and codec and the rest prefilled, against raw and
   against a full prefill.
4. Token hit rate at equal bytes on both Mooncake traces (LRU, tree mode, the traces'
   512-token blocks): a budget of N bytes holds N / (frame bytes per token) tokens of a
   codec, so each codec is replayed at the capacity in tokens its frames fit in N, for
   N = the bytes of 1M and of 3M raw tokens. Frame bytes are those of the SmolLM2
   cache's 16-token blocks (section 1), the block a tier really stores.
5. A summary against the issue's targets: int8 >= 1.9x tokens per byte with TTFT at
   90 % cached from disk no worse than raw's; int4 >= 3.5x; each ratio with its dtype.

KV values are random normals for sections 2 and 3 (the codecs' work does not depend on
the values; ``Unrepresentable`` aside, which normals never hit) and the model's own KV
for the TTFT runs.

Run:  .venv/bin/python benchmarks/bench_codecs.py [--quick] [--repeats N] [--no-model]
      [--no-redis] [--traces DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TierConfig
from prefixcache.hashing import CacheContext, get_hash
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.summary import summarize
from prefixcache.sim.traces import read_trace
from prefixcache.storage import codec, quant

ROOT = Path(__file__).resolve().parent.parent
TRACE_DIRS = (ROOT / "tests" / "data" / "traces", Path("/work/shared/traces"))
TRACES = ("mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl")
CODECS: tuple[str, ...] = tuple(codec.CODECS)
LOSSY = tuple(c for c in CODECS if c != "raw")
DTYPES = ("float32", "bfloat16")
BLOCK = 16
PREFIX_TOKENS = 2048
CACHED_SHARE = 0.9
BUDGETS = (1_000_000, 3_000_000)  # N = the bytes of this many raw tokens
TRACE_BLOCK = 512  # the Mooncake traces are hashed in 512-token blocks
KEY_LEN = len(get_hash(CacheConfig().hash)().digest())  # the cache's block keys, in every frame's header
INT8_TARGET, INT4_TARGET = 1.9, 3.5
REPEATS = 5
TENANT = "bench"
CTX = CacheContext(tenant=TENANT, model="smollm2-135m")


def layout(dtype: str) -> KVLayout:
    """SmolLM2-135M's KV layout in ``dtype``."""
    return KVLayout(layers=30, kv_heads=3, head_dim=64, dtype=dtype)


def spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """Median and (min-max) of a measurement's rounds."""
    med, lo, hi = statistics.median(values), min(values), max(values)
    return f"{fmt.format(med)} ({fmt.format(lo)}-{fmt.format(hi)})"


def alternating(items: Sequence[Any], rounds: int) -> Iterator[tuple[int, list[Any]]]:
    """Each round's order: forward, then reversed, and so on, so that no item always runs
    first (cold caches, a neighbour's load) or last."""
    for r in range(rounds):
        yield r, list(items) if r % 2 == 0 else list(reversed(items))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------- 1. sizes


def frame_bytes(dtype: str, name: str) -> int:
    """Bytes of one 16-token block's frame of ``name`` (header and key included)."""
    return codec.encoded_size(layout(dtype).shape(BLOCK), dtype, KEY_LEN, name)


@dataclass(frozen=True)
class Ratio:
    """How many frames of a codec fit in the bytes of one raw frame of ``against``."""

    dtype: str  # the KV's dtype the codec encodes (and decodes into)
    codec: str
    against: str  # the raw frame's dtype
    value: float


def ratio(dtype: str, name: str, against: str) -> Ratio:
    return Ratio(dtype, name, against, frame_bytes(against, "raw") / frame_bytes(dtype, name))


def print_sizes() -> None:
    print(f"1. Bytes per {BLOCK}-token block, SmolLM2-135M layout (30 layers x 2 x 3 heads x 64), whole frames")
    print(f"   (header and {KEY_LEN}-byte key included); ratio = raw frame bytes / codec frame bytes")
    print(f"   {'dtype':<9} {'codec':<6} {'bytes/block':>12} {'bytes/token':>12} {'x vs raw same dtype':>20}"
          f" {'x vs raw bfloat16':>18}")  # fmt: skip
    for dtype in DTYPES:
        for name in CODECS:
            size = frame_bytes(dtype, name)
            same, bf16 = ratio(dtype, name, dtype).value, ratio(dtype, name, "bfloat16").value
            print(f"   {dtype:<9} {name:<6} {size:>12,} {size / BLOCK:>12,.0f} {same:>19.2f}x {bf16:>17.2f}x")
    print()


# ---------------------------------------------------------------------------- 2. throughput


def synthetic_kv(dtype: str, tokens: int, seed: int = 0) -> np.ndarray:
    """Random normal KV of ``tokens`` in ``dtype`` (bfloat16 as its bits, ``np.uint16``)."""
    values = np.random.default_rng(seed).standard_normal(layout("float32").shape(tokens), dtype=np.float32)
    return quant.bf16_bits(values) if dtype == "bfloat16" else values


def blocks_of(kv: np.ndarray) -> list[np.ndarray]:
    """The KV's 16-token blocks, each contiguous (as the cache hands a block to the codec)."""
    return [np.ascontiguousarray(kv[:, :, :, t : t + BLOCK]) for t in range(0, kv.shape[3], BLOCK)]


def block_ids(i: int) -> tuple[bytes, bytes]:
    """Block ``i``'s key and token bytes (the frame only keeps the tokens' checksum)."""
    return i.to_bytes(KEY_LEN, "little"), np.arange(i * BLOCK, (i + 1) * BLOCK, dtype="<u4").tobytes()


def bench_throughput(dtype: str, tokens: int, repeats: int) -> None:
    kv = synthetic_kv(dtype, tokens)
    blocks = blocks_of(kv)
    ids = [block_ids(i) for i in range(len(blocks))]
    frames = {
        name: [codec.encode(k, t, b, dtype=dtype, codec=name) for (k, t), b in zip(ids, blocks, strict=True)]
        for name in CODECS
    }
    raw_views = [np.frombuffer(f, np.uint8) for f in frames["raw"]]
    copies = [np.empty_like(v) for v in raw_views]
    out = np.empty_like(kv)

    def memcpy() -> None:
        for src, dst in zip(raw_views, copies, strict=True):
            np.copyto(dst, src)

    def encode(name: str) -> None:
        for (k, t), b in zip(ids, blocks, strict=True):
            codec.encode(k, t, b, dtype=dtype, codec=name)

    def decode(name: str) -> None:
        for i, ((k, _), f) in enumerate(zip(ids, frames[name], strict=True)):
            block = codec.decode(f, key=k)
            np.copyto(out[:, :, :, i * BLOCK : (i + 1) * BLOCK], block.view(out.dtype))

    memcpy()  # untimed: fault in every buffer once
    for name in CODECS:
        encode(name)
        decode(name)
    times: dict[str, list[float]] = {"memcpy": [], **{f"{op} {n}": [] for n in CODECS for op in ("encode", "decode")}}
    for _, order in alternating(("memcpy", *CODECS), repeats):
        for item in order:
            if item == "memcpy":
                times["memcpy"].append(timed(memcpy))
            else:
                times[f"encode {item}"].append(timed(lambda item=item: encode(item)))
                times[f"decode {item}"].append(timed(lambda item=item: decode(item)))
    gbs = lambda s: kv.nbytes / s / 1e9  # noqa: E731
    print(f"   {dtype} KV, {len(blocks)} blocks ({kv.nbytes / 1e6:.1f} MB decoded):")
    print(f"   {'codec':<6} {'encode GB/s':>20} {'decode GB/s':>20} {'encode / memcpy time':>22}"
          f" {'decode / memcpy time':>22}")  # fmt: skip
    base = times["memcpy"]
    print(f"   {'memcpy':<6} {spread([gbs(s) for s in base]):>20} {'(of the raw frames)':>20}")
    for name in CODECS:
        enc, dec = times[f"encode {name}"], times[f"decode {name}"]
        enc_x = [e / b for e, b in zip(enc, base, strict=True)]
        dec_x = [d / b for d, b in zip(dec, base, strict=True)]
        print(
            f"   {name:<6} {spread([gbs(s) for s in enc]):>20} {spread([gbs(s) for s in dec]):>20}"
            f" {spread(enc_x, '{:.1f}x'):>22} {spread(dec_x, '{:.1f}x'):>22}"
        )


# ---------------------------------------------------------------------------- 3. loads


def drop_pages(directory: Path) -> None:
    """Write the tier's files back and drop them from this machine's page cache, so the next
    read goes to the disk (only these files: the machine is shared)."""
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@dataclass
class Tier:
    """One tier kind to measure: how to configure it per codec, and what runs before a load."""

    label: str
    config: Callable[[str], TierConfig]
    cold_dir: Callable[[str], Path] | None = None  # a disk measured cold: its directory per codec

    def before_load(self, name: str) -> None:
        if self.cold_dir is not None:
            drop_pages(self.cold_dir(name))


def tiers_to_measure(root: Path, redis_url: str | None, tag: str) -> list[Tier]:
    """The tiers to measure, their files under ``root`` and Redis keys under ``tag``
    (each section stores its own blocks, so none adopts another's)."""

    def memory(name: str) -> TierConfig:
        return TierConfig(kind="memory", capacity_bytes=4 << 30, codec=name)

    def disk_dir(name: str) -> Path:
        return root / f"{tag}-disk-{name}"

    def disk(name: str) -> TierConfig:
        return TierConfig(kind="disk", capacity_bytes=16 << 30, path=str(disk_dir(name)), fsync="none", codec=name)

    tiers = [Tier("memory", memory), Tier("disk warm", disk), Tier("disk cold", disk, disk_dir)]
    if redis_url is not None:
        url = redis_url

        def redis(name: str) -> TierConfig:
            return TierConfig(
                kind="redis", capacity_bytes=16 << 30, url=url, namespace=f"{tag}-{name}", read_timeout=10.0, codec=name
            )

        tiers.append(Tier("redis", redis))
    return tiers


def open_cache(tier: TierConfig, dtype: str = "float32") -> PrefixCache:
    return PrefixCache(CacheConfig(block_size=BLOCK, kv_layout=layout(dtype), tiers=(tier,), seed="bench"))


def load(cache: PrefixCache, tokens: list[int], out: np.ndarray) -> None:
    """A hit: match, load (fetch, verify, decode, copy into ``out``), release."""
    with cache.match(tokens, CTX) as m:
        loaded = cache.load(m, out)
    if loaded.tokens != len(tokens):
        raise SystemExit(f"a load returned {loaded.tokens} of {len(tokens)} tokens: the tier lost blocks")


def bench_loads(tiers: list[Tier], tokens: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per load, by tier label and codec, one entry per round."""
    kv = synthetic_kv("float32", tokens, seed=1)
    ids = list(range(tokens))
    out = np.empty_like(kv)
    results: dict[str, dict[str, list[float]]] = {}
    built: dict[str, PrefixCache] = {}  # "disk warm" and "disk cold" share their caches
    with ExitStack() as stack:
        for tier in tiers:
            caches = {}
            for name in CODECS:
                config = tier.config(name)
                key = f"{config.kind}-{name}"
                if key not in built:
                    cache = stack.enter_context(open_cache(config))
                    if cache.insert(ids, CTX, kv=kv) != tokens or not cache.flush(timeout=120):
                        raise SystemExit(f"{tier.label} {name}: the prefix was not stored")
                    built[key] = cache
                caches[name] = built[key]
            for name in CODECS:  # untimed: a first load of each (and the one that checks it)
                tier.before_load(name)
                load(caches[name], ids, out)
                if name == "raw" and not np.array_equal(out, kv):
                    raise SystemExit(f"{tier.label}: a raw load returned other KV")
            times: dict[str, list[float]] = {name: [] for name in CODECS}
            for _, order in alternating(CODECS, repeats):
                for name in order:
                    tier.before_load(name)
                    times[name].append(timed(lambda cache=caches[name]: load(cache, ids, out)))
            results[tier.label] = times
    print(f"   {'tier':<10} {'codec':<6} {'load ms':>20} {'GB/s decoded':>13} {'time / raw':>20}")
    for label, times in results.items():
        for name in CODECS:
            rel = [t / r for t, r in zip(times[name], times["raw"], strict=True)]
            gbs = kv.nbytes / statistics.median(times[name]) / 1e9
            print(f"   {label:<10} {name:<6} {spread([t * 1e3 for t in times[name]], '{:.1f}'):>20} {gbs:>13.2f}"
                  f" {spread(rel, '{:.2f}x'):>20}")  # fmt: skip
    return results


# ---------------------------------------------------------------------------- 3b. TTFT


def bench_ttft(tiers: list[Tier], prompt_tokens: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """TTFT in seconds by tier label ("full prefill": no cache) and codec, one per round."""
    from prefixcache.engine import Engine, Request, SamplingParams, load_model

    lm = load_model(models_dir=ROOT / ".prefixcache" / "models", device="cpu")
    if lm.kv.layers != 30 or lm.kv.kv_heads != 3 or lm.kv.head_dim != 64:
        raise SystemExit(f"expected SmolLM2-135M's KV layout, got {lm.kv}")
    dtype = lm.kv.dtype
    cached = int(prompt_tokens * CACHED_SHARE) // BLOCK * BLOCK
    rng = random.Random(0)
    results: dict[str, dict[str, list[float]]] = {}
    with ExitStack() as stack:
        helper_cache = stack.enter_context(open_cache(TierConfig(kind="memory", capacity_bytes=4 << 30), dtype))
        helper = Engine(lm, "bench", cache=helper_cache)
        stack.callback(helper.close)
        plain = Engine(lm, "bench", cache=None)
        stack.callback(plain.close)
        setups: list[tuple[Tier | None, str, PrefixCache | None, Any]] = [(None, "-", None, plain)]
        for tier in tiers:
            if tier.label == "disk warm":
                continue  # TTFT from disk is measured cold
            for name in CODECS:
                cache = stack.enter_context(open_cache(tier.config(name), dtype))
                engine = Engine(lm, "bench", cache=cache)
                stack.callback(engine.close)
                setups.append((tier, name, cache, engine))

        def ask(engine: Any, tokens: list[int]) -> Any:
            usage = engine.generate(Request(tokens, TENANT, SamplingParams(1, 0.0))).result(600).usage
            if not engine.wait_idle(600):
                raise SystemExit("the engine did not settle")
            return usage

        # NOTE: round 0 warms every engine (its load buffer, the model's kernels) and is not counted
        for r, order in alternating(setups, repeats + 1):
            prompt = [rng.randrange(100, 49_000) for _ in range(prompt_tokens)]
            ask(helper, prompt[:cached])  # the model's own KV of the cached share, computed once a round
            with helper_cache.match(prompt[:cached], helper.context(TENANT)) as m:
                kv = np.array(helper_cache.load(m).kv)
            for tier, name, cache, engine in order:
                label = "full prefill" if tier is None else tier.label
                if tier is not None and cache is not None:
                    if cache.insert(prompt[:cached], engine.context(TENANT), kv=kv) != cached or not cache.flush(120):
                        raise SystemExit(f"{label} {name}: the cached share was not stored")
                    tier.before_load(name)
                usage = ask(engine, prompt)
                if cache is not None:
                    cache.flush(timeout=120)  # the engine's own store of the prompt, off the next measurement
                if usage.cached_tokens != (cached if cache is not None else 0):
                    raise SystemExit(f"{label} {name}: {usage.cached_tokens} tokens cached, expected {cached}")
                if r:
                    results.setdefault(label, {}).setdefault(name, []).append(usage.prefill_s)
    full = results["full prefill"]["-"]
    print(f"   SmolLM2 ({dtype}, CPU), {prompt_tokens}-token prompts, {cached} cached ({cached / prompt_tokens:.0%}),"
          f" a new prompt each round; full prefill {spread([t * 1e3 for t in full], '{:.0f}')} ms")  # fmt: skip
    print(f"   {'tier':<10} {'codec':<6} {'TTFT ms':>20} {'TTFT / raw':>20} {'speedup vs full':>20}")
    for label in (tier.label for tier in tiers if tier.label in results):
        by_codec = results[label]
        for name in CODECS:
            times = by_codec[name]
            rel = [t / r for t, r in zip(times, by_codec["raw"], strict=True)]
            speed = [f / t for f, t in zip(full, times, strict=True)]
            print(f"   {label:<10} {name:<6} {spread([t * 1e3 for t in times], '{:.0f}'):>20}"
                  f" {spread(rel, '{:.2f}x'):>20} {spread(speed, '{:.1f}x'):>20}")  # fmt: skip
    return results


# ---------------------------------------------------------------------------- 4. hit rate


Rates = dict[tuple[str, int, str], float]
"""Token hit rate by (KV dtype, budget in raw tokens, codec)."""


def tokens_in(budget_bytes: int, dtype: str, name: str) -> int:
    """Tokens whose 16-token frames of ``name`` fit in ``budget_bytes`` (whole blocks)."""
    return budget_bytes // frame_bytes(dtype, name) * BLOCK


def bench_hit_rates(trace: Path, dtypes: Sequence[str]) -> Rates:
    """Token hit rate by (dtype, budget in raw tokens, codec)."""
    requests = list(read_trace(trace, "mooncake"))
    summary = summarize(lambda: requests)
    cells = []
    for dtype in dtypes:
        for budget in BUDGETS:
            # N: the bytes of ``budget`` raw tokens' frames, rounded to whole raw blocks
            n_bytes = budget // BLOCK * frame_bytes(dtype, "raw")
            for name in CODECS:
                cells.append((dtype, budget, name, n_bytes, tokens_in(n_bytes, dtype, name)))
    # NOTE: one replay per distinct capacity (raw and bf16 on bfloat16 KV hold the same
    # tokens): the simulator merges configurations that are the same cache
    capacities = sorted({held for *_, held in cells})
    configs = [
        ReplayConfig(CacheConfig(policy="lru", capacity_tokens=held, block_size=TRACE_BLOCK, isolation="shared"))
        for held in capacities
    ]
    results = replay(lambda: requests, configs, trace_name=trace.name, optimal=False, summary=summary)
    if len(results) != len(capacities):
        raise SystemExit(f"{len(capacities)} capacities replayed, {len(results)} results")
    by_capacity = {held: result.token_hit_rate for held, result in zip(capacities, results, strict=True)}
    rates = {}
    print(f"   {trace.name} ({len(requests):,} requests), LRU, replayed on the {results[0].engine} engine")
    print(f"   {'dtype':<9} {'N':>14} {'codec':<6} {'tokens held':>12} {'hit rate':>9} {'x raw hits':>11}")
    for dtype, budget, name, n_bytes, held in cells:
        rate = rates[(dtype, budget, name)] = by_capacity[held]
        raw = rates[(dtype, budget, "raw")]
        gain = rate / raw if raw else math.nan
        n = f"{n_bytes / 1e9:.1f} GB" if name == "raw" else ""
        print(f"   {dtype:<9} {n:>14} {name:<6} {held:>12,} {rate:>9.2%} {gain:>10.2f}x")
    cross_check(trace)
    return rates


def cross_check(trace: Path) -> None:
    """The simulator's own answer to the same question (``replay --codec``'s function),
    where it is installed: SmolLM2 in bfloat16 as its cost model knows it, ratios taken
    at the trace's 512-token blocks (fewer headers and key scales per token than the
    16-token frames above, so slightly more tokens per byte)."""
    try:
        from prefixcache.sim.codec_replay import hit_rates_at_bytes
    except ImportError:
        print("   (the simulator's codec replay is not installed here: the table above is the only figure)")
        return
    for budget in BUDGETS:
        n_bytes = budget * layout("bfloat16").bytes_per_token
        try:
            rates = hit_rates_at_bytes(trace, n_bytes, CODECS, model="smollm2-135m", warmup=0.0)
        except Exception as exc:  # NOTE: a cross-check only: its failure is reported, the table above stands
            print(f"   (the simulator's codec replay failed: {type(exc).__name__}: {exc})")
            return
        cells = ", ".join(f"{name} {rates[name]:.2%}" for name in CODECS)
        print(f"   simulator (smollm2-135m bfloat16, 512-token frames), N = {n_bytes / 1e9:.1f} GB: {cells}")


# ---------------------------------------------------------------------------- main


def find_traces(directory: Path | None, quick: bool) -> list[Path]:
    names = TRACES[:1] if quick else TRACES
    dirs = (directory,) if directory is not None else TRACE_DIRS
    for d in dirs:
        if all((d / n).exists() for n in names):
            return [d / n for n in names]
    raise SystemExit(f"Mooncake traces ({', '.join(names)}) not found in {', '.join(map(str, dirs))}")


def start_redis(root: Path, stack: ExitStack) -> str | None:
    sys.path.insert(0, str(ROOT / "tests"))
    from redis_server import REDIS_SERVER, RedisServer  # the tests' helper: a real server on loopback

    if not Path(REDIS_SERVER).exists():
        print("(redis: skipped, no redis-server; `make test` installs it)")
        return None
    (root / "redis").mkdir()
    server = RedisServer(root / "redis").start()
    stack.callback(server.stop)
    return server.url


def summary(ttft: dict[str, dict[str, list[float]]] | None, hits: dict[str, Rates]) -> None:
    print("5. Summary against the issue's targets (ratios: whole 16-token frames, tokens per byte)")
    for name, target in (("int8", INT8_TARGET), ("int4", INT4_TARGET)):
        for against in ("float32", "bfloat16"):
            r = ratio(against, name, against).value
            verdict = "met" if r >= target else f"NOT met (short by {target - r:.2f}x)"
            print(
                f"   {name} on {against} KV vs raw {against}: {r:.2f}x tokens per byte (target >= {target}x): {verdict}"
            )
    for name in ("int8", "int4"):
        big = codec.stored_ratio(layout("bfloat16").shape(TRACE_BLOCK), "bfloat16", name, KEY_LEN)
        print(f"   ({name} vs raw bfloat16 at {TRACE_BLOCK}-token frames, fewer headers and key scales: {big:.2f}x)")
    for trace, rates in hits.items():
        for dtype in DTYPES:
            cells = ", ".join(
                f"{budget // 1_000_000}M {rates[(dtype, budget, 'int8')]:.1%} vs {rates[(dtype, budget, 'raw')]:.1%}"
                for budget in BUDGETS
            )
            print(f"   int8 vs raw token hit rate at equal bytes ({dtype} KV), {trace}: {cells}")
    if ttft is None or "disk cold" not in ttft:
        print("   int8 TTFT at 90 % cached from disk vs raw: not measured (--no-model)")
        return
    disk = ttft["disk cold"]
    for name in LOSSY:
        rel = [t / r for t, r in zip(disk[name], disk["raw"], strict=True)]
        med = statistics.median(rel)
        verdict = "no worse than raw" if med <= 1.0 else f"{med - 1:.0%} slower than raw"
        note = " (target: no worse than raw)" if name == "int8" else ""
        print(f"   {name} TTFT at 90 % cached from cold disk / raw's: {spread(rel, '{:.2f}x')}: {verdict}{note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few repeats, 512 tokens, one trace (the smoke test)")
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"rounds per measurement (default {REPEATS}; 3 with --quick)"
    )
    parser.add_argument("--no-model", action="store_true", help="skip the TTFT runs on SmolLM2")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis tier")
    parser.add_argument("--traces", type=Path, default=None, help="folder of the Mooncake traces")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else REPEATS)
    tokens = 512 if args.quick else PREFIX_TOKENS
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    traces = find_traces(args.traces, args.quick)
    print(f"bench_codecs: codecs {', '.join(CODECS)}; {repeats} rounds, order alternating; median (min-max)\n")
    print_sizes()

    print(f"2. Encode / decode throughput, GB/s of decoded KV, against a memcpy of the raw frames ({repeats} rounds)")
    for dtype in DTYPES:
        bench_throughput(dtype, tokens, repeats)
    print()

    ttft = None
    with ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="bench-codecs-"))
        stack.callback(shutil.rmtree, root, True)
        url = None if args.no_redis else start_redis(root, stack)
        print(f"3. Load of a {tokens:,}-token prefix (float32 KV) through PrefixCache, one tier in each codec")
        bench_loads(tiers_to_measure(root, url, "load"), tokens, repeats)
        if not args.no_model:
            print(f"\n3b. Time to first token at {CACHED_SHARE:.0%} cached, loaded from each tier and codec")
            ttft = bench_ttft(tiers_to_measure(root, url, "ttft"), tokens, repeats)
    print()

    print("4. Token hit rate at equal bytes: N = the bytes of 1M / 3M raw tokens' frames")
    print("   (each codec replayed at the tokens its frames fit in N: the codec's capacity in tokens)")
    hits = {trace.stem: bench_hit_rates(trace, DTYPES) for trace in traces}
    print()
    summary(ttft, hits)


if __name__ == "__main__":
    main()
