"""A request that waits for another's prompt in flight (``inflight.py``) on the real
model: when its deadline passes or its client leaves, the step loop ends it at once (its
504, or its cancel) and its slot goes to the next request, while the prompt it waited
for is still prefilling; it no longer waits for that prefill's end.

Deterministic: the engine's clock is the test's, and the lead's prefill steps run one
at a time as the test lets them (every wait is on an event or a count)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_support import engine, model, tiered_cache
from prefixcache.engine import DoneEvent, ErrorEvent, Event, Request, RequestTimeout, SamplingParams, TokenEvent
from prefixcache.engine.job import Job, Phase
from prefixcache.engine.loop import StepLoop
from prefixcache.engine.runner import Chunk
from support import Clock, wait_for

pytestmark = pytest.mark.model  # the real model

CHUNK = 64
GUARD_S = 120.0  # a bound on a wait for what must happen, so that a bug fails rather than hangs
ONE = SamplingParams(max_tokens=1, temperature=0.0)


class Gate:
    """Holds every step that carries a chunk of ``prompt``'s job until the test lets one run."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.held = threading.Semaphore(0)  # a step is held now (one count each time)
        self.permits = threading.Semaphore(0)
        self.open = False
        self.lead: Job | None = None

    def before(self, chunks: list[tuple[Job, Chunk]]) -> None:
        for job, _ in chunks:
            if job.prompt == self.prompt:
                self.lead = job
                if not self.open:
                    self.held.release()
                    assert self.permits.acquire(timeout=GUARD_S), "the test never let the step run"

    def step(self) -> None:
        """Let one held step run, and wait until the next one is held."""
        self.permits.release()
        assert self.held.acquire(timeout=GUARD_S)

    def release(self) -> None:
        self.open = True
        self.permits.release()


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ended = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if not isinstance(event, TokenEvent):
            self.ended.set()

    def end(self) -> Event:
        assert self.ended.wait(GUARD_S)
        return self.events[-1]


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    rng = random.Random(7)
    gate = Gate([rng.randrange(1000, 40000) for _ in range(4 * CHUNK)])  # four chunks of prefill
    step = StepLoop._step

    def gated_step(self: StepLoop, chunks: list[tuple[Job, Chunk]]) -> bool:
        gate.before(chunks)
        return step(self, chunks)

    monkeypatch.setattr(StepLoop, "_step", gated_step)
    yield gate
    gate.release()


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_a_follower_past_its_deadline_or_left_ends_at_once_while_its_lead_prefills(
    how: str, gated: Gate, tmp_path: Path
) -> None:
    lm, clock = model(), Clock()
    cache = tiered_cache(lm, tmp_path)
    eng = engine(lm, cache, clock=clock, prefill_chunk_tokens=CHUNK, max_active=3)
    lead, follower, next_one = Sink(), Sink(), Sink()
    try:
        eng.submit(Request(gated.prompt, "acme", ONE, timeout_s=1000.0), lead)
        assert gated.held.acquire(timeout=GUARD_S)  # its first chunk's step is held
        prompt = [*gated.prompt[: 3 * CHUNK], 11, 12, 13]  # shares three chunks with the lead
        handle = eng.submit(Request(prompt, "acme", ONE, timeout_s=1.0), follower)
        wait_for(lambda: eng._io.following == 1, GUARD_S)  # it waits for the lead's prompt
        eng.submit(Request([*gated.prompt[:8], 5, 6], "acme", ONE), next_one)  # no slot for a third of acme's
        assert eng.scheduler.load()["acme"].waiting == 1
        if how == "deadline":
            clock.now += 2.0
        else:
            handle.cancel()
        gated.step()  # one chunk of the lead runs; the step loop's next turn ends the follower
        end = follower.end()
        assert gated.lead is not None and gated.lead.phase is Phase.PREFILL  # the lead is still prefilling
        assert not lead.ended.is_set() and eng._io.following == 0
        if how == "deadline":
            assert isinstance(end, ErrorEvent) and isinstance(end.error, RequestTimeout)
            assert end.error.status == 504
        else:
            assert isinstance(end, DoneEvent) and end.finish_reason == "cancelled" and end.tokens == ()
        wait_for(lambda: eng.scheduler.load()["acme"].waiting == 0, GUARD_S)  # its slot went to the next
        gated.release()
        assert isinstance(lead.end(), DoneEvent) and isinstance(next_one.end(), DoneEvent)
        assert eng.wait_idle(GUARD_S)
    finally:
        gated.release()
        eng.close()
        cache.close()
    stats = eng.stats
    if how == "deadline":
        assert (stats.timed_out, stats.cancelled, stats.completed) == (1, 0, 2)
    else:
        assert (stats.timed_out, stats.cancelled, stats.cancelled_queued, stats.completed) == (0, 1, 1, 2)
