"""Retention's fairness through the real server: one tenant asks retention for everything
it sends, three ask nothing; the three keep their hit rate, the flooder is held to its cap.

Each phase is a fresh ``prefixcache serve`` process (SmolLM2-135M on this machine's CPU)
with one host-RAM tier sized in blocks (``--capacity-blocks``, no disk: nothing survives
a phase), four tenants' API keys and an admin key. The three quiet tenants each own a few
prompts (``--prompts`` of ``--tokens`` random token ids, through ``/v1/completions``,
``max_tokens = 1``) and send them again and again: one warm pass, then ``--passes``
measured passes; a tenant's hit rate is its cached tokens over its prompt tokens in the
measured passes. The flooder sends ``--flood`` new prompts of the same length before each
quiet request, every one with OpenAI's ``prompt_cache_retention: "24h"``.

Phases:

- ``alone``: the three without the flooder (the baseline);
- ``flood, capped``: with the flooder, retention capped as configured (the default share,
  a quarter of each level, all the flooder's as no one else retains);
- once each: ``flood, no retention`` (the same flood asking nothing: what LRU alone keeps,
  so the volume is not what a cap has to fix) and ``flood, share 1.0``
  (``[admission.tenants.flood] retain_share = 1.0``, the default share 0: no cap; the
  benchmark must fail there).

The tier is sized so that the quiet prompts and the flood between two sends of one fit
beside the capped retention, while the flood of a phase is larger than the whole tier:
uncapped, its retention crowds the quiet prompts out.

After each flood request the admin's ``/admin/stats`` gives the flooder's retention per
level (the cache in tokens, the tier in frames) and its cap there; the largest held/cap
is printed (target: never above 1). Rounds alternate the order of ``alone`` and
``flood, capped``; the spread is over rounds.

Targets (issue 41): each quiet tenant's hit rate with the flooder at least 0.95 of its
rate without; the flooder's retention never above its cap.

Run:  .venv/bin/python benchmarks/bench_retention_fairness.py [--rounds 2] [--passes 6]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from prefixcache.config import KVLayout
from serve_process import serve_process

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".prefixcache" / "models"
MODEL = "smollm2-135m-instruct"
SMOLLM2 = KVLayout(30, 3, 64, "float32")  # the stored bytes of a block size the tier
BLOCK = 16
QUIET = ("q1", "q2", "q3")
FLOODER = "flood"
KEYS = {f"sk-{t}-0123456789abcdef": t for t in (*QUIET, FLOODER)}
KEY_OF = {t: k for k, t in KEYS.items()}
ADMIN = "admin-0123456789abcdef"
TARGET_RATIO = 0.95
RETENTION_HEADER = "x-prefixcache-retention"


@dataclass(frozen=True)
class Phase:
    name: str
    flood: bool
    retain: bool = True  # the flooder asks retention
    flooder_share: float | None = None  # [admission.tenants.flood] retain_share; None: the default share

    def config(self, port: int, capacity_blocks: int) -> str:
        keys = ", ".join(f'"{k}" = "{t}"' for k, t in KEYS.items())
        tier_bytes = capacity_blocks * SMOLLM2.stored_bytes(BLOCK, "raw")
        own = (  # the flooder's own share; the default then 0, as shares may not add up past the whole
            f"retain_share = 0\n[admission.tenants.{FLOODER}]\nretain_share = {self.flooder_share}\n"
            if self.flooder_share
            else ""
        )
        return (
            f'[server]\nport = {port}\nrequest_timeout_s = 600\n[model]\nmodels_dir = "{MODELS}"\n'
            f'[cache]\nblock_size = {BLOCK}\n[[cache.tiers]]\nkind = "memory"\ncapacity_bytes = {tier_bytes}\n'
            f'[auth]\napi_keys = {{ {keys} }}\nadmin_key = "{ADMIN}"\n[admission]\nmax_concurrent = 8\n{own}'
        )


ALONE = Phase("alone", flood=False)
CAPPED = Phase("flood, capped", flood=True)
UNRETAINED = Phase("flood, no retention", flood=True, retain=False)
UNCAPPED = Phase("flood, share 1.0", flood=True, flooder_share=1.0)


@contextlib.contextmanager
def serving(phase: Phase, args: argparse.Namespace, tmp: Path) -> Iterator[str]:
    """A ``prefixcache serve`` process for ``phase``; its URL."""
    with serve_process(lambda port: phase.config(port, args.capacity_blocks), tmp) as url:
        yield url


@dataclass
class Result:
    """One phase: each quiet tenant's measured tokens, and the flooder's retention."""

    prompt: Counter[str] = field(default_factory=Counter)
    cached: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # the flooder's retention header
    worst: list[float] = field(default_factory=list)  # per binding level: the largest held / cap seen
    held_max: list[int] = field(default_factory=list)  # per binding level: the most held
    caps: list[int] = field(default_factory=list)  # per binding level: the cap then
    levels: list[str] = field(default_factory=list)

    def rate(self, tenant: str) -> float:
        return self.cached[tenant] / self.prompt[tenant] if self.prompt[tenant] else 0.0


def complete(http: httpx.Client, url: str, tenant: str, prompt: list[int], retain: bool) -> httpx.Response:
    body: dict[str, object] = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if retain:
        body["prompt_cache_retention"] = "24h"
    response = http.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_OF[tenant]}"})
    response.raise_for_status()
    return response


def sample_retention(http: httpx.Client, url: str, result: Result) -> None:
    """The flooder's retention and caps now, per binding level, folded into ``result``."""
    stats = http.get(url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()["cache"]
    levels = stats["retention_levels"]
    mine = next((t for t in stats["retention"] if t["tenant"] == FLOODER), None)
    binding = [i for i, level in enumerate(levels) if level["binding"]]
    if not result.levels:
        result.levels = [f"{levels[i]['name']} ({'tokens' if levels[i]['per_token'] else 'frames'})" for i in binding]
        result.worst, result.held_max, result.caps = [0.0] * len(binding), [0] * len(binding), [0] * len(binding)
    if mine is None:
        return
    for j, i in enumerate(binding):
        held, cap = mine["held"][i], mine["caps"][i]
        result.held_max[j] = max(result.held_max[j], held)
        result.caps[j] = cap
        result.worst[j] = max(result.worst[j], held / cap if cap else (float("inf") if held else 0.0))


def run_phase(phase: Phase, args: argparse.Namespace, tmp: Path, seed: int) -> Result:
    rng = random.Random(seed)
    prompts = {
        t: [[rng.randrange(1000, 40000) for _ in range(args.tokens)] for _ in range(args.prompts)] for t in QUIET
    }
    flood_rng = random.Random(seed * 7919 + 1)
    result = Result()
    with serving(phase, args, tmp) as url, httpx.Client(timeout=600) as http:
        for p in range(args.passes + 1):  # the first pass warms the cache, unmeasured
            for i in range(args.prompts):
                for tenant in QUIET:
                    if phase.flood:
                        for _ in range(args.flood):
                            noise = [flood_rng.randrange(1000, 40000) for _ in range(args.tokens)]
                            answer = complete(http, url, FLOODER, noise, phase.retain)
                            result.outcomes[answer.headers.get(RETENTION_HEADER, "none")] += 1
                            sample_retention(http, url, result)
                    usage = complete(http, url, tenant, prompts[tenant][i], False).json()["usage"]
                    if p > 0:
                        result.prompt[tenant] += usage["prompt_tokens"]
                        result.cached[tenant] += usage["prompt_tokens_details"]["cached_tokens"]
    return result


def describe(phase: Phase, r: Result) -> str:
    rates = " ".join(f"{t} {r.rate(t):.3f}" for t in QUIET)
    line = f"  {phase.name:22} hit rates {rates}"
    if phase.flood and phase.retain:
        worst = ", ".join(
            f"{name} {held:,}/{cap:,} (max {w:.2f})"
            for name, held, cap, w in zip(r.levels, r.held_max, r.caps, r.worst, strict=True)
        )
        line += f"; flooder retained at most {worst}; headers {dict(sorted(r.outcomes.items()))}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--passes", type=int, default=6, help="measured passes over the quiet prompts")
    parser.add_argument("--prompts", type=int, default=2, help="prompts of each quiet tenant")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of every prompt")
    parser.add_argument("--flood", type=int, default=1, help="flood prompts before each quiet request")
    parser.add_argument("--capacity-blocks", type=int, default=384, help="the memory tier, in blocks of 16 tokens")
    parser.add_argument("--no-failing-runs", action="store_true", help="skip the no-retention and share-1.0 runs")
    args = parser.parse_args()
    results: dict[str, list[Result]] = {ALONE.name: [], CAPPED.name: []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-retention-") as tmp:
        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds}", flush=True)
            for phase in (ALONE, CAPPED) if r % 2 == 0 else (CAPPED, ALONE):  # alternate which goes first
                result = run_phase(phase, args, Path(tmp), seed=r)
                results[phase.name].append(result)
                print(describe(phase, result), flush=True)
        extra: dict[str, Result] = {}
        if not args.no_failing_runs:
            print("once each", flush=True)
            for phase in (UNRETAINED, UNCAPPED):
                extra[phase.name] = run_phase(phase, args, Path(tmp), seed=0)
                print(describe(phase, extra[phase.name]), flush=True)
    report(args, results, extra, time.monotonic() - started)


def report(args: argparse.Namespace, results: dict[str, list[Result]], extra: dict[str, Result], took: float) -> None:
    quiet_tokens = len(QUIET) * args.prompts * (args.tokens + 1)
    print(
        f"\n{len(QUIET)} quiet tenants x {args.prompts} prompts of {args.tokens} tokens ({quiet_tokens:,} tokens "
        f"stored), {args.passes} measured passes; the flooder: {args.flood} new {args.tokens}-token prompt(s) with "
        f'"24h" retention before each quiet request; a memory tier of {args.capacity_blocks} blocks '
        f"({args.capacity_blocks * BLOCK:,} tokens); {args.rounds} rounds, alternating; {took / 60:.1f} min"
    )
    alone, capped = results[ALONE.name], results[CAPPED.name]
    met = True
    for tenant in QUIET:
        ratios = [
            c.rate(tenant) / a.rate(tenant) if a.rate(tenant) else 0.0 for a, c in zip(alone, capped, strict=True)
        ]
        base = statistics.median(a.rate(tenant) for a in alone)
        ratio = statistics.median(ratios)
        met &= min(ratios) >= TARGET_RATIO
        print(
            f"{tenant}: hit rate with the flooder / without: {ratio:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}; "
            f"without {base:.3f})"
        )
    worst = max((max(c.worst) for c in capped if c.worst), default=0.0)
    held_ok = worst <= 1.0
    print(
        f"quiet tenants keep >= {TARGET_RATIO} of their hit rate: {'met' if met else 'NOT met'}; the flooder's "
        f"retention at most {worst:.2f} of its cap in every round (target <= 1): {'met' if held_ok else 'NOT met'}"
    )
    base = {t: statistics.median(a.rate(t) for a in alone) for t in QUIET}
    for name, r in extra.items():
        ratios = " ".join(f"{t} {r.rate(t) / base[t] if base[t] else 0.0:.3f}" for t in QUIET)
        print(f"{name}: hit rate / without the flooder: {ratios}")


if __name__ == "__main__":
    main()
