"""The vLLM connector's parts that run without vLLM: its view of vLLM's paged KV, the
scheduler's lookups over a socket, the scheduler's step plans and the worker's loads
and saves against a real ``PrefixCache``. The connector inside real vLLM is tested in
``tests_vllm/`` (in the ``.venv-vllm`` that ``make test`` builds)."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.facade import PrefixCache
from prefixcache.config import CacheConfig, PublishConfig, TierConfig
from prefixcache.hashing import KeyChain, Segments, get_hash, root_encoding, root_hasher, token_bytes
from prefixcache.identity import PARAMS_KEY, RETAIN_KEY, Unverified, stamp, tenant_salt
from prefixcache.integrations.vllm.groups import Found, MissReason
from prefixcache.integrations.vllm.lookup import LookupClient, LookupServer, private_dir, socket_path
from prefixcache.integrations.vllm.paged import Layout, PagedKV, PagedSource
from prefixcache.integrations.vllm.scheduler import SchedulerState, StepPlan
from prefixcache.integrations.vllm.scope import Bypass, Fingerprints, Media, Scope, scope_of
from prefixcache.integrations.vllm.settings import model_key, parse_settings
from prefixcache.integrations.vllm.worker import ConnectorWorker, LoadSpec, SaveSpec, Tally
from prefixcache.storage import codec

H, D, N, LAYERS, BLOCKS = 3, 8, 4, 2, 10


def cpu_caches(seed: int = 0, blocks: int = BLOCKS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(blocks, H, N, 2 * D, generator=g) for i in range(LAYERS)}


def paged(caches: dict[str, torch.Tensor]) -> PagedKV:
    return PagedKV(caches, kv_heads=H, head_dim=D, block_size=N)


def test_cpu_layout_reads_each_heads_keys_then_values() -> None:
    caches = cpu_caches()
    kv = paged(caches).gather([3, 7])
    assert kv.shape == (LAYERS, 2, H, 2 * N, D)
    for layer, tensor in enumerate(caches.values()):
        as_backend = tensor.view(BLOCKS, H, 2 * N, D)  # how vLLM's CPU backend reads it
        keys, values = as_backend[:, :, :N], as_backend[:, :, N:]
        for i, block in enumerate([3, 7]):
            assert np.array_equal(kv[layer, 0, :, i * N : (i + 1) * N], keys[block].numpy())
            assert np.array_equal(kv[layer, 1, :, i * N : (i + 1) * N], values[block].numpy())


@pytest.mark.parametrize("layout", [Layout.CPU, Layout.FLASH])
@settings(max_examples=25, deadline=None)
@given(ids=st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS, unique=True))
def test_scatter_then_gather_round_trips_and_touches_only_its_blocks(layout: Layout, ids: list[int]) -> None:
    if layout is Layout.CPU:
        caches = cpu_caches(1)
    else:
        caches = {f"l{i}": torch.randn(2, BLOCKS, N, H, D) for i in range(LAYERS)}
    before = {k: v.clone() for k, v in caches.items()}
    view = paged(caches)
    assert view.layout is layout
    kv = np.random.default_rng(2).standard_normal((LAYERS, 2, H, len(ids) * N, D)).astype(np.float32)
    view.scatter(kv, ids)
    assert np.array_equal(view.gather(ids), kv)
    others = [b for b in range(BLOCKS) if b not in ids]
    if others:
        assert np.array_equal(view.gather(others), PagedKV(before, kv_heads=H, head_dim=D, block_size=N).gather(others))


def test_an_unknown_layout_or_mixed_layers_is_an_error_that_says_what_it_saw() -> None:
    with pytest.raises(ValueError, match=r"unknown vLLM KV cache layout \(10, 3, 4, 17\)"):
        paged({"a": torch.zeros(BLOCKS, H, N, 2 * D + 1)})
    with pytest.raises(ValueError, match="differs from the first layer"):
        paged({"a": torch.zeros(BLOCKS, H, N, 2 * D), "b": torch.zeros(BLOCKS + 1, H, N, 2 * D)})
    with pytest.raises(ValueError, match="dtype"):
        paged({"a": torch.zeros(BLOCKS, H, N, 2 * D, dtype=torch.int8)})
    with pytest.raises(ValueError, match="expected"):
        paged(cpu_caches()).scatter(np.zeros((LAYERS, 2, H, N, D), np.float32), [1, 2])


def test_a_paged_source_reads_any_range_of_its_blocks() -> None:
    view = paged(cpu_caches())
    whole = view.gather([5, 1, 8])
    source = PagedSource(view, [5, 1, 8])
    assert np.array_equal(source.read(3, 10), whole[:, :, :, 3:10])
    with pytest.raises(ValueError, match="beyond"):
        source.read(0, 13)


# ---------------------------------------------------------------------------- lookups


def test_lookups_travel_over_the_socket_and_a_dead_worker_is_a_miss(tmp_path: Path) -> None:
    asked: list[tuple[list[int], Scope]] = []

    def lookup(tokens: np.ndarray, scope: Scope) -> Found:
        asked.append((tokens.tolist(), scope))
        return Found(len(tokens) // 2, MissReason.WINDOW)

    path = socket_path("engine-1", str(tmp_path))
    server = LookupServer(path, lookup)
    client = LookupClient(path, timeout=2.0)
    scope = Scope("acmé", "a@f00", (Media(3, 2, "img-1"),))
    assert client.lookup([1, 2, 3, 4_000_000_000], scope) == Found(2, MissReason.WINDOW)
    assert asked == [([1, 2, 3, 4_000_000_000], scope)]
    with pytest.raises(ValueError, match="32 bits"):
        client.lookup([-1], Scope("a"))
    server.close()
    assert client.lookup([1, 2], Scope("a")) == Found(0) and client.failures == 1
    assert LookupClient(str(tmp_path / "none.sock")).lookup([1], Scope("a")) == Found(0)


def test_the_lookup_socket_is_0600_in_a_folder_only_its_user_may_enter(tmp_path: Path) -> None:
    """It answers any scope, so it must not be reachable by another local user (issue #39):
    whatever the umask, the folder is 0700 and the socket 0600."""
    path = Path(socket_path("e", str(tmp_path)))
    assert path.parent.parent == tmp_path and path.parent.name == f"prefixcache-{os.getuid()}"
    old = os.umask(0)
    try:
        server = LookupServer(str(path), lambda tokens, scope: Found(3))
    finally:
        os.umask(old)
    try:
        folder = path.parent.stat()
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert LookupClient(str(path)).lookup([1], Scope("t")).tokens == 3
    finally:
        server.close()
    again = LookupServer(str(path), lambda tokens, scope: Found(4))  # the same folder, reused
    again.close()


def test_a_socket_folder_not_ours_or_not_private_is_refused_with_what_to_do(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o750)
    with pytest.raises(PermissionError, match=r"open to group or others .*chmod 700"):
        private_dir(folder)
    folder.chmod(0o700)
    with pytest.raises(PermissionError, match=f"belongs to uid {os.getuid()}, not to this user"):
        private_dir(folder, uid=os.getuid() + 1)  # as another user sees our folder
    assert private_dir(folder) == folder
    link = tmp_path / "link"
    link.symlink_to(folder)
    with pytest.raises(PermissionError, match="not a directory"):
        private_dir(link)
    (tmp_path / "file").write_text("")
    with pytest.raises(PermissionError, match="not a directory"):
        private_dir(tmp_path / "file")
    path = tmp_path / f"prefixcache-{os.getuid()}"
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    with pytest.raises(PermissionError, match="open to group or others"):
        LookupServer(str(path / "e.sock"), lambda tokens, scope: Found(0))
    assert not (path / "e.sock").exists()


def test_a_malformed_lookup_closes_that_connection_only(tmp_path: Path) -> None:
    path = socket_path("e", str(tmp_path))
    server = LookupServer(path, lambda tokens, scope: Found(7))
    try:
        for bad in (b"XXXX" + b"\0" * 8, b"PCL3" + (3).to_bytes(4, "little") + b"\0" * 4 + b"\xc1\xc1\xc1"):
            with socket.socket(socket.AF_UNIX) as raw:
                raw.connect(path)
                raw.sendall(bad)
                raw.settimeout(2)
                assert raw.recv(4) == b""  # closed, no answer
        assert LookupClient(path).lookup([1], Scope("t")).tokens == 7
    finally:
        server.close()


def test_a_slow_worker_costs_the_scheduler_its_timeout_only(tmp_path: Path) -> None:
    release = threading.Event()
    path = socket_path("slow", str(tmp_path))
    server = LookupServer(path, lambda tokens, scope: Found(5 if release.wait(5) else 0))
    try:
        assert LookupClient(path, timeout=0.2).lookup([1], Scope("t")).tokens == 0
    finally:
        release.set()
        server.close()


# ---------------------------------------------------------------------------- worker


ALICE, T = Scope("alice"), Scope("t")


def worker(tmp_path: Path, caches: dict[str, torch.Tensor], model: str = "m@1") -> ConnectorWorker:
    config = CacheConfig(
        tiers=(
            TierConfig(kind="memory", capacity_bytes=1 << 20, write="through"),
            TierConfig(kind="disk", capacity_bytes=1 << 22, path=str(tmp_path / "disk")),
        ),
        writer="inline",
    )
    return ConnectorWorker(config, paged(caches), model)


def test_a_saved_prefix_loads_bit_exact_into_other_blocks_for_its_tenant_only(tmp_path: Path) -> None:
    source = cpu_caches(3)
    tokens = tuple(range(100, 100 + 3 * N))
    w = worker(tmp_path, source)
    assert w.save(SaveSpec("r1", ALICE, tokens, ((4, 0, 9),))) == 3 * N
    assert w.lookup(list(tokens), ALICE).tokens == 3 * N and w.lookup(list(tokens), Scope("bob")).tokens == 0
    assert w.lookup([*tokens[:N], 7, 7, 7, 7], ALICE).tokens == N

    target = cpu_caches(4)
    w2 = ConnectorWorker(w.cache.config, paged(target), "m@1")  # a second process on the same disk
    w.close(5)
    assert w2.lookup(list(tokens), ALICE).tokens == 3 * N
    failed = w2.load(LoadSpec("r2", ALICE, tokens, 1, ((6, 2),)))  # block 0 is vLLM's own hit
    assert failed == []
    assert np.array_equal(paged(target).gather([6, 2]), paged(source).gather([0, 9]))
    tally = w2.take_tally()
    assert tally is not None and sum(tally.hit_tokens.values()) == 2 * N
    assert {tier for _, tier in tally.hit_tokens} <= {"memory", "disk"}
    assert w2.take_tally() is None
    w2.close(5)


def test_the_connectors_tiers_store_in_their_codec_and_load_the_decoded_kv(tmp_path: Path) -> None:
    """The connector's cache is the same ``PrefixCache``: a disk tier that says int8
    stores int8 frames, and a second process loads into vLLM's blocks what they decode to."""
    source = cpu_caches(6)
    tokens = tuple(range(500, 500 + 3 * N))
    config = CacheConfig(
        tiers=(TierConfig(kind="disk", capacity_bytes=1 << 22, path=str(tmp_path / "disk"), codec="int8"),),
        writer="inline",
    )
    w = ConnectorWorker(config, paged(source), "m@1")
    assert w.save(SaveSpec("r1", ALICE, tokens, ((4, 0, 9),))) == 3 * N
    w.close(5)
    frames = sorted((tmp_path / "disk").rglob("*.blk"))
    assert len(frames) == 3 and {codec.peek_header(f.read_bytes()).codec for f in frames} == {"int8"}
    target = cpu_caches(7)
    w2 = ConnectorWorker(config, paged(target), "m@1")
    assert w2.load(LoadSpec("r2", ALICE, tokens, 0, ((6, 2, 3),))) == []
    for got, block in zip((6, 2, 3), (4, 0, 9), strict=True):
        kv = paged(source).gather([block]).numpy()
        key = b"k" * 16
        want = codec.decode(codec.encode(key, b"", kv, codec="int8"), key=key)
        assert not np.array_equal(want, kv) and np.array_equal(paged(target).gather([got]).numpy(), want)
    w2.close(5)
    lossy = {"cache": {"tiers": [{"kind": "memory", "capacity_bytes": 1 << 20, "codec": "int4"}]}}
    with pytest.raises(ValueError, match=r"lossy tier codecs \(memory: int4\) have no quality gate inside vLLM"):
        parse_settings(lossy)
    assert parse_settings({**lossy, "allow_ungated_codecs": True}).cache.tiers[0].codec == "int4"


def test_a_load_beyond_vllms_hit_reads_only_the_blocks_vllm_lacks(tmp_path: Path) -> None:
    """A prompt half held by vLLM's own cache reads half the bytes from the tiers."""
    tokens = tuple(range(8 * N))
    w = worker(tmp_path, cpu_caches(8))
    w.save(SaveSpec("r", T, tokens, (tuple(range(8)),)))
    w.close(5)
    reads = []
    for first in (0, 4):
        w2 = worker(tmp_path, cpu_caches(9))  # after a restart: the disk holds them
        assert w2.load(LoadSpec("r", T, tokens, first, (tuple(range(first, 8)),))) == []
        reads.append(sum(t.bytes_read for t in w2.cache.stats().tiers))
        w2.close(5)
    assert reads[0] > 0 and reads[1] * 2 == reads[0]


def test_a_corrupt_block_loads_the_blocks_before_it_and_reports_the_rest(tmp_path: Path) -> None:
    tokens = tuple(range(3 * N))
    w = worker(tmp_path, cpu_caches(5))
    w.save(SaveSpec("r", T, tokens, ((1, 2, 3),)))
    with w.cache.match(tokens, w.context(T)) as m:
        keys = m.block_keys
    w.close(5)
    second = tmp_path / "disk" / "blocks" / keys[1].hex()[:2] / f"{keys[1].hex()}.blk"  # the chain's second block
    data = bytearray(second.read_bytes())
    data[-5] ^= 0xFF
    second.write_bytes(bytes(data))
    target = cpu_caches(6)
    before = paged(target).gather([7, 8])
    w2 = worker(tmp_path, target)
    assert w2.load(LoadSpec("r", T, tokens, 0, ((5, 7, 8),))) == [7, 8]
    assert np.array_equal(paged(target).gather([7, 8]), before)  # nothing wrong was written
    assert w2.tally.lost_tokens["t"] == 2 * N
    w2.close(5)


def test_a_tally_survives_its_trip_between_processes() -> None:
    t = Tally()
    t.hit_tokens[("a", "disk")] += 5
    t.saved_tokens["a"] += 3
    t.load_seconds.append(0.25)
    back = Tally.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.merge(back).hit_tokens[("a", "disk")] == 10 and back.saved_tokens["a"] == 3


# ---------------------------------------------------------------------------- scheduler


def request(req_id: str, prompt: list[int], salt: str | None = None, params: Any = None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=prompt, cache_salt=salt, kv_transfer_params=params, num_computed_tokens=0
    )


def output(new: list[Any] = (), cached: Any = None, scheduled: dict[str, int] | None = None) -> SimpleNamespace:
    cached = cached or SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled or {},
        finished_req_ids=set(),
    )


def scoper(secret: bytes | None = None, unverified: Unverified = Unverified.BYPASS) -> Any:
    fingerprints = Fingerprints()
    return lambda r: scope_of(r, secret=secret, default_tenant="d", unverified=unverified, fingerprints=fingerprints)


def test_without_a_secret_the_tenant_is_the_salt_never_the_transfer_params() -> None:
    scope = scoper()
    assert scope(request("r", [1], "s", {"tenant": "t", PARAMS_KEY: "t"})) == Scope("s")
    assert scope(request("r", [1], None, {PARAMS_KEY: "victim"})) == Scope("d")
    assert scope(request("r", [1])) == Scope("d")


def test_with_a_secret_only_the_gateways_claim_names_a_tenant() -> None:
    secret = b"0123456789abcdef-secret"
    scope = scoper(secret)
    stamped = stamp({"prompt": "x", "cache_salt": "victim"}, "acme", secret)
    assert scope(request("r", [1], stamped["cache_salt"], stamped["kv_transfer_params"])) == Scope("acme")
    forged = [
        request("r", [1], "victim", {PARAMS_KEY: "victim"}),  # a salt of the client's choosing
        request("r", [1], tenant_salt(secret, "attacker"), {PARAMS_KEY: "victim"}),  # another tenant's claim
        request("r", [1], tenant_salt(b"another-secret-16b", "victim"), {PARAMS_KEY: "victim"}),
        request("r", [1], tenant_salt(secret, "victim"), None),  # a salt with no claim
        request("r", [1], None, {PARAMS_KEY: "victim"}),
        request("r", [1]),
        request("r", [1], stamped["cache_salt"], "acme"),  # malformed transfer params
        request("r", [1], stamped["cache_salt"], [PARAMS_KEY, "acme"]),
        request("r", [1], stamped["cache_salt"], {PARAMS_KEY: ["acme"]}),
        request("r", [1], 7, {PARAMS_KEY: "acme"}),  # a salt that is not a string
    ]
    for r in forged:
        assert scope(r) == Bypass("unverified_tenant")
        assert scoper(secret, Unverified.DEFAULT)(r) == Scope("d")


def test_the_gateways_retention_rides_the_scope_and_a_forged_one_is_none() -> None:
    secret = b"0123456789abcdef-secret"
    scope = scoper(secret)
    stamped = stamp({"prompt": "x"}, "acme", secret, 3600)
    salt, params = stamped["cache_salt"], stamped["kv_transfer_params"]
    assert scope(request("r", [1], salt, params)) == Scope("acme", retain_s=3600)
    raised = params | {RETAIN_KEY: 86_400}  # the client raised what the gateway stamped
    assert scope(request("r", [1], salt, raised)) == Scope("acme")
    bare = {PARAMS_KEY: "acme", RETAIN_KEY: 3600}  # no proof
    assert scope(request("r", [1], salt, bare)) == Scope("acme")
    assert scoper()(request("r", [1], "s", {RETAIN_KEY: 300})) == Scope("s", retain_s=300)  # no gateway: the ask


def test_a_save_with_a_retention_retains_what_it_stored_for_that_tenant(tmp_path: Path) -> None:
    """The worker retains what it saves for a retained scope: the cache's pools then evict
    around it (``tests/test_cache_retention.py`` holds the rest; ``tests_vllm`` the engine)."""
    w = worker(tmp_path, cpu_caches(40))
    kept = tuple(range(100, 100 + 2 * N))
    w.save(SaveSpec("r1", Scope("alice", retain_s=600), kept, ((0, 1),)))
    held = {t.tenant: t.held[0] for t in w.cache.stats().retention}
    assert held == {"alice": 2 * N}
    w.save(SaveSpec("r2", Scope("bob"), tuple(range(900, 900 + 2 * N)), ((2, 3),)))
    assert {t.tenant for t in w.cache.stats().retention} == {"alice"}
    w.close(5)


def adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_an_adapter_is_keyed_by_name_and_the_contents_of_its_files(tmp_path: Path) -> None:
    a = adapter(tmp_path / "a", b"a" * 64)
    b = adapter(tmp_path / "b", b"b" * 64)
    scope = scoper()

    def with_lora(name: str, path: Path | str) -> Any:
        r = request("r", [1], "s")
        r.lora_request = SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))
        return r

    first = scope(with_lora("x", a))
    assert isinstance(first, Scope) and first.adapter is not None and first.adapter.startswith("x@")
    assert scope(with_lora("x", a)) == first
    assert scope(with_lora("x", b)).adapter != first.adapter  # same name, other weights
    assert scope(with_lora("y", a)).adapter != first.adapter
    adapter(a, b"c" * 64)  # rewritten in place, same size
    assert scope(with_lora("x", a)).adapter not in (first.adapter, None)
    assert scope(with_lora("x", tmp_path / "missing")) == Bypass("adapter_unreadable")


def test_media_items_and_prompt_embeds_are_in_the_scope_or_bypass_it() -> None:
    r = request("r", list(range(20)), "s")
    r.mm_features = [
        SimpleNamespace(identifier="img-b", mm_position=SimpleNamespace(offset=9, length=4)),
        SimpleNamespace(identifier="img-a", mm_position=SimpleNamespace(offset=2, length=4)),
    ]
    got = scoper()(r)
    assert isinstance(got, Scope) and got.media == (Media(2, 4, "img-a"), Media(9, 4, "img-b"))
    assert [seg.start for seg in got.segments(8)] == [2]  # a prefix keys the items that start in it
    r.prompt_embeds = torch.zeros(3, 4)
    assert scoper()(r) == Bypass("prompt_embeds")


def _scopes_that_differ() -> Any:
    media = st.builds(
        Media, st.integers(0, 3 * N - 1), st.integers(1, 8), st.sampled_from(["img-1", "img-2", "a" * 64])
    )
    return st.builds(
        Scope,
        st.sampled_from(["acme", "globex", "acme2"]),
        st.sampled_from([None, "x@1", "x@2", "y@1"]),
        st.lists(media, max_size=2, unique=True).map(
            lambda m: tuple(sorted(m, key=lambda x: (x.offset, x.length, x.key)))
        ),
    )


@settings(max_examples=200, deadline=None)
@given(
    a=_scopes_that_differ(), b=_scopes_that_differ(), tokens=st.lists(st.integers(0, 50), min_size=N, max_size=3 * N)
)
def test_two_scopes_that_differ_never_share_a_block(a: Scope, b: Scope, tokens: list[int]) -> None:
    """Same tokens, another tenant, adapter or image (or an image elsewhere): no shared KV,
    except that an image after the blocks in common does not change them."""
    cache = PrefixCache(CacheConfig(block_size=N))
    cache.insert(tokens, a.context("m"), a.segments(len(tokens)))
    seen = cache.peek(tokens, b.context("m"), b.segments(len(tokens))).num_blocks
    if (a.tenant, a.adapter) != (b.tenant, b.adapter):
        assert seen == 0
    else:
        first_difference = min(
            [m.offset for m in set(a.media) ^ set(b.media) if m.offset < len(tokens)], default=len(tokens)
        )
        assert seen == min(first_difference // N, len(tokens) // N)


def test_a_collision_search_over_media_keys_finds_none() -> None:
    """200,000 media items (content hash, offset, length) in the first block of one
    prompt, keyed as the connector keys them: every block key differs."""
    ctx = Scope("t").context("m")
    enc = root_encoding("seed", ctx, "t", 0, 0)
    data = token_bytes([7] * N)
    seen: set[bytes] = set()
    rng = np.random.default_rng(0)
    for i in range(200_000):
        media = Media(int(rng.integers(0, N)), int(rng.integers(1, 4)), f"{int(rng.integers(0, 1 << 16)):04x}{i}")
        segments = Segments.of(Scope("t", None, (media,)).segments(N), N)
        seen.add(KeyChain(root_hasher(get_hash("xxh3_128"), enc), data, segments).at(N))
    assert len(seen) == 200_000


def test_the_scheduler_offers_whole_blocks_beyond_vllms_hit_never_the_last_token() -> None:
    asked: list[tuple[int, str]] = []

    def lookup(tokens: list[int], scope: Scope) -> Found:
        asked.append((len(tokens), scope.tenant))
        return Found(100)

    state = SchedulerState(N, lookup, scoper())
    r = request("r", list(range(13)), "acme")  # 12 = 3 blocks may be offered, never token 13
    state.seen(r)
    assert state.matched(r, 4) == 8 and asked == [(12, "acme")]
    assert state.matched(request("x", list(range(4))), 0) == 0  # one block and the last token: nothing
    state.allocated(r, 8)
    new = SimpleNamespace(
        req_id="r", prompt_token_ids=list(range(13)), block_ids=([10, 11, 12, 13],), num_computed_tokens=4
    )
    plan = state.step(output([new], scheduled={"r": 1}))
    assert plan.loads == [LoadSpec("r", Scope("acme"), tuple(range(12)), 1, ((11, 12),))]
    assert plan.saves == []  # what it loads or had is in the cache already
    cached = SimpleNamespace(req_ids=["r"], new_block_ids=[([14],)], num_computed_tokens=[13], resumed_req_ids=set())
    assert state.step(output(cached=cached, scheduled={"r": 1})).saves == []  # decode: no new prompt block


def test_the_scheduler_saves_each_prompt_block_once_as_chunks_complete() -> None:
    state = SchedulerState(N, lambda tokens, scope: Found(0), scoper())
    r = request("r", list(range(11)))
    state.seen(r)
    assert state.matched(r, 0) == 0
    state.allocated(r, 0)
    new = SimpleNamespace(req_id="r", prompt_token_ids=list(range(11)), block_ids=([3, 4],), num_computed_tokens=0)
    first = state.step(output([new], scheduled={"r": 6}))  # a chunk of 6: one full block
    assert first.saves == [SaveSpec("r", Scope("d"), tuple(range(4)), ((3,),), reached=6)]
    cached = SimpleNamespace(req_ids=["r"], new_block_ids=[([9],)], num_computed_tokens=[6], resumed_req_ids=set())
    second = state.step(output(cached=cached, scheduled={"r": 5}))
    assert second.saves == [
        SaveSpec("r", Scope("d"), tuple(range(8)), ((3, 4),), since_block=1, computed=6, reached=11)
    ]


# ---------------------------------------------------------------------------- settings


def test_settings_refuse_unknown_keys_and_name_the_valid_ones() -> None:
    assert parse_settings(None).cache.tiers[0].kind == "memory"
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key cachee; valid: cache, default_tenant"):
        parse_settings({"cachee": {}})
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key cache.policyy; valid: block_size"):
        parse_settings({"cache": {"policyy": "lru"}})
    with pytest.raises(ValueError, match="lookup_timeout_s"):
        parse_settings({"lookup_timeout_s": 0})
    cfg = parse_settings({"cache": {"policy": "lru", "tiers": [{"kind": "memory", "capacity_bytes": 1 << 20}]}})
    assert cfg.cache.policy == "lru" and cfg.cache.tiers[0].capacity_bytes == 1 << 20


def test_the_model_key_changes_when_the_weights_or_dtype_change(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_key("smol", str(tmp_path), "float32")
    assert first == model_key("smol", str(tmp_path), "float32") and first.startswith("smol@")
    assert model_key("smol", str(tmp_path), "bfloat16") != first
    (tmp_path / "model.safetensors").write_bytes(b"y" * 10)  # the same size, other contents
    assert model_key("smol", str(tmp_path), "float32") != first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    assert model_key("smol", str(tmp_path), "float32") == first
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert model_key("smol", str(tmp_path), "float32") != first
    assert model_key("org/smol", "org/smol", "float32", "abc") != model_key("org/smol", "org/smol", "float32", "abd")


def test_a_preempted_request_matched_again_loads_into_its_new_blocks() -> None:
    state = SchedulerState(N, lambda tokens, scope: Found(8), scoper())
    r = request("r", list(range(13)), "s")
    state.seen(r)
    state.allocated(r, 0)
    new = SimpleNamespace(
        req_id="r", prompt_token_ids=list(range(13)), block_ids=([1, 2, 3, 4],), num_computed_tokens=0
    )
    state.step(output([new], scheduled={"r": 13}))
    assert state.matched(r, 0) == 8  # back from preemption: its blocks were freed
    state.allocated(r, 8)
    cached = SimpleNamespace(
        req_ids=["r"], new_block_ids=[([7, 6, 5, 9],)], num_computed_tokens=[8], resumed_req_ids={"r"}
    )
    plan = state.step(output(cached=cached, scheduled={"r": 5}))
    assert plan.loads == [LoadSpec("r", Scope("s"), tuple(range(8)), 0, ((7, 6),))]
    assert plan.saves == [
        SaveSpec("r", Scope("s"), tuple(range(12)), ((7, 6, 5),), since_block=2, computed=8, reached=13)
    ]


def test_a_copy_into_vllm_that_fails_reports_every_block_to_recompute(tmp_path: Path) -> None:
    tokens = tuple(range(2 * N))
    w = worker(tmp_path, cpu_caches(7))
    w.save(SaveSpec("r", T, tokens, ((1, 2),)))

    def broken(kv: np.ndarray, block_ids: Any) -> None:
        raise RuntimeError("device lost")

    w.paged[0].scatter = broken  # type: ignore[method-assign]
    assert w.load(LoadSpec("r", T, tokens, 0, ((5, 6),))) == [5, 6]
    assert w.tally.errors["load"] == 1 and not w.tally.hit_tokens
    w.close(5)


@dataclass
class PrefillStats:
    """vLLM's ``PrefillStats`` as the scheduler's half uses it (``set`` recomputes the total)."""

    num_prompt_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cached_tokens: int = 0

    def set(self, num_prompt_tokens: int, num_local_cached_tokens: int, num_external_cached_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_local_cached_tokens = num_local_cached_tokens
        self.num_external_cached_tokens = num_external_cached_tokens
        self.num_cached_tokens = num_local_cached_tokens + num_external_cached_tokens


def test_after_a_failed_load_the_cached_count_is_what_loaded_and_the_rest_is_saved_again() -> None:
    state = SchedulerState(N, lambda tokens, scope: Found(12), scoper())
    r = request("r", list(range(14)), "s")
    r.prefill_stats = PrefillStats()
    state.seen(r)
    assert state.matched(r, 0) == 12
    state.allocated(r, 12)
    r.prefill_stats.set(14, 0, 12)  # what vLLM records when it schedules the request
    new = SimpleNamespace(
        req_id="r", prompt_token_ids=list(range(14)), block_ids=([1, 2, 3, 4],), num_computed_tokens=0
    )
    plan = state.step(output([new], scheduled={"r": 2}))
    assert plan.loads == [LoadSpec("r", Scope("s"), tuple(range(12)), 0, ((1, 2, 3),))] and plan.saves == []
    state.load_failed({2, 3, 99})  # the worker filled block 1 only; vLLM recomputes from block 2
    assert r.prefill_stats.num_cached_tokens == N
    cached = SimpleNamespace(req_ids=["r"], new_block_ids=[None], num_computed_tokens=[N], resumed_req_ids=set())
    again = state.step(output(cached=cached, scheduled={"r": 14 - N}))
    assert again.saves == [
        SaveSpec("r", Scope("s"), tuple(range(12)), ((1, 2, 3),), since_block=1, computed=4, reached=14)
    ]
    state.load_failed({77})  # another request's block: this one's count stands
    assert r.prefill_stats.num_cached_tokens == N


def test_a_request_that_bypasses_the_cache_is_neither_looked_up_nor_saved() -> None:
    asked: list[int] = []
    state = SchedulerState(N, lambda tokens, scope: asked.append(1) or Found(8), scoper(b"0123456789abcdef-secret"))
    r = request("r", list(range(13)), "victim", {PARAMS_KEY: "victim"})
    state.seen(r)
    assert state.matched(r, 0) == 0 and asked == []
    state.allocated(r, 0)
    new = SimpleNamespace(
        req_id="r", prompt_token_ids=list(range(13)), block_ids=([1, 2, 3, 4],), num_computed_tokens=0
    )
    assert state.step(output([new], scheduled={"r": 13})) == StepPlan()
    assert state.bypassed == {"unverified_tenant": 1}


def test_an_async_load_is_planned_at_allocation_and_its_request_saved_from_its_first_schedule() -> None:
    """With ``async_load`` vLLM parks the request while the worker loads: the load is
    decided when vLLM allocates its blocks (the request is not scheduled in that step),
    and a failed block is reported before the request runs (saved again from there)."""
    state = SchedulerState(N, lambda tokens, scope: Found(12), scoper(), async_load=True)
    r = request("r", list(range(14)), "s")
    r.prefill_stats = PrefillStats()
    state.seen(r)
    assert state.matched(r, 4) == 8  # vLLM holds block 0
    state.allocated(r, 8, ([5, 6, 7, 8],))
    r.prefill_stats.set(14, 4, 8)
    plan = state.step(output())  # the request waits: nothing of it is scheduled
    assert plan.loads == [LoadSpec("r", Scope("s"), tuple(range(12)), 1, ((6, 7),))] and plan.saves == []
    assert state.step(output()).loads == []  # planned once
    state.load_failed({7})
    assert r.prefill_stats.num_cached_tokens == 4 + N
    new = SimpleNamespace(
        req_id="r", prompt_token_ids=list(range(14)), block_ids=([5, 6, 7, 8],), num_computed_tokens=8
    )
    resumed = state.step(output([new], scheduled={"r": 6}))
    assert resumed.loads == [] and resumed.saves == [
        SaveSpec("r", Scope("s"), tuple(range(12)), ((5, 6, 7),), computed=8, reached=14)
    ]


def test_an_async_fetch_counts_nothing_until_it_is_committed(tmp_path: Path) -> None:
    tokens = tuple(range(2 * N))
    w = worker(tmp_path, cpu_caches(10))
    w.save(SaveSpec("r", T, tokens, ((1, 2),)))
    w.take_tally()
    loaded = w.fetch(LoadSpec("r", T, tokens, 0, ((5, 6),)))
    assert loaded.blocks == 2 and w.take_tally() is None
    assert w.commit(loaded) == []
    tally = w.take_tally()
    assert tally is not None and sum(tally.hit_tokens.values()) == 2 * N
    w.close(5)


def test_the_schedulers_lookup_changes_nothing_however_often_it_asks(tmp_path: Path) -> None:
    """vLLM asks again for a request that stays waiting: no stat, no event, no eviction order moves."""
    w = worker(tmp_path, cpu_caches(11))
    tokens = tuple(range(3 * N))
    w.save(SaveSpec("r", T, tokens, ((1, 2, 3),)))
    w.cache.flush()
    w.cache.take_events()
    before = w.cache.stats()
    for _ in range(5):
        assert w.lookup(list(tokens), T).tokens == 3 * N
        assert w.lookup([*tokens[:N], 9, 9, 9, 9], T).tokens == N
    assert w.cache.stats() == before and w.cache.take_events() == []
    w.close(5)


def test_hot_prefixes_published_by_enough_verified_tenants_serve_every_tenant(tmp_path: Path) -> None:
    """k-anonymous publication on the production path: tenants as the gateway vouched for them."""
    secret = b"0123456789abcdef-secret"
    scope = scoper(secret)

    def vouched(tenant: str) -> Scope:
        body = stamp({}, tenant, secret)
        got = scope(request("r", [1], body["cache_salt"], body["kv_transfer_params"]))
        assert isinstance(got, Scope)
        return got

    config = CacheConfig(
        tiers=(TierConfig(kind="memory", capacity_bytes=1 << 20, write="through"),),
        writer="inline",
        publish=PublishConfig(min_tenants=2, min_tokens=N),
    )
    w = ConnectorWorker(config, paged(cpu_caches(12)), "m@1")
    system = tuple(range(500, 500 + 2 * N))
    w.save(SaveSpec("a", vouched("acme"), system, ((1, 2),)))
    assert w.lookup(list(system), vouched("initech")).tokens == 0  # one tenant alone publishes nothing
    w.save(SaveSpec("b", vouched("globex"), system, ((3, 4),)))
    w.save(SaveSpec("c", vouched("globex"), system, ((3, 4),)))  # the next request after the count is met
    assert w.lookup(list(system), vouched("initech")).tokens == 2 * N
    w.close(5)
