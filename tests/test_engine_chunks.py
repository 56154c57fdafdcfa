"""Chunked prefill on the real model: the same KV, logits and greedy answers as one
forward over the whole suffix, from no cached prefix or a cached one, with several
requests' prefills interleaved on one worker and sharing its load buffer."""

from __future__ import annotations

import threading
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from engine_support import engine, model, tiered_cache
from prefixcache.engine import DoneEvent, Engine, LoadedModel, Request, SamplingParams
from prefixcache.engine.job import Job
from prefixcache.engine.kv import cut_cache, fill_cache, to_numpy
from prefixcache.engine.loop import StepLoop
from prefixcache.engine.runner import Chunk, Sequence, advance, full_logits
from support import Clock

pytestmark = pytest.mark.model  # the real model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
MANUAL = (
    "The Fernwood rake has forty steel tines, an ash handle and a lifetime warranty against breakage. "
    "Return it within thirty days with the receipt for a full refund; shipping takes three to five days. "
)


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return model()


def prompt(lm: LoadedModel, question: str, repeats: int = 12) -> list[int]:
    messages = [{"role": "system", "content": MANUAL * repeats}, {"role": "user", "content": question}]
    return engine(lm).tokenize_chat(messages)


@pytest.mark.parametrize("cached", [0, 100, 173])  # none, mid-prompt, a partial block
def test_chunked_prefill_gives_the_logits_of_one_forward(lm: LoadedModel, cached: int) -> None:
    tokens = prompt(lm, "Can I return a rake?")
    assert len(tokens) - cached > 6 * 48  # several chunks, the last one partial
    kv = to_numpy(cut_cache(_filled(lm, tokens), cached)) if cached else None
    whole = Sequence(lm).prefill(tokens, kv, keep=len(tokens) - cached)
    chunked = Sequence(lm, chunk_tokens=48)
    logits = chunked.prefill(tokens, kv, keep=len(tokens) - cached)
    torch.testing.assert_close(logits, whole, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(logits, full_logits(lm, tokens)[cached:], atol=1e-3, rtol=1e-4)
    assert chunked.length == len(tokens)
    kv_whole = cut_cache(_filled(lm, tokens), len(tokens))
    torch.testing.assert_close(cut_cache(chunked.cache, len(tokens)), kv_whole, atol=1e-3, rtol=1e-4)


def test_prefill_steps_are_chunks_and_the_last_gives_the_logits(lm: LoadedModel) -> None:
    tokens = prompt(lm, "Hi", repeats=2)
    seq = Sequence(lm, chunk_tokens=32)
    steps = seq.prefill_steps(tokens)
    sizes, lengths = [], []
    step = advance(steps)
    while isinstance(step, Chunk):
        assert step.seq is seq and seq.length == sum(sizes)  # a chunk starts where the last ended
        sizes.append(len(step.tokens))
        step = advance(steps, step.run())
        lengths.append(seq.length)
    assert sizes == [32] * (len(tokens) // 32) + [len(tokens) % 32] * bool(len(tokens) % 32)
    assert lengths[-1] == len(tokens)
    assert isinstance(step, torch.Tensor) and tuple(step.shape) == (1, lm.tokenizer.vocab_size)
    with pytest.raises(RuntimeError, match="no logits"):  # a driver that ran nothing
        steps = Sequence(lm, chunk_tokens=32).prefill_steps(tokens)
        advance(steps)
        advance(steps)


def test_a_filled_cache_holds_a_copy_so_the_load_buffer_may_be_reused(lm: LoadedModel) -> None:
    tokens = prompt(lm, "Hi", repeats=1)
    payload = to_numpy(cut_cache(_filled(lm, tokens), len(tokens)))
    buffer = payload.copy()
    cache = fill_cache(buffer, lm.model.config, torch.device("cpu"), torch.float32)
    buffer[...] = np.float32(7.0)  # the next job's load lands in the same buffer
    assert torch.equal(cut_cache(cache, len(tokens)), torch.from_numpy(payload))


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_engine_answers_as_the_unchunked_one_cached_or_not(lm: LoadedModel, tmp_path: Path, chunk: int) -> None:
    questions = ("Can I return a rake?", "How long does shipping take?")
    prompts = [prompt(lm, q, repeats=4) for q in questions]
    with closing(engine(lm, prefill_chunk_tokens=100_000)) as whole:
        plain = _answers(whole, prompts)
    cache = tiered_cache(lm, tmp_path / str(chunk), partial_blocks=True)
    eng = engine(lm, cache, prefill_chunk_tokens=chunk)
    try:
        cold = _answers(eng, prompts)  # the second hits on the first's system prompt
        warm = _answers(eng, prompts)  # both hit on their whole prompt
    finally:
        eng.close()
        cache.close()
    assert [d.tokens for d in cold] == [d.tokens for d in warm] == [d.tokens for d in plain]
    assert cold[0].usage.cached_tokens == 0 and cold[1].usage.cached_tokens >= 16
    assert all(d.usage.cached_tokens >= len(p) - 16 for d, p in zip(warm, prompts, strict=True))


def test_interleaved_prefills_sharing_the_load_buffer_answer_as_alone(
    lm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tenants' requests in flight at once, each loading its own cached prefix into
    the worker's one load buffer while the other's prefill is not done: each answer is
    the one it gets alone, without the cache. The worker's first step waits until both
    are staged, and the engine's clock counts its steps."""
    prompts = {t: prompt(lm, f"{t}: is the rake in stock?", repeats=6) for t in ("acme", "globex")}
    with closing(engine(lm)) as alone:
        plain = {t: _answers(alone, [p])[0].tokens for t, p in prompts.items()}
    cache = tiered_cache(lm, tmp_path, partial_blocks=True)
    clock = Clock(1000.0)
    eng = engine(lm, cache, prefill_chunk_tokens=16, max_active=2, clock=clock)
    try:
        for tenant, tokens in prompts.items():  # each tenant's prefix is cached, in its own namespace
            eng.generate(Request(tokens[: len(tokens) // 2], tenant, SamplingParams(1, 0.0))).result(120)
        assert eng.wait_idle(60)
        steps = both_staged_then_counted(monkeypatch, clock)
        handles = {t: eng.generate(Request(p, t, GREEDY)) for t, p in prompts.items()}
        done = {t: h.result(120) for t, h in handles.items()}
    finally:
        eng.close()
        cache.close()
    for tenant, event in done.items():
        assert event.usage.cached_tokens >= len(prompts[tenant]) // 2 - 16
        assert event.tokens == plain[tenant]
    # both were in flight together: the first to start was not done before the second began
    first, second = sorted(done.values(), key=lambda d: d.usage.queue_s)
    assert second.usage.queue_s < first.usage.queue_s + first.usage.prefill_s
    assert any({h.id for h in handles.values()} <= jobs for jobs in steps)  # in one step, even


def both_staged_then_counted(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> list[set[int]]:
    """From now on: the worker's next step waits until two lookups have ended, and each
    step moves ``clock`` by one and is recorded (the ids of its jobs)."""
    lookup, step = Job.lookup, StepLoop._step
    looked = threading.Semaphore(0)
    opened = threading.Event()
    steps: list[set[int]] = []

    def counted_lookup(job: Job) -> Any:
        try:
            return lookup(job)
        finally:
            looked.release()

    def gated_step(loop: StepLoop, chunks: list[tuple[Job, Chunk]]) -> bool:
        if not opened.is_set():
            assert looked.acquire(timeout=60) and looked.acquire(timeout=60)
            opened.set()
        jobs = {job.handle.id for job in [*loop._rows, *(job for job, _ in chunks)]}
        try:
            return step(loop, chunks)
        finally:
            steps.append(jobs)
            clock.now += 1

    monkeypatch.setattr(Job, "lookup", counted_lookup)
    monkeypatch.setattr(StepLoop, "_step", gated_step)
    return steps


def _filled(lm: LoadedModel, tokens: list[int]) -> DynamicCache:
    seq = Sequence(lm)
    seq.prefill(tokens)
    return seq.cache


def _answers(eng: Engine, prompts: list[list[int]], tenant: str = "acme") -> list[DoneEvent]:
    return [eng.generate(Request(p, tenant, GREEDY)).result(120) for p in prompts]
