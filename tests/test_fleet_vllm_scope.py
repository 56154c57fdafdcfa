"""Which namespace a vLLM backend's chains count in (``fleet/vllm_events.py``): a salted
chain is its tenant's, the connector's tier stores are the namespace they name, and
everything else is ``PRIVATE``; then the router's ranking, tenant by tenant."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from prefixcache.config import CacheConfig
from prefixcache.fleet.router import RouteConfig, Router
from prefixcache.fleet.vllm_events import PRIVATE, decode_vllm
from prefixcache.fleet.wire import BlockStored
from prefixcache.fleet.zmq import VllmSource
from prefixcache.identity import tenant_salt
from prefixcache.settings import AuthSettings, Settings

BS = 4
MODEL = "m"
SECRET = b"a-tenant-secret-of-32-characters"
KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
SALTS = {tenant_salt(SECRET, t): t for t in ("acme", "globex")}
ACME = tenant_salt(SECRET, "acme")
TOKENS = list(range(100, 100 + 6 * BS))


def stored(first: Any, n: int = 3, start: int = 0, name: str = "h", **fields: Any) -> dict[str, Any]:
    """vLLM 0.32's ``BlockStored`` map of ``n`` blocks named ``name<i>``, ``first`` the
    first block's extra keys."""
    return {
        "type": "BlockStored",
        "block_hashes": [f"{name}{start + i}".encode() for i in range(n)],
        "parent_block_hash": None,
        "token_ids": TOKENS[start * BS : (start + n) * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None if first is None else [first] + [None] * (n - 1),
        "group_idx": 0,
    } | fields


def scope(event: dict[str, Any], salts: dict[str, str] | None = SALTS) -> Any:
    batch, _ = decode_vllm(msgspec.msgpack.encode([time.time(), [event], 0]), MODEL, salts)
    got = batch.events[0]
    assert isinstance(got, BlockStored)
    return got.extra_keys


def test_a_chain_salted_by_the_gateway_is_its_tenants() -> None:
    assert scope(stored([ACME])) == [("acme", MODEL)]
    assert scope(stored([tenant_salt(SECRET, "globex")], medium="CPU")) == [("globex", MODEL)]  # vLLM's offload
    assert scope(stored([ACME], parent_block_hash=b"h9")) is None  # a later store: its parent's scope


@pytest.mark.parametrize(
    ("first", "fields"),
    [
        (["victims-salt"], {}),  # a salt no gateway set (a client that reached vLLM itself)
        ([tenant_salt(b"another-secret-16bytes", "acme")], {}),  # another gateway's
        (["acme"], {}),  # a tenant's name is not its salt
        (None, {}),  # no salt: vLLM's shared cache, which no stamped request reaches
        (["adapter", ACME], {"lora_name": "adapter"}),  # LoRA: the router keys no adapter
        ([ACME], {"lora_id": 3}),
        ([["image-hash", 0], ACME], {}),  # multimodal: (id, offset) before the salt
        ([ACME, b"embeds-digest"], {}),  # prompt embeddings after it
        (["acme", "m"], {}),  # a [namespace, model] pair from vLLM itself is not the connector's
    ],
)
def test_anything_else_from_vllm_is_private(first: Any, fields: dict[str, Any]) -> None:
    assert scope(stored(first, **fields)) == [(PRIVATE, "")]


def test_without_a_gateway_an_unsalted_chain_is_public_and_a_salted_one_private() -> None:
    assert scope(stored(None), salts=None) is None
    assert scope(stored([ACME]), salts=None) == [(PRIVATE, "")]


def test_the_connectors_stores_count_in_the_namespace_they_name_under_the_backends_model() -> None:
    pair = ["acme", "connector-model@0123456789abcdef"]  # its model key is not the router's model id
    assert scope(stored(pair, medium="memory")) == [("acme", MODEL)]
    assert scope(stored(pair, medium="redis")) == [("acme", MODEL)]
    assert scope(stored(["", pair[1]], medium="disk")) == [("", MODEL)]  # a public (published) block
    assert scope(stored(pair, medium="memory", lora_name="adapter@ff")) == [(PRIVATE, "")]


# ---------------------------------------------------------------------- ranking


def router(isolation: str = "namespace") -> Router:
    vllm = tuple(VllmSource.parse(f"http://v{i}=tcp://127.0.0.1:1", BS, MODEL) for i in range(3))
    auth = AuthSettings(api_keys=KEYS, tenant_secret=SECRET.decode(), allow_cross_tenant_reuse=True)
    settings = Settings(auth=auth, cache=CacheConfig(isolation=isolation))
    made = Router(RouteConfig((), "redis://127.0.0.1:1/0", vllm=vllm), settings, lambda p, b: [], CollectorRegistry())
    for b in made.backends:
        assert b.source is not None
        b.info, b.up = b.source.info(), True
    return made


def publish(made: Router, backend: int, *events: dict[str, Any]) -> None:
    """``events`` as backend ``backend``'s vLLM publishes them, decoded with the router's salts."""
    b = made.backends[backend]
    batch, _ = decode_vllm(msgspec.msgpack.encode([time.time(), list(events), 0]), MODEL, b.salts)
    for event in batch.events:
        made.index.apply(b.name, event, MODEL)


def overlaps(made: Router, tenant: str) -> dict[str, int]:
    return {b.name: overlap for b, overlap, _left in made.rank(tenant, TOKENS, set())}


@pytest.mark.parametrize("isolation", ["namespace", "partitioned", "shared"])
def test_a_tenants_salted_blocks_attract_its_requests_only(isolation: str) -> None:
    made = router(isolation)
    publish(made, 1, stored([ACME], n=6))
    publish(made, 2, stored(["victims-salt"], n=6), stored(None, n=6, name="unsalted"))
    assert overlaps(made, "acme") == {"http://v0": 0, "http://v1": 6, "http://v2": 0}
    assert overlaps(made, "globex") == {"http://v0": 0, "http://v1": 0, "http://v2": 0}
    assert made.rank("acme", TOKENS, set())[0][0].name == "http://v1"


def test_the_connectors_blocks_attract_their_namespaces_requests_only() -> None:
    made = router()
    publish(made, 0, stored(["globex", "connector-model@0123"], n=4, medium="memory"))
    publish(made, 2, stored(["", "connector-model@0123"], n=2, medium="disk"))
    assert overlaps(made, "globex") == {"http://v0": 4, "http://v1": 0, "http://v2": 2}
    assert overlaps(made, "acme") == {"http://v0": 0, "http://v1": 0, "http://v2": 2}  # the public blocks only
