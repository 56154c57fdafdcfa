"""Deadlines that stop the work and tenants that take turns, on the real model: a prompt
past its deadline or whose client left stops within about a chunk, and its slot goes
to the next request; tenants are served in turn; a light tenant's first token does not
wait for a heavy tenant's prefills; a tenant over its share gets 429 through the server.

Timings are compared with chunk and prefill times measured in the same test, with
generous bounds: the CPU may be shared, and its speed change from minute to minute."""

from __future__ import annotations

import concurrent.futures
import contextlib
import random
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_support import MODEL_ID, MODELS_DIR, LiveServer, engine, model, tiered_cache
from prefixcache.engine import (
    DoneEvent,
    ErrorEvent,
    Event,
    LoadedModel,
    Order,
    Request,
    RequestTimeout,
    SamplingParams,
    TokenEvent,
)
from prefixcache.engine.job import Job
from prefixcache.engine.loop import StepLoop
from prefixcache.engine.runner import Chunk
from prefixcache.server.main import build_service
from prefixcache.settings import AuthSettings, ModelSettings, ServerSettings, Settings
from prefixcache.settings.admission import AdmissionSettings, TenantAdmission
from support import wait_for

pytestmark = pytest.mark.model  # the real model

CHUNK = 64  # small, so that a test prompt is many chunks
LONG = 2000  # prompt tokens of a heavy request: seconds of prefill, many chunks
ONE = SamplingParams(max_tokens=1, temperature=0.0)
SHORT = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return model()


def heavy(seed: int, tokens: int = LONG) -> list[int]:
    """A prompt of ``tokens`` random tokens (no two seeds share a prefix)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(tokens)]


def light(lm: LoadedModel, question: str) -> list[int]:
    return engine(lm).tokenize_chat([{"role": "user", "content": question}])


@dataclass
class Probe:
    """A sink that notes when each event of one request came."""

    name: str = ""
    events: list[tuple[float, Event]] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)
    log: list[str] | None = None  # names of ended requests, in order

    def __call__(self, event: Event) -> None:
        self.events.append((time.monotonic(), event))
        if not isinstance(event, TokenEvent):
            if self.log is not None:
                self.log.append(self.name)
            self.ended.set()

    def wait(self) -> Event:
        assert self.ended.wait(120)
        return self.events[-1][1]

    @property
    def first_at(self) -> float:
        return self.events[0][0]

    @property
    def end_at(self) -> float:
        return self.events[-1][0]


@dataclass(frozen=True)
class Step:
    """One step the worker ran: whose, when."""

    job: int  # the request's handle id
    began: float
    ended: float


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    """Every step the worker runs, recorded: timing claims are made against the steps
    of the same run (a shared CPU makes one step take ten times another). A step is one
    of each request it decodes or runs a prompt chunk of; a chunk run alone (no batching,
    or a request past its deadline in the queue), one of its request."""
    recorded: list[Step] = []
    prefill, step = Job.prefill, StepLoop._step

    def timed_prefill(self: Job) -> None:
        began = time.monotonic()
        try:
            prefill(self)
        finally:
            recorded.append(Step(self.handle.id, began, time.monotonic()))

    def timed_step(self: StepLoop, chunks: list[tuple[Job, Chunk]]) -> bool:
        jobs = [job.handle.id for job in [*self._rows, *(job for job, _ in chunks)]]
        began = time.monotonic()
        try:
            return step(self, chunks)
        finally:
            ended = time.monotonic()
            recorded.extend(Step(job, began, ended) for job in jobs)

    monkeypatch.setattr(Job, "prefill", timed_prefill)
    monkeypatch.setattr(StepLoop, "_step", timed_step)
    return recorded


def step_end_at(steps: list[Step], job: int, moment: float) -> float:
    """When the step of ``job`` running at ``moment`` ended (``moment`` if none ran)."""
    return next((s.ended for s in steps if s.job == job and s.began <= moment < s.ended), moment)


EPS = 0.3  # seconds for what is not a model step (events, the end of a request), generous


def test_a_prompt_past_its_deadline_frees_the_engine_within_a_chunk(
    lm: LoadedModel, tmp_path: Path, steps: list[Step]
) -> None:
    cache = tiered_cache(lm, tmp_path, partial_blocks=True)
    eng = engine(lm, cache, prefill_chunk_tokens=CHUNK, max_active=1)  # one slot: the next waits for it
    prompt, deadline = heavy(1), 1.0
    late, following = Probe(), Probe()
    try:
        submitted = time.monotonic()
        one = eng.submit(Request(prompt, "acme", SHORT, timeout_s=deadline), late)
        two = eng.submit(Request(light(lm, "Hi"), "globex", SHORT), following)
        end, done = late.wait(), following.wait()
        assert eng.wait_idle(30)
        # what it prefilled before its deadline was stored: a retry starts from there
        again = eng.generate(Request(prompt, "acme", ONE)).result(300)
    finally:
        eng.close()
        cache.close()
    assert isinstance(end, ErrorEvent) and isinstance(end.error, RequestTimeout) and end.error.status == 504
    assert "while prefilling" in end.error.message
    assert isinstance(done, DoneEvent) and done.finish_reason in ("stop", "length")
    due = submitted + deadline
    # it stopped at the end of the chunk running at its deadline ...
    assert late.end_at < step_end_at(steps, one.id, due) + EPS, (late.end_at - due, steps)
    # ... and the next request started right after its last step (the end: a 504, its KV stored)
    last = max(s.ended for s in steps if s.job == one.id)
    assert late.end_at <= min(s.began for s in steps if s.job == two.id) < last + EPS
    assert CHUNK <= again.usage.cached_tokens < len(prompt)
    assert (eng.stats.timed_out, eng.stats.completed) == (1, 2)


def test_a_client_gone_during_prefill_stops_it(lm: LoadedModel, tmp_path: Path, steps: list[Step]) -> None:
    cache = tiered_cache(lm, tmp_path, partial_blocks=True)
    eng = engine(lm, cache, prefill_chunk_tokens=CHUNK)
    prompt, probe = heavy(2), Probe()
    try:
        handle = eng.submit(Request(prompt, "acme", SHORT), probe)
        time.sleep(1.0)
        left = time.monotonic()
        handle.cancel()
        end = probe.wait()
        assert eng.wait_idle(30)
        rest = eng.generate(Request(prompt, "acme", ONE)).result(300)  # the part never prefilled
    finally:
        eng.close()
        cache.close()
    assert isinstance(end, DoneEvent) and end.finish_reason == "cancelled" and end.tokens == ()
    assert probe.end_at < step_end_at(steps, handle.id, left) + EPS  # at the end of the chunk running then
    assert CHUNK <= rest.usage.cached_tokens < len(prompt)  # stopped part way, what it computed kept
    assert (eng.stats.cancelled, eng.stats.cancelled_queued, eng.stats.completed) == (1, 0, 1)


@pytest.mark.parametrize(
    ("order", "expected"),
    [(Order.FAIR, ["a1", "b1", "a2", "b2", "a3"]), (Order.FIFO, ["a1", "a2", "a3", "b1", "b2"])],
)
def test_waiting_tenants_are_served_in_turn(lm: LoadedModel, order: Order, expected: list[str]) -> None:
    eng = engine(lm, max_active=1, order=order)
    ended: list[str] = []
    probes = []
    try:
        blocker = eng.generate(Request(light(lm, "Tell me a story."), "z", SamplingParams(8, 0.0)))
        for name in ("a1", "a2", "a3", "b1", "b2"):  # all wait behind the blocker
            probe = Probe(name, log=ended)
            eng.submit(Request(light(lm, f"Say {name}."), f"tenant-{name[0]}", ONE), probe)
            probes.append(probe)
        blocker.result(120)
        for probe in probes:
            probe.wait()
    finally:
        eng.close()
    assert ended == expected


@dataclass(frozen=True)
class Timed:
    job: int
    submitted: float
    first_token: float

    @property
    def ttft(self) -> float:
        return self.first_token - self.submitted


def timed(eng: Any, prompt: list[int], tenant: str) -> Timed:
    """Submit and wait; when it was submitted and when its first token came."""
    probe = Probe()
    submitted = time.monotonic()
    handle = eng.submit(Request(prompt, tenant, SHORT), probe)
    assert isinstance(probe.wait(), DoneEvent)
    return Timed(handle.id, submitted, probe.first_at)


def others_began(steps: list[Step], request: Timed) -> int:
    """Steps of other requests that began between ``request``'s submission and its first step."""
    first = min(s.began for s in steps if s.job == request.job)
    return sum(1 for s in steps if s.job != request.job and request.submitted < s.began < first)


def test_a_light_tenant_does_not_wait_for_a_heavy_tenants_prefills(lm: LoadedModel, steps: list[Step]) -> None:
    eng = engine(lm, prefill_chunk_tokens=CHUNK, max_active=4)
    questions = ("Hi", "Name a tool.", "Is it sunny?", "Say yes.", "Count to 3.", "Hello there.", "Bye.")
    floods = [Probe(f"heavy{i}") for i in range(2)]
    try:
        started = time.monotonic()
        eng.submit(Request(heavy(10, 1500), "heavy", ONE), floods[0])
        own = timed(eng, light(lm, "Hi"), "heavy")  # its own short one, beside its long one
        eng.submit(Request(heavy(11, 1500), "heavy", ONE), floods[1])
        lights = []
        for question in questions:
            lights.append(timed(eng, light(lm, question), "light"))
            time.sleep(0.05)
        assert not any(p.ended.is_set() for p in floods), "the heavy prompts ended before the light ones"
        for probe in floods:
            assert isinstance(probe.wait(), DoneEvent)
    finally:
        eng.close()
    # each short request started within one step of another's (the one running when it came)
    assert all(others_began(steps, r) <= 1 for r in [own, *lights]), [others_began(steps, r) for r in lights]
    # the worker spent the time until the heavy prompts ended on them (the light ones are small)
    one_heavy = (max(p.end_at for p in floods) - started) / len(floods)
    ttfts = [r.ttft for r in lights]
    assert statistics.median(ttfts) < 0.25 * one_heavy, (ttfts, one_heavy)
    assert own.ttft < 0.5 * one_heavy, (own, one_heavy)  # round robin within a tenant too


def test_one_queue_in_arrival_order_makes_the_light_tenant_wait(lm: LoadedModel, steps: list[Step]) -> None:
    """The contrast that shows the test above can fail: one slot, one queue (the engine
    before), and the light tenant's first token waits for a whole heavy prefill."""
    eng = engine(lm, prefill_chunk_tokens=CHUNK, max_active=1, order=Order.FIFO)
    probe = Probe()
    try:
        eng.submit(Request(heavy(20), "heavy", ONE), probe)
        waited = timed(eng, light(lm, "Hi"), "light")
        done = probe.wait()
    finally:
        eng.close()
    assert isinstance(done, DoneEvent)
    assert others_began(steps, waited) > 10  # every chunk of the heavy prompt first
    assert waited.ttft > 0.8 * done.usage.prefill_s


KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}


@pytest.fixture(scope="module")
def limited() -> Iterator[LiveServer]:
    """A server built by ``build_service`` from settings: one request at a time per
    tenant, two for globex."""
    settings = Settings(
        auth=AuthSettings(api_keys=KEYS),
        model=ModelSettings(models_dir=str(MODELS_DIR), device="cpu"),
        server=ServerSettings(cache=False),
        admission=AdmissionSettings(
            max_concurrent=1, tenants={"globex": TenantAdmission(max_concurrent=2)}, prefill_chunk_tokens=CHUNK
        ),
    )
    service = build_service(settings)
    live = LiveServer(service.app, service.engine).start()
    yield live
    live.stop()
    service.close()


def test_the_settings_reach_the_engine(limited: LiveServer) -> None:
    assert limited.engine is not None
    config = limited.engine.scheduler.config
    assert config.admission.limits("acme").max_concurrent == 1
    assert config.admission.limits("globex").max_concurrent == 2
    assert config.admission.limits("globex").max_queued_tokens == 32768  # the default, not overridden
    assert (config.max_active, config.order) == (32, Order.FAIR)


def test_a_tenant_over_its_share_gets_429_with_retry_after(limited: LiveServer) -> None:
    assert limited.engine is not None
    scheduler = limited.engine.scheduler
    url = limited.url + "/v1/completions"
    acme = {"Authorization": "Bearer sk-acme-0123456789"}
    holding = {"model": MODEL_ID, "prompt": heavy(30, 6000), "max_tokens": 1, "temperature": 0}

    def hold() -> None:  # acme's one request: a long prefill, then its client gives up (a cancel)
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(url, json=holding, headers=acme, timeout=httpx.Timeout(60, read=15))

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        wait_for(lambda: "acme" in scheduler.load(), 30)
        refused = httpx.post(url, json=holding | {"prompt": "Hi"}, headers=acme, timeout=60)
        assert "acme" in scheduler.load(), "the holding request ended too soon for this test"
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "tenant_busy")
        assert "max_concurrent = 1" in error["message"]
        with pytest.raises(openai.RateLimitError):  # the official client sees the same
            client("sk-acme-0123456789", limited).chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
        # another tenant is served meanwhile, two at a time (its own limit)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: ask("sk-globex-0123456789", limited), range(2), timeout=120))
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
        assert "acme" in scheduler.load(), "the holding request ended too soon for this test"
    finally:
        holder.join(120)


def client(key: str, live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(key: str, live: LiveServer) -> Any:
    messages: Any = [{"role": "user", "content": "Name a garden tool."}]
    return client(key, live).chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, temperature=0)
