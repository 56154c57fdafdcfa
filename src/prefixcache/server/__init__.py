"""The OpenAI-compatible server: FastAPI routes over the engine, settings, ``prefixcache serve``.

The names below load on first use, so that importing the package does not load the
engine and its dependencies (the model runtime, the blend index); the settings live in
``prefixcache.settings``, which ``serve``, ``route`` and the vLLM connector share. ``create_app`` is the app as
``serve`` wires it (``main.create_app``: with the ``[fleet]`` publisher).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Settings", "create_app", "load_settings"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from prefixcache.server.main import create_app

        return create_app
    if name in ("Settings", "load_settings"):
        import prefixcache.settings

        return getattr(prefixcache.settings, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
