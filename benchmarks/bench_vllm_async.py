"""Requests already decoding keep their pace while another one's blocks come from a slow
tier: the connector's async load, against the same traffic over a disk of normal speed.

Run from the vLLM venv (``make test`` builds it)::

    .venv-vllm/bin/python benchmarks/bench_vllm_async.py [--rounds 2] [--delay 0.2]

A long prompt P (``PROMPT_BLOCKS`` blocks of 128 tokens) is stored on the connector's
disk tier by a first server; then each setup starts a fresh ``vllm serve`` (SmolLM2,
CPU, float32, the connector over memory + that disk; vLLM's memory and the cache's
memory tier are cold, so P's blocks come from disk) and:

1. starts ``STREAMS`` streaming completions (short prompts, ``ignore_eos``), and waits
   until each has produced tokens;
2. sends P (one output token) and counts the streams' tokens over the next ``WINDOW_S``
   seconds: their decode rate while P's blocks load.

Setups: ``async`` (the default: the load runs on the connector's I/O threads, P waits
alone) over a disk of normal speed (the baseline) and over a disk whose reads take
``--delay`` seconds a block; ``sync`` over the slow disk (the load inside vLLM's step,
as before) to show what the async load avoids. Each round runs the setups in turn, the
order reversed every other round; the figures are per round and their medians.

Target (the production-path issue): with the slow disk, the streams' tokens per second
are within 10 % of the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench_vllm import Proc, free_port  # this folder: the script runs from it

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
MODEL = os.environ.get("PREFIXCACHE_VLLM_MODEL", str(ROOT / ".prefixcache/models/SmolLM2-135M-Instruct.Q4_1"))
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
PROMPT_BLOCKS = 12  # about P's full blocks (its words tokenize to a few more), all on the slow disk
STREAMS = 3
WINDOW_S = 4.0
WORDS = ["harbor", "lantern", "ledger", "copper", "valley", "orchard", "quarry", "meadow", "signal", "timber"]


def long_prompt() -> str:
    """About ``PROMPT_BLOCKS`` + 1 blocks of SmolLM2 tokens (a word is about a token)."""
    words = [WORDS[(i * 7 + i // 13) % len(WORDS)] for i in range((PROMPT_BLOCKS + 1) * 128)]
    return "Notes: " + " ".join(words)


@dataclass(frozen=True)
class Setup:
    name: str
    async_load: bool
    delay: float


@dataclass(frozen=True)
class Result:
    setup: str
    stream_tps: float  # the streams' tokens per second while P loads
    p_ttft_s: float
    p_cached: int


def server(disk: Path, setup: Setup, log: Path) -> Proc:
    """``vllm serve`` with the connector (``slow_disk_connector``) over ``disk``, answering."""
    port = free_port()
    config = {
        "kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "slow_disk_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "async_load": setup.async_load,
            "cache": {
                "tiers": [
                    {"kind": "memory", "capacity_bytes": 1 << 30, "write": "through"},
                    {"kind": "disk", "capacity_bytes": 4 << 30, "path": str(disk), "write": "through"},
                ]
            },
        },
    }
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p),
        "PREFIXCACHE_BENCH_READ_DELAY_S": str(setup.delay),
    }
    args = [
        *SERVE,
        *("--model", MODEL, "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048"),
        *("--enforce-eager", "--enable-prefix-caching", "--gpu-memory-utilization", "0.3"),
        *("--enable-prompt-tokens-details", "--port", str(port), "--shutdown-timeout", "30"),
        *("--kv-transfer-config", json.dumps(config)),
    ]
    url = f"http://127.0.0.1:{port}"
    proc = Proc.started(args, env, log, lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 300)
    proc.url = url
    return proc


def complete(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One completion: (seconds to its first token, cached prompt tokens)."""
    start = time.perf_counter()
    reply = httpx.post(
        f"{url}/v1/completions",
        json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=300,
    )
    reply.raise_for_status()
    details = reply.json()["usage"].get("prompt_tokens_details") or {}
    return time.perf_counter() - start, int(details.get("cached_tokens") or 0)


def stream(url: str, prompt: str, stamps: list[float], stop: threading.Event) -> None:
    """A streaming completion that records when each token arrives, until ``stop``."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1500, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if stop.is_set():
                return
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())


def measure(disk: Path, setup: Setup, log: Path) -> Result:
    vllm = server(disk, setup, log)
    try:
        stop = threading.Event()
        stamps: list[list[float]] = [[] for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=stream, args=(vllm.url, f"Story {i}: once upon a time", stamps[i], stop))
            for i in range(STREAMS)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while not all(len(s) >= 20 for s in stamps):
            if time.monotonic() > deadline:
                raise RuntimeError("the streams did not start")
            time.sleep(0.05)
        sent = time.perf_counter()
        ttft, cached = complete(vllm.url, long_prompt(), 1)
        time.sleep(max(0.0, sent + WINDOW_S - time.perf_counter()))
        stop.set()
        counted = sum(sum(1 for t in s if sent <= t < sent + WINDOW_S) for s in stamps)
        for t in threads:
            t.join(timeout=30)
        return Result(setup.name, counted / WINDOW_S, ttft, cached)
    finally:
        vllm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds per block read from the slow disk")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-async-"))
    disk = work / "disk"
    setups = [
        Setup("async, disk", True, 0.0),
        Setup(f"async, disk +{args.delay * 1000:.0f} ms/block", True, args.delay),
        Setup(f"sync, disk +{args.delay * 1000:.0f} ms/block", False, args.delay),
    ]
    try:
        warm = server(disk, setups[0], work / "warm.log")  # P's blocks onto the disk
        try:
            complete(warm.url, long_prompt(), 1)
        finally:
            warm.close()
        results: dict[str, list[Result]] = {s.name: [] for s in setups}
        for r in range(args.rounds):
            order = setups if r % 2 == 0 else setups[::-1]
            for setup in order:
                result = measure(disk, setup, work / f"round{r}-{setup.name.split(',')[0]}-{setup.delay}.log")
                results[setup.name].append(result)
                print(
                    f"round {r}: {setup.name:<28} streams {result.stream_tps:6.1f} tok/s  "
                    f"P: TTFT {result.p_ttft_s * 1000:7.0f} ms, {result.p_cached} cached",
                    flush=True,
                )
        base = statistics.median(x.stream_tps for x in results[setups[0].name])
        cached = max(x.p_cached for xs in results.values() for x in xs)
        print(f"\n{STREAMS} streams decoding while {cached} cached prompt tokens load from disk ({args.rounds} rounds)")
        print(f"{'setup':<30} {'streams tok/s':>14} {'vs baseline':>12} {'spread':>16} {'P TTFT ms':>10}")
        for s in setups:
            tps = [x.stream_tps for x in results[s.name]]
            med = statistics.median(tps)
            ttft = statistics.median(x.p_ttft_s for x in results[s.name]) * 1000
            print(f"{s.name:<30} {med:14.1f} {med / base:11.1%} {min(tps):7.1f}-{max(tps):<7.1f} {ttft:10.0f}")
        slow = statistics.median(x.stream_tps for x in results[setups[1].name]) / base
        verdict = "met" if slow >= 0.9 else "missed"
        print(f"\nTarget: async over the slow disk within 10 % of the baseline: {slow:.1%} ({verdict})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
