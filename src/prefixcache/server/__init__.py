"""The OpenAI-compatible server: FastAPI routes over the engine, settings, ``prefixcache serve``."""

from prefixcache.server.app import create_app
from prefixcache.server.settings import Settings, load_settings

__all__ = ["Settings", "create_app", "load_settings"]
