"""On the real model: a request served beside others (its decoding batched with theirs,
its prefill chunks between their steps) answers exactly as when served alone, over
mixed lengths, cached and uncached prefixes, stop sequences, sampling with a seed and
streaming; the prefix cache's work runs on the I/O thread, never on the step loop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine_support import engine, model, tiered_cache
from prefixcache.cache import PrefixCache
from prefixcache.engine import DoneEvent, Engine, Event, LoadedModel, Request, SamplingParams, TokenEvent
from prefixcache.engine.batch import Batch
from prefixcache.engine.runner import Chunk

pytestmark = pytest.mark.model

SYSTEM = (
    "You are the support assistant of a garden tool shop. Answer in one or two short sentences, "
    "name the tool, and never invent a price. The shop sells spades, rakes, hoes, shears, "
    "wheelbarrows, watering cans and hoses; it repairs lawn mowers on Tuesdays."
)


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return model()


@dataclass
class Answer:
    """A request's events, gathered by its sink."""

    streamed: list[str] = field(default_factory=list)
    done: DoneEvent | None = None
    ended: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.streamed.append(event.text)
            return
        assert isinstance(event, DoneEvent), event
        self.done = event
        self.ended.set()


def requests(lm: LoadedModel) -> list[Request]:
    eng = engine(lm)
    chat = eng.tokenize_chat
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    long_text = " ".join(f"Item {i}: a {['spade', 'rake', 'hoe'][i % 3]} of size {i * 7 % 13}." for i in range(90))
    system = {"role": "system", "content": SYSTEM}
    return [
        Request(chat([system, {"role": "user", "content": "Which tool digs a hole?"}]), "acme", greedy),
        Request(chat([system, {"role": "user", "content": "When are mowers repaired?"}]), "acme", greedy),
        Request(chat([{"role": "user", "content": "Hi"}]), "globex", SamplingParams(max_tokens=5, temperature=0.0)),
        Request(chat([{"role": "user", "content": long_text + " Which item is first?"}]), "globex", greedy),
        Request(
            chat([{"role": "user", "content": "List three colours, separated by commas."}]),
            "initech",
            SamplingParams(max_tokens=40, temperature=0.0, stop=[","]),
        ),
        Request(
            chat([{"role": "user", "content": "Tell me about rakes."}]),
            "initech",
            SamplingParams(max_tokens=30, temperature=0.8, seed=11),
        ),
        Request(chat([system, {"role": "user", "content": "Do you sell hoses?"}]), "umbrella", greedy),
    ]


def serve(eng: Engine, batch: list[Request], together: bool) -> list[Answer]:
    answers = [Answer() for _ in batch]
    for request, answer in zip(batch, answers, strict=True):
        eng.submit(request, answer)
        if not together:
            assert answer.ended.wait(300)
    for answer in answers:
        assert answer.ended.wait(300)
    return answers


def warmed(lm: LoadedModel, tmp: Path, **kwargs: Any) -> tuple[Engine, PrefixCache]:
    """An engine whose cache holds the shop's system prompt for acme and umbrella."""
    cache = tiered_cache(lm, tmp)
    eng = engine(lm, cache, prefill_chunk_tokens=128, **kwargs)
    for tenant in ("acme", "umbrella"):
        prompt = eng.tokenize_chat([{"role": "system", "content": SYSTEM}], generation_prompt=False)
        eng.generate(Request(prompt, tenant, SamplingParams(max_tokens=1, temperature=0.0))).result(300)
    assert eng.wait_idle(60)
    return eng, cache


def test_answers_beside_others_are_the_answers_alone(lm: LoadedModel, tmp_path: Path) -> None:
    batch = requests(lm)
    runs = {}
    for name, together in (("alone", False), ("together", True)):
        eng, cache = warmed(lm, tmp_path / name, max_active=8 if together else 1)
        try:
            runs[name] = serve(eng, batch, together)
        finally:
            eng.close()
            cache.close()
    for index, (alone, beside) in enumerate(zip(runs["alone"], runs["together"], strict=True)):
        assert alone.done is not None and beside.done is not None
        assert beside.done.tokens == alone.done.tokens, index
        assert (beside.done.text, beside.done.finish_reason) == (alone.done.text, alone.done.finish_reason), index
        assert "".join(beside.streamed) == beside.done.text  # streaming adds up to the answer
        assert beside.done.usage.completion_tokens == len(beside.done.tokens)
    shared = [0, 1, 6]  # the system prompt's KV came from the cache, alone and beside others
    assert all(run[i].done.usage.cached_tokens > 0 for run in runs.values() for i in shared)  # type: ignore[union-attr]
    assert runs["together"][4].done.finish_reason == "stop" and "," not in runs["together"][4].done.text  # type: ignore[union-attr]


@pytest.fixture
def rows(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The rows and the prompt chunks of every batch step, in order."""
    seen: list[tuple[int, int]] = []
    step = Batch.step

    def counted(self: Batch, tokens: dict[int, int], chunks: Sequence[Chunk] = ()) -> Any:
        seen.append((len(tokens), len(chunks)))
        return step(self, tokens, chunks)

    monkeypatch.setattr(Batch, "step", counted)
    return seen


def test_the_cache_works_on_the_io_thread_and_decoding_is_batched(
    lm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: list[tuple[int, int]]
) -> None:
    threads: set[str] = set()
    eng, cache = warmed(lm, tmp_path, max_active=8)
    for name in ("match", "load", "insert"):
        monkeypatch.setattr(cache, name, noting(getattr(cache, name), threads))
    try:
        rows.clear()
        answers = serve(eng, requests(lm), together=True)
        assert eng.wait_idle(60)
    finally:
        eng.close()
        cache.close()
    assert all(a.done is not None and a.done.finish_reason in ("stop", "length") for a in answers)
    # match, load and insert on the I/O workers, never on the step loop
    assert threads and all(name.startswith("prefixcache-cache-io-") for name in threads), threads
    assert max(n for n, _ in rows) >= 3  # several requests decoded in one forward
    assert any(n and chunks for n, chunks in rows)  # prompts' chunks rode along decoding rows


def noting(method: Callable[..., Any], threads: set[str]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.current_thread().name)
        return method(*args, **kwargs)

    return wrapped


def test_without_batching_each_request_decodes_alone(lm: LoadedModel, rows: list[tuple[int, int]]) -> None:
    eng = engine(lm, max_active=8, batch_decode=False)
    try:
        answers = serve(eng, requests(lm)[:4], together=True)
    finally:
        eng.close()
    assert all(a.done is not None for a in answers)
    assert rows and max(n for n, _ in rows) == 1
    assert not any(chunks for _, chunks in rows)  # each chunk ran alone


def test_chats_that_open_alike_at_once_prefill_their_prefix_once(lm: LoadedModel, tmp_path: Path) -> None:
    """Four chats of one tenant with one long system prompt, sent together to a cold
    cache: one prefills the prompt, the others wait for its KV (stored when its prefill
    ends) and hit on it; the answers are those alone."""
    system = {"role": "system", "content": SYSTEM * 4}
    questions = ("Which tool digs?", "Do you repair mowers?", "Sell hoses?", "What is a hoe?")
    results = {}
    for name, together in (("alone", False), ("together", True)):
        cache = tiered_cache(lm, tmp_path / name)
        eng = engine(lm, cache, max_active=8)
        chats = [
            Request(eng.tokenize_chat([system, {"role": "user", "content": q}]), "acme", SamplingParams(12, 0.0))
            for q in questions
        ]
        try:
            results[name] = serve(eng, chats, together)
        finally:
            eng.close()
            cache.close()
    shared = common_start(eng, system)
    for alone, beside in zip(results["alone"], results["together"], strict=True):
        assert alone.done is not None and beside.done is not None
        assert beside.done.tokens == alone.done.tokens
    cached = sorted(a.done.usage.cached_tokens for a in results["together"])  # type: ignore[union-attr]
    assert cached[0] == 0 and all(c >= shared - 16 for c in cached[1:]), (cached, shared)


def common_start(eng: Engine, system: dict[str, str]) -> int:
    one = eng.tokenize_chat([system, {"role": "user", "content": "a"}])
    two = eng.tokenize_chat([system, {"role": "user", "content": "b"}])
    return next(i for i, (x, y) in enumerate(zip(one, two, strict=False)) if x != y)
