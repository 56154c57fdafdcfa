"""The shape of the code, as a newcomer meets it: lines by package, the largest modules,
and the hops of a chat request and of a vLLM load.

    .venv/bin/python tools/code_shape.py lines
    .venv/bin/python tools/code_shape.py hops          # loads SmolLM2: about a minute
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python tools/code_shape.py hops

A hop is a call from a function of one ``prefixcache`` module into a function of
another, counted while one request runs (every thread: the engine's worker and the
cache's I/O threads too). Three counts: the modules the request touches, the distinct
module-to-module edges it crosses, and the calls that cross one. The chat request is a
second turn that hits on the first (match, load, prefill of the suffix, insert); the
vLLM load is the connector's worker reading a saved prefix back from a disk tier.

Not a speed claim: it counts structure, so it needs no baseline run alongside.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import prefixcache

SRC = Path(prefixcache.__file__).resolve().parent


def module_of(filename: str) -> str | None:
    path = Path(filename)
    try:
        rel = path.resolve().relative_to(SRC)
    except ValueError:
        return None
    return ".".join(rel.with_suffix("").parts)


# ---------------------------------------------------------------------------- lines


def lines(top: int) -> None:
    by_package: Counter[str] = Counter()
    c_lines: Counter[str] = Counter()
    modules: list[tuple[int, str]] = []
    for path in sorted(SRC.rglob("*")):
        if path.suffix not in (".py", ".c", ".h") or "__pycache__" in path.parts:
            continue
        n = len(path.read_text().splitlines())
        rel = path.relative_to(SRC)
        package = rel.parts[0] if len(rel.parts) > 1 else "(top)"
        if path.suffix == ".py":
            by_package[package] += n
            modules.append((n, str(rel)))
        else:
            c_lines[package] += n
    print(f"src/prefixcache: {sum(by_package.values())} Python lines, {sum(c_lines.values())} C lines")
    print("| package | Python | C |\n|---|---|---|")
    for package, n in sorted(by_package.items(), key=lambda kv: -kv[1]):
        print(f"| {package} | {n} | {c_lines.get(package, 0) or ''} |")
    print(f"\nlargest modules (top {top}):")
    for n, rel in sorted(modules, reverse=True)[:top]:
        print(f"  {n:5d}  {rel}")
    print(f"modules over 400 lines: {sum(1 for n, _ in modules if n > 400)}")


# ---------------------------------------------------------------------------- hops


@dataclass
class Hops:
    modules: set[str]
    edges: Counter[tuple[str, str]]

    def line(self, what: str) -> str:
        crossing = sum(self.edges.values())
        return f"{what}: {len(self.modules)} modules, {len(self.edges)} module edges, {crossing} crossing calls"


class Tracer:
    """Installed before the code under test starts its threads (3.11 has no way to
    profile a thread already running); counts only inside ``active()``."""

    def __init__(self) -> None:
        self.hops = Hops(set(), Counter())
        self.on = False
        self.lock = threading.Lock()
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def close(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    @contextmanager
    def active(self) -> Iterator[Hops]:
        self.on = True
        try:
            yield self.hops
        finally:
            self.on = False

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        callee = module_of(frame.f_code.co_filename)
        if callee is None or frame.f_back is None:
            return
        caller = module_of(frame.f_back.f_code.co_filename)
        with self.lock:
            self.hops.modules.add(callee)
            if caller is not None and caller != callee:
                self.hops.edges[(caller, callee)] += 1


def chat_hops(tmp: Path, tracer: Tracer) -> Hops:
    from fastapi.testclient import TestClient

    from prefixcache.server.main import build_service
    from prefixcache.settings import load_settings

    settings = load_settings(
        None,
        env={},
        overrides={
            "cache": {
                "tiers": [
                    {"kind": "memory", "capacity_bytes": 64 << 20},
                    {"kind": "disk", "capacity_bytes": 256 << 20, "path": str(tmp / "disk")},
                ]
            }
        },
    )
    service = build_service(settings)
    system = "You answer questions about the tides of the North Sea. " * 20
    body: dict[str, Any] = {
        "model": settings.model.served_id,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Why are there two?"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    try:
        with TestClient(service.app) as client:
            first = client.post("/v1/chat/completions", json=body)
            first.raise_for_status()
            body["messages"][1]["content"] = "When is the next one?"
            with tracer.active() as hops:
                second = client.post("/v1/chat/completions", json=body)
            second.raise_for_status()
            cached = second.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            if not cached:
                raise SystemExit("the second turn did not hit: the hops would not include a load")
    finally:
        service.close()
    return hops


def vllm_hops(tmp: Path, tracer: Tracer) -> Hops:
    import torch

    from prefixcache.config import CacheConfig, TierConfig
    from prefixcache.integrations.vllm.paged import PagedKV
    from prefixcache.integrations.vllm.scope import Scope
    from prefixcache.integrations.vllm.worker import ConnectorWorker, LoadSpec, SaveSpec

    heads, dim, block, layers, blocks = 2, 16, 16, 4, 16

    def paged(seed: int) -> PagedKV:
        g = torch.Generator().manual_seed(seed)
        caches = {f"layers.{i}.attn": torch.randn(blocks, heads, block, 2 * dim, generator=g) for i in range(layers)}
        return PagedKV(caches, kv_heads=heads, head_dim=dim, block_size=block)

    config = CacheConfig(
        block_size=block,
        tiers=(
            TierConfig(kind="memory", capacity_bytes=1 << 22, write="through"),
            TierConfig(kind="disk", capacity_bytes=1 << 24, path=str(tmp / "vllm")),
        ),
        writer="inline",
    )
    tokens = tuple(range(1000, 1000 + 8 * block))
    saver = ConnectorWorker(config, paged(1), "m@1")
    saver.save(SaveSpec("a", Scope("t"), tokens, tuple(range(8))))
    saver.close(5)
    loader = ConnectorWorker(config, paged(2), "m@1")  # a restart: the disk holds the prefix
    assert loader.lookup(list(tokens), Scope("t")) == len(tokens)
    with tracer.active() as hops:
        failed = loader.load(LoadSpec("b", Scope("t"), tokens, 0, tuple(range(8, 16))))
    loader.close(5)
    if failed:
        raise SystemExit(f"the load failed for blocks {failed}")
    return hops


def hops(show: bool) -> None:
    runs: list[tuple[str, Callable[[Path, Tracer], Hops]]] = [
        ("chat request (a hit)", chat_hops),
        ("vLLM load", vllm_hops),
    ]
    for what, run in runs:
        tracer = Tracer()
        try:
            with tempfile.TemporaryDirectory(prefix="prefixcache-shape-") as tmp:
                result = run(Path(tmp), tracer)
        finally:
            tracer.close()
        print(result.line(what))
        if show:
            for (a, b), n in sorted(result.edges.items()):
                print(f"    {a} -> {b}  x{n}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("lines").add_argument("--top", type=int, default=12)
    sub.add_parser("hops").add_argument("--edges", action="store_true", help="list every module edge")
    args = parser.parse_args()
    print(f"# {SRC}")
    if args.what == "lines":
        lines(args.top)
    else:
        hops(args.edges)


if __name__ == "__main__":
    main()
