"""vLLM alone, vLLM's own CPU offloading, LMCache and prefixcache at equal memory, in one run.

Run from the vLLM venv (``make test`` builds it; ``make bench-lmcache-venv`` builds the
LMCache one, else that setup is printed as skipped; (c) needs ``redis-server``)::

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--quick] [--runs 2] [--setups vllm,prefixcache]
        [--workloads ab,c]

Every setup is ``vllm serve`` (SmolLM2-135M, CPU, float32, vLLM's prefix cache on) with
the same memory budget of ``budget`` KV blocks of 128 tokens (46,080 bytes a token;
on CPU vLLM's KV space is host RAM too), counted exactly:

    setup         vLLM KV blocks   more host memory (bytes of)   disk (or shared tier)
    vllm          budget           -                             -
    vllm+offload  budget/2         budget/2 blocks (native CPU)  -
    lmcache       budget/2         L1 of budget/2 blocks         fs L2
    prefixcache   budget/2         memory tier of budget/2       disk tier; in (c) Redis
                                   blocks (slots, not more)

Workloads, multi-tenant and multi-turn: ``tenants`` tenants (each its own
``cache_salt``) with a document each and ``conversations`` conversations of ``turns``
turns that append a question and a reply; the requests go round the tenants, as traffic
does, and their distinct 128-token prefixes are about 4x the budget (printed).

- (a) that workload on servers started cold;
- (b) the same requests again after every process (vLLM, LMCache's server) is
  stopped and started again: a warm restart, where a disk tier pays;
- (c) the requests of (a), each with its tenant's API key, through ``prefixcache
  route`` (cost routing on the servers' KV events, ``--kv-events-config``) to ``FLEET``
  = 2 ``vllm serve`` of the setup started cold, each with the per-server budget of (a)
  (so the fleet holds twice (a)'s memory). The router stamps each request with its
  tenant's salt; the connectors verify it with the same secret. prefixcache's servers
  keep their own memory tier and share a Redis (``redis-server``, started by the
  script) as the tier below, instead of (a)'s disk: a disk tier's index is read when
  it opens, so a running server does not see what the other writes there. LMCache's
  two servers share one LMCache server, its L1 the two halves together (``FLEET`` x
  budget/2 blocks), over one fs L2. vLLM alone x2 shares nothing;
- no-reuse throughput: ``rounds`` batches of ``unique`` distinct prompts, 32 output
  tokens each, sent at once; prompt and output tokens per second, the median of the
  rounds. A batch must fit the KV that the smallest vLLM can use (budget/2 blocks less
  the one vLLM keeps back), else a prompt waits in the half-KV setups only: the script
  counts the batch's blocks and refuses to run otherwise (3 prompts of 2 blocks).

Each request of (a), (b) and (c) is sent alone with one output token: its latency is
its time to first token; the token hit rate is vLLM's cached prompt tokens
(``usage.prompt_tokens_details``) over prompt tokens. Every setup runs ``--runs`` times,
the order reversed every other run; the table gives each run and the spread.

Targets (issue #26, point 6): on (a), (b) and (c) prefixcache's token hit rate at
least the best other setup's and its mean TTFT at least 1.5x better than the best
other's; no-reuse throughput within 5 % of vLLM alone.

Before each setup starts (not with ``--quick``), the script waits (30 s polls, up to 20 minutes) until no
other vLLM engine or vLLM test runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from prefixcache.identity import SECRET_ENV

ROOT = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("PREFIXCACHE_VLLM_MODEL", str(ROOT / ".prefixcache/models/SmolLM2-135M-Instruct.Q4_1"))
VLLM_PYTHON = sys.executable
LMCACHE_PYTHON = ROOT / ".venv-lmcache/bin/python"
SERVER = ("-m", "vllm.entrypoints.openai.api_server")
BLOCK = 128
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, float32: layers x (K, V) x kv heads x head dim x 4
BLOCK_BYTES = BLOCK * TOKEN_BYTES
GiB = 1 << 30
FRAME_SLACK = 1024  # a memory-tier slot is a block's bytes plus a frame header (< 200 bytes), 16-aligned
BUSY = "vllm.entrypoints|EngineCore|scenario.py|pytest"  # what other engineers' vLLM runs look like
FLEET = 2  # vLLM servers behind the router in (c)
# NOTE: vLLM on CPU reserves one core for its scheduler and, with any KV connector, one
# more: on a 2-core machine vLLM alone then computes on 1 core and a connector's setup
# (too few left to reserve) on both. Every setup reserves the same one core here.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
SECRET = "bench-vllm-tenant-secret-0123456789"  # the router's and the connectors' (c)
ADMIN = "bench-vllm-admin-0123456789"
KEYS = {f"tenant-{t}": f"sk-bench-tenant-{t}-0123456789" for t in range(32)}  # tenant -> its API key in (c)

WORDS = [
    *("harbor", "lantern", "ledger", "copper", "valley", "orchard", "quarry", "meadow", "signal", "timber"),
    *("beacon", "compass", "glacier", "canyon", "prairie", "summit", "island", "river", "forest", "desert"),
    *("harvest", "engine", "bridge", "tunnel", "market", "garden", "castle", "village"),
]


@dataclass(frozen=True)
class Size:
    budget: int  # KV blocks of memory each setup gets in all
    tenants: int
    conversations: int
    turns: int
    doc_words: int  # about one token a word
    unique: int  # no-reuse prompts sent at once (2 blocks each)
    rounds: int


FULL = Size(budget=16, tenants=9, conversations=2, turns=2, doc_words=500, unique=3, rounds=5)
QUICK = Size(budget=16, tenants=2, conversations=1, turns=2, doc_words=500, unique=2, rounds=1)


def text(seed: int, words: int) -> str:
    """Deterministic filler text, different for each seed."""
    state, out = seed * 7919 + 13, []
    for _ in range(words):
        state = (state * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[state % len(WORDS)])
    return " ".join(out) + "."


def multi_turn(size: Size) -> list[tuple[str, str]]:
    """(tenant, prompt) in arrival order: turn by turn, conversation by conversation, round the tenants."""
    documents = {t: f"Document of tenant {t}: " + text(1000 + t, size.doc_words) for t in range(size.tenants)}
    requests = []
    for turn in range(size.turns):
        for c in range(size.conversations):
            for t in range(size.tenants):
                seed = t * 100 + c * 10
                history = "".join(
                    f"\nUser: {text(seed + k, 50)}\nAssistant: {text(seed + k + 5, 45)}" for k in range(turn)
                )
                question = f"\nUser: {text(seed + turn, 50)}\nAssistant:"
                requests.append((f"tenant-{t}", documents[t] + history + question))
    return requests


def tokenized(requests: list[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    """Prompts as token ids (sent as such, so the working set below is exact)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    return [(tenant, tok(prompt)["input_ids"]) for tenant, prompt in requests]


def working_set(requests: Sequence[tuple[str, list[int]]]) -> int:
    """Distinct full 128-token prefixes (per tenant): the blocks the workload would keep."""
    seen = {(tenant, tuple(ids[: k * BLOCK])) for tenant, ids in requests for k in range(1, len(ids) // BLOCK + 1)}
    return len(seen)


# ---------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_quiet(limit_s: float = 1200, poll_s: float = 30) -> None:
    """CPU etiquette: measured runs start only when no other vLLM run is on the machine."""
    deadline = time.monotonic() + limit_s
    while True:
        found = subprocess.run(["pgrep", "-f", BUSY], capture_output=True, text=True).stdout.split()
        others = [p for p in found if int(p) != os.getpid()]
        if not others or time.monotonic() > deadline:
            if others:
                print(f"  (still busy after {limit_s:.0f} s: measuring anyway)", flush=True)
            return
        print(f"  waiting for other vLLM runs to finish (pids {', '.join(others)})", flush=True)
        time.sleep(poll_s)


class Proc:
    """A child process with its log; ``ready`` polls until it answers or exits."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self.url = ""  # a server's, once known
        self.log = log.open("a")
        self.proc = subprocess.Popen(list(argv), stdout=self.log, stderr=subprocess.STDOUT, env=env)

    @classmethod
    def started(
        cls, argv: Sequence[str], env: dict[str, str], log: Path, probe: Callable[[], bool], timeout: float
    ) -> Proc:
        """A child that answers ``probe`` within ``timeout`` seconds (closed if it does not)."""
        proc = cls(argv, env, log)
        try:
            proc.ready(probe, timeout)
        except BaseException:
            proc.close()
            raise
        return proc

    def ready(self, probe: Callable[[], bool], timeout: float = 420) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(last_error(self.log_path))
            try:
                if probe():
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"not ready in {timeout:.0f} s; see {self.log_path}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def listening(port: int) -> Callable[[], bool]:
    """A readiness probe: something accepts connections on ``port`` of 127.0.0.1."""
    return lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() is None


def last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error:" in ln and "initialization failed" not in ln]
    return (errors or lines or ["exited with no output"])[-1][-300:]


# ---------------------------------------------------------------------- setups


@dataclass(frozen=True)
class Setup:
    name: str
    python: Path | str
    blocks: Callable[[int], int]  # vLLM's KV blocks for a budget
    note: str

    def shared(self, budget: int, servers: int, work: Path, env: dict[str, str], log: Path) -> tuple[list[Proc], str]:
        """The processes this setup's ``servers`` vLLM servers share, started and ready,
        and their address: LMCache's server (its L1 the servers' halves together), or for
        prefixcache in a fleet a Redis (the shared tier). ``env`` is updated in place."""
        if self.name == "lmcache":
            port = free_port()
            server = Proc.started(
                [
                    *(str(LMCACHE_PYTHON.parent / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port)),
                    *("--l1-size-gb", f"{servers * (budget // 2) * BLOCK_BYTES / GiB:.6f}", "--eviction-policy", "LRU"),
                    *("--chunk-size", str(BLOCK), "--supported-transfer-mode", "auto"),
                    *("--l2-adapter", json.dumps({"type": "fs", "base_path": str(work / "lmcache-fs")})),
                ],
                env,
                log.with_suffix(".lmcache.log"),
                listening(port),
                180,
            )
            env["LMCACHE_MP_TRANSFER_MODE"] = "engine_driven"
            return [server], str(port)
        if self.name == "prefixcache" and servers > 1:
            port = free_port()
            redis = Proc.started(
                [
                    *("redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"),
                    *("--dir", str(work), "--maxmemory", "8gb", "--maxmemory-policy", "allkeys-lru"),
                ],
                env,
                log.with_suffix(".redis.log"),
                listening(port),
                60,
            )
            return [redis], f"redis://127.0.0.1:{port}/0"
        return [], ""

    def vllm(self, budget: int, max_len: int, port: int, work: Path, shared: str, events: int | None) -> list[str]:
        """This setup's ``vllm serve`` command line; ``events``: the port of its KV events' publisher."""
        args = [
            *(str(self.python), *SERVER, "--model", MODEL, "--served-model-name", "smollm2", "--dtype", "float32"),
            *("--max-model-len", str(max_len), "--enforce-eager", "--enable-prefix-caching", "--seed", "0"),
            *("--enable-prompt-tokens-details", "--port", str(port), "--shutdown-timeout", "30"),
            *("--num-gpu-blocks-override", str(self.blocks(budget))),
        ]
        if events is not None:
            kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}"}
            args += ["--kv-events-config", json.dumps({**kv_events, "topic": "kv"})]
        half_bytes = budget // 2 * BLOCK_BYTES
        if self.name == "vllm+offload":
            args += ["--kv-offloading-size", f"{half_bytes / GiB:.6f}", "--kv-offloading-backend", "native"]
        elif self.name == "lmcache":
            transfer = {
                "kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": int(shared)},
            }
            args += ["--disable-hybrid-kv-cache-manager", "--kv-transfer-config", json.dumps(transfer)]
        elif self.name == "prefixcache":
            # NOTE: sized in slots: exactly budget/2 blocks, headers included, not one more
            memory = {"kind": "memory", "capacity_bytes": budget // 2 * (BLOCK_BYTES + FRAME_SLACK), "write": "through"}
            if shared:  # a fleet: the Redis every server reads (a disk's index is read at open only)
                below = {"kind": "redis", "capacity_bytes": 4 * GiB, "url": shared}
            else:
                below = {"kind": "disk", "capacity_bytes": 8 * GiB, "path": str(work / "prefixcache-disk")}
            transfer = {
                "kv_connector": "PrefixCacheConnector",
                "kv_connector_module_path": "prefixcache.integrations.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cache": {"tiers": [memory, below]}},
            }
            args += ["--kv-transfer-config", json.dumps(transfer)]
        return args

    def start(self, budget: int, max_len: int, work: Path, log: Path) -> list[Proc]:
        """This setup's processes (vLLM last), started and ready; ``work`` persists across restarts."""
        env = {**os.environ, **ENV}
        procs, shared = self.shared(budget, 1, work, env, log)
        try:
            port = free_port()
            vllm = Proc(self.vllm(budget, max_len, port, work, shared, None), env, log)
            procs.append(vllm)
            vllm.ready(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200)
        except BaseException:
            for p in reversed(procs):
                p.close()
            raise
        vllm.url = f"http://127.0.0.1:{port}"
        return procs

    def fleet(self, budget: int, max_len: int, work: Path) -> tuple[list[Proc], list[Proc], Proc]:
        """(c): ``FLEET`` vLLM servers of this setup, each with the per-server budget of
        (a), behind one ``prefixcache route`` that routes on their KV events; returns the
        processes to close (router first), the vLLM servers, and the router."""
        env = {**os.environ, **ENV, SECRET_ENV: SECRET}
        procs, shared = self.shared(budget, FLEET, work, env, work / "c.log")
        try:
            servers, backends = [], []
            for i in range(FLEET):
                port, events = free_port(), free_port()
                server = Proc(self.vllm(budget, max_len, port, work, shared, events), env, work / f"c{i}.log")
                server.url = f"http://127.0.0.1:{port}"
                procs.append(server)
                servers.append(server)
                backends += ["--vllm-backend", f"{server.url}=tcp://127.0.0.1:{events},topic=kv"]
            for server in servers:
                server.ready(lambda url=server.url: httpx.get(f"{url}/health", timeout=2).status_code == 200, 600)
            settings = work / "route.toml"
            keys = ", ".join(f'"{key}" = "{tenant}"' for tenant, key in KEYS.items())
            settings.write_text(
                f'[auth]\napi_keys = {{{keys}}}\ntenant_secret = "{SECRET}"\nadmin_key = "{ADMIN}"\n'
                f'[model]\nname = "{MODEL}"\nid = "smollm2"\n'
            )
            port = free_port()
            router = Proc(
                [
                    *(VLLM_PYTHON, "-m", "prefixcache.cli", "route", "--config", str(settings), "--port", str(port)),
                    *("--block-size", str(BLOCK), "--model-id", "smollm2", *backends),
                ],
                {k: v for k, v in env.items() if k != SECRET_ENV},  # the router reads its own settings
                work / "route.log",
            )
            procs.append(router)
            router.url = f"http://127.0.0.1:{port}"
            router.ready(lambda: len(httpx.get(f"{router.url}/healthz", timeout=2).json()["backends_up"]) == FLEET, 120)
        except BaseException:
            for p in reversed(procs):
                p.close()
            raise
        return procs[::-1], servers, router


SETUPS = {
    s.name: s
    for s in (
        Setup("vllm", VLLM_PYTHON, lambda b: b, "vLLM's prefix cache, all the budget as KV"),
        Setup("vllm+offload", VLLM_PYTHON, lambda b: b // 2, "vLLM's native CPU offloading"),
        Setup("lmcache", LMCACHE_PYTHON, lambda b: b // 2, "LMCache 0.5.6 MP server, L1 + fs L2"),
        Setup("prefixcache", VLLM_PYTHON, lambda b: b // 2, "PrefixCacheConnector, memory + disk tiers"),
    )
}


# ---------------------------------------------------------------------- measuring


@dataclass
class Pass:
    ttft: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0

    @property
    def hit(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0

    @property
    def mean(self) -> float:
        return statistics.mean(self.ttft)

    @property
    def p95(self) -> float:
        ordered = sorted(self.ttft)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def complete(
    client: httpx.Client, url: str, prompt: list[int] | str, salt: str | None, max_tokens: int, key: str = ""
) -> dict:
    """One completion's usage; ``key``: a tenant's API key for the router, which then sets the salt."""
    body: dict[str, Any] = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    if max_tokens > 1:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {key}"} if key else None
    reply = client.post(f"{url}/v1/completions", json=body, headers=headers, timeout=600)
    reply.raise_for_status()
    return dict(reply.json()["usage"])


def workload(url: str, requests: Sequence[tuple[str, list[int]]], routed: bool = False) -> Pass:
    """Each request alone, one output token; ``routed``: through the router, each with its
    tenant's API key (the router stamps the tenant's salt), else with the tenant as salt."""
    result = Pass()
    with httpx.Client() as client:
        for tenant, ids in requests:
            start = time.perf_counter()
            usage = (
                complete(client, url, ids, None, 1, KEYS[tenant]) if routed else complete(client, url, ids, tenant, 1)
            )
            result.ttft.append(time.perf_counter() - start)
            result.prompt += usage["prompt_tokens"]
            result.cached += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return result


NO_REUSE_TOKENS = 32  # output tokens of each no-reuse request


def no_reuse(size: Size, r: int) -> list[str]:
    """Round ``r``'s distinct prompts (about 210 tokens: 2 blocks with their output)."""
    return [f"Request {r}.{i}: " + text(50_000 + 100 * r + i, 200) for i in range(size.unique)]


def batch_blocks(size: Size) -> int:
    """The most KV blocks a no-reuse batch needs (prompt and output tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    return max(
        sum(-(-(len(tok(p)["input_ids"]) + NO_REUSE_TOKENS) // BLOCK) for p in no_reuse(size, r))
        for r in range(size.rounds)
    )


def throughput(url: str, size: Size) -> float:
    rates = []
    with httpx.Client() as client, ThreadPoolExecutor(size.unique) as pool:
        for r in range(size.rounds):
            prompts = no_reuse(size, r)
            start = time.perf_counter()
            usages = list(pool.map(lambda p: complete(client, url, p, None, NO_REUSE_TOKENS), prompts))
            seconds = time.perf_counter() - start
            rates.append(sum(u["prompt_tokens"] + u["completion_tokens"] for u in usages) / seconds)
    return statistics.median(rates)


@dataclass
class Run:
    a: Pass
    b: Pass
    tput: float


@dataclass
class Fleet:
    c: Pass
    split: list[int]  # prompt tokens each vLLM server got from the router


def prompt_tokens(url: str) -> int:
    """The prompt tokens a vLLM server has served (its Prometheus counter)."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return int(sum(float(ln.split()[-1]) for ln in lines if ln.startswith("vllm:prompt_tokens_total")))


def run_fleet(setup: Setup, size: Size, requests: Sequence[tuple[str, list[int]]], tmp: Path, tag: str) -> Fleet:
    """(c): the requests of (a) through ``prefixcache route`` to ``FLEET`` servers, started cold."""
    work = tmp / tag
    work.mkdir()
    procs, servers, router = setup.fleet(size.budget, (size.budget // 2 - 1) * BLOCK, work)
    try:
        c = workload(router.url, requests, routed=True)
        split = [prompt_tokens(s.url) for s in servers]
    finally:
        for p in procs:
            p.close()
    shutil.rmtree(work, ignore_errors=True)
    return Fleet(c, split)


def run_setup(setup: Setup, size: Size, requests: Sequence[tuple[str, list[int]]], tmp: Path, tag: str) -> Run:
    work = tmp / tag
    work.mkdir()
    # NOTE: every setup alike: what the smallest vLLM KV space holds, less the one block
    # vLLM keeps back (its null block)
    max_len = (size.budget // 2 - 1) * BLOCK
    procs = setup.start(size.budget, max_len, work, work / "a.log")
    try:
        a = workload(procs[-1].url, requests)
        tput = throughput(procs[-1].url, size)
    finally:
        for p in reversed(procs):
            p.close()
    procs = setup.start(size.budget, max_len, work, work / "b.log")  # the warm restart: same folders
    try:
        b = workload(procs[-1].url, requests)
    finally:
        for p in reversed(procs):
            p.close()
    shutil.rmtree(work, ignore_errors=True)
    return Run(a, b, tput)


# ---------------------------------------------------------------------- report


def spread(values: Sequence[float]) -> str:
    """max - min as a share of the mean, over the runs."""
    mean = statistics.mean(values)
    return f"{100 * (max(values) - min(values)) / mean:.0f}%" if mean and len(values) > 1 else "-"


def report(
    size: Size,
    results: dict[str, list[Run]],
    fleets: dict[str, list[Fleet]],
    skipped: dict[str, str],
    requests: int,
    ws: int,
    blocks: int,
) -> None:
    print(
        f"\nbudget {size.budget} KV blocks of 128 tokens ({size.budget * BLOCK_BYTES / 1e6:.0f} MB) per setup "
        f"(per server in (c), {FLEET} servers); {size.tenants} tenants x {size.conversations} conversations x "
        f"{size.turns} turns = {requests} requests, working set {ws} blocks ({ws / size.budget:.1f}x the budget); "
        f"no reuse: {size.rounds} batches of {size.unique} prompts x {NO_REUSE_TOKENS} tokens ({blocks} KV blocks "
        f"a batch, of the {size.budget // 2 - 1} the smallest vLLM can use)"
    )
    head = f"{'workload':<12} {'setup':<13} {'token hit rate':>15} {'mean TTFT ms':>18} {'spread':>6}"
    head += f" {'p95 TTFT ms':>18}"
    tables: list[tuple[str, dict[str, list[Pass]]]] = [
        ("(a) cold", {n: [r.a for r in runs] for n, runs in results.items()}),
        ("(b) restart", {n: [r.b for r in runs] for n, runs in results.items()}),
        ("(c) routed", {n: [f.c for f in runs] for n, runs in fleets.items()}),
    ]
    for label, table in tables:
        if not table:
            continue
        print(f"\n{head}")
        for name, passes in table.items():
            hits = "/".join(f"{p.hit:.3f}" for p in passes)
            means = "/".join(f"{1000 * p.mean:.0f}" for p in passes)
            p95 = "/".join(f"{1000 * p.p95:.0f}" for p in passes)
            print(f"{label:<12} {name:<13} {hits:>15} {means:>18} {spread([p.mean for p in passes]):>6} {p95:>18}")
    for name, runs in fleets.items():
        shares = " ".join("/".join(f"{100 * t / max(1, sum(f.split)):.0f}%" for t in f.split) for f in runs)
        print(f"(c) {name}: prompt tokens per server (runs): {shares}")
    if results:
        print(f"\n{'no reuse':<12} {'setup':<13} {'tokens/s (runs)':>18} {'spread':>6}")
    for name, runs in results.items():
        rates = [r.tput for r in runs]
        print(f"{'':<12} {name:<13} {'/'.join(f'{x:.1f}' for x in rates):>18} {spread(rates):>6}")
    for name, why in skipped.items():
        print(f"skipped: {name}: {why}")
    targets(results, fleets)


def compare(label: str, ours: list[Pass], others: dict[str, list[Pass]]) -> None:
    """prefixcache's run means against the best other setup's, on one workload."""
    hit = statistics.mean(p.hit for p in ours)
    mean = statistics.mean(p.mean for p in ours)
    best_hit_name = max(others, key=lambda k: statistics.mean(p.hit for p in others[k]))
    best_hit = statistics.mean(p.hit for p in others[best_hit_name])
    best_ttft_name = min(others, key=lambda k: statistics.mean(p.mean for p in others[k]))
    ratio = statistics.mean(p.mean for p in others[best_ttft_name]) / mean
    print(
        f"  {label} token hit rate {hit:.3f} against {best_hit:.3f} ({best_hit_name}), target >= it: "
        + ("met" if hit >= best_hit else f"missed by {best_hit - hit:.3f}")
    )
    print(
        f"  {label} mean TTFT {ratio:.2f}x better than {best_ttft_name}, target >= 1.5x: "
        + ("met" if ratio >= 1.5 else f"missed ({ratio / 1.5:.0%} of the target)")
    )


def targets(results: dict[str, list[Run]], fleets: dict[str, list[Fleet]]) -> None:
    print("\nTargets (prefixcache against the best other setup; run means)")
    ours = results.get("prefixcache")
    others = {k: v for k, v in results.items() if k != "prefixcache"}
    if ours is None or not others:
        print("  (a), (b): not evaluated: prefixcache and at least one other setup must run")
    else:
        compare("(a)", [r.a for r in ours], {k: [r.a for r in v] for k, v in others.items()})
        compare("(b)", [r.b for r in ours], {k: [r.b for r in v] for k, v in others.items()})
    fleet_ours = fleets.get("prefixcache")
    fleet_others = {k: [f.c for f in v] for k, v in fleets.items() if k != "prefixcache"}
    if fleet_ours is None or not fleet_others:
        print("  (c): not evaluated: prefixcache and at least one other setup must run behind the router")
    else:
        compare("(c)", [f.c for f in fleet_ours], fleet_others)
    if ours is not None and "vllm" in results:
        share = statistics.mean(r.tput for r in ours) / statistics.mean(r.tput for r in results["vllm"])
        verdict = "met" if share >= 0.95 else f"missed by {95 - 100 * share:.1f} points"
        print(f"  no-reuse throughput {100 * share:.1f} % of vLLM alone's, target >= 95 %: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 tenants, 1 run (not a measurement)")
    parser.add_argument("--runs", type=int, help="runs of each setup (default 2; --quick 1)")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--workloads", default="ab,c", help="ab: (a), (b) and no reuse; c: the fleet (default both)")
    args = parser.parse_args()
    if not Path(MODEL, "config.json").is_file():
        sys.exit(f"no model at {MODEL}: run make test (or make serve) once to convert it")
    size = QUICK if args.quick else FULL
    runs = args.runs or (1 if args.quick else 2)
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    if unknown := [n for n in names if n not in SETUPS]:
        sys.exit(f"unknown setup {', '.join(unknown)}; valid: {', '.join(SETUPS)}")
    workloads = {w.strip() for w in args.workloads.split(",") if w.strip()}
    if not workloads or workloads - {"ab", "c"}:
        sys.exit("--workloads is ab, c or ab,c")
    requests = tokenized(multi_turn(size))
    ws = working_set(requests)
    blocks = batch_blocks(size)
    if blocks > size.budget // 2 - 1:
        sys.exit(f"a no-reuse batch needs {blocks} KV blocks, more than a vLLM of {size.budget // 2} can use")
    skipped: dict[str, str] = {}
    if "lmcache" in names and not LMCACHE_PYTHON.is_file():
        skipped["lmcache"] = f"no {LMCACHE_PYTHON.relative_to(ROOT)}: run make bench-lmcache-venv"
    if "c" in workloads and not shutil.which("redis-server") and "prefixcache" in names:
        skipped["prefixcache (c)"] = "no redis-server on PATH (the fleet's shared tier)"
    results: dict[str, list[Run]] = {n: [] for n in names if n not in skipped}
    fleets: dict[str, list[Fleet]] = {n: [] for n in names if n not in skipped and f"{n} (c)" not in skipped}
    tmp = Path(tempfile.mkdtemp(prefix="benchvllm_"))
    try:
        for r in range(runs):
            order = list(results) if r % 2 == 0 else list(results)[::-1]
            for name in order:
                if "ab" in workloads and name not in skipped:
                    if not args.quick:
                        wait_quiet()
                    started = time.monotonic()
                    try:
                        run = run_setup(SETUPS[name], size, requests, tmp, f"{name}-{r}")
                    except RuntimeError as exc:
                        skipped[name] = f"failed to start or run: {exc}"
                        print(f"run {r}: {name}: {skipped[name]}", flush=True)
                    else:
                        results[name].append(run)
                        print(
                            f"run {r}: {name:<13} (a) hit {run.a.hit:.3f} mean TTFT {1000 * run.a.mean:.0f} ms  "
                            f"(b) hit {run.b.hit:.3f} mean TTFT {1000 * run.b.mean:.0f} ms  "
                            f"no reuse {run.tput:.1f} tok/s  [{time.monotonic() - started:.0f} s]",
                            flush=True,
                        )
                fleet_name = f"{name} (c)"
                if "c" in workloads and name not in skipped and fleet_name not in skipped:
                    if not args.quick:
                        wait_quiet()
                    started = time.monotonic()
                    try:
                        fleet = run_fleet(SETUPS[name], size, requests, tmp, f"{name}-c{r}")
                    except RuntimeError as exc:
                        skipped[fleet_name] = f"failed to start or run: {exc}"
                        print(f"run {r}: {fleet_name}: {skipped[fleet_name]}", flush=True)
                    else:
                        fleets[name].append(fleet)
                        print(
                            f"run {r}: {fleet_name:<17} hit {fleet.c.hit:.3f} mean TTFT {1000 * fleet.c.mean:.0f} ms  "
                            f"prompt tokens per server {'/'.join(map(str, fleet.split))}  "
                            f"[{time.monotonic() - started:.0f} s]",
                            flush=True,
                        )
        done = {k: v for k, v in results.items() if k not in skipped and v}
        fleets_done = {k: v for k, v in fleets.items() if k not in skipped and f"{k} (c)" not in skipped and v}
        report(size, done, fleets_done, skipped, len(requests), ws, blocks)
    finally:
        if any(why.startswith("failed") for why in skipped.values()):
            print(f"logs of the failed setups kept under {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
