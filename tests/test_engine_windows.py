"""Sliding-window models served exactly, and one job's bad chunk failing that job alone.

Mistral (every layer windowed), Gemma 3 and Qwen2 (windowed and full layers mixed), with
a window of 8 and prompts several windows long: packed prompt chunks, decoding rows and
the KV a row leaves with are those of transformers' own forward of each sequence alone,
and two tenants' requests served together get the greedy answers of the model alone. A
chunk that would raise inside the step's forward (checked before it) fails its own job,
not another tenant's answer decoding in the same step. Tiny random models (``tiny_support``)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from prefixcache.engine import DoneEvent, Engine, ErrorEvent, Event, LoadedModel, Request, SamplingParams, TokenEvent
from prefixcache.engine.arch import serving
from prefixcache.engine.batch import Batch
from prefixcache.engine.job import Job
from prefixcache.engine.kv import cut_cache
from prefixcache.engine.model import kv_layout
from prefixcache.engine.modes import EXACT, ExactTurn, Turn
from prefixcache.engine.runner import Chunk, Prefill, Sequence, full_logits
from prefixcache.hashing import CacheContext
from support import wait_for
from tiny_support import SMALL, load, save, tokenizer, tokens

WINDOW = 8
CONFIGS: dict[str, Any] = {
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=WINDOW),
    "gemma3": lambda: Gemma3TextConfig(
        **SMALL, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
    "qwen2": lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def in_memory(config: Any) -> LoadedModel:
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    model.train(False)
    return LoadedModel(model, tokenizer(), kv_layout(config, "float32"), 64, torch.device("cpu"), "tiny", "tiny")


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(torch.allclose(got, expected, atol=2e-5, rtol=1e-4))


@torch.inference_mode()
def own_kv(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The KV of ``ids`` from transformers' own forward, every position of every layer."""
    cache = DynamicCache()
    loaded.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cut_cache(cache, len(ids))


def pieces(seqs: list[Sequence], prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
    """The next chunk of 7 tokens of each prompt not fully prefilled, by prompt index."""
    out = [(i, prompt[seq.length : seq.length + 7]) for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True))]
    return [(i, piece) for i, piece in out if piece]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompts_longer_than_the_window_answer_as_the_model_alone(name: str) -> None:
    loaded = in_memory(CONFIGS[name]())
    assert WINDOW in serving(loaded.model.config).windows
    prompts = [tokens(30, seed=1), tokens(19, seed=2), tokens(5, seed=3)]
    batch = Batch(loaded)
    seqs = [Sequence(loaded) for _ in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    while riding := pieces(seqs, prompts):
        _, kept = batch.step({}, [Chunk(seqs[i], piece, len(piece)) for i, piece in riding])
        for (i, piece), out in zip(riding, kept, strict=True):
            got[i].append(out)
            seqs[i].length += len(piece)
    for i, prompt in enumerate(prompts):
        assert close(torch.cat(got[i]), full_logits(loaded, prompt)), i

    # every prompt decodes as a row, past the window, while a late prompt's chunks ride along
    rows = {batch.join(seq.cache, seq.length): i for i, seq in enumerate(seqs)}
    texts = [list(prompt) for prompt in prompts]
    late, late_seq, late_got = tokens(20, seed=4), Sequence(loaded), []
    last = {row: torch.cat(got[i])[-1] for row, i in rows.items()}
    for _ in range(12):
        fed = {row: int(last[row].argmax()) for row in rows}
        piece = late[late_seq.length : late_seq.length + 5]
        chunks = [Chunk(late_seq, piece, len(piece))] if piece else []
        last, kept = batch.step(fed, chunks)
        for row, i in rows.items():
            texts[i].append(fed[row])
            assert close(last[row], full_logits(loaded, texts[i])[-1]), (i, len(texts[i]))
        if piece:
            late_got.append(kept[0])
            late_seq.length += len(piece)
    assert close(torch.cat(late_got), full_logits(loaded, late))
    for row, i in rows.items():
        kv = batch.leave(row)
        read = torch.from_numpy(np.asarray(kv.read(0, kv.length)))
        assert torch.allclose(read, own_kv(loaded, texts[i][: kv.length]), atol=1e-5), i


@pytest.mark.parametrize("past", [0, 5, 12])
def test_a_windowed_chunk_packed_alone_is_its_forward_alone_bit_for_bit(past: int) -> None:
    loaded = in_memory(CONFIGS["mistral"]())
    prompt = tokens(past + 11, seed=5)
    packed, alone = Sequence(loaded), Sequence(loaded)
    if past:
        packed.prefill(prompt[:past])
        alone.prefill(prompt[:past])
    _, kept = Batch(loaded).step({}, [Chunk(packed, prompt[past:], 4)])
    assert torch.equal(kept[0], Chunk(alone, prompt[past:], 4).run())
    assert torch.equal(cut_cache(packed.cache, len(prompt)), cut_cache(alone.cache, len(prompt)))


def greedy_alone(loaded: LoadedModel, prompt: list[int], count: int) -> list[int]:
    out = list(prompt)
    for _ in range(count):
        out.append(int(full_logits(loaded, out)[-1].argmax()))
    return out[len(prompt) :]


def test_two_tenants_past_the_window_get_the_answers_of_the_model_alone(tmp_path: Path) -> None:
    loaded = load(save(tmp_path / "mistral", CONFIGS["mistral"]()))
    prompts = {"acme": tokens(50, seed=6), "globex": tokens(5, seed=7)}
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine = Engine(loaded, "tiny", max_active=4, prefill_chunk_tokens=16)
    try:
        handles = {tenant: engine.generate(Request(prompt, tenant, params)) for tenant, prompt in prompts.items()}
        answers = {tenant: list(handle.result(timeout=120).tokens) for tenant, handle in handles.items()}
    finally:
        engine.close()
    assert answers == {tenant: greedy_alone(loaded, prompt, 8) for tenant, prompt in prompts.items()}


class _BrokenTurn(ExactTurn):
    """A turn whose chunk claims KV its sequence does not hold: its forward would raise."""

    def prefill(self, seq: Sequence, tokens: list[int], prefix_kv: Any) -> Prefill:
        seq.length = 3
        logits = yield Chunk(seq, tokens, 1)
        assert logits is not None
        return logits[-1]


class _Mode:
    def open(self, request: Request, ctx: CacheContext) -> Turn:
        return _BrokenTurn() if request.tenant == "bad" else EXACT.open(request, ctx)


def test_a_chunk_that_cannot_run_fails_its_job_not_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's answer decoding in the step a bad chunk would have joined goes on: the
    chunk is checked before the forward and fails its own job only."""
    loaded = in_memory(LlamaConfig(**SMALL))
    staged: list[Job] = []
    lookup = Job.lookup

    def noted(job: Job) -> Any:
        if job.tenant == "bad":
            staged.append(job)
        return lookup(job)

    monkeypatch.setattr(Job, "lookup", noted)
    bad_ended = threading.Event()
    bad_events: list[Event] = []
    good_events: list[Event] = []
    good_ended = threading.Event()
    engine = Engine(loaded, "tiny", mode=_Mode(), max_active=2)

    def good_sink(event: Event) -> None:
        good_events.append(event)
        if isinstance(event, TokenEvent) and len(good_events) == 1:
            # NOTE: the worker waits here, after the good answer's first token, until the bad
            # request is staged: the next step carries both, the good one still decoding
            engine.submit(Request(tokens(6, seed=9), "bad", SamplingParams(max_tokens=4)), bad_sink)
            wait_for(lambda: bool(staged) and staged[0].staged is not None, timeout=60)
        if not isinstance(event, TokenEvent):
            good_ended.set()

    def bad_sink(event: Event) -> None:
        bad_events.append(event)
        if not isinstance(event, TokenEvent):
            bad_ended.set()

    try:
        engine.submit(Request(tokens(6, seed=8), "good", SamplingParams(max_tokens=8, temperature=0.0)), good_sink)
        assert bad_ended.wait(60) and good_ended.wait(60)
    finally:
        engine.close()
    assert isinstance(bad_events[-1], ErrorEvent) and bad_events[-1].error.status == 500
    done = good_events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "length" and len(done.tokens) == 8
    assert engine.stats.failed == 1 and engine.stats.completed == 1
