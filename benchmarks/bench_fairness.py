"""A light tenant's time to first token while a heavy tenant floods the server with
8,000-token prompts: the engine's fair, time-sliced scheduling against the engine before
(one request at a time, one queue in arrival order, each prompt prefilled in one
forward), in the same run, through the real HTTP server.

Each configuration runs as its own ``prefixcache serve`` process (SmolLM2-135M on this
machine's CPU, the prefix cache off so that no prompt hits: every prefill is computed):

- ``fair``: the defaults (``[admission]``: up to 4 requests in flight, prefilled in chunks
  of 256 tokens, tenants in turn, at most 4 requests of a tenant in the engine);
- ``fifo``, the baseline: ``max_active = 1``, ``order = "fifo"``, chunks as long as the
  context (the engine before this scheduler), no per-tenant limit.

In each, the light tenant first sends ``--light`` short chat requests one after another
on an idle server (unloaded), then the same while ``--heavy`` clients of the heavy tenant
each send 8,000-token completions (random tokens, ``max_tokens = 1``) back to back
(loaded). TTFT is the official ``openai`` client's time from sending a streamed request
to its first chunk. Rounds alternate the order of the configurations; the figures are
over every round, with each round's p95 ratio for the spread.

Target (the gateway issue): the light tenant's p95 TTFT loaded within 2x of unloaded.

Run:  .venv/bin/python benchmarks/bench_fairness.py [--rounds 2] [--light 12] [--heavy 2] [--chunks 256 64]
(about 20 minutes on a 2-core CPU at the defaults; the baseline's light requests each
wait for whole heavy prefills).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from serve_process import serve_process

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".prefixcache" / "models"
MODEL = "smollm2-135m-instruct"
KEYS = {"sk-heavy-0123456789": "heavy", "sk-light-0123456789": "light"}
HEAVY_TOKENS = 8000
TARGET = 2.0  # p95 loaded / unloaded
QUESTIONS = ("Name a garden tool.", "Is it sunny?", "Say hello.", "Count to three.", "What is a rake?")


@dataclass(frozen=True)
class Setup:
    name: str
    admission: str  # the [admission] table

    def config(self, port: int) -> str:
        keys = ", ".join(f'"{k}" = "{t}"' for k, t in KEYS.items())
        return (
            f'[server]\nport = {port}\ncache = false\nrequest_timeout_s = 600\n[model]\nmodels_dir = "{MODELS}"\n'
            f"[auth]\napi_keys = {{ {keys} }}\n[admission]\n{self.admission}"
        )


def setups(chunks: list[int]) -> list[Setup]:
    fair = [Setup(f"fair, chunks of {c}", f"prefill_chunk_tokens = {c}\n") for c in chunks]
    fifo = Setup(
        "fifo (the engine before)", 'max_active = 1\norder = "fifo"\nprefill_chunk_tokens = 8192\nmax_concurrent = 64\n'
    )
    return [*fair, fifo]


@contextlib.contextmanager
def serving(setup: Setup, tmp: Path) -> Iterator[str]:
    """A ``prefixcache serve`` process in ``setup``; its URL."""
    with serve_process(setup.config, tmp) as url:
        yield url


def ttft(client: openai.OpenAI, question: str) -> float:
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0, stream=True
    )
    first = 0.0
    for _ in stream:
        first = first or time.monotonic() - started
    return first


def light_run(url: str, n: int, rng: random.Random) -> list[float]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-light-0123456789", max_retries=0, timeout=900)
    out = []
    for i in range(n):
        out.append(ttft(client, f"[{rng.random():.6f}] {QUESTIONS[i % len(QUESTIONS)]}"))
        time.sleep(0.2)
    return out


@dataclass
class Flood:
    """Heavy clients sending long prompts back to back until stopped."""

    url: str
    clients: int
    tokens: int
    seed: int
    stop: threading.Event = field(default_factory=threading.Event)
    served: list[int] = field(default_factory=list)  # status codes
    threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Flood:
        for c in range(self.clients):
            thread = threading.Thread(target=self._client, args=(random.Random(self.seed * 100 + c),), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _client(self, rng: random.Random) -> None:
        headers = {"Authorization": "Bearer sk-heavy-0123456789"}
        with httpx.Client(timeout=900) as http:
            while not self.stop.is_set():
                prompt = [rng.randrange(1000, 40000) for _ in range(self.tokens)]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
                status = http.post(self.url + "/v1/completions", json=body, headers=headers).status_code
                self.served.append(status)
                if status == 429:
                    time.sleep(1.0)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(900)


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) > 1 else values[0]


@dataclass
class Figures:
    unloaded: list[float] = field(default_factory=list)
    loaded: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # each round's p95 loaded / unloaded
    heavy: list[int] = field(default_factory=list)


def measure(setup: Setup, args: argparse.Namespace, tmp: Path, seed: int, figures: Figures) -> None:
    rng = random.Random(seed)
    with serving(setup, tmp) as url:
        light_run(url, 2, rng)  # warm-up
        unloaded = light_run(url, args.light, rng)
        with Flood(url, args.heavy, args.heavy_tokens, seed) as flood:
            time.sleep(2.0)  # the heavy prompts are in the engine
            loaded = light_run(url, args.light, rng)
    figures.unloaded += unloaded
    figures.loaded += loaded
    figures.ratios.append(p95(loaded) / p95(unloaded))
    figures.heavy += flood.served
    print(
        f"  {setup.name}: light p95 {p95(unloaded) * 1000:.0f} ms unloaded, {p95(loaded) * 1000:.0f} ms loaded",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--light", type=int, default=12, help="light requests per phase")
    parser.add_argument("--heavy", type=int, default=2, help="heavy clients flooding")
    parser.add_argument("--heavy-tokens", type=int, default=HEAVY_TOKENS, help="prompt tokens of a heavy request")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256], help="prefill chunk sizes of the fair setup")
    args = parser.parse_args()
    runs = setups(args.chunks)
    figures = {s.name: Figures() for s in runs}
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds}", flush=True)
            for setup in runs if r % 2 == 0 else runs[::-1]:  # alternate which goes first
                measure(setup, args, Path(tmp), r, figures[setup.name])
    print(
        f"\nlight tenant TTFT ({args.light} requests a phase, {args.rounds} rounds), heavy: {args.heavy} clients "
        f"of {args.heavy_tokens}-token prompts"
    )
    print(f"{'setup':32} {'unloaded p50/p95 ms':>20} {'loaded p50/p95 ms':>20} {'p95 ratio':>10} {'rounds':>14}")
    for name, f in figures.items():
        spread = f"{min(f.ratios):.1f}-{max(f.ratios):.1f}x"
        ratio = p95(f.loaded) / p95(f.unloaded)
        print(
            f"{name:32} {statistics.median(f.unloaded) * 1000:9.0f}/{p95(f.unloaded) * 1000:<9.0f} "
            f"{statistics.median(f.loaded) * 1000:9.0f}/{p95(f.loaded) * 1000:<9.0f} {ratio:9.1f}x {spread:>14}"
        )
        refused = sum(1 for s in f.heavy if s == 429)
        print(f"{'':32} heavy requests answered: {len(f.heavy)} ({refused} refused with 429)")
    base = figures[runs[-1].name]
    for setup in runs[:-1]:
        f = figures[setup.name]
        ratio = p95(f.loaded) / p95(f.unloaded)
        verdict = "met" if ratio <= TARGET else "NOT met"
        gain = p95(base.loaded) / p95(f.loaded)
        print(
            f"{setup.name}: loaded p95 {ratio:.1f}x unloaded (target <= {TARGET:.0f}x: {verdict}); "
            f"{gain:.1f}x lower than the baseline's loaded p95"
        )


if __name__ == "__main__":
    main()
