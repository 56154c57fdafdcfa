"""vLLM alone, vLLM + its ExampleConnector, vLLM + prefixcache, side by side in one run.

Run from the vLLM venv (``make test`` builds it)::

    .venv-vllm/bin/python benchmarks/bench_vllm.py

Each engine runs in a process of its own (SmolLM2-135M, CPU, float32), with vLLM's KV
space held to ``KV_BLOCKS`` blocks of 128 tokens, several times smaller than the
workload's working set, as on a busy server:

- a multi-tenant, multi-turn workload: ``TENANTS`` tenants, each with its own document
  (a RAG context), ``CONVERSATIONS`` conversations each, ``TURNS`` turns that append a
  question and a reply; requests go round the tenants, as traffic does. Each request
  is timed alone with one output token (its time to first token); the token hit rate
  is ``num_cached_tokens`` over prompt tokens.
- a workload with no reuse: ``ROUNDS`` batches of ``UNIQUE`` distinct prompts, 32 output
  tokens each, that fit in vLLM's KV space (so that no request is preempted and
  recomputed, which a connector would turn into a reuse); throughput is prompt and
  output tokens per second, the median of the rounds.

vLLM alone keeps its own prefix cache on; ExampleConnector, as vLLM ships it, runs with
vLLM's prefix cache off; prefixcache (host memory + disk tiers) sits behind vLLM's
prefix cache. Targets: prefixcache's token hit rate at least 2x vLLM alone's and its
mean TTFT at least 2x better; on the no-reuse workload, throughput within 5 % of vLLM
alone's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("PREFIXCACHE_VLLM_MODEL", str(ROOT / ".prefixcache/models/SmolLM2-135M-Instruct.Q4_1"))
KV_BLOCKS = 24
TENANTS, CONVERSATIONS, TURNS = 6, 2, 3
UNIQUE, ROUNDS = 6, 3  # no-reuse batches: small enough for vLLM's KV, so nothing is preempted

WORDS = [
    "harbor",
    "lantern",
    "ledger",
    "copper",
    "valley",
    "orchard",
    "quarry",
    "meadow",
    "signal",
    "timber",
    "beacon",
    "compass",
    "glacier",
    "canyon",
    "prairie",
    "summit",
    "island",
    "river",
    "forest",
    "desert",
    "harvest",
    "engine",
    "bridge",
    "tunnel",
    "market",
    "garden",
    "castle",
    "village",
]


def text(seed: int, words: int) -> str:
    """Deterministic filler text, different for each seed."""
    state, out = seed * 7919 + 13, []
    for _ in range(words):
        state = (state * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[state % len(WORDS)])
    return " ".join(out) + "."


def multi_turn() -> list[tuple[str, str]]:
    """(tenant, prompt) in arrival order."""
    documents = {t: f"Document of tenant {t}: " + text(1000 + t, 700) for t in range(TENANTS)}
    requests = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            for t in range(TENANTS):
                history = "".join(
                    f"\nUser: {text(t * 100 + c * 10 + k, 25)}\nAssistant: {text(t * 100 + c * 10 + k + 5, 20)}"
                    for k in range(turn)
                )
                question = f"\nUser: {text(t * 100 + c * 10 + turn, 25)}\nAssistant:"
                requests.append((f"tenant-{t}", documents[t] + history + question))
    return requests


def engine(kind: str, workdir: Path) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(
        model=MODEL,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        num_gpu_blocks_override=KV_BLOCKS,
        enable_prefix_caching=kind != "example",
        seed=0,
    )
    if kind == "example":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(workdir / "example")},
        )
    elif kind == "prefixcache":
        tiers = [
            {"kind": "memory", "capacity_bytes": 1 << 30, "write": "through"},
            {"kind": "disk", "capacity_bytes": 8 << 30, "path": str(workdir / "disk")},
        ]
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PrefixCacheConnector",
            kv_connector_module_path="prefixcache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"cache": {"tiers": tiers}},
        )
    return LLM(**kwargs)


def run_one(kind: str, out: Path) -> None:
    from vllm import SamplingParams

    llm = engine(kind, out.parent)
    first = SamplingParams(temperature=0, max_tokens=1)
    ttft, prompt_tokens, cached = [], 0, 0
    for tenant, prompt in multi_turn():
        start = time.perf_counter()
        result = llm.generate([{"prompt": prompt, "cache_salt": tenant}], first, use_tqdm=False)[0]
        ttft.append(time.perf_counter() - start)
        prompt_tokens += len(result.prompt_token_ids)
        cached += result.num_cached_tokens or 0
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    rates = []
    for round_ in range(ROUNDS):
        unique = [f"Request {round_}.{i}: " + text(50_000 + 100 * round_ + i, 250) for i in range(UNIQUE)]
        start = time.perf_counter()
        results = llm.generate(unique, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rates.append(sum(len(r.prompt_token_ids) + len(r.outputs[0].token_ids) for r in results) / seconds)
    out.write_text(
        json.dumps(
            {"ttft": ttft, "prompt_tokens": prompt_tokens, "cached": cached, "throughput": statistics.median(rates)}
        )
    )


def main() -> None:
    if not Path(MODEL, "config.json").is_file():
        sys.exit(f"no model at {MODEL}: run make test (or make serve) once to convert it")
    kinds = ("vllm", "example", "prefixcache")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            out = Path(tmp) / kind / "result.json"
            out.parent.mkdir()
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            subprocess.run([sys.executable, __file__, "--one", kind, str(out)], check=True, env=env)
            results[kind] = json.loads(out.read_text())
    requests = len(multi_turn())
    print(
        f"\n{TENANTS} tenants x {CONVERSATIONS} conversations x {TURNS} turns = {requests} requests, vLLM KV "
        f"{KV_BLOCKS} blocks of 128 tokens; no reuse: {ROUNDS} batches of {UNIQUE} prompts x 32 tokens"
    )
    print(f"{'engine':>12} {'token hit rate':>15} {'mean TTFT ms':>13} {'p95 TTFT ms':>12} {'no-reuse tok/s':>15}")
    for kind in kinds:
        r = results[kind]
        ttft = sorted(r["ttft"])
        p95 = ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))]
        print(
            f"{kind:>12} {r['cached'] / r['prompt_tokens']:>15.3f} {1000 * statistics.mean(ttft):>13.1f} "
            f"{1000 * p95:>12.1f} {r['throughput']:>15.1f}"
        )
    base, ours = results["vllm"], results["prefixcache"]
    base_rate, our_rate = base["cached"] / base["prompt_tokens"], ours["cached"] / ours["prompt_tokens"]
    hit_ratio = our_rate / base_rate if base_rate else float("inf")
    ttft_ratio = statistics.mean(base["ttft"]) / statistics.mean(ours["ttft"])
    tput = ours["throughput"] / base["throughput"]
    print("\nTargets (prefixcache against vLLM alone)")
    print(f"  token hit rate {hit_ratio:.2f}x (target >= 2x): {'met' if hit_ratio >= 2 else 'NOT met'}")
    print(f"  mean TTFT {ttft_ratio:.2f}x better (target >= 2x): {'met' if ttft_ratio >= 2 else 'NOT met'}")
    print(f"  no-reuse throughput {100 * tput:.1f} % (target >= 95 %): {'met' if tput >= 0.95 else 'NOT met'}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        run_one(sys.argv[2], Path(sys.argv[3]))
    else:
        main()
