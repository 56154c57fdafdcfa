"""``prefixcache route``: the command line of the router (``router.py``)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["add_route_parser", "route_warnings", "run_route"]


def add_route_parser(sub: Any) -> None:
    from prefixcache.fleet.scoring import Routing

    route = sub.add_parser(
        "route",
        help="an OpenAI-compatible router in front of several prefixcache (or vLLM) servers",
        description="Send each request to the backend where the prefill left, plus the load there, is smallest "
        "(docs/fleet.md). The settings file is the servers' own: its API keys, isolation and model.",
    )
    route.add_argument("--backend", action="append", default=[], metavar="URL", help="a backend (repeat: one each)")
    route.add_argument(
        "--vllm-backend",
        action="append",
        default=[],
        metavar="URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=NAME]",
        help="a vLLM backend and its --kv-events-config publisher (repeat: one each; docs/fleet.md)",
    )
    route.add_argument(
        "--block-size", type=int, default=None, help="vLLM backends' block size (default: the settings' cache)"
    )
    route.add_argument(
        "--model-id", default=None, help="the model id vLLM backends' blocks are keyed under (default: [model]'s)"
    )
    route.add_argument("--redis", metavar="URL", help="the Redis the backends publish events to (with --backend)")
    route.add_argument("--config", help="the servers' TOML settings file (default: $PREFIXCACHE_CONFIG)")
    route.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    route.add_argument("--port", type=int, default=8100, help="port to listen on (default 8100)")
    route.add_argument(
        "--allow-open-access",
        action="store_true",
        help="listen beyond loopback with no API keys configured (anyone who reaches the port may use it)",
    )
    route.add_argument(
        "--routing",
        default=Routing.COST.value,
        choices=[r.value for r in Routing],
        help="how to choose a backend (default cost)",
    )
    route.add_argument(
        "--load-weight", type=float, default=None, help="weight of a backend's load in the cost (default 0.25)"
    )


def run_route(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from prefixcache.api.prompts import Tokenizer
    from prefixcache.api.transport import uvicorn_config
    from prefixcache.fleet.router import RouteConfig, Router, create_router
    from prefixcache.fleet.scoring import Routing, Scorer
    from prefixcache.fleet.stamping import NO_SECRET, route_secret
    from prefixcache.fleet.zmq import VllmSource
    from prefixcache.settings import load_settings

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.backend and not args.vllm_backend:
        parser.error("route needs at least one --backend URL or --vllm-backend")
    if any(not b.startswith(("http://", "https://")) for b in args.backend):
        parser.error("each --backend is an http:// or https:// URL")
    if args.backend and not args.redis:
        parser.error("--backend needs --redis URL (where prefixcache servers publish their events)")
    try:
        listen: dict[str, Any] = {"host": args.host, "port": args.port}
        if args.allow_open_access:
            listen["allow_open_access"] = True
        # NOTE: the router listens at --host/--port, so the settings' check of an open
        # address (no API keys off loopback) reads them, not the servers' own server.host
        settings = load_settings(args.config, overrides={"server": listen})
        scorer = Scorer() if args.load_weight is None else Scorer(load_weight=args.load_weight)
        block_size = settings.cache.block_size if args.block_size is None else args.block_size
        model = args.model_id or settings.model.served_id
        vllm = tuple(VllmSource.parse(spec, block_size, model) for spec in args.vllm_backend)
        secret = route_secret(settings)  # messages never repeat a secret
    except ValueError as exc:
        parser.error(str(exc))
    if vllm and secret is None:
        parser.error(NO_SECRET)
    for line in route_warnings(settings):
        logging.getLogger("prefixcache.route").warning("%s", line)
    urls = [*(b.rstrip("/") for b in args.backend), *(v.url for v in vllm)]
    if len(set(urls)) != len(urls):
        parser.error("each backend URL may be given once")
    redis_url = args.redis or "redis://127.0.0.1:6379/0"  # never connected to without a --backend
    config = RouteConfig(tuple(args.backend), redis_url, Routing(args.routing), scorer, vllm, secret)
    router = Router(config, settings, Tokenizer(settings.model), CollectorRegistry())
    app = create_router(router)
    # NOTE: the router believes no client's X-Forwarded-* (uvicorn_config turns uvicorn's own
    # off; only server.trusted_proxies are believed) and sets them itself for the backends (stamping)
    served = uvicorn_config(app, settings, host=args.host, port=args.port)
    uvicorn.Server(served).run()
    return 0


def route_warnings(settings: Any) -> list[str]:
    """What ``route`` warns of at start, as ``serve`` does of its own settings."""
    out = []
    if settings.auth.local_mode:
        out.append("no [auth] api_keys configured: single-tenant local mode, no authentication (tenant 'local')")
    if settings.auth.tenant_header and not settings.auth.tenant_secret:
        out.append(
            f"auth.tenant_header ({settings.auth.tenant_header}) with no auth.tenant_secret: the router names each "
            "request's tenant to its backends by that header and believes no client's own (the tenant comes from "
            "the API key); the backends believe whoever reaches them, so only the router may: set tenant_secret"
        )
    return out
