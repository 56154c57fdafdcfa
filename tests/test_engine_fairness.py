"""Deadlines that stop the work and tenants that take turns, on the real model: a prompt
past its deadline or whose client left stops within about a chunk, and its slot goes
to the next request; tenants are served in turn; a light tenant's first token does not
wait for a heavy tenant's prefills; a tenant over its share gets 429 through the server.

No test here reads the wall clock for a verdict: deadlines run on an injected clock that
the test moves a step at a time, and who waits for whom is counted in the worker's steps
(a shared CPU makes one step take ten times another; the order of steps stays)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_support import MODEL_ID, MODELS_DIR, LiveServer, engine, model, tiered_cache
from prefixcache.engine import (
    Admission,
    DoneEvent,
    ErrorEvent,
    Event,
    Handle,
    LoadedModel,
    Order,
    Request,
    RequestTimeout,
    SamplingParams,
    TenantBusy,
    TenantLimits,
    TokenEvent,
)
from prefixcache.engine.job import Job
from prefixcache.engine.loop import StepLoop
from prefixcache.engine.runner import Chunk
from prefixcache.server.main import build_service
from prefixcache.settings import AuthSettings, ModelSettings, ServerSettings, Settings
from prefixcache.settings.admission import AdmissionSettings, TenantAdmission
from support import Clock, wait_for

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
    """A sink that notes at which worker step each event of one request came (with
    ``steps``; the sink runs in the worker, during the step)."""

    name: str = ""
    steps: Steps | None = None
    events: list[tuple[int, Event]] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)
    log: list[str] | None = None  # names of ended requests, in order

    def __call__(self, event: Event) -> None:
        self.events.append((self.steps.count if self.steps is not None else -1, event))
        if not isinstance(event, TokenEvent):
            if self.log is not None:
                self.log.append(self.name)
            self.ended.set()

    def wait(self) -> Event:
        assert self.ended.wait(300)
        return self.events[-1][1]

    @property
    def first_at(self) -> int:
        """The step its first event came in."""
        return self.events[0][0]


@dataclass(frozen=True)
class Step:
    """One step the worker ran: whose, and its place in the run (steps run one at a time)."""

    job: int  # the request's handle id
    index: int  # the step's number, from 0


class Steps(list[Step]):
    """The steps the worker ran, in order; ``after`` runs in the worker after each step
    with the ids of the jobs in it (a test's clock or cancel, at a chosen step)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0  # steps ended: the index of the step running or next
        self.begun = 0  # steps begun
        self.staged: dict[int, int] = {}  # job -> ``begun`` when its lookup ended: steps from it on began after
        self.after: list[Callable[[set[int]], None]] = []

    def ran(self, jobs: list[int]) -> None:
        self.extend(Step(job, self.count) for job in jobs)
        self.count += 1
        for hook in self.after:
            hook(set(jobs))

    def of(self, job: int) -> list[int]:
        """The indices of ``job``'s steps."""
        return [s.index for s in self if s.job == job]


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> Steps:
    """Every step the worker runs, recorded: claims about who waits are made in steps
    (a shared CPU makes one step take ten times another). A step is one of each request
    it decodes or runs a prompt chunk of; a chunk run alone (no batching, or a request
    past its deadline in the queue), one of its request."""
    recorded = Steps()
    prefill, step, lookup = Job.prefill, StepLoop._step, Job.lookup

    def counted_lookup(self: Job) -> Any:
        try:
            return lookup(self)
        finally:
            recorded.staged[self.handle.id] = recorded.begun

    def counted_prefill(self: Job) -> None:
        recorded.begun += 1
        try:
            prefill(self)
        finally:
            recorded.ran([self.handle.id])

    def counted_step(self: StepLoop, chunks: list[tuple[Job, Chunk]]) -> bool:
        jobs = [job.handle.id for job in [*self._rows, *(job for job, _ in chunks)]]
        recorded.begun += bool(jobs)
        try:
            return step(self, chunks)
        finally:
            if jobs:
                recorded.ran(jobs)

    monkeypatch.setattr(Job, "prefill", counted_prefill)
    monkeypatch.setattr(StepLoop, "_step", counted_step)
    monkeypatch.setattr(Job, "lookup", counted_lookup)
    return recorded


def test_a_prompt_past_its_deadline_frees_the_engine_within_a_chunk(
    lm: LoadedModel, tmp_path: Path, steps: Steps
) -> None:
    """The engine's clock moves 0.3 s a step of the late request: its 1 s deadline passes
    during its 4th chunk, and it ends there, before a 5th."""
    clock = Clock(1000.0)
    cache = tiered_cache(lm, tmp_path, partial_blocks=True)
    eng = engine(lm, cache, prefill_chunk_tokens=CHUNK, max_active=1, clock=clock)  # one slot: the next waits
    prompt, late, following = heavy(1, 8 * CHUNK), Probe(), Probe()
    steps.after.append(lambda jobs: setattr(clock, "now", clock.now + 0.3 * (not late.ended.is_set())))
    try:
        one = eng.submit(Request(prompt, "acme", SHORT, timeout_s=1.0), late)  # due at 1.0 on ``clock``
        two = eng.submit(Request(light(lm, "Hi"), "globex", SHORT), following)
        end, done = late.wait(), following.wait()
        assert eng.wait_idle(30)
        # what it prefilled before its deadline was stored: a retry starts from there
        again = eng.generate(Request(prompt, "acme", ONE)).result(300)
    finally:
        eng.close()
        cache.close()
    assert isinstance(end, ErrorEvent) and isinstance(end.error, RequestTimeout) and end.error.status == 504
    assert "while prefilling its prompt (256 of 512)" in end.error.message
    assert isinstance(done, DoneEvent) and done.finish_reason in ("stop", "length")
    # it stopped at the end of the chunk running at its deadline ...
    assert len(steps.of(one.id)) == 4, steps
    # ... and the next request ran the very next step (the end: a 504, its KV stored)
    assert min(steps.of(two.id)) == max(steps.of(one.id)) + 1, steps
    assert again.usage.cached_tokens == 4 * CHUNK
    assert (eng.stats.timed_out, eng.stats.completed) == (1, 2)


def test_a_client_gone_during_prefill_stops_it(lm: LoadedModel, tmp_path: Path, steps: Steps) -> None:
    """The client leaves while its request's 3rd chunk runs: it ends at that chunk's end."""
    cache = tiered_cache(lm, tmp_path, partial_blocks=True)
    eng = engine(lm, cache, prefill_chunk_tokens=CHUNK)
    prompt, probe = heavy(2, 8 * CHUNK), Probe()
    handles: list[Handle] = []
    submitted = threading.Event()

    def leave(jobs: set[int]) -> None:  # the worker, after each step: at the 3rd, the client leaves
        if steps.count == 3:
            assert submitted.wait(60)
            handles[0].cancel()

    steps.after.append(leave)
    try:
        handles.append(eng.submit(Request(prompt, "acme", SHORT), probe))
        submitted.set()
        handle = handles[0]
        end = probe.wait()
        assert eng.wait_idle(30)
        rest = eng.generate(Request(prompt, "acme", ONE)).result(300)  # the part never prefilled
    finally:
        eng.close()
        cache.close()
    assert isinstance(end, DoneEvent) and end.finish_reason == "cancelled" and end.tokens == ()
    assert len(steps.of(handle.id)) == 3  # at the end of the chunk running then
    assert rest.usage.cached_tokens == 3 * CHUNK  # stopped part way, what it computed kept
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
    """A request's place in the worker's steps: from when it was staged (the steps from
    ``staged`` on began after that) to the step its first token came in."""

    job: int
    staged: int
    first_token: int

    @property
    def waited(self) -> int:
        """Steps begun after its staging, to the end of the step of its first token."""
        return self.first_token - self.staged + 1


def timed(eng: Any, prompt: list[int], tenant: str, steps: Steps) -> Timed:
    """Submit and wait; where its staging and first token fell among the steps."""
    probe = Probe(steps=steps)
    handle = eng.submit(Request(prompt, tenant, SHORT), probe)
    assert isinstance(probe.wait(), DoneEvent)
    return Timed(handle.id, steps.staged[handle.id], probe.first_at)


def others_began(steps: Steps, request: Timed) -> int:
    """Steps of other requests that began between ``request``'s staging and its first step."""
    first = min(steps.of(request.job))
    return len({s.index for s in steps if s.job != request.job and request.staged <= s.index < first})


def test_a_light_tenant_does_not_wait_for_a_heavy_tenants_prefills(lm: LoadedModel, steps: Steps) -> None:
    eng = engine(lm, prefill_chunk_tokens=CHUNK, max_active=4)
    questions = ("Hi", "Name a tool.", "Is it sunny?", "Say yes.", "Count to 3.", "Hello there.", "Bye.")
    floods = [Probe(f"heavy{i}", steps) for i in range(2)]
    try:
        heavies = [eng.submit(Request(heavy(10, 1500), "heavy", ONE), floods[0])]
        own = timed(eng, light(lm, "Hi"), "heavy", steps)  # its own short one, beside its long one
        heavies.append(eng.submit(Request(heavy(11, 1500), "heavy", ONE), floods[1]))
        lights = [timed(eng, light(lm, question), "light", steps) for question in questions]
        assert not any(p.ended.is_set() for p in floods), "the heavy prompts ended before the light ones"
        for probe in floods:
            assert isinstance(probe.wait(), DoneEvent)
    finally:
        eng.close()
    # each short request started within one step of another's (the one running when it was
    # staged), and its one-chunk prompt gave its first token in its first step
    assert all(others_began(steps, r) <= 1 for r in [own, *lights]), [others_began(steps, r) for r in lights]
    assert all(r.first_token == min(steps.of(r.job)) for r in [own, *lights])
    # in steps, what a heavy prompt's prefill took dwarfs what a light one waited
    one_heavy = min(len(steps.of(h.id)) for h in heavies)
    assert one_heavy >= 1500 // CHUNK
    assert max(r.waited for r in lights) <= 2 < 0.25 * one_heavy, (lights, one_heavy)
    assert own.waited <= 2  # round robin within a tenant too


def test_one_queue_in_arrival_order_makes_the_light_tenant_wait(lm: LoadedModel, steps: Steps) -> None:
    """The contrast that shows the test above can fail: one slot, one queue (the engine
    before), and the light tenant's first token waits for a whole heavy prefill."""
    eng = engine(lm, prefill_chunk_tokens=CHUNK, max_active=1, order=Order.FIFO)
    probe = Probe(steps=steps)
    try:
        first = eng.submit(Request(heavy(20, 12 * CHUNK), "heavy", ONE), probe)
        waited = timed(eng, light(lm, "Hi"), "light", steps)
        done = probe.wait()
    finally:
        eng.close()
    assert isinstance(done, DoneEvent)
    assert len(steps.of(first.id)) == 12  # every chunk of the heavy prompt first ...
    assert min(steps.of(waited.job)) > max(steps.of(first.id))  # ... before the light one's first step


def test_a_tenant_at_its_limit_sends_its_next_request_the_moment_its_answer_ends(lm: LoadedModel) -> None:
    """A client with one request in flight at a time, at exactly its tenant's limit,
    sends the next from inside the end event's sink (in the worker, before any later
    line of the loop runs): the slot must already be free then, so it is never refused.
    The answers that end by an error free their slot first as well."""
    eng = engine(lm, admission=Admission(TenantLimits(max_concurrent=1)))
    refused: list[str] = []
    ends: list[Event] = []
    done = threading.Event()
    prompts = [heavy(40 + i, 8) for i in range(4)]

    def sink_for(i: int) -> Callable[[Event], None]:
        def sink(event: Event) -> None:
            if isinstance(event, TokenEvent):
                return
            ends.append(event)
            if i + 1 == 4:
                return done.set()
            # NOTE: the third answer ends by its timeout, the others normally
            request = Request(prompts[i + 1], "acme", ONE, timeout_s=0.0 if i + 1 == 2 else None)
            try:
                eng.submit(request, sink_for(i + 1))
            except TenantBusy as exc:
                refused.append(str(exc))
                done.set()

        return sink

    try:
        eng.submit(Request(prompts[0], "acme", ONE), sink_for(0))
        assert done.wait(300)
    finally:
        eng.close()
    assert refused == []
    assert [type(e) for e in ends] == [DoneEvent, DoneEvent, ErrorEvent, DoneEvent]
    assert isinstance(ends[2], ErrorEvent) and isinstance(ends[2].error, RequestTimeout)


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

    leave = threading.Event()

    def hold() -> None:  # acme's one request: a long prefill, until its client leaves (a cancel) at the end
        held = http.client.HTTPConnection(httpx.URL(url).host, httpx.URL(url).port)
        try:
            held.request("POST", "/v1/completions", json.dumps(holding), acme | {"Content-Type": "application/json"})
            leave.wait(600)  # the answer is never read
        finally:
            held.close()

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
        leave.set()
        holder.join(120)


def client(key: str, live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(key: str, live: LiveServer) -> Any:
    messages: Any = [{"role": "user", "content": "Name a garden tool."}]
    return client(key, live).chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, temperature=0)
