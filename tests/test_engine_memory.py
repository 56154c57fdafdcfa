"""The KV memory budget on the real model: a request waits while the ones in flight
reserve the memory and starts when one ends; one over the whole budget gets 413
``kv_budget_exceeded`` through the server, which goes on serving; the budget reaches the
engine from the settings (half the machine's memory by default).

No verdict reads the wall clock: the worker is held in a sink while the test looks, and
who went first is the order of the events."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from engine_support import MODEL_ID, MODELS_DIR, LiveServer, encode, engine, model
from prefixcache.engine import DoneEvent, Event, LoadedModel, Request, SamplingParams, TokenEvent
from prefixcache.engine import loop as loop_module
from prefixcache.engine.memory import KV_COPIES, KVMemory, default_budget, reservation
from prefixcache.engine.shelf import RowKV, Shelf
from prefixcache.server.main import build_service, open_engine
from prefixcache.settings import AuthSettings, ModelSettings, ServerSettings, Settings
from prefixcache.settings.admission import AdmissionSettings
from support import wait_for

pytestmark = pytest.mark.model  # the real model

KEYS = {"sk-acme-0123456789": "acme"}
ADMIN = "adm-0123456789"
BUDGET_TOKENS = 64  # the server's budget, in tokens of a request
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return model()


def per_token(loaded: LoadedModel) -> int:
    return loaded.kv.bytes_per_token * KV_COPIES


def test_a_request_waits_for_the_memory_and_starts_when_the_one_before_ends(lm: LoadedModel) -> None:
    prompt = list(encode(lm, PROMPT))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    need = reservation(lm.kv, lm.context_length, len(prompt) + params.max_tokens)
    eng = engine(lm, max_active=4, kv_budget=need + need // 2)  # slots for four, memory for one
    events: list[tuple[str, Event]] = []  # NOTE: appended by the worker thread alone
    holding, go = threading.Event(), threading.Event()

    def first(event: Event) -> None:
        events.append(("first", event))
        if isinstance(event, TokenEvent) and not holding.is_set():
            holding.set()
            assert go.wait(120)  # the worker waits here, the first request in flight

    try:
        eng.submit(Request(prompt, "acme", params), first)
        assert holding.wait(120)
        eng.submit(Request(prompt, "globex", params), lambda event: events.append(("second", event)))
        scheduler = eng.scheduler
        assert (scheduler.active, scheduler.waiting) == (1, 1)  # three slots free, no memory
        assert eng.kv_memory() == KVMemory(budget_bytes=need + need // 2, reserved_bytes=need)
        go.set()
        assert eng.wait_idle(300)
    finally:
        go.set()
        eng.close()
    names = [name for name, _ in events]
    first_done = next(i for i, (name, e) in enumerate(events) if name == "first" and isinstance(e, DoneEvent))
    assert names.index("second") > first_done  # it started once the first had ended
    assert sum(isinstance(e, DoneEvent) for _, e in events) == 2
    assert eng.kv_memory().reserved_bytes == 0


@pytest.fixture(scope="module")
def budgeted(lm: LoadedModel) -> Iterator[LiveServer]:
    """A server built from settings whose KV budget holds ``BUDGET_TOKENS`` tokens."""
    settings = Settings(
        auth=AuthSettings(api_keys=KEYS, admin_key=ADMIN),
        model=ModelSettings(models_dir=str(MODELS_DIR), device="cpu"),
        server=ServerSettings(cache=False),
        admission=AdmissionSettings(kv_memory_bytes=BUDGET_TOKENS * per_token(lm)),
    )
    service = build_service(settings)
    live = LiveServer(service.app, service.engine).start()
    yield live
    live.stop()
    service.close()


def test_a_request_over_the_whole_budget_gets_413_and_the_server_goes_on(budgeted: LiveServer, lm: LoadedModel) -> None:
    assert budgeted.engine is not None
    budget = BUDGET_TOKENS * per_token(lm)
    assert budgeted.engine.scheduler.config.kv_budget == budget  # the setting reached the engine
    client = openai.OpenAI(base_url=budgeted.url + "/v1", api_key="sk-acme-0123456789", max_retries=0, timeout=120)
    need = reservation(lm.kv, lm.context_length, len(encode(lm, PROMPT)) + 100)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=100, temperature=0)
    error = refused.value
    assert (error.status_code, error.code, error.type) == (413, "kv_budget_exceeded", "invalid_request_error")
    assert f"reserves {need} bytes" in error.message and f"budget of {budget} bytes" in error.message
    assert "admission.kv_memory_bytes" in error.message and "reduce max_tokens or the prompt" in error.message
    assert f"at most {BUDGET_TOKENS} tokens" in error.message
    fits = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0)
    assert fits.choices[0].finish_reason in ("stop", "length")
    assert budgeted.engine.wait_idle(120)
    stats = httpx.get(budgeted.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert stats.json()["kv_memory"] == {"budget_bytes": budget, "reserved_bytes": 0}


def test_the_default_budget_is_half_the_memory_and_reaches_the_engine() -> None:
    settings = Settings(
        model=ModelSettings(models_dir=str(MODELS_DIR), device="cpu"), server=ServerSettings(cache=False)
    )
    eng, _ = open_engine(settings)
    try:
        assert eng.scheduler.config.kv_budget == default_budget()
    finally:
        eng.close()


def test_a_long_rows_kv_goes_once_it_ended_and_was_stored(lm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode buffers of a long row beside a short one are no one's once both ended
    and the engine is idle (no loop or I/O thread keeps the last one it handled), and
    that much freed memory is handed back to the system."""
    left: list[weakref.ref[torch.Tensor]] = []
    leave, trims = Shelf.leave, []

    def watched(self: Shelf, slot: int) -> RowKV:
        kv = leave(self, slot)
        left.extend(weakref.ref(t) for t in (*kv.keys, *kv.values))
        return kv

    monkeypatch.setattr(Shelf, "leave", watched)
    monkeypatch.setattr(loop_module, "give_back", lambda: trims.append(1) or True)
    eng = engine(lm, max_active=2)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        long = eng.generate(Request([1000 + i % 3000 for i in range(700)], "acme", params))
        short = eng.generate(Request(list(encode(lm, PROMPT)), "globex", params))
        assert isinstance(long.result(), DoneEvent) and isinstance(short.result(), DoneEvent)
        assert eng.wait_idle(120)
        wait_for(lambda: not gc.collect() and all(ref() is None for ref in left), 60)
    finally:
        eng.close()
    assert left and trims  # a 700-token row's buffers: more than TRIM_BYTES
