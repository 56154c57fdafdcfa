"""The connector's KV cache groups (issue 40): a hybrid's sliding-window blocks stored and
loaded as what vLLM's hybrid manager keeps, keyed apart by group, whole or nothing.

vLLM-free: the groups as ``kv_groups`` reads them from vLLM, the paged KV as vLLM's CPU
backend lays it out (``test_vllm_parts.py``); the real vLLM runs are in ``tests_vllm/``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.config import CacheConfig, TierConfig
from prefixcache.integrations.vllm.groups import NULL_BLOCK, Found, KVGroup, KVGroups, LayerKind, MissReason, digests
from prefixcache.integrations.vllm.paged import GroupedKV, PagedKV, StatePages
from prefixcache.integrations.vllm.scheduler import SchedulerState
from prefixcache.integrations.vllm.scope import Media, Scope
from prefixcache.integrations.vllm.worker import ConnectorWorker, LoadSpec, SaveSpec
from prefixcache.integrations.vllm.worker_hooks import WorkerHooks
from test_vllm_parts import output, request, scoper

H, D, N, BLOCKS = 2, 4, 4, 64
WINDOW = 8  # tokens: a prefix of j blocks needs the sliding group's blocks from (4j - 7) // 4 on
T = Scope("acme")


def kv_groups(stride: int = 0, window: int = WINDOW) -> KVGroups:
    return KVGroups(
        (
            KVGroup(0, LayerKind.SLIDING, ("layers.0.attn",), window),
            KVGroup(1, LayerKind.FULL, ("layers.1.attn",)),
            KVGroup(2, LayerKind.SLIDING, ("layers.2.attn",), window),
        ),
        N,
        stride,
    )


def caches(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{f"layers.{i}.attn": torch.randn(BLOCKS, H, N, 2 * D, generator=g)} for i in range(3)]


def grouped(tensors: list[dict[str, torch.Tensor]]) -> GroupedKV:
    return GroupedKV([PagedKV(t, kv_heads=H, head_dim=D, block_size=N) for t in tensors])


def worker(tmp_path: Path, tensors: list[dict[str, torch.Tensor]], groups: KVGroups) -> ConnectorWorker:
    config = CacheConfig(
        tiers=(
            TierConfig(kind="memory", capacity_bytes=1 << 20, write="through"),
            TierConfig(kind="disk", capacity_bytes=1 << 22, path=str(tmp_path / "disk")),
        ),
        writer="inline",
    )
    return ConnectorWorker(config, grouped(tensors), "m@1", groups)


def vllm_ids(group: KVGroup, first: int, end: int, ids: list[int]) -> tuple[int, ...]:
    """The block ids vLLM allocates a group for a load of blocks ``first .. end``: a
    sliding group's skipped ones are its null block."""
    needed = group.needed(end, N)
    return tuple(b if i in needed else NULL_BLOCK for i, b in zip(range(first, end), ids, strict=True))


def save_all(w: ConnectorWorker, tokens: tuple[int, ...], ids: list[int], scope: Scope = T) -> None:
    """One step computed the whole prompt (the ids are the same in every group)."""
    w.save(SaveSpec("r", scope, tokens, tuple(tuple(ids) for _ in range(3)), since_block=0, computed=0))


def test_a_hybrid_prefix_loads_each_group_as_what_it_is(tmp_path: Path) -> None:
    source, target = caches(1), caches(2)
    groups = kv_groups()
    w = worker(tmp_path, source, groups)
    tokens = tuple(range(100, 100 + 6 * N))
    ids = list(range(1, 7))
    save_all(w, tokens, ids)
    assert w.lookup(tokens, T) == Found(6 * N)
    w2 = worker(tmp_path / "other", target, groups)
    w2.cache = w.cache  # one cache, the blocks of another request
    w2.partial.cache = w.cache
    into = list(range(20, 26))
    spec = LoadSpec("q", T, tokens, 0, tuple(vllm_ids(g, 0, 6, into) for g in groups.groups))
    loaded = w2.fetch(spec)
    assert loaded.blocks == 6 and w2.commit(loaded) == []
    for g in groups.groups:
        name = g.layers[0]
        for i, block in enumerate(into):
            if spec.block_ids[g.index][i] == NULL_BLOCK:
                continue
            assert torch.equal(target[g.index][name][block], source[g.index][name][ids[i]]), (g.kind, i)
    # the sliding groups filled only their window: blocks 4 and 5 of a prefix of 6
    assert [i for i, b in enumerate(spec.block_ids[0]) if b != NULL_BLOCK] == [4, 5]


def test_sliding_groups_store_only_the_window_of_each_boundary(tmp_path: Path) -> None:
    w = worker(tmp_path, caches(3), kv_groups())
    tokens = tuple(range(40 * N))
    save_all(w, tokens, list(range(1, 41)))
    held = [
        i for i in range(40) if w.partial._held(w.context(T), w.groups.groups[0], tokens, i, w._digests(tokens, T)[i])
    ]
    assert held == [38, 39]  # of 40 blocks, the window of the one boundary (its end)
    assert len(w.cache) == 40 + 2 * 2  # the full chain, and two blocks a sliding group


def test_a_boundary_never_reads_a_block_vllm_may_have_freed(tmp_path: Path) -> None:
    """A sliding group's blocks before the window of the tokens computed before this step
    may belong to another request now: a save whose boundary needs one keeps no boundary."""
    w = worker(tmp_path, caches(4), kv_groups())
    tokens = tuple(range(6 * N))
    ids = tuple(range(1, 7))
    # computed 23 tokens before the step: vLLM freed the blocks before (23 - 8 + 1) // 4 = 4
    w.save(SaveSpec("r", T, tokens[: 5 * N], (ids[:5],) * 3, since_block=4, computed=23))
    assert w.lookup(tokens[: 5 * N], T) == Found(0, MissReason.WINDOW)  # the window of 5 starts at block 3
    w.save(SaveSpec("r", T, tokens, (ids,) * 3, since_block=5, computed=23))
    assert w.lookup(tokens, T) == Found(6 * N)  # the window of 6 (blocks 4, 5) was alive


def test_a_prompt_resumes_at_the_last_boundary_its_chain_reaches(tmp_path: Path) -> None:
    tokens = tuple(range(12 * N))
    other = tokens[: 9 * N + 1] + (7,) * (3 * N - 1)  # shares 9 blocks, then differs
    for stride, expected in ((0, Found(0, MissReason.WINDOW)), (4, Found(8 * N, MissReason.WINDOW))):
        w = worker(tmp_path / str(stride), caches(5), kv_groups(stride))
        save_all(w, tokens, list(range(1, 13)))
        assert w.lookup(other, T) == expected
        assert w.lookup(tokens, T) == Found(12 * N)


def test_a_group_block_never_loads_into_another_group_or_for_another_tenant(tmp_path: Path) -> None:
    a = kv_groups()
    b = KVGroups(
        (a.groups[0], a.groups[1], KVGroup(2, LayerKind.SLIDING, ("layers.2.attn",), 2 * WINDOW)), N
    )  # another window: another group
    assert len({g.signature for g in a.groups + b.groups}) == 4
    w = worker(tmp_path, caches(6), a)
    tokens = tuple(range(6 * N))
    save_all(w, tokens, list(range(1, 7)))
    w_b = worker(tmp_path / "b", caches(6), b)
    w_b.cache = w.cache
    w_b.partial.cache = w.cache
    assert w_b.lookup(tokens, T) == Found(0, MissReason.WINDOW)
    assert w.lookup(tokens, Scope("globex")) == Found(0)
    media = Scope("acme", media=(Media(5, 2, "img"),))
    assert w.lookup(tokens, media).tokens == 0  # the chain parts at the image's block
    assert digests(tokens, N, [(5, "img:2")])[1] != digests(tokens, N)[1]  # from the block it starts in
    assert digests(tokens, N, [(5, "img:2")])[0] == digests(tokens, N)[0]


def test_a_hybrid_load_missing_one_block_fails_the_whole_request(tmp_path: Path) -> None:
    """vLLM takes block-level load errors from one group only: a hybrid's failed load is a
    failed receive, which vLLM recomputes from the start."""
    groups = kv_groups()
    w = worker(tmp_path, caches(7), groups)
    tokens = tuple(range(6 * N))
    save_all(w, tokens, list(range(1, 7)))
    ctx = groups.context(w.context(T), groups.groups[2], w._digests(tokens, T)[5])
    assert w.cache.purge_prefix(tokens[5 * N : 6 * N], ctx) == N  # the last block of one sliding group
    hooks = WorkerHooks(w, async_load=True)
    into = list(range(30, 36))
    hooks.start_loads([LoadSpec("q", T, tokens, 0, tuple(vllm_ids(g, 0, 6, into) for g in groups.groups))])
    hooks.close(5)  # waits for the load
    done, failed = hooks.transfers()
    assert done == failed == {"q"} and hooks.load_errors() == set()
    with pytest.raises(ValueError, match="asynchronously only"):
        WorkerHooks(w, async_load=False)


def test_the_scheduler_sends_every_groups_blocks_and_counts_why_a_request_hits_less() -> None:
    state = SchedulerState(N, lambda tokens, scope: Found(8, MissReason.WINDOW), scoper(), async_load=True)
    r = request("r", list(range(13)), "acme")
    state.seen(r)
    assert state.matched(r, 0) == 8 and state.matched(r, 0) == 8  # asked twice, counted once
    state.allocated(r, 8, ([0, 6, 7, 8], [5, 6, 7, 8]))
    plan = state.step(output())
    assert plan.loads == [LoadSpec("r", Scope("acme"), tuple(range(8)), 0, ((0, 6), (5, 6)))]
    short = request("s", list(range(N)), "acme")
    state.seen(short)
    assert state.matched(short, 0) == 0
    tally = state.take_tally()
    assert tally is not None and tally.misses == {"window_not_kept": 1, "shorter_than_a_block": 1}
    new = SimpleNamespace(
        req_id="r", prompt_token_ids=list(range(13)), block_ids=([0, 6, 7, 8], [5, 6, 7, 8]), num_computed_tokens=8
    )
    assert state.step(output([new], scheduled={"r": 5})).saves == [
        SaveSpec("r", Scope("acme"), tuple(range(12)), ((0, 6, 7), (5, 6, 7)), since_block=0, computed=8, reached=13)
    ]


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=4),
    ask=st.integers(1, 14),
    stride=st.sampled_from([0, 2, 3]),
)
def test_what_a_lookup_promises_the_load_delivers(
    tmp_path_factory: pytest.TempPathFactory, lengths: list[int], ask: int, stride: int
) -> None:
    """Whatever was saved (prompts of several lengths sharing a prefix), the boundary the
    lookup answers loads whole, and is a boundary: the full chain and each group's window."""
    groups = kv_groups(stride)
    source = caches(8)
    w = worker(tmp_path_factory.mktemp("w"), source, groups)
    base = tuple(range(14 * N))
    for k, blocks in enumerate(lengths):
        prompt = base[: blocks * N]
        w.save(SaveSpec(str(k), T, prompt, (tuple(range(1, blocks + 1)),) * 3, since_block=0, computed=0))
    found = w.lookup(base[: ask * N], T)
    j, chain = found.tokens // N, min(ask, max(lengths))
    assert j in (0, chain) or (stride and j % stride == 0 and j < chain)
    if j:
        into = list(range(40, 40 + j))
        loaded = w.fetch(LoadSpec("q", T, base[: j * N], 0, tuple(vllm_ids(g, 0, j, into) for g in groups.groups)))
        assert loaded.blocks == j
    assert (found.reason is None) == (j == chain)


def state_tensors(seed: int, real: int = 100) -> dict[str, torch.Tensor]:
    """Two Mamba layers as vLLM's CPU backend registers them: int8 ``[blocks, 1, 1, real]``
    views whose blocks are an attention page apart (the state padded to the page)."""
    page = 2 * H * N * D * 4  # float32 attention page of one layer
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 127, (2, BLOCKS * page), dtype=torch.int8, generator=g)
    return {f"layers.{i}.mixer": raw[i].as_strided((BLOCKS, 1, 1, real), (page, real, real, 1)) for i in range(2)}


def state_worker(tmp_path: Path, seed: int) -> tuple[ConnectorWorker, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    groups = KVGroups(
        (KVGroup(0, LayerKind.STATE, ("layers.0.mixer", "layers.1.mixer")), KVGroup(1, LayerKind.FULL, ("a0", "a1"))), N
    )
    g = torch.Generator().manual_seed(seed)
    attn = {f"a{i}": torch.randn(BLOCKS, H, N, 2 * D, generator=g) for i in range(2)}
    full = PagedKV(attn, kv_heads=H, head_dim=D, block_size=N)
    states = state_tensors(seed)
    paged = GroupedKV([StatePages(states, full.kv_layout, N), full])
    config = CacheConfig(tiers=(TierConfig(kind="memory", capacity_bytes=1 << 20, write="through"),), writer="inline")
    return ConnectorWorker(config, paged, "m@1", groups), states, attn


def test_a_recurrent_state_is_kept_where_a_step_ended_and_loads_byte_exact(tmp_path: Path) -> None:
    w, states, _ = state_worker(tmp_path, 9)
    tokens = tuple(range(5 * N))
    ids = (tuple(range(1, 6)), tuple(range(1, 6)))
    # a step from 0 to 4.5 blocks: no state at a boundary (the running state is mid-block)
    w.save(SaveSpec("r", T, tokens[: 4 * N], ids, computed=0, reached=4 * N + 2))
    assert w.lookup(tokens[: 4 * N], T) == Found(0, MissReason.STATE)
    # a step that ended at block 5: the state after block 4 is in block 5's page
    w.save(SaveSpec("r", T, tokens, ids, since_block=4, computed=4 * N, reached=5 * N))
    assert w.lookup(tokens, T) == Found(5 * N)
    before = {k: v.clone() for k, v in states.items()}
    loaded = w.fetch(LoadSpec("q", T, tokens, 0, ((0, 0, 0, 0, 9), (20, 21, 22, 23, 24))))
    assert loaded.blocks == 5
    for name, view in states.items():
        assert torch.equal(view[9], before[name][5])  # the page's state bytes, in the block vLLM gave
        assert torch.equal(torch.cat([view[:9], view[10:]]), torch.cat([before[name][:9], before[name][10:]]))


def test_a_state_page_of_another_size_is_refused_at_start() -> None:
    full = PagedKV({"a": torch.zeros(BLOCKS, H, N, 2 * D)}, kv_heads=H, head_dim=D, block_size=N)
    odd = torch.zeros(BLOCKS * 100, dtype=torch.int8).as_strided((BLOCKS, 1, 1, 60), (100, 60, 60, 1))
    with pytest.raises(ValueError, match="100 bytes apart, an attention block's page 256"):
        StatePages({"m": odd}, full.kv_layout, N)
