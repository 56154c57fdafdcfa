"""The engine's KV memory with one long prompt among short chats (issue 44, point 2).

Two setups, each in a fresh process with the default model (SmolLM2-135M, float32, no
cache, so that only the engine's own KV counts), eight requests submitted at once:

- ``short``: eight short chats (a 120-token prompt each, 64 tokens decoded);
- ``mixed``: seven of those beside one 4,000-token prompt (64 tokens decoded).

Printed per run: the process's RSS once the model is loaded, its peak while the requests
ran (sampled every 2 ms), what the peak added to the loaded RSS, and the RSS once they
all ended (what stays held). Then, per round, the mixed peak's addition over the short
one's, and the spread; the rounds alternate the order of the two setups.

The long prompt's own KV is about 4,064 tokens x 46 KB (float32, 30 layers, 3 KV heads of
64): a floor the mixed setup cannot go below (the prefill's copy and the decode batch's
row are two of it).

Run:  .venv/bin/python benchmarks/bench_kv_memory.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHORT_PROMPT, LONG_PROMPT, DECODE = 120, 4000, 64
PAGE = 4096


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """The highest RSS seen by a thread sampling every 2 ms, while running."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def one(setup: str) -> dict[str, float]:
    """One setup in this process: its RSS figures, in bytes."""
    from prefixcache.engine import DoneEvent, Engine, Request, SamplingParams, load_model

    lm = load_model(models_dir=ROOT / ".prefixcache" / "models", device="cpu")
    engine = Engine(lm, "bench", cache=None, max_active=8, max_queue=16, timeout_s=3600.0)
    rng = random.Random(7)
    lengths = [SHORT_PROMPT] * 8 if setup == "short" else [SHORT_PROMPT] * 7 + [LONG_PROMPT]
    params = SamplingParams(max_tokens=DECODE, temperature=0.0)
    warm = engine.generate(Request([rng.randrange(1000, 40000) for _ in range(16)], "warm", params))
    assert isinstance(warm.result(), DoneEvent)
    loaded = rss()
    with Peak() as peak:
        handles = [
            engine.generate(Request([rng.randrange(1000, 40000) for _ in range(n)], f"t{i}", params))
            for i, n in enumerate(lengths)
        ]
        ends = [h.result() for h in handles]
    assert all(isinstance(e, DoneEvent) for e in ends), ends
    engine.wait_idle()
    time.sleep(1.0)  # the worker releases the rows whose store ended at its next turn
    after = rss()
    engine.close()
    own = (LONG_PROMPT + DECODE) * lm.kv.bytes_per_token  # one copy of the long prompt's KV
    return {"loaded": loaded, "peak": peak.peak, "added": peak.peak - loaded, "after": after - loaded, "own": own}


def run(setup: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--one", setup], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"the {setup} setup failed:\n{done.stderr[-4000:]}")
    out = done.stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=("short", "mixed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    mb = 1 << 20
    ratios, added = [], {"short": [], "mixed": []}
    for r in range(args.rounds):
        order = ("short", "mixed") if r % 2 == 0 else ("mixed", "short")
        got = {}
        for setup in order:
            got[setup] = res = run(setup)
            added[setup].append(res["added"])
            print(
                f"round {r + 1} {setup:5s}: loaded {res['loaded'] / mb:7.0f} MiB, peak {res['peak'] / mb:7.0f} MiB "
                f"(+{res['added'] / mb:6.0f}), held after {res['after'] / mb:+6.0f} MiB",
                flush=True,
            )
        ratios.append(got["mixed"]["added"] / max(got["short"]["added"], 1))
        print(f"round {r + 1}: the mixed peak adds {ratios[-1]:.2f}x the short one's", flush=True)
    print(f"one copy of the long prompt's KV: {res['own'] / mb:.0f} MiB (a floor of what it adds)")
    print(
        f"mixed peak over the loaded model: median {statistics.median(added['mixed']) / mb:.0f} MiB; "
        f"short: {statistics.median(added['short']) / mb:.0f} MiB; "
        f"ratio median {statistics.median(ratios):.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)})"
    )


if __name__ == "__main__":
    main()
