"""The package's layers, from its static imports (every ``import``, at module level or in
a function, ``TYPE_CHECKING`` ones too): which part may import which, and no cycles
between parts.

A part is a top-level subpackage or module of ``prefixcache`` (``api``, ``cache``,
``config``, ``fleet``, ``server``, ``settings``, ...). The settings schema that ``serve``,
``route`` and the vLLM connector all read is a part of its own, so ``fleet`` and ``api``
import nothing of ``server``.

::

    cli ──> server ──> api ──> engine, identity, ...
     │        │  └─(main.py: the [fleet] publisher)──> fleet ──> api
     └──────────────────────────────────────────────> fleet
    server, fleet, api ──> settings ──> config, blend, engine
    storage ──> config        (config imports nothing of storage)
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

Graph = Mapping[str, set[str]]

# Cycles between parts known today and allowed (sorted tuples of parts); none.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, package: str = "prefixcache") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (``from a import b`` imports
    ``a.b`` too when that is a module), for every ``.py`` under ``root / package``."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                where = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    where = ".".join(base[: len(base) - node.level + 1] + ([where] if where else []))
                targets.add(where)
                targets |= {f"{where}.{alias.name}" for alias in node.names if f"{where}.{alias.name}" in files}
        graph[name] = {t for t in targets if t == package or t.startswith(package + ".")}
    return graph


def part_of(module: str) -> str:
    """The part a module belongs to (module doc)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def edges(graph: Graph) -> Iterable[tuple[str, str]]:
    for source, targets in graph.items():
        for target in targets:
            yield source, target


def violations(graph: Graph) -> list[str]:
    """The imports that break a layer's rule, as ``source -> target: rule`` lines."""
    found = []
    for source, target in sorted(edges(graph)):
        src, dst = part_of(source), part_of(target)
        if src in ("fleet", "api") and dst == "server":
            found.append(f"{source} -> {target}: {src}/ imports nothing of server/")
        if src == "api" and dst == "fleet":
            found.append(f"{source} -> {target}: api/ is below fleet/")
        if source == "prefixcache.server.app" and dst == "fleet":
            found.append(f"{source} -> {target}: the app reaches the publisher through app.EventPublisher")
        if src == "config" and dst == "storage":
            found.append(f"{source} -> {target}: config sits below storage")
    return found


def part_cycles(graph: Graph) -> list[tuple[str, ...]]:
    """The strongly connected sets of parts larger than one (Tarjan's algorithm), each sorted."""
    parts: dict[str, set[str]] = {}
    for source, target in edges(graph):
        a, b = part_of(source), part_of(target)
        parts.setdefault(a, set())
        parts.setdefault(b, set())
        if a != b:
            parts[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(parts[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(parts):
        if v not in index:
            visit(v)
    return sorted(found)


def cycle_path(graph: Graph, cycle: tuple[str, ...]) -> list[str]:
    """The imports that make a cycle of parts, for its failure message."""
    inside = set(cycle)
    return sorted(
        f"{s} -> {t}"
        for s, t in edges(graph)
        if part_of(s) in inside and part_of(t) in inside and part_of(s) != part_of(t)
    )


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(SRC)


def test_the_walk_reaches_every_part(graph: Graph) -> None:
    parts = {part_of(m) for m in graph}
    assert {"api", "cache", "config", "fleet", "server", "settings", "storage", "integrations"} <= parts
    assert "prefixcache.api.errors" in graph["prefixcache.fleet.router"]


def test_no_layer_rule_is_broken(graph: Graph) -> None:
    assert violations(graph) == []


def test_no_cycle_between_parts(graph: Graph) -> None:
    cycles = [c for c in part_cycles(graph) if c not in KNOWN_CYCLES]
    assert not cycles, "\n".join(f"{c}: " + "; ".join(cycle_path(graph, c)) for c in cycles)


def test_route_and_serve_share_the_settings_part(graph: Graph) -> None:
    """fleet/ and api/ read the one settings schema, not a copy and not server/'s."""
    into = {(part_of(s), part_of(t)) for s, t in edges(graph)}
    assert {("fleet", "settings"), ("server", "settings")} <= into
    assert not any(t.startswith("prefixcache.server") for s, t in edges(graph) if part_of(s) == "settings")


PLANTED = {
    "fleet/x.py": ("def f():\n    from prefixcache.server import app\n", "fleet/ imports nothing of server/"),
    "api/x.py": ("from ..fleet import wire\n", "api/ is below fleet/"),
    "server/app.py": ("import prefixcache.fleet.publisher\n", "app.EventPublisher"),
    "config.py": ("if True:\n    from prefixcache.storage.codec import WIRE_DTYPES\n", "config sits below storage"),
}


def plant(root: Path, files: Mapping[str, str]) -> dict[str, set[str]]:
    """A small ``prefixcache`` tree under ``root`` with ``files`` in it, and its graph."""
    base = {
        "__init__.py": "",
        "api/__init__.py": "",
        "fleet/__init__.py": "",
        "fleet/wire.py": "",
        "fleet/publisher.py": "",
        "server/__init__.py": "",
        "server/app.py": "",
        "settings/__init__.py": "",
        "storage/__init__.py": "",
        "storage/codec.py": "from prefixcache.config import KV_DTYPES\n",
        "config.py": "",
    }
    for name, text in {**base, **files}.items():
        path = root / "prefixcache" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(root)


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_violation_fails(tmp_path: Path, name: str) -> None:
    text, rule = PLANTED[name]
    graph = plant(tmp_path, {name: text})
    assert any(rule in line for line in violations(graph)), violations(graph)


def test_a_planted_cycle_fails_and_the_settings_edge_passes(tmp_path: Path) -> None:
    clean = plant(tmp_path / "a", {"fleet/x.py": "from prefixcache.settings import Settings\n"})
    assert violations(clean) == [] and part_cycles(clean) == []
    cycle = plant(tmp_path / "b", {"config.py": "def f():\n    from prefixcache.storage import codec\n"})
    assert part_cycles(cycle) == [("config", "storage")]


def test_config_dtypes_are_the_wire_dtypes() -> None:
    """config.py writes the KV dtypes without importing storage; the codec frames each at that size."""
    from prefixcache.config import KV_DTYPES
    from prefixcache.storage.codec import WIRE_DTYPES

    assert {label: dtype.itemsize for label, dtype in WIRE_DTYPES.items()} == KV_DTYPES
    assert list(WIRE_DTYPES) == list(KV_DTYPES)  # the order errors list the valid ones in


def test_config_codecs_are_the_frame_codecs() -> None:
    """config.py names the tier codecs without importing storage; the codec writes each."""
    from prefixcache.config import KV_CODECS
    from prefixcache.storage.codec import CODECS

    assert tuple(KV_CODECS) == tuple(CODECS)


def test_config_counts_each_codecs_bytes_as_the_codec_frames_them() -> None:
    """A tier's capacity in tokens comes from config's sizes (``KVLayout.stored_bytes``);
    the codec's frames must take exactly those bytes and a header the same in every codec."""
    from prefixcache.config import KV_CODECS, KVLayout
    from prefixcache.storage.codec import encoded_size

    layouts = (KVLayout(30, 3, 64, "float32"), KVLayout(2, 1, 48, "bfloat16"), KVLayout(3, 2, 8, "float16"))
    for layout in layouts:
        for tokens in (1, 7, 16):
            header = encoded_size(layout.shape(tokens), layout.dtype, 16) - tokens * layout.bytes_per_token
            for name in KV_CODECS:
                frame = encoded_size(layout.shape(tokens), layout.dtype, 16, name)
                assert frame - header == layout.stored_bytes(tokens, name), (layout, tokens, name)


def test_serve_and_the_connector_default_to_one_table_of_tiers() -> None:
    """``[cache]`` and the connector's ``cache`` are CacheConfig's defaults but for the
    tiers, which both take from ``config.local_tiers`` (each in its own folder)."""
    import dataclasses

    from prefixcache.config import CacheConfig, local_tiers
    from prefixcache.integrations.vllm.settings import ConnectorSettings
    from prefixcache.settings import Settings

    for cache, disk, changed in (
        (Settings().cache, ".prefixcache/disk", {"partial_blocks": True}),
        (ConnectorSettings().cache, ".prefixcache/vllm-disk", {}),
    ):
        assert cache == dataclasses.replace(CacheConfig(), tiers=local_tiers(disk), **changed)
