"""``prefixcache route``: the command line of the router (``router.py``)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["add_route_parser", "run_route"]


def add_route_parser(sub: Any) -> None:
    from prefixcache.fleet.scoring import Routing

    route = sub.add_parser(
        "route",
        help="an OpenAI-compatible router in front of several prefixcache servers",
        description="Send each request to the backend where the prefill left, plus the load there, is smallest "
        "(docs/fleet.md). The settings file is the servers' own: its API keys, isolation and model.",
    )
    route.add_argument("--backend", action="append", default=[], metavar="URL", help="a backend (repeat: one each)")
    route.add_argument("--redis", required=True, metavar="URL", help="the Redis the backends publish events to")
    route.add_argument("--config", help="the servers' TOML settings file (default: $PREFIXCACHE_CONFIG)")
    route.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    route.add_argument("--port", type=int, default=8100, help="port to listen on (default 8100)")
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

    from prefixcache.fleet.prompts import Tokenizer
    from prefixcache.fleet.router import RouteConfig, Router, create_router
    from prefixcache.fleet.scoring import Routing, Scorer
    from prefixcache.server.settings import load_settings
    from prefixcache.server.transport import uvicorn_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.backend:
        parser.error("route needs at least one --backend URL")
    if any(not b.startswith(("http://", "https://")) for b in args.backend):
        parser.error("each --backend is an http:// or https:// URL")
    try:
        settings = load_settings(args.config)
        scorer = Scorer() if args.load_weight is None else Scorer(load_weight=args.load_weight)
    except ValueError as exc:
        parser.error(str(exc))
    config = RouteConfig(tuple(args.backend), args.redis, Routing(args.routing), scorer)
    router = Router(config, settings, Tokenizer(settings.model), CollectorRegistry())
    app = create_router(router)
    uvicorn.Server(uvicorn_config(app, settings, host=args.host, port=args.port)).run()
    return 0
