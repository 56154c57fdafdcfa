"""prefixcache as a KV connector of vLLM v1 (``PrefixCacheConnector``).

vLLM loads it with ``kv_connector_module_path="prefixcache.integrations.vllm"`` and
``kv_connector="PrefixCacheConnector"``; its settings are ``kv_connector_extra_config``
(``settings.py``). The connector class imports vLLM, so it is loaded only when asked
for: the parts free of vLLM (``paged``, ``lookup``, ``scheduler``, ``worker``,
``settings``) import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PrefixCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "PrefixCacheConnector":
        from prefixcache.integrations.vllm.connector import PrefixCacheConnector

        return PrefixCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
