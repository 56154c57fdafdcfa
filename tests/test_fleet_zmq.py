"""vLLM backends behind the router: a fake publisher that speaks exactly vLLM's ZMQ
protocol (``ZmqEventPublisher``: PUB ``[topic, seq, payload]``, a ROUTER replay socket
with a bounded buffer), on loopback, read by ``ZmqReader`` into the global index."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
import zmq
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry

from engine_support import LiveServer
from prefixcache.fleet import router as router_module
from prefixcache.fleet.backends import Backend
from prefixcache.fleet.follow import Follower
from prefixcache.fleet.index import GlobalIndex
from prefixcache.fleet.keys import chain_keys, root_key
from prefixcache.fleet.router import RouteConfig, Router, create_router
from prefixcache.fleet.wire import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from prefixcache.fleet.zmq import PRIVATE, VllmSource, ZmqReader, decode_vllm
from prefixcache.identity import tenant_salt
from prefixcache.settings import AuthSettings, Settings
from support import wait_for

BS = 4
MODEL = "m"
TOPIC = "kv-events"
SECRET = b"a-tenant-secret-of-32-characters"


class FakeVllm:
    """vLLM 0.32's publisher, frame for frame: seqs from 0, 8-byte big-endian; a replay
    request ``[id, b"", start]`` answers ``[id, b"", topic, seq, payload]`` for every
    buffered batch from ``start`` on, then ``[id, b"", b"", -1, b""]`` (``legacy``: the
    replies of older vLLM, without the topic frame)."""

    def __init__(self, buffer_steps: int = 100, legacy: bool = False) -> None:
        self.legacy = legacy
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.lock = threading.Lock()
        self.replays = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def source(self, url: str = "http://vllm") -> VllmSource:
        return VllmSource.parse(f"{url}={self.endpoint},replay={self.replay},topic={TOPIC}", BS, MODEL)

    def publish(self, payload: bytes, send: bool = True) -> int:
        """Number, buffer and (unless ``send`` is False: lost on the way) send ``payload``."""
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        with self.lock:
            self.seq = 0
            self.buffer.clear()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            with self.lock:
                held = [(s, p) for s, p in self.buffer if s >= int.from_bytes(start, "big")]
                self.replays += 1
            topic = [] if self.legacy else [TOPIC.encode()]
            for s, p in held:
                self.router.send_multipart([client, b"", *topic, s.to_bytes(8, "big"), p])
            end = [] if self.legacy else [b""]
            self.router.send_multipart([client, b"", *end, (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def stored(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM encodes it now: a map tagged by ``type``."""
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return event | extra


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), 0])


def chain(name: str, n: int, parent: Any = None, start: int = 0) -> tuple[dict[str, Any], list[int]]:
    """A store of ``n`` blocks named ``name-i``, of tokens distinct to ``name``."""
    base = 1000 * (sum(map(ord, name)) % 97 + 1)
    tokens = [base + i for i in range(start * BS, (start + n) * BS)]
    return stored([f"{name}-{i}".encode() for i in range(start, start + n)], parent, tokens), tokens


def held(index: GlobalIndex, tokens: list[int], backend: str = "v") -> int:
    return len(index.matched([chain_keys(root_key("", MODEL), tokens, BS)], [backend])[backend])


@pytest.fixture(params=[False, True], ids=["vllm-0.32", "legacy-replay"])
def fake(request: pytest.FixtureRequest) -> Iterator[FakeVllm]:
    f = FakeVllm(legacy=request.param)
    yield f
    f.close()


@pytest.fixture
def followed(fake: FakeVllm) -> Iterator[tuple[ZmqReader, GlobalIndex]]:
    index = GlobalIndex()
    reader = ZmqReader(Follower("v", index, MODEL), fake.source()).start()
    wait_for(lambda: warm(fake, reader))  # ZMQ's slow joiner: batches sent before the SUB is connected
    yield reader, index
    reader.stop()


def warm(fake: FakeVllm, reader: ZmqReader) -> bool:
    if reader.stats.received:
        return reader.follower.seq == fake.seq
    fake.publish(batch())
    time.sleep(0.02)
    return False


# ---------------------------------------------------------------------- decoding


def test_both_of_vllms_encodings_decode_with_its_media_as_our_tiers() -> None:
    event, tokens = chain("a", 2)
    removed = {"type": "BlockRemoved", "block_hashes": [b"a-1"], "medium": "CPU", "group_idx": 0}
    off_disk = {"type": "BlockRemoved", "block_hashes": [b"a-0"], "medium": "STORAGE", "locality": "LOCAL"}
    events = [event, removed, {"type": "AllBlocksCleared"}, off_disk]
    as_map = msgspec.msgpack.encode({"ts": 1.0, "events": events})
    legacy = encode_batch(KVEventBatch(1.0, [BlockStored([7, 8], None, tokens, BS, None, None)]))
    got, skipped = decode_vllm(as_map, MODEL)
    assert skipped == 0 and got.ts == 1.0 and len(got.events) == 4
    first, second, last = got.events[0], got.events[1], got.events[3]
    assert isinstance(last, BlockRemoved) and last.medium == "disk"
    assert isinstance(first, BlockStored) and first.medium == "device" and first.token_ids == tokens
    assert first.block_hashes == [b"a-0", b"a-1"] and first.extra_keys is None  # public: no gateway salts requests
    assert isinstance(second, BlockRemoved) and second.medium == "memory"
    old, _ = decode_vllm(legacy, MODEL)
    assert isinstance(old.events[0], BlockStored) and old.events[0].block_hashes == [7, 8]
    assert old.events[0].medium == "device"  # no medium: vLLM's GPU cache


def test_salted_adapter_and_other_group_stores_never_count_as_public() -> None:
    salted, _ = chain("s", 1)
    salted["extra_keys"] = [("salt-of-acme",)]
    lora, _ = chain("l", 1)
    lora["lora_name"] = "adapter"
    other, _ = chain("o", 1)
    other["group_idx"] = 1
    got, skipped = decode_vllm(batch(salted, lora, other), MODEL)
    assert skipped == 1 and len(got.events) == 2
    assert all(isinstance(e, BlockStored) and e.extra_keys == [(PRIVATE, "")] for e in got.events)


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode([1.0, [["Nope", 1]]]), b"\x93\x01\x02\x03"])
def test_payloads_that_are_not_vllms_raise_wire_errors(payload: bytes) -> None:
    from prefixcache.fleet.wire import WireError

    with pytest.raises(WireError):
        decode_vllm(payload, MODEL)


# ---------------------------------------------------------------------- the reader


def test_batches_are_applied_in_order(fake: FakeVllm, followed: tuple[ZmqReader, GlobalIndex]) -> None:
    reader, index = followed
    first, tokens = chain("doc", 3)
    second, more = chain("doc", 2, parent=b"doc-2", start=3)
    fake.publish(batch(first))
    fake.publish(batch(second))
    wait_for(lambda: held(index, tokens + more) == 5)
    assert index.matched([chain_keys(root_key("", MODEL), tokens, BS)], ["v"])["v"] == ("device",) * 3
    fake.publish(batch({"type": "BlockRemoved", "block_hashes": [b"doc-4"], "medium": "GPU"}))
    wait_for(lambda: held(index, tokens + more) == 4 and reader.follower.seq == fake.seq)
    assert reader.stats.cleared == 0 and reader.stats.bad == 0 and reader.follower.seq == fake.seq


def test_a_lost_batch_is_replayed_from_the_replay_socket(
    fake: FakeVllm, followed: tuple[ZmqReader, GlobalIndex]
) -> None:
    reader, index = followed
    lost, tokens = chain("lost", 2)
    after, more = chain("lost", 1, parent=b"lost-1", start=2)
    reader.lose_next(1)
    fake.publish(batch(lost))
    fake.publish(batch(after))
    wait_for(lambda: held(index, tokens + more) == 3 and reader.follower.stats.replays >= 1)
    assert reader.follower.stats.replays >= 1 and reader.stats.cleared == 0 and reader.stats.orphans == 0
    assert fake.replays >= 1


def test_a_gap_older_than_the_buffer_clears_the_backend_and_recovers_from_later_events() -> None:
    fake = FakeVllm(buffer_steps=3)
    index = GlobalIndex()
    reader = ZmqReader(Follower("v", index, MODEL), fake.source()).start()
    try:
        wait_for(lambda: warm(fake, reader))
        before, old = chain("old", 2)
        fake.publish(batch(before))
        wait_for(lambda: held(index, old) == 2)
        fake.publish(batch(chain("gone", 1)[0]), send=False)  # lost, and soon out of the buffer
        child, _ = chain("old", 1, parent=b"old-1", start=2)
        fake.publish(batch(child), send=False)  # replayable, but its parent was cleared
        new, tokens = chain("new", 2)
        fake.publish(batch(new), send=False)
        later, more = chain("new", 1, parent=b"new-1", start=2)
        fake.publish(batch(later))
        wait_for(lambda: held(index, tokens + more) == 3 and reader.follower.seq == fake.seq)
        assert held(index, old) == 0  # what the backend held before the gap is forgotten
        assert reader.stats.cleared == 1 and reader.stats.orphans == 1
        assert reader.follower.seq == fake.seq
    finally:
        reader.stop()
        fake.close()


def test_a_restarted_publisher_starts_a_new_incarnation(
    fake: FakeVllm, followed: tuple[ZmqReader, GlobalIndex]
) -> None:
    reader, index = followed
    before, old = chain("old", 2)
    fake.publish(batch(before))
    wait_for(lambda: held(index, old) == 2)
    inc = reader.inc
    fake.restart()  # seqs from 0 again, an empty cache
    fake.publish(batch(), send=False)  # its first batch is missed: the replay brings it
    after, tokens = chain("new", 2)
    fake.publish(batch(after))
    wait_for(lambda: held(index, tokens) == 2 and reader.follower.seq == fake.seq)
    assert held(index, old) == 0 and reader.inc != inc and reader.stats.restarts == 1
    assert reader.follower.inc == reader.inc and reader.follower.seq == 2 and reader.stats.cleared == 0


def test_bad_messages_are_counted_and_the_reader_goes_on(
    fake: FakeVllm, followed: tuple[ZmqReader, GlobalIndex]
) -> None:
    reader, index = followed
    fake.pub.send_multipart([TOPIC.encode(), b"short"])  # not [topic, seq, payload]
    fake.publish(b"\xc1 not msgpack")
    good, tokens = chain("good", 2)
    fake.publish(batch(good))
    wait_for(lambda: held(index, tokens) == 2 and reader.follower.seq == fake.seq)
    assert reader.stats.bad >= 2 and reader.follower.seq == fake.seq and reader._thread.is_alive()


def test_a_silent_replay_socket_clears_instead_of_blocking(fake: FakeVllm, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixcache.fleet import zmq as zmq_module

    monkeypatch.setattr(zmq_module, "REPLAY_WAIT_MS", 100)
    index = GlobalIndex()
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes requests, answers nothing
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    source = VllmSource.parse(f"http://vllm={fake.endpoint},replay=tcp://127.0.0.1:{port},topic={TOPIC}", BS, MODEL)
    reader = ZmqReader(Follower("v", index, MODEL), source).start()
    try:
        wait_for(lambda: warm(fake, reader))
        fake.publish(batch(), send=False)
        new, tokens = chain("new", 2)
        fake.publish(batch(new))
        wait_for(lambda: held(index, tokens) == 2)
        assert reader.stats.replay_timeouts >= 1 and reader.stats.cleared >= 1
    finally:
        reader.stop()
        silent.close(linger=0)


# ---------------------------------------------------------------------- flags and the router


@pytest.mark.parametrize(
    "spec",
    [
        "tcp://h:1",  # no URL
        "http://h=tcp://*:5557",  # a bind address
        "http://h=udp://h:1",
        "http://h=tcp://h:1,replay",
        "http://h=tcp://h:1,replay=tcp://h:2,replay=tcp://h:3",
        "http://h=tcp://h:1,hwm=3",
    ],
)
def test_bad_vllm_backend_flags_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="--vllm-backend"):
        VllmSource.parse(spec, BS, MODEL)


def test_a_vllm_flag_parses_with_its_replay_and_topic() -> None:
    got = VllmSource.parse("http://h:8000/=tcp://h:5557,replay=tcp://h:5558,topic=kv", 16, "m")
    assert got == VllmSource("http://h:8000", "tcp://h:5557", "tcp://h:5558", 16, "m", "kv")
    assert VllmSource.parse("http://h=tcp://h:1", 16, "m").replay is None
    assert Backend(got.url, source=got).health_path == "/health" and Backend("http://x").health_path == "/healthz"


class FakeVllmServer:
    """vLLM's HTTP side: ``/health`` (there is no ``/healthz``) and a chat route that
    streams its name; its events on a ``FakeVllm``."""

    def __init__(self, name: str) -> None:
        self.name, self.events = name, FakeVllm()
        app = FastAPI()

        @app.get("/health")
        def health() -> dict[str, str]:
            return {}

        @app.post("/v1/chat/completions")
        def chat() -> StreamingResponse:
            return StreamingResponse(iter([f'data: {{"backend": "{self.name}"}}\n\n'.encode()]))

        self.live = LiveServer(app).start()


def test_the_router_sends_a_request_to_the_vllm_backend_holding_its_tenants_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(router_module, "HEALTH_EVERY_S", 3600.0)
    servers = [FakeVllmServer(f"v{i}") for i in range(3)]
    vllm = tuple(s.events.source(s.live.url) for s in servers)
    text = "the quick brown fox jumps over the lazy dog " * 3

    def tokenize(path: str, body: dict[str, Any]) -> list[int]:
        return [ord(c) for c in body["messages"][-1]["content"]]

    settings = Settings(auth=AuthSettings(tenant_secret=SECRET.decode()))  # local mode: one tenant, "local"
    router = Router(RouteConfig((), "redis://127.0.0.1:1/0", vllm=vllm), settings, tokenize, CollectorRegistry())
    app = create_router(router)
    live = LiveServer(app, config=uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")).start()
    try:
        wait_for(lambda: all(b.up for b in router.backends))
        tokens = [ord(c) for c in text][: len(text) // BS * BS]
        n = len(tokens) // BS
        salted = stored(list(range(n)), None, tokens, extra_keys=[[tenant_salt(SECRET, "local")]] + [None] * (n - 1))
        target, unsalted = servers[1], servers[2]
        for server, store in ((target, salted), (unsalted, stored(list(range(n)), None, tokens))):
            reader = router.backends[servers.index(server)].reader
            assert isinstance(reader, ZmqReader)
            wait_for(lambda: warm(server.events, reader))  # noqa: B023 (called here, in the loop)
            server.events.publish(batch(store))
            wait_for(lambda: router.index.held(server.live.url) == n)  # noqa: B023
        body = {"model": MODEL, "messages": [{"role": "user", "content": text + "and?"}], "stream": True}
        for _ in range(3):  # the unsalted chain is no routed request's: only the salted one attracts
            reply = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=10)
            assert reply.status_code == 200 and reply.headers["x-prefixcache-backend"] == target.live.url
            assert '"backend": "v1"' in reply.text
    finally:
        live.stop()
        for s in servers:
            s.live.stop()
            s.events.close()


def test_stores_of_another_block_size_are_counted(fake: FakeVllm, followed: tuple[ZmqReader, GlobalIndex]) -> None:
    reader, _index = followed
    other, _ = chain("big", 1)
    fake.publish(batch(other | {"block_size": 2 * BS, "token_ids": list(range(2 * BS))}))
    wait_for(lambda: reader.follower.seq == fake.seq)
    assert reader.stats.other_block_size == 1


def test_a_store_no_key_can_cover_is_counted_and_the_rest_applied(
    fake: FakeVllm, followed: tuple[ZmqReader, GlobalIndex]
) -> None:
    reader, index = followed
    bad, _ = chain("neg", 1)
    good, tokens = chain("pos", 1)
    fake.publish(batch(bad | {"token_ids": [-1] * BS}, good))
    wait_for(lambda: held(index, tokens) == 1 and reader.follower.seq == fake.seq)
    assert reader.stats.bad == 1 and reader._thread.is_alive() and reader.follower.seq == fake.seq
