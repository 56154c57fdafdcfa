"""The ``prefixcache`` command.

- ``prefixcache replay TRACE``: replay a request trace through the cache under several
  configurations and report hit rates, the offline optimum and prefill compute saved.
- ``prefixcache workload OUT``: write a deterministic synthetic multi-tenant trace.
- ``prefixcache plan TRACE``: the cache capacity (tokens, GiB, tiers) for a target hit
  rate on a trace, and the prefill GPU-hours and money it saves per hour of traffic.
- ``prefixcache serve``: the OpenAI-compatible server on a real model, with the cache.
- ``prefixcache serve-vllm``: vLLM with the prefixcache connector and ``prefixcache route``
  in front, started, wired and stopped together.
- ``prefixcache diagnose URL_OR_FILE``: read /metrics (or saved scrapes) and print a
  diagnosis with the next action; exit 1 when something needs action.
- ``prefixcache audit-timing URL``: audit a server for prompt-cache timing leaks between
  tenants; exit 1 on a leak, 2 when inconclusive.
- ``prefixcache gate-codec``: measure each KV codec against raw on a model (the codec
  quality gate) and store the figures a server checks its tiers' codecs against.
- ``prefixcache warm PROMPTS``: prefill a file of prompts or chats into the cache's tiers
  (or through a server) before traffic arrives; a rerun skips what is stored.
- ``prefixcache demo``: drive the cache with synthetic chat traffic and print what it saved.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence

from prefixcache import __version__
from prefixcache.cache import PrefixCache
from prefixcache.config import ISOLATION_MODES, CacheConfig, PublishConfig
from prefixcache.fleet.cli import add_route_parser, run_route
from prefixcache.fleet.serve_vllm import add_serve_vllm_parser, run_serve_vllm
from prefixcache.hashing import CacheContext
from prefixcache.ops.audit_cli import add_audit_parser, run_audit_timing
from prefixcache.ops.diagnose import add_diagnose_parser, run_diagnose
from prefixcache.policies import POLICIES
from prefixcache.quality.codec_cli import add_gate_codec_parser, run_gate_codec
from prefixcache.sim.cli import add_replay_parser, add_workload_parser, run_replay, run_workload
from prefixcache.sim.curve_cli import add_curve_parser, run_curve
from prefixcache.sim.plan_cli import add_plan_parser, run_plan
from prefixcache.warm.cli import add_warm_parser, run_warm


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(49_152) for _ in range(n)]


def run_demo(
    requests: int, tenants: int, policy: str, isolation: str, capacity: int, seed: int, out: list[str]
) -> PrefixCache:
    """Replay a synthetic multi-tenant chat workload; append a report to ``out``."""
    rng = random.Random(seed)
    publish = PublishConfig(min_tenants=3, min_tokens=256) if isolation != "shared" else None
    config = CacheConfig(
        block_size=16,
        capacity_tokens=capacity,
        policy=policy,
        isolation=isolation,
        partial_blocks=True,
        publish=publish,
    )
    cache = PrefixCache(config)
    shared_system = _tokens(rng, 512)  # the same vendor system prompt, used by every tenant
    own_system = {f"tenant-{t}": _tokens(rng, 256) for t in range(tenants)}
    sessions: dict[str, list[list[int]]] = {name: [] for name in own_system}
    for _ in range(requests):
        tenant = f"tenant-{rng.randrange(tenants)}"
        ctx = CacheContext(tenant=tenant, model="demo-model")
        chats = sessions[tenant]
        if chats and rng.random() < 0.7:  # the next turn of an open conversation
            history = rng.choice(chats)
            history += _tokens(rng, rng.randrange(20, 120))
            prompt = list(history)
        elif rng.random() < 0.8:  # a new conversation
            base = shared_system if rng.random() < 0.5 else own_system[tenant]
            prompt = base + _tokens(rng, rng.randrange(30, 200))
            chats.append(list(prompt))
        else:  # a one-off prompt
            prompt = _tokens(rng, rng.randrange(100, 800))
        with cache.match(prompt, ctx):
            pass  # a server would load the matched KV and prefill the rest here
        answer = _tokens(rng, rng.randrange(20, 150))
        cache.insert(prompt + answer, ctx)
        if prompt in chats:
            chats[chats.index(prompt)] = prompt + answer
    stats = cache.stats()
    out.append(
        f"prefixcache {__version__} demo: {requests} requests from {tenants} tenants, "
        f"isolation={isolation}, policy={policy}, capacity={capacity:,} tokens"
    )
    rate = stats.hit_tokens / max(stats.lookup_tokens, 1)
    out.append(
        f"  token hit rate {rate:.1%}: {stats.hit_tokens:,} of {stats.lookup_tokens:,} prompt tokens "
        f"came from the cache instead of prefill"
    )
    out.append(
        f"  used {stats.used_tokens:,} tokens in {stats.blocks:,} blocks; evictions {stats.evictions:,}, "
        f"published blocks {stats.published_blocks}, collisions {stats.collisions}"
    )
    for name, per in sorted(stats.tenants.items()):
        per_rate = per.hit_tokens / max(per.lookup_tokens, 1)
        out.append(f"  {name:>10}: {per.lookups:4d} lookups, token hit rate {per_rate:6.1%}")
    return cache


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, built without running anything (the docs' check reads it)."""
    parser = argparse.ArgumentParser(prog="prefixcache", description="A prefix (KV) cache for LLM serving.")
    parser.add_argument("--version", action="version", version=f"prefixcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_replay_parser(sub)
    add_workload_parser(sub)
    add_plan_parser(sub)
    add_curve_parser(sub)
    add_diagnose_parser(sub)
    add_audit_parser(sub)
    add_route_parser(sub)
    add_serve_vllm_parser(sub)
    add_gate_codec_parser(sub)
    add_warm_parser(sub)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server with the prefix cache")
    serve.add_argument("--config", help="TOML settings file (default: $PREFIXCACHE_CONFIG, else built-in defaults)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8000)")
    serve.add_argument(
        "--allow-open-access",
        action="store_true",
        help="listen beyond loopback with no API keys configured (anyone who reaches the port may use it)",
    )
    serve.add_argument("--model", help="'smollm2-135m-instruct' (default) or a local transformers model folder")
    serve.add_argument(
        "--print-settings",
        action="store_true",
        help="print the effective settings (JSON, secrets masked) and exit, without loading the model",
    )
    demo = sub.add_parser("demo", help="replay synthetic multi-tenant chat traffic through the cache")
    demo.add_argument("--requests", type=int, default=2000, help="number of requests (default 2000)")
    demo.add_argument("--tenants", type=int, default=5, help="number of tenants (default 5)")
    demo.add_argument("--policy", choices=sorted(POLICIES), default="lru", help="eviction policy")
    demo.add_argument("--isolation", choices=ISOLATION_MODES, default="namespace", help="tenant isolation")
    demo.add_argument("--capacity-tokens", type=int, default=200_000, help="cache capacity in tokens")
    demo.add_argument("--seed", type=int, default=0, help="workload seed")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "replay":
        return run_replay(args, parser)
    if args.command == "workload":
        return run_workload(args, parser)
    if args.command == "plan":
        return run_plan(args, parser)
    if args.command == "curve":
        return run_curve(args, parser)
    if args.command == "diagnose":
        return run_diagnose(args)
    if args.command == "audit-timing":
        return run_audit_timing(args, parser)
    if args.command == "route":
        return run_route(args, parser)
    if args.command == "serve-vllm":
        return run_serve_vllm(args, parser)
    if args.command == "gate-codec":
        return run_gate_codec(args, parser)
    if args.command == "warm":
        return run_warm(args, parser)
    if args.command == "serve":
        from prefixcache.server.main import run_serve  # torch and transformers load only here

        return run_serve(args, parser)
    if args.requests < 1 or args.tenants < 1 or args.capacity_tokens < 0:
        parser.error("--requests and --tenants must be >= 1 and --capacity-tokens >= 0")
    lines: list[str] = []
    run_demo(args.requests, args.tenants, args.policy, args.isolation, args.capacity_tokens, args.seed, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
