"""Batched decode under load (issue #31): 16 concurrent multi-turn chats on the engine
against the engine before it (one decoding request per forward), in the same run.

Each configuration runs in a subprocess of its own (SmolLM2-135M on this machine's CPU,
a prefix cache with a memory tier, so that a chat's later turns and a tenant's shared
system prompt hit):

- ``baseline``: the engine at ``--baseline-rev`` (``git archive`` of its ``src/`` into a
  temporary folder, first on ``PYTHONPATH``), as ``make serve`` runs it: ``max_active=4``,
  its own defaults otherwise (chunks of 256 tokens, bursts of 8 tokens);
- ``new``: the working tree's engine as ``make serve`` runs it now: ``max_active=32``,
  ``batch_decode=True``, its own defaults otherwise, the main thread's torch on one core
  (as ``serve`` sets it, ``engine/threads.py``);
- ``baseline-serial``: the baseline with its main thread's torch on one core as the
  working tree's ``serve`` sets it (``engine/threads.py``): its one thread that runs the
  model then has the process's only OpenMP team, as the new engine's worker has. Not
  what the engine before ran like; what its design is worth beside the new one's on
  the same footing;
- ``ablation``: the same with ``batch_decode=False`` (each decoding request its own
  forward): what batching buys apart from more requests in flight. Left out while the
  working tree's ``Engine`` has no ``batch_decode``.

Workload (deterministic): ``--clients`` threads, spread over ``--tenants`` tenants, each a
chat of ``--turns`` turns: the tenant's system prompt (a few hundred tokens), then a user
message from a fixed list; greedy, ``--max-tokens`` per answer; each turn appends the
answer (the ``DoneEvent`` text) and the next user message. The clients start together.
TTFT is ``submit`` to the request's first event; output tokens/s is every answer's
tokens over the wall time of the concurrent run.

Wrong outputs: each subprocess then serves every chat alone (a fresh engine and cache,
one request at a time, the same turns, each chat on its own answers) as the reference.
Turn k of the concurrent run is compared (tokens) only when its history (the answers of
turns before k) equals the reference's; a difference is a wrong output.

Rounds alternate the order of the configurations; the ratios are per round (median and
min-max). Targets (issue #31): new vs baseline, output tokens/s >= 4x, TTFT p50 >= 3x
lower, 0 wrong outputs.

Run:  .venv/bin/python benchmarks/bench_serve_load.py [--rounds 2] [--configs new baseline ablation]
      [--clients 16] [--tenants 4] [--turns 3] [--max-tokens 48] [--dtype float32] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NOTE: resolved on PYTHONPATH: a baseline child imports the baseline revision's engine
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.engine import (
    DoneEvent,
    Engine,
    EngineError,
    Event,
    LoadedModel,
    Request,
    SamplingParams,
    TokenEvent,
    load_model,
)

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".prefixcache" / "models"
BASELINE_REV = "d75cdca"  # the engine before batched decode
TARGET_TOKENS, TARGET_TTFT = 4.0, 3.0

RULES = (
    "Answer the customer in two or three short sentences, politely and without guessing. If a question is "
    "outside what you know about the company, say so and offer to connect the customer with a person. Never "
    "promise a refund, a discount or a delivery date that the policies below do not give. Quote prices in "
    "euros. Do not ask for card numbers or passwords. Keep a friendly tone, use no lists and no emoji, and "
    "end by asking whether there is anything else you can help with. "
)
COMPANIES = (
    "Greenleaf Tools, a shop for garden tools in Utrecht. Refunds within 30 days with the receipt; shipping "
    "takes 3 to 5 days; spades cost 25 euros, rakes 18 euros; the support line is open 9 to 5 on weekdays.",
    "Harbor Bikes, a bicycle repair shop in Hamburg. A tune-up costs 60 euros and takes one day; spare "
    "parts are ordered within 48 hours; rental bikes cost 15 euros a day; the shop is closed on Mondays.",
    "Northwind Books, an online bookstore. Orders over 40 euros ship free; e-books are not refundable; "
    "gift cards never expire; the reading club meets on the first Thursday of each month at 7 pm.",
    "Copper Kettle, a cafe and bakery in Lyon. Breakfast is served until 11; cakes must be ordered two days "
    "ahead; the terrace opens in April; oat milk costs 50 cents extra; dogs are welcome inside.",
)
USERS = (
    "Hello! What do you sell?",
    "How long does shipping take?",
    "Can I get my money back if I change my mind?",
    "What are your opening hours?",
    "Do you have anything for a beginner?",
    "How much does your cheapest item cost?",
    "Is there a discount for students?",
    "Can I pay with cash?",
    "Where are you located?",
    "Do you deliver abroad?",
    "What is your most popular product?",
    "Can I bring my dog?",
    "How do I contact a person?",
    "Thank you, that helps. One more question: do you have gift cards?",
    "What happens if my order arrives damaged?",
    "Can you summarise what you told me so far?",
)


@dataclass(frozen=True)
class Workload:
    clients: int
    tenants: int
    turns: int
    max_tokens: int
    dtype: str = "float32"  # the model's (both engines'), as `[model] dtype` sets it

    def args(self) -> list[str]:
        return [f"--{f.name.replace('_', '-')}={getattr(self, f.name)}" for f in dataclasses.fields(self)]

    def system(self, client: int) -> str:
        company = COMPANIES[client % self.tenants % len(COMPANIES)]
        return f"You are the assistant of {company} {RULES * 2}"

    def user(self, client: int, turn: int) -> str:
        return USERS[(client + 7 * turn) % len(USERS)]


@dataclass(frozen=True)
class Config:
    name: str
    engine: str  # which source: the working tree or the baseline revision
    max_active: int
    batch_decode: bool | None  # None: not passed (the baseline's engine has no such argument)
    serial: bool  # the main thread's torch on one core, as `serve` sets it since engine/threads.py


CONFIGS = {
    "new": Config("new", "working tree", 32, True, True),
    "baseline": Config("baseline", "baseline rev", 4, None, False),
    "baseline-serial": Config("baseline-serial", "baseline rev", 4, None, True),
    "ablation": Config("ablation", "working tree", 32, False, True),
}


@dataclass(frozen=True)
class Turn:
    ttft_s: float
    tokens: tuple[int, ...]
    text: str
    error: str | None = None


@dataclass(frozen=True)
class RunResult:
    """One configuration's run in one round, as its subprocess reports it (one JSON line)."""

    config: str
    round: int
    batch_decode: bool | None
    wall_s: float
    requests: int
    output_tokens: int
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    compared: int  # concurrent turns whose history matched the reference's
    wrong: int  # of those, answers that differ from the reference's
    errors: int  # requests that ended in an error

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        raw = json.loads(text)
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls)})


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, math.ceil(0.95 * len(values)) - 1)]


# ---------------------------------------------------------------------- the child: one engine


class Waiter:
    """A sink that notes when the first event came and waits for the last."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: Event | None = None
        self.ended = threading.Event()

    def __call__(self, event: Event) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        if not isinstance(event, TokenEvent):
            self.last = event
            self.ended.set()


def chat(engine: Engine, work: Workload, client: int, start: threading.Barrier | None) -> list[Turn]:
    """One client's chat: each turn on the answers before it; stops at an error."""
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0)
    messages = [{"role": "system", "content": work.system(client)}]
    turns: list[Turn] = []
    if start is not None:
        start.wait()
    for k in range(work.turns):
        messages.append({"role": "user", "content": work.user(client, k)})
        request = Request(engine.tokenize_chat(messages), f"tenant-{client % work.tenants}", params)
        waiter = Waiter()
        began = time.perf_counter()
        try:
            engine.submit(request, waiter)
        except EngineError as e:
            return [*turns, Turn(0.0, (), "", f"{type(e).__name__}: {e.message}")]
        waiter.ended.wait()
        ttft = (waiter.first or began) - began
        if not isinstance(waiter.last, DoneEvent):
            return [*turns, Turn(ttft, (), "", repr(waiter.last))]
        turns.append(Turn(ttft, waiter.last.tokens, waiter.last.text))
        messages.append({"role": "assistant", "content": waiter.last.text})
    return turns


def batch_decode(config: Config) -> bool | None:
    """What ``config`` passes as ``batch_decode``: nothing to an engine without it."""
    if "batch_decode" in inspect.signature(Engine).parameters:
        return config.batch_decode
    if config.batch_decode is False:
        raise SystemExit(f"{config.name}: this engine has no batch_decode")
    return None


def open_engine(lm: LoadedModel, config: Config) -> Engine:
    """A fresh engine on a fresh cache (memory tier), as ``make serve`` slices its time."""
    # NOTE: partial blocks as `serve` stores them: a turn's answer hits up to its last token
    tiers = (TierConfig(kind="memory", capacity_bytes=4 << 30),)
    cache = PrefixCache(CacheConfig(block_size=16, kv_layout=lm.kv, tiers=tiers, partial_blocks=True))
    flag = batch_decode(config)
    # NOTE: by keyword from a dict: an engine without the argument must not see it at all
    extra: dict[str, Any] = {} if flag is None else {"batch_decode": flag}
    # NOTE: no per-tenant admission limits: `make serve`'s (4 requests a tenant) never bind
    # at the defaults (4 clients a tenant, one request each in flight)
    # NOTE: chunk size and decode steps per chunk: each engine's own defaults, as `make serve` runs it
    return Engine(lm, "bench", cache=cache, max_active=config.max_active, **extra)


def serial_main() -> None:
    """What ``prefixcache serve`` does to its main thread before it loads the model
    (``engine/threads.py``, loaded from the working tree: a baseline child has the
    baseline's ``prefixcache`` on its path)."""
    spec = importlib.util.spec_from_file_location("_threads", ROOT / "src" / "prefixcache" / "engine" / "threads.py")
    assert spec is not None and spec.loader is not None
    threads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(threads)
    if not threads.serial_torch():
        raise SystemExit("torch does not run on GNU OpenMP here: --configs without serial ones")


def run_child(config: Config, work: Workload, round_: int) -> RunResult:
    if config.serial:
        serial_main()
    lm = load_model(models_dir=MODELS, device="cpu", dtype=work.dtype)
    warm = Engine(lm, "bench")  # the first forwards of a process are slow; no cache, nothing stored
    warm.generate(Request([1, 2, 3, 4], "warm-up", SamplingParams(max_tokens=4, temperature=0.0))).result(120)
    warm.close()

    engine = open_engine(lm, config)
    start = threading.Barrier(work.clients)
    found: list[list[Turn]] = [[] for _ in range(work.clients)]

    def client(i: int) -> None:
        found[i] = chat(engine, work, i, start)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(work.clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    engine.close()

    alone = open_engine(lm, config)
    reference = [chat(alone, work, i, None) for i in range(work.clients)]
    alone.close()

    compared = wrong = 0
    for got, want in zip(found, reference, strict=True):
        for k in range(min(len(got), len(want))):
            if [t.text for t in got[:k]] != [t.text for t in want[:k]]:
                break  # a different history: the turns after a wrong one are not comparable
            if got[k].error is None and want[k].error is None:
                compared += 1
                wrong += got[k].tokens != want[k].tokens
    turns = [t for chat_turns in found for t in chat_turns if t.error is None]
    ttfts = [t.ttft_s for t in turns]
    tokens = sum(len(t.tokens) for t in turns)
    errors = sum(1 for chat_turns in [*found, *reference] for t in chat_turns if t.error is not None)
    return RunResult(
        config.name,
        round_,
        batch_decode(config),
        wall,
        len(turns),
        tokens,
        tokens / wall,
        statistics.median(ttfts) if ttfts else math.nan,
        p95(ttfts) if ttfts else math.nan,
        compared,
        wrong,
        errors,
    )


# ---------------------------------------------------------------------- the parent: rounds, ratios


def batch_decode_supported() -> bool:
    return "batch_decode" in inspect.signature(Engine).parameters


def extract(rev: str, folder: Path) -> Path:
    """``rev``'s ``src/`` under ``folder``, for ``PYTHONPATH``."""
    git = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True)
    if git.returncode != 0:
        raise SystemExit(f"git archive {rev} failed (the baseline needs git history): {git.stderr.decode()}")
    archive = git.stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def measure(config: Config, work: Workload, round_: int, src: Path) -> RunResult:
    env = os.environ | {"PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, f"--child={config.name}", f"--child-round={round_}", *work.args()]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(f"{config.name} failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    result = RunResult.from_json(run.stdout.strip().splitlines()[-1])
    print(
        f"  {config.name:9} {result.tokens_per_s:7.1f} tok/s  TTFT p50 {result.ttft_p50_s * 1000:6.0f} ms  "
        f"p95 {result.ttft_p95_s * 1000:6.0f} ms  wrong {result.wrong}/{result.compared}  errors {result.errors}",
        flush=True,
    )
    return result


@dataclass(frozen=True)
class Ratio:
    name: str
    tokens: list[float]  # per round: tokens/s of the one over the other
    ttft_p50: list[float]  # per round: the other's TTFT over the one's (higher is better)
    ttft_p95: list[float]


def ratio(one: str, other: str, results: list[RunResult], rounds: int) -> Ratio:
    pairs = []
    for r in range(rounds):
        by = {x.config: x for x in results if x.round == r}
        pairs.append((by[one], by[other]))
    return Ratio(
        f"{one} vs {other}",
        [a.tokens_per_s / b.tokens_per_s for a, b in pairs],
        [b.ttft_p50_s / a.ttft_p50_s for a, b in pairs],
        [b.ttft_p95_s / a.ttft_p95_s for a, b in pairs],
    )


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f}x ({min(values):.2f}-{max(values):.2f})"


def report(results: list[RunResult], names: list[str], work: Workload, rounds: int, rev: str) -> list[Ratio]:
    print(
        f"\n{work.clients} clients, {work.tenants} tenants, {work.turns} turns, {work.max_tokens} tokens an answer, "
        f"{work.dtype}, {rounds} round(s); baseline rev {rev}"
    )
    print(
        f"{'config':9} {'engine':13} {'active':>6} {'batch':>5} {'round':>5} {'tok/s':>7} {'p50 ms':>7} "
        f"{'p95 ms':>7} {'wall s':>7} {'wrong':>9} {'errors':>6}"
    )
    for x in sorted(results, key=lambda x: (names.index(x.config), x.round)):
        c = CONFIGS[x.config]
        print(
            f"{x.config:9} {c.engine:13} {c.max_active:6} {x.batch_decode!s:>5} {x.round + 1:5} "
            f"{x.tokens_per_s:7.1f} {x.ttft_p50_s * 1000:7.0f} {x.ttft_p95_s * 1000:7.0f} {x.wall_s:7.1f} "
            f"{f'{x.wrong}/{x.compared}':>9} {x.errors:6}"
        )
    pairs = (("new", "baseline"), ("new", "baseline-serial"), ("ablation", "baseline"), ("new", "ablation"))
    ratios = [ratio(a, b, results, rounds) for a, b in pairs if a in names and b in names]
    if ratios:
        print(f"\n{'ratios: median (rounds)':24} {'tokens/s':>20} {'TTFT p50':>20} {'TTFT p95':>20}")
    for q in ratios:
        print(f"{q.name:24} {spread(q.tokens):>20} {spread(q.ttft_p50):>20} {spread(q.ttft_p95):>20}")
    for q in ratios:
        if q.name != "new vs baseline":
            continue
        wrong = sum(x.wrong + x.errors for x in results if x.config == "new")
        met = min(q.tokens) >= TARGET_TOKENS and min(q.ttft_p50) >= TARGET_TTFT and wrong == 0
        print(
            f"\ntarget (issue #31): tokens/s >= {TARGET_TOKENS:.0f}x, TTFT p50 >= {TARGET_TTFT:.0f}x, 0 wrong "
            f"(every round): {'met' if met else 'NOT met'}"
        )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 2 (1 with --quick)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="every engine's model")
    parser.add_argument("--baseline-rev", default=BASELINE_REV)
    parser.add_argument("--quick", action="store_true", help="4 clients, 2 tenants, 2 turns, 16 tokens, 1 round")
    parser.add_argument("--json", type=Path, help="write every run's figures and the ratios here")
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--child-round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.clients, args.tenants, args.turns, args.max_tokens = 4, 2, 2, 16
    work = Workload(args.clients, args.tenants, args.turns, args.max_tokens, args.dtype)
    if args.child:
        print(json.dumps(dataclasses.asdict(run_child(CONFIGS[args.child], work, args.child_round))))
        return
    rounds = args.rounds or (1 if args.quick else 2)
    names = [n for n in CONFIGS if n in args.configs]
    if not batch_decode_supported():
        print("note: the working tree's engine has no batch_decode yet: new is more requests in flight only")
        if "ablation" in names:
            print("ablation left out: it needs batch_decode")
            names.remove("ablation")
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-load-") as tmp:
        base = extract(args.baseline_rev, Path(tmp)) if "baseline" in names else ROOT / "src"
        for r in range(rounds):
            print(f"round {r + 1} of {rounds}", flush=True)
            for name in names if r % 2 == 0 else names[::-1]:  # alternate which goes first
                results.append(measure(CONFIGS[name], work, r, base if name == "baseline" else ROOT / "src"))
    ratios = report(results, names, work, rounds, args.baseline_rev)
    if args.json:
        out = {"runs": [dataclasses.asdict(x) for x in results], "ratios": [dataclasses.asdict(q) for q in ratios]}
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
