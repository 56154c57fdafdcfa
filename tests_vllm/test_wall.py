"""Every hook of vLLM's ``KVConnectorBase_V1`` that ``PrefixCacheConnector`` overrides
answers vLLM even when everything behind it raises (``wall.py``, design invariant 17):
the connector's own part of each hook runs inside the wall too. The halves behind it
(``scheduler.py``, ``worker_hooks.py``) are tested in ``tests/test_vllm_wall.py``."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorTransferResults

from prefixcache.integrations.vllm.connector import PrefixCacheConnector, PrefixCacheMeta
from prefixcache.integrations.vllm.settings import parse_settings
from prefixcache.integrations.vllm.wall import Wall
from prefixcache.integrations.vllm.worker import LoadSpec

# register_kv_caches runs once at start: a layout it cannot read must stop vLLM there.
START_ONLY = {"__init__", "register_kv_caches", "build_kv_connector_stats", "build_prom_metrics"}
NOTHING_TO_FAIL = {"wait_for_layer_load", "save_kv_layer", "take_events"}  # no body, or a list handed over
ANSWERS: dict[str, Any] = {
    "get_num_new_matched_tokens": (0, False),
    "build_connector_meta": PrefixCacheMeta(),
    "request_finished": (False, None),
    "get_transfer_results": KVConnectorTransferResults(),
    "get_finished": (None, None),
    "get_block_ids_with_load_errors": set(),
    "get_kv_connector_stats": None,
    "get_kv_connector_kv_cache_events": None,
}


class Broken:
    """Whatever is asked of it raises: a scheduler state or worker gone wrong."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"broken: {name}")


def hooks() -> list[str]:
    own = {n for n, v in vars(PrefixCacheConnector).items() if callable(v) or isinstance(v, classmethod)}
    return sorted(n for n in own if hasattr(KVConnectorBase_V1, n) and n not in START_ONLY | NOTHING_TO_FAIL)


def broken_connector() -> PrefixCacheConnector:
    connector = PrefixCacheConnector.__new__(PrefixCacheConnector)
    connector.settings, connector.block_size, connector.wall = parse_settings(None), 4, Wall()
    connector._state, connector._hooks = Broken(), Broken()  # type: ignore[assignment]
    connector._server = connector._client = Broken()  # type: ignore[assignment]
    connector._events = []
    connector._connector_metadata = PrefixCacheMeta(loads=[LoadSpec("r", None, (1,), 0, ((1,),))])  # type: ignore[arg-type]
    return connector


def test_the_connector_overrides_the_hooks_vllm_calls() -> None:
    assert {
        "on_new_request",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
        "update_connector_output",
        "start_load_kv",
        "wait_for_save",
        "get_transfer_results",
        "get_block_ids_with_load_errors",
        "get_kv_connector_stats",
        "get_kv_connector_kv_cache_events",
        "shutdown",
    } <= set(hooks())


@pytest.mark.parametrize("name", hooks())
def test_a_hook_whose_insides_raise_answers_vllm_as_for_a_miss(name: str) -> None:
    connector = broken_connector()
    method = getattr(connector, name)
    args = [None] * sum(1 for p in inspect.signature(method).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD)
    got = method(*args)
    if name in ANSWERS:
        assert got == ANSWERS[name]
    assert connector.wall.total >= 1, f"{name} met nothing that raised: is it still walled?"
