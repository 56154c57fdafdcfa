"""The simulator stays behind the cache's public API (issue #28): an import contract,
checked on the source of every module of ``prefixcache.sim``.

The public API, for this test:

* ``prefixcache.cache`` is its package, the names in its ``__all__`` (``PrefixCache``,
  ``Match``, ``Peek``), and ``prefixcache.cache.stats``, the types ``PrefixCache.stats()``
  returns. Every other module under ``prefixcache.cache`` (ledger, tree, lifecycle,
  plans, ...) is internal: sim imports none of them.
* Any other package of ``prefixcache`` outside ``sim``: its modules and names that do not
  start with an underscore (``prefixcache.storage._placed`` and ``from prefixcache.hashing
  import _U64`` are private).
* An attribute with a leading underscore (not a dunder) is read only on ``self`` or
  ``cls``, a sim object's own state: ``self.cache._ledger`` is out, and so is
  ``getattr(x, "_ledger")``. Sim's own private modules and names (``sim.native._kernel``,
  ``sim.report._finite``) are sim's business, not the boundary's.

NOTE: a static check, by name: it cannot tell whose object ``x`` is in ``x._y``, so it
forbids the form everywhere but on ``self`` and ``cls``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import prefixcache.cache
import prefixcache.sim

SIM = "prefixcache.sim"
PUBLIC_CACHE_MODULES = frozenset({"prefixcache.cache", "prefixcache.cache.stats"})
OWN = frozenset({"self", "cls"})
ATTR_FUNCTIONS = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _inside_sim(module: str) -> bool:
    return module == SIM or module.startswith(SIM + ".")


def _module_violation(module: str) -> str | None:
    """Why importing ``module`` crosses the boundary (None when it does not)."""
    if not module.startswith("prefixcache") or _inside_sim(module):
        return None
    if any(_private(part) for part in module.split(".")):
        return f"imports private module {module}"
    if module.startswith("prefixcache.cache.") and module not in PUBLIC_CACHE_MODULES:
        return f"imports cache internals {module} (public: {', '.join(sorted(PUBLIC_CACHE_MODULES))})"
    return None


def _public_in_cache(name: str) -> bool:
    """Whether ``from prefixcache.cache import name`` takes a public name or module."""
    return name in prefixcache.cache.__all__ or f"prefixcache.cache.{name}" in PUBLIC_CACHE_MODULES


def _absolute(node: ast.ImportFrom, module: str) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[: -node.level]
    return ".".join([*base, *([node.module] if node.module else [])])


def violations(source: str, module: str) -> list[str]:
    """Every crossing of the boundary in ``source`` (the text of sim module ``module``),
    as ``"line: what"``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if why := _module_violation(alias.name):
                    found.append(f"{node.lineno}: {why}")
        elif isinstance(node, ast.ImportFrom):
            source_module = _absolute(node, module)
            if why := _module_violation(source_module):
                found.append(f"{node.lineno}: {why}")
            elif source_module.startswith("prefixcache") and not _inside_sim(source_module):
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{node.lineno}: imports private {alias.name} from {source_module}")
                    elif source_module == "prefixcache.cache" and not _public_in_cache(alias.name):
                        found.append(f"{node.lineno}: imports {alias.name} from prefixcache.cache (not public)")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in OWN):
                found.append(f"{node.lineno}: reads private attribute {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTR_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"{node.lineno}: {node.func.id}s private attribute {node.args[1].value!r}")
    return found


def sim_modules() -> list[tuple[str, Path]]:
    root = Path(prefixcache.sim.__file__).parent
    return [
        (".".join([SIM, *path.relative_to(root).with_suffix("").parts]), path)  # NOTE: a package as .__init__
        for path in sorted(root.rglob("*.py"))
    ]


def test_the_simulator_has_modules_to_check() -> None:
    names = {name for name, _ in sim_modules()}
    assert {"prefixcache.sim.__init__", "prefixcache.sim.engines", "prefixcache.sim.replay"} <= names


@pytest.mark.parametrize(("module", "path"), sim_modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_sim_uses_only_the_public_api(module: str, path: Path) -> None:
    assert violations(path.read_text(encoding="utf-8"), module) == []


@pytest.mark.parametrize(
    "planted",
    [
        "self._removals = self.cache._ledger.counters.removals",
        "n = cache._ledger",
        "n = getattr(cache, '_ledger')",
        "from prefixcache.cache.ledger import Ledger",
        "from prefixcache.cache import ledger",
        "from prefixcache.cache import facade",
        "import prefixcache.cache.tree",
        "import prefixcache.storage._placed",
        "from prefixcache.storage import _placed",
        "from prefixcache.hashing import _U64",
        "from ..cache.lifecycle import Lifecycle",
        "from ..hashing import _TRAILER",
    ],
)
def test_the_checker_catches_a_planted_violation(planted: str) -> None:
    assert len(violations(planted, "prefixcache.sim.engines")) == 1


@pytest.mark.parametrize(
    "allowed",
    [
        "from prefixcache.cache import PrefixCache",
        "from prefixcache.cache.stats import CacheStats",
        "from prefixcache.hashing import token_bytes",
        "from prefixcache.sim.native import _kernel",
        "from prefixcache.sim.report import _finite",
        "from .engines import _helper",
        "self._tree = tree",
        "n = cls._cache",
        "n = _kernel.Tree",
        "n = cache.__class__",
    ],
)
def test_the_checker_allows_the_public_api_and_sims_own_names(allowed: str) -> None:
    assert violations(allowed, "prefixcache.sim.engines") == []
