"""A sliding-window model in vLLM: memory with the connector on, as vLLM's hybrid manager
promises, and hits at equal memory (issue 40, point 3).

Run from the vLLM venv (``make bench-vllm-hybrid``)::

    .venv-vllm/bin/python benchmarks/bench_vllm_hybrid.py [--runs 2] [--quick]

The model is the tiny random Gemma-3 text model of ``tests_vllm/tiny_hybrid.py`` (five
sliding-window layers of window 32 tokens to one full-attention layer, SmolLM2's
tokenizer), every setup ``vllm.LLM`` on CPU, float32, vLLM's prefix cache on. Printed:

1. **KV capacity**: the concurrent 32,768-token requests vLLM's KV space holds (vLLM's own
   figure, from its start log; chunks of 2,048 tokens, blocks of 32), with
   ``VLLM_CPU_KVCACHE_SPACE`` = 1 GiB in each setup:
   vLLM alone, vLLM + prefixcache (the hybrid manager on), and vLLM with the hybrid
   manager off, what any connector without ``SupportsHMA`` gets (this connector before
   issue 40). Target: the connector's equal to vLLM alone's.
2. **Bytes stored per cached token** in prefixcache's tiers after the workload below
   (frames on its disk tier over the prompt tokens stored), beside full KV (every layer
   keeps every token) and the full-attention layer alone. Target: the window's share,
   i.e. close to the full layer's bytes on prompts much longer than the window.
3. **Hits at equal memory**: ``conversations`` multi-turn chats whose prompts exceed the
   window many times, each turn appending about 150 tokens, sent one request at a time
   with one output token (latency = TTFT), chunks of 256 tokens. vLLM alone gets
   ``blocks`` KV blocks (vLLM's ``num_gpu_blocks_override``; a block is one layer's 32
   tokens); with the connector vLLM gets half and prefixcache a memory tier of the other
   half's bytes (and a disk tier beside it, as users run it). Token hit rate (vLLM's cached prompt tokens
   over prompt tokens) and mean TTFT, each setup ``--runs`` times, the order alternated,
   every run printed; the ratio is vLLM alone's mean TTFT over the connector's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests_vllm"))
TEXT_MODEL = ROOT / ".prefixcache/models/SmolLM2-135M-Instruct.Q4_1"
BLOCK = 32  # vLLM's CPU attention block for this model
PAGE = 2 * 1 * BLOCK * 32 * 4  # bytes of one layer's block: K and V, 1 KV head, head_dim 32, float32
LAYERS, FULL_LAYERS = 6, 1


def child(job_path: str) -> None:
    """One vLLM process: start, run the job's prompts, print one JSON line of results."""
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(
        model=job["model"],
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        **job.get("engine", {}),
    )
    if job.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PrefixCacheConnector",
            kv_connector_module_path="prefixcache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=job["connector"],
        )
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    results = []
    for ids in job.get("requests", []):
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        results.append({"prompt": len(ids), "cached": out.num_cached_tokens, "seconds": time.perf_counter() - start})
    print("RESULTS " + json.dumps(results), flush=True)
    del llm


def run(tmp: Path, name: str, job: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(job))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(path)], env=env, capture_output=True, text=True, timeout=1200
    )
    log = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(log)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{log[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :]), log


def concurrency(log: str) -> float:
    found = re.findall(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", log)
    if not found:
        raise SystemExit("vLLM printed no maximum concurrency")
    return float(found[-1][1])


def workload(conversations: int, turns: int) -> list[list[int]]:
    """Chats, round robin: a 300-token start, then ~150 tokens (a reply and a question) a turn."""
    rng = random.Random(40)
    chats = [[rng.randrange(100, 49000) for _ in range(300)] for _ in range(conversations)]
    requests = []
    for _ in range(turns):
        for chat in chats:
            requests.append(list(chat))
            chat.extend(rng.randrange(100, 49000) for _ in range(150))
    return requests


def connector(tmp: Path, memory_bytes: int) -> dict[str, Any]:
    return {
        "cache": {
            "tiers": [
                {"kind": "memory", "capacity_bytes": memory_bytes, "write": "through"},
                {"kind": "disk", "capacity_bytes": 1 << 32, "path": str(tmp), "write": "through"},
            ]
        }
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=256, help="vLLM alone's KV blocks in (3)")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="one run, 3 conversations of 3 turns")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.quick:
        args.runs, args.conversations, args.turns = 1, 3, 3
    from tiny_hybrid import build_gemma3

    tmp = Path(tempfile.mkdtemp(prefix="bench-hybrid-"))
    model = str(build_gemma3(tmp / "model", TEXT_MODEL, max_position_embeddings=32768))
    print(f"model: tiny Gemma-3 text ({LAYERS} layers, 5 sliding of window 32, 1 full), block {BLOCK} tokens")

    print("\n1. KV capacity (VLLM_CPU_KVCACHE_SPACE=1 GiB): concurrent 32,768-token requests")
    long = {"block_size": BLOCK, "max_model_len": 32768, "max_num_batched_tokens": 2048}
    base = {"model": model, "engine": long}
    alone = concurrency(run(tmp, "cap-alone", base)[1])
    with_pc = concurrency(run(tmp, "cap-pc", {**base, "connector": connector(tmp / "cap-disk", 1 << 26)})[1])
    hma_off = concurrency(
        run(
            tmp,
            "cap-off",
            {
                **base,
                "connector": connector(tmp / "cap-disk-off", 1 << 26),
                "engine": {**long, "disable_hybrid_kv_cache_manager": True},
            },
        )[1]
    )
    print(f"   vLLM alone                          {alone:10.2f}x")
    print(f"   vLLM + prefixcache (hybrid manager) {with_pc:10.2f}x   ratio {with_pc / alone:.2f} of vLLM alone")
    print(f"   hybrid manager off (no SupportsHMA) {hma_off:10.2f}x   ratio {hma_off / alone:.2f} of vLLM alone")

    requests = workload(args.conversations, args.turns)
    tokens = sum(len(r) for r in requests)
    chats, half = f"{args.conversations} chats x {args.turns} turns", args.blocks // 2
    print(f"\n3. equal memory: {len(requests)} requests ({chats}), {tokens:,} prompt tokens,")
    print(f"   vLLM alone {args.blocks} blocks; with prefixcache {half} blocks + a memory tier of {half} blocks' bytes")
    figures: dict[str, list[tuple[float, float]]] = {"alone": [], "prefixcache": []}
    stored: list[float] = []
    base = {"model": model}
    short = {"block_size": BLOCK, "max_model_len": 1024, "max_num_batched_tokens": 256}
    for r in range(args.runs):
        order = ["alone", "prefixcache"] if r % 2 == 0 else ["prefixcache", "alone"]
        for setup in order:
            if setup == "alone":
                job = {**base, "engine": {**short, "num_gpu_blocks_override": args.blocks}, "requests": requests}
            else:
                disk = tmp / f"disk-{r}"
                job = {
                    **base,
                    "engine": {**short, "num_gpu_blocks_override": args.blocks // 2},
                    "connector": connector(disk, args.blocks // 2 * PAGE),
                    "requests": requests,
                }
            results, _ = run(tmp, f"{setup}-{r}", job)
            hit = sum(x["cached"] for x in results) / tokens
            ttft = statistics.mean(x["seconds"] for x in results)
            figures[setup].append((hit, ttft))
            print(f"   run {r + 1} {setup:12s} token hit rate {hit:6.1%}   mean TTFT {1000 * ttft:8.1f} ms")
            if setup == "prefixcache":
                frames = sum(p.stat().st_size for p in (disk / "blocks").rglob("*.blk"))
                stored_tokens = len({tuple(x[:i]) for x in requests for i in range(BLOCK, len(x), BLOCK)})
                stored.append(frames / (stored_tokens * BLOCK))
    a = statistics.mean(t for _, t in figures["alone"])
    p = statistics.mean(t for _, t in figures["prefixcache"])
    spread = [f"{t_a / t_p:.2f}" for (_, t_a), (_, t_p) in zip(figures["alone"], figures["prefixcache"], strict=True)]
    print(f"   TTFT ratio vLLM alone / prefixcache: {a / p:.2f} (runs: {', '.join(spread)})")

    full = LAYERS * PAGE / BLOCK
    print("\n2. bytes prefixcache stores per cached token (disk frames over distinct prompt blocks)")
    print(
        f"   stored {statistics.mean(stored):8.0f} B/token   full KV {full:.0f} B/token   "
        f"full-attention layer alone {FULL_LAYERS * PAGE / BLOCK:.0f} B/token   "
        f"ratio {statistics.mean(stored) / full:.2f} of full KV"
    )


if __name__ == "__main__":
    main()
