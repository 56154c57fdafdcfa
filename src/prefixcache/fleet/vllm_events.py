"""vLLM's KV events as ``wire``'s structs, each chain credited to the namespace it serves.

Older vLLM encodes events as positional arrays, newer as maps tagged by ``type``, with
fields added over time (``medium``, ``lora_name``, ``extra_keys``, ``group_idx``):
``decode_vllm`` reads both. What it changes on the way:

* ``medium``: vLLM's ``GPU``/``CPU``/``STORAGE`` (none: ``GPU``) become our tier kinds
  ``device``/``memory``/``disk``, so the scorer credits them like our servers' tiers;
* only KV cache group 0 is followed (hybrid models publish one store per group);
* scope: the namespace a chain's first store is keyed under, the index placing later
  stores under their parents. A vLLM behind ``prefixcache route`` publishes two kinds
  of stores, told apart by their medium and ``extra_keys``:

  ========================  ==================================  =====================
  store                     first block's ``extra_keys``         namespace
  ========================  ==================================  =====================
  vLLM's own, salted        ``[salt]``, a salt of ``salts``      that salt's tenant
  vLLM's own, other salt    ``[salt]``, unknown                  ``PRIVATE``
  vLLM's own, no salt       none                                 public without
                                                                 ``salts``, else
                                                                 ``PRIVATE``
  vLLM's own, LoRA, media,  anything more                        ``PRIVATE``
  prompt embeddings
  the connector's tiers     ``[namespace, model]``, medium one   ``namespace``
  (``fleet.translate``)     of our tier kinds, no adapter
  ========================  ==================================  =====================

  vLLM puts a request's ``cache_salt`` in its first block's extra keys, untagged (a
  bare string, after a LoRA's name and multimodal ``[id, offset]`` pairs, before
  prompt-embedding digests: ``vllm.v1.core.kv_cache_utils.to_event_extra_keys``).
  The gateway salts every request it sends vLLM with ``identity.tenant_salt``, so
  ``salts`` (salt -> the tenant's namespace) names the tenant of each salted chain,
  and an unsalted chain is reachable by no routed request. ``PRIVATE`` is a namespace
  no request computes: those chains never shape anyone's routing.

  The connector's stores name the namespace its cache filed the request under, and
  its model key, which hashes the weights and is not the model id the router keys
  the backend under (``VllmSource.model``). The namespace is taken as is, the model
  replaced by the backend's: the router follows one model per backend, and the
  connector's namespace is a tenant only once its ``cache_salt`` verified. A store
  with an adapter is ``PRIVATE`` (the router keys no adapter).

NOTE: no client can make its blocks count in another tenant's namespace. The events
come from the operator's vLLM and connector, never from a client. A client sets at
most a request's ``cache_salt``, which the gateway overwrites; a salt of a tenant is an
HMAC under the gateway's secret, so only the gateway can produce one; and vLLM
publishes a salt as a single string, never as the ``[namespace, model]`` pair of the
connector's stores (with a LoRA it publishes two strings, but then ``lora_name`` is
set and the chain is ``PRIVATE``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

import msgspec

from prefixcache.config import TIER_KINDS
from prefixcache.fleet.wire import KVEventBatch, WireError

__all__ = ["PRIVATE", "decode_vllm"]

PRIVATE = "\0vllm-private"  # the namespace of chains no routed request can reuse

_MEDIA = {"gpu": "device", "cpu": "memory", "storage": "disk"}
# vLLM's field order, which the positional form and ``wire``'s structs share
_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_FIELDS = {
    "BlockStored": (*_STORED, "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_WIRE_LEN = {"BlockStored": 8, "BlockRemoved": 2, "AllBlocksCleared": 0}  # fields ``wire`` keeps


def decode_vllm(data: bytes, model: str, salts: Mapping[str, str] | None = None) -> tuple[KVEventBatch, int]:
    """A vLLM payload as ``wire`` structs, and the number of events of other KV cache
    groups left out; raises ``WireError``. ``model`` is the id the router keys this
    backend under; ``salts`` maps each tenant's ``cache_salt`` to its namespace, None
    when requests reach vLLM unsalted (no gateway salts them)."""
    try:
        raw: Any = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireError("not a KV event batch")
    events: list[list[Any]] = []
    for ev in raw[1]:
        tag, fields = _fields(ev)
        if fields.get("group_idx") not in (None, 0):
            continue
        if tag == "BlockStored":
            fields["extra_keys"] = _scope(fields, model, salts)
        if tag != "AllBlocksCleared":
            medium = fields.get("medium")
            name = medium.lower() if isinstance(medium, str) else "gpu"
            fields["medium"] = _MEDIA.get(name, name)
        events.append([tag, *(fields.get(f) for f in _FIELDS[tag][: _WIRE_LEN[tag]])])
    rank = raw[2] if len(raw) > 2 else None
    try:
        batch = msgspec.convert([raw[0], events, rank], KVEventBatch)
    except msgspec.ValidationError as exc:
        raise WireError(f"not a KV event batch: {exc}") from None
    return batch, len(raw[1]) - len(events)


def _fields(ev: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(ev, dict):
        tag, fields = ev.get("type"), dict(ev)
    elif isinstance(ev, list) and ev:
        tag = ev[0]
        fields = dict(zip(_FIELDS.get(tag, ()) if isinstance(tag, str) else (), ev[1:], strict=False))
    else:
        raise WireError("an event is neither an array nor a map")
    if not isinstance(tag, str) or tag not in _FIELDS:
        raise WireError(f"unknown event type {tag!r}")
    return tag, fields


def _scope(fields: dict[str, Any], model: str, salts: Mapping[str, str] | None) -> list[tuple[str, str]] | None:
    """``wire``'s ``extra_keys`` for a store, from its raw fields (see the module doc):
    only a chain's first store is scoped; None is the public namespace."""
    if fields.get("parent_block_hash") is not None:
        return None
    extra = fields.get("extra_keys")
    first = extra[0] if isinstance(extra, list) and extra else None
    if fields.get("lora_id") is not None or fields.get("lora_name") is not None:
        return [(PRIVATE, "")]
    if fields.get("medium") in TIER_KINDS and _pair(first):  # the connector's (ours: lower case)
        return [(first[0], model)]
    if first is None or first == []:
        return None if salts is None else [(PRIVATE, "")]
    salt = first[0] if isinstance(first, list) and len(first) == 1 else None
    namespace = salts.get(salt) if salts is not None and isinstance(salt, str) else None
    return [(PRIVATE, "")] if namespace is None else [(namespace, model)]


def _pair(keys: object) -> TypeGuard[list[str]]:
    return isinstance(keys, list) and len(keys) == 2 and all(isinstance(k, str) for k in keys)
