"""KV events on the wire: vLLM's schema, carried on Redis Streams.

The event types are vLLM's (``vllm.distributed.kv_events``), struct for struct, field
for field: ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` inside a
``KVEventBatch``, msgpack-encoded by msgspec (array-like structs tagged by class name,
as vLLM's connector events are). vLLM 0.32's own ZMQ publisher writes its events as
tagged maps with more fields; ``vllm_events.decode_vllm`` reads those into these structs.
What our publishers put in vLLM's fields:

* ``block_hashes``: the backend's own block keys. Opaque to a router, which uses them
  only to name the blocks of later removals and the parents of later stores.
* ``token_ids``: the tokens of the blocks stored, concatenated. A router hashes them
  itself (``fleet.keys``), so it never needs a backend's seed, salt or hash function.
* ``medium``: the tier kind the blocks entered or left (``device``, ``memory``,
  ``disk``, ``redis``); a block held by two tiers is stored twice, once per medium.
* ``extra_keys``: one ``[namespace, model]`` per block, namespace ``""`` being the
  public (shared) one. A router scores a tenant only on its own namespace and the
  public one.

A publisher numbers its batches ``1, 2, ...`` within an *incarnation* (a random id
drawn when it starts). One stream entry holds one batch (``STREAM_FIELDS``); the
stream's ``MAXLEN`` is the replay buffer. ``Snapshot`` is the whole index of a backend
at one sequence number, for a router whose gap is older than the buffer.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BackendInfo",
    "BlockRemoved",
    "BlockStored",
    "Entry",
    "KVEventBatch",
    "Snapshot",
    "WireError",
    "decode_batch",
    "decode_entry",
    "encode_batch",
    "encode_entry",
    "stream_key",
]

BlockHash = bytes | int  # vLLM's ExternalBlockHash


class WireError(ValueError):
    """Bytes that are not a valid event batch, entry or snapshot."""


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of vLLM's event structs (tagged by class name on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class Snapshot(msgspec.Struct, frozen=True):
    """A backend's whole index as ``BlockStored`` events (parents before children), taken
    after the batch ``seq`` of incarnation ``inc`` and before the next one."""

    inc: str
    seq: int
    events: list[BlockStored]


class BackendInfo(msgspec.Struct, frozen=True):
    """What a backend tells a router about itself (``GET /fleet/info``)."""

    name: str
    inc: str
    stream: str  # the Redis stream its events go to
    block_size: int
    model: str
    maxlen: int  # the stream's replay buffer, in batches


class Entry(msgspec.Struct, frozen=True):
    """One stream entry: one batch of one incarnation."""

    inc: str
    seq: int
    batch: KVEventBatch


_ENC = msgspec.msgpack.Encoder()
_BATCH = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENC.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    try:
        return _BATCH.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"not a KV event batch: {exc}") from None


def encode_entry(entry: Entry) -> dict[bytes, bytes]:
    """The fields of the Redis stream entry that carries ``entry``."""
    return {b"inc": entry.inc.encode(), b"seq": b"%d" % entry.seq, b"batch": encode_batch(entry.batch)}


def decode_entry(fields: dict[bytes, bytes]) -> Entry:
    try:
        inc, seq, batch = fields[b"inc"].decode(), int(fields[b"seq"]), fields[b"batch"]
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"not a KV event stream entry ({type(exc).__name__}: {exc})") from None
    if seq < 1:
        raise WireError(f"a stream entry's seq starts at 1, got {seq}")
    return Entry(inc, seq, decode_batch(batch))


def stream_key(prefix: str, name: str) -> str:
    """The stream a publisher named ``name`` writes to."""
    return f"{prefix}:events:{name}"
