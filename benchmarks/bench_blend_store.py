"""The blend path's latency when each request stores new chunks, with a disk tier
against without one: does the disk's durable write (an fsync per frame) reach the
engine's worker thread?

Each request is a chat of an opted-in tenant whose message holds new documents (lines
the blend mode stores as chunks after the answer); requests run one after another, so
a request also waits for the chunks the one before it stored. Two setups in one
process, rounds alternating their order: the cache's tiers as ``memory`` alone, and
``memory`` + ``disk``. Printed: p50 latency of each and the ratio disk / memory (1.0:
the disk costs the request nothing; above it: the worker waited on the disk).

NOTE: the blend mode stores chunks only for a model past its quality gate; this
benchmark writes the gate's verdict as passed (as the server tests do) because it
measures the storing path's latency, not answer quality (benchmarks/bench_blend.py and
``prefixcache gate-blend`` measure that).

    .venv/bin/python benchmarks/bench_blend_store.py [--requests 12] [--rounds 2] [--fsync-ms 20]

``--fsync-ms`` adds that much to every ``fsync`` of the process (the disk tier's durable
write): this machine's virtual disk syncs in well under a millisecond, a network volume
or a busy SSD takes milliseconds; both setups get the same handicap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from prefixcache.server.main import build_service
from prefixcache.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
EVAL_SET = ROOT / "tests" / "data" / "blend" / "eval.json"
KEY, ADMIN = "sk-bench-0123456789", "adm-bench-0123456789"
WORDS = ("granite", "harbour", "owl", "glacier", "valley", "lantern", "orchard", "meadow", "river", "beacon", "quarry")


def document(seed: int, n: int) -> str:
    """A line of about 60 tokens no other request has (the seed's words in its order)."""
    words = [WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(n)]
    return f"Record {seed}: " + " ".join(words) + "."


def settings_for(tmp: Path, disk: bool) -> Any:
    tiers: list[dict[str, Any]] = [{"kind": "memory", "capacity_bytes": 256 << 20, "write": "through"}]
    if disk:
        tiers.append({"kind": "disk", "capacity_bytes": 1 << 30, "path": str(tmp / "disk")})
    return load_settings(
        None,
        env={},
        overrides={
            "auth": {"api_keys": {KEY: "bench"}, "admin_key": ADMIN},
            "cache": {"tiers": tiers},
            "blend": {
                "tenants": ["bench"],
                "plan": "epic",
                "k": 4,
                "gate_file": str(tmp / "gate.json"),
                "eval_set": str(EVAL_SET),
                "min_chunk_tokens": 16,
                "fallback": False,
            },
        },
    )


def pass_gate(settings: Any) -> None:
    """Write the gate's verdict on the configured plan as passed (see the module's NOTE)."""
    from prefixcache.blend.gate import gate_key
    from prefixcache.engine import load_model
    from prefixcache.quality.evalset import load_eval_set
    from prefixcache.quality.reference import model_fingerprint
    from prefixcache.quality.verdict import GateFigures, GateStore, NoiseFloor

    config = settings.blend.config()
    m = settings.model
    loaded = load_model(m.name, m.models_dir, m.device, m.dtype)
    key = gate_key(model_fingerprint(loaded), load_eval_set(config.eval_set).digest, config.gate_steps, config.plan)
    floor = NoiseFloor("bfloat16", 19, 1.0, 1.0, 0.002, 0.02)
    GateStore(config.gate_file).put(key, GateFigures("epic(k=4)", 19, 1.0, 1.0, 0.001, 0.01, 100, 10, 50, 0.4, floor))


def check_blended(metrics: str) -> None:
    """The blend mode was on and looked chunks up: else this measured nothing of it."""
    enabled = [line for line in metrics.splitlines() if line.startswith("prefixcache_blend_enabled{")]
    lookups = [line for line in metrics.splitlines() if line.startswith("prefixcache_blend_chunk_lookups_total{")]
    if not any(line.endswith(" 1.0") for line in enabled) or not lookups:
        raise SystemExit("the blend mode did not run: nothing of its storing path was measured")


def run(disk: bool, requests: int, offset: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="bench-blend-store-") as tmp:
        settings = settings_for(Path(tmp), disk)
        pass_gate(settings)
        service = build_service(settings)
        latencies = []
        try:
            with TestClient(service.app) as client:
                headers = {"Authorization": f"Bearer {KEY}"}
                for i in range(requests + 1):
                    docs = "\n".join(document(offset + 3 * i + j, 40) for j in range(3))
                    body = {
                        "model": settings.model.served_id,
                        "messages": [{"role": "user", "content": f"{docs}\nWhich record is longest?"}],
                        "max_tokens": 1,
                        "temperature": 0,
                    }
                    started = time.perf_counter()
                    client.post("/v1/chat/completions", json=body, headers=headers).raise_for_status()
                    if i:  # the first one warms up (nothing stored before it)
                        latencies.append(time.perf_counter() - started)
                check_blended(client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text)
        finally:
            service.close()
    return latencies


def slow_fsync(ms: float) -> None:
    """Every ``os.fsync`` of this process takes ``ms`` longer (see the module's docstring)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        time.sleep(ms / 1000)

    os.fsync = fsync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fsync-ms", type=float, default=0.0, help="added to every fsync (a slower disk)")
    args = parser.parse_args()
    if args.fsync_ms:
        slow_fsync(args.fsync_ms)
    ratios = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        p50 = {}
        for disk in order:
            p50[disk] = statistics.median(run(disk, args.requests, 1000 * (2 * r + disk)))
        ratios.append(p50[True] / p50[False])
        print(
            f"round {r + 1} (memory {'second' if order[0] else 'first'}): p50 memory {p50[False] * 1e3:.0f} ms, "
            f"memory+disk {p50[True] * 1e3:.0f} ms, ratio {ratios[-1]:.2f}"
        )
    spread = f"rounds {min(ratios):.2f}-{max(ratios):.2f}"
    print(f"p50 latency, memory+disk / memory alone: {statistics.median(ratios):.2f} ({spread})")


if __name__ == "__main__":
    main()
