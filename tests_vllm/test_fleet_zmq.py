"""The router's ZMQ reader against vLLM's own publisher: ``ZmqEventPublisher`` made by
``EventPublisherFactory`` from a ``KVEventsConfig`` (no model), publishing vLLM's own
event structs, read by ``ZmqReader`` into the global index; a lost batch comes back
through vLLM's replay socket."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    EventPublisherFactory,
    KVEventBatch,
)

from prefixcache.fleet.follow import Follower
from prefixcache.fleet.index import GlobalIndex
from prefixcache.fleet.keys import chain_keys, root_key
from prefixcache.fleet.zmq import VllmSource, ZmqReader

BS = 4
MODEL = "m"
TOPIC = "kv-events"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def vllm() -> Iterator[tuple[EventPublisher, VllmSource]]:
    pub, replay = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{pub}",
        replay_endpoint=f"tcp://*:{replay}",
        topic=TOPIC,
    )
    publisher = EventPublisherFactory.create(config)
    source = VllmSource.parse(
        f"http://vllm=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{replay},topic={TOPIC}", BS, MODEL
    )
    yield publisher, source
    publisher.shutdown()


def store(hashes: list[int | bytes], parent: int | bytes | None, tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None] * len(hashes),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def held(index: GlobalIndex, tokens: list[int]) -> tuple[str, ...]:
    return index.matched([chain_keys(root_key("", MODEL), tokens, BS)], ["v"])["v"]


def test_vllms_own_publisher_is_decoded_indexed_and_replayed(vllm: tuple[EventPublisher, VllmSource]) -> None:
    publisher, source = vllm
    index = GlobalIndex()
    reader = ZmqReader(Follower("v", index, MODEL), source).start()
    try:

        def warm() -> bool:  # ZMQ's slow joiner: batches sent before the SUB connects are a gap
            if not reader.stats.received:
                publisher.publish(KVEventBatch(ts=time.time(), events=[]))
                time.sleep(0.05)
            return reader.stats.received > 0 and reader.stats.cleared == 0

        wait(warm)
        tokens = list(range(100, 100 + 3 * BS))
        publisher.publish(
            KVEventBatch(ts=time.time(), events=[store([2**63 + 1, b"\x01" * 32], None, tokens[: 2 * BS])])
        )
        wait(lambda: len(held(index, tokens)) == 2)
        assert held(index, tokens) == ("device", "device")  # vLLM's GPU blocks, credited as a device tier

        reader.lose_next(1)  # a batch lost on the way: vLLM's replay socket brings it back
        publisher.publish(KVEventBatch(ts=time.time(), events=[store([7], b"\x01" * 32, tokens[2 * BS :])]))
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[2**63 + 1], medium="GPU")]))
        wait(lambda: reader.follower.stats.replays >= 1)
        wait(lambda: held(index, tokens) == ())  # the first block left: no prefix
        assert index.held("v") == 2 and reader.stats.cleared == 0 and reader.stats.bad == 0

        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        wait(lambda: index.held("v") == 0)
        assert reader.stats.orphans == 0 and reader.errors == 0
    finally:
        reader.stop()
