"""The blend mode in the server, live: an opted-in tenant's reordered-RAG prompt reuses
its cached documents and ``usage`` says so apart from ``cached_tokens`` (the exact
prefix hits only); a tenant not opted in gets none; no tenant reuses another's chunks;
a model that has not passed its gate gets exact prefix caching only; bad settings are
clear errors. The official ``openai`` client parses every answer."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_support import MODEL_ID, MODELS_DIR, LiveServer, model, tiered_cache
from prefixcache.blend.gate import gate_key
from prefixcache.blend.serve_engine import BlendEngine
from prefixcache.blend.serve_gate import open_blender, read_gate
from prefixcache.blend.serve_types import BlendConfig
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.engine import LoadedModel
from prefixcache.quality.evalset import load_eval_set
from prefixcache.quality.reference import model_fingerprint
from prefixcache.quality.verdict import GateFigures, GateStore, GateThresholds, NoiseFloor
from prefixcache.server.app import create_app
from prefixcache.server.main import build_service
from prefixcache.settings import AuthSettings, BlendSettings, ModelSettings, Settings, describe, load_settings

KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex", "sk-initech-0123456789": "initech"}
ACME, GLOBEX, INITECH = KEYS
ADMIN = "adm-0123456789"
EVAL = Path(__file__).parent / "data" / "blend" / "eval.json"
SYSTEM = "Answer in one short sentence."  # shorter than a chunk
DOCS = {
    "glacier": "The Mornfeld glacier flows down a long valley in the northern mountains and ends in a lake at "
    "nine hundred metres; since 1922 its front has moved back by almost two kilometres.",
    "lighthouse": "The lighthouse at Skerry Point is forty-one metres tall, was built of granite in 1871, and its "
    "lamp can be seen from twenty-six nautical miles away on a clear night.",
    "owl": "Barn owls hunt at dusk over rough grassland, find voles by sound alone, and nest in old barns, "
    "church towers and hollow trees, laying four to six white eggs each spring.",
}
EDITED = DOCS["owl"].replace("four to six", "three to seven")


def blend_settings(gate: Path, **extra: Any) -> BlendSettings:
    fields: dict[str, Any] = {
        "tenants": ("acme", "globex"),
        "plan": "epic",
        "k": 4,
        "gate_file": str(gate),
        "eval_set": str(EVAL),
        "min_chunk_tokens": 16,
    }
    return BlendSettings(**(fields | extra))


def write_gate(lm: LoadedModel, config: BlendConfig, passed: bool) -> None:
    key = gate_key(model_fingerprint(lm), load_eval_set(EVAL).digest, config.gate_steps, config.plan)
    top1 = 1.0 if passed else 0.5
    floor = NoiseFloor("bfloat16", 19, 1.0, 1.0, 0.002, 0.02)  # the KL bars: above the figures' own
    figures = GateFigures("epic(k=4)", 19, top1, top1, 0.001, 0.01, 100, 10, 50, 0.4, floor)
    GateStore(config.gate_file).put(key, figures)


def start(lm: LoadedModel, tmp: Path, blend: BlendSettings) -> tuple[LiveServer, BlendEngine]:
    settings = Settings(auth=AuthSettings(api_keys=KEYS, admin_key=ADMIN), blend=blend)
    cache = tiered_cache(lm, tmp, partial_blocks=True)
    config = blend.config()
    blender, gate = open_blender(config, lm, MODEL_ID, cache)
    engine = BlendEngine(lm, MODEL_ID, config, blender, gate, cache=cache)
    server = LiveServer(create_app(engine, settings, cache), engine).start()
    return server, engine


def stop(server: LiveServer, engine: BlendEngine) -> None:
    server.stop()
    engine.close()
    assert engine.cache is not None
    engine.cache.close()


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return model()


@pytest.fixture(scope="module")
def live(lm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, BlendEngine]]:
    tmp = tmp_path_factory.mktemp("blend")
    blend = blend_settings(tmp / "gate.json")
    write_gate(lm, blend.config(), passed=True)
    server, engine = start(lm, tmp, blend)
    yield server, engine
    stop(server, engine)


def messages(order: list[str], question: str) -> Any:
    docs = "\n\n".join(DOCS.get(name, name) for name in order)
    user = f"Answer the question using the documents below.\n\n{docs}\n\nQuestion: {question}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def ask(server: LiveServer, engine: BlendEngine, key: str, order: list[str], question: str) -> Any:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model=MODEL_ID, messages=messages(order, question), max_tokens=4, temperature=0
    )
    assert engine.wait_idle(60)  # the chunks of the prompt are stored after the answer
    return answer.usage


def blend_of(usage: Any) -> tuple[int, int] | None:
    details = usage.prompt_tokens_details.model_extra
    if "blend_reused_tokens" not in details:
        return None
    return int(details["blend_reused_tokens"]), int(details["blend_recomputed_tokens"])


def metric(server: LiveServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def common_prefix(a: Any, b: Any, engine: BlendEngine) -> int:
    x, y = engine.tokenize_chat(a), engine.tokenize_chat(b)
    return next(i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t)


def doc_tokens(lm: LoadedModel, *names: str) -> int:
    return sum(len(lm.tokenizer.encode(DOCS[name], add_special_tokens=False)) for name in names)


@pytest.mark.model
def test_reordered_documents_are_reused_and_reported_apart_from_cached_tokens(
    lm: LoadedModel, live: tuple[LiveServer, BlendEngine]
) -> None:
    server, engine = live
    first = ask(server, engine, ACME, ["glacier", "lighthouse", "owl"], "How tall is the lighthouse?")
    assert blend_of(first) == (0, 0)  # nothing was stored yet: exact prefix caching only

    second = ask(server, engine, ACME, ["owl", "glacier", "lighthouse"], "When did measurements start?")
    reused, recomputed = blend_of(second) or (0, 0)
    assert reused + recomputed == doc_tokens(lm, "glacier", "lighthouse", "owl")
    assert recomputed == 3 * 4  # epic(k=4): the first 4 tokens of each of the three documents
    # cached_tokens: the exact prefix only (system prompt and header), never a document
    shared = common_prefix(
        messages(["glacier", "lighthouse", "owl"], "How tall is the lighthouse?"),
        messages(["owl", "glacier", "lighthouse"], "When did measurements start?"),
        engine,
    )
    assert 0 < second.prompt_tokens_details.cached_tokens <= shared
    assert second.prompt_tokens_details.cached_tokens + reused + recomputed < second.prompt_tokens

    hits = metric(server, "prefixcache_hit_tokens_total", tenant="acme")
    told = first.prompt_tokens_details.cached_tokens + second.prompt_tokens_details.cached_tokens
    assert hits == told  # blended tokens are never exact hits
    assert metric(server, "prefixcache_blend_reused_tokens_total", tenant="acme", model=MODEL_ID) == reused
    assert metric(server, "prefixcache_blend_recomputed_tokens_total", tenant="acme") == recomputed
    assert metric(server, "prefixcache_blend_requests_total", tenant="acme", outcome="blended") == 1
    assert metric(server, "prefixcache_blend_chunk_lookups_total", tenant="acme", found="exact") == 3
    assert metric(server, "prefixcache_blend_enabled", model=MODEL_ID, plan="epic(k=4)") == 1
    assert metric(server, "prefixcache_blend_gate_passed", model=MODEL_ID, plan="epic(k=4)") == 1
    assert metric(server, "prefixcache_blend_gate_top1_agreement_ratio", model=MODEL_ID) == 1.0
    # the dashboard's strip shows the kept chunks apart from exact hits and computed tokens
    recent = httpx.get(server.url + "/dashboard/data", headers={"Authorization": f"Bearer {ADMIN}"}).json()["recent"]
    cached = second.prompt_tokens_details.cached_tokens
    assert [n for source, n in recent[-1]["segments"] if source == "blended"] == [reused]
    assert recent[-1]["segments"][-1] == ["computed", second.prompt_tokens - cached - reused]

    # The prefix cache kept only the exact part of the blended prompt: asked again, the
    # same prompt's exact hit stops where the first reused document began.
    again = ask(server, engine, ACME, ["owl", "glacier", "lighthouse"], "When did measurements start?")
    assert 0 < again.prompt_tokens_details.cached_tokens <= shared < again.prompt_tokens - 100
    assert blend_of(again) == (reused, recomputed)


@pytest.mark.model
def test_streaming_usage_carries_the_blend_fields(live: tuple[LiveServer, BlendEngine]) -> None:
    server, engine = live
    ask(server, engine, ACME, ["lighthouse", "owl"], "Where do owls nest?")  # stores them if not yet there
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=ACME, max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages(["owl", "lighthouse"], "What is the lamp's range?"),
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and (blend_of(usage[0]) or (0, 0))[0] > 0


@pytest.mark.model
def test_a_tenant_not_opted_in_gets_no_blend(live: tuple[LiveServer, BlendEngine]) -> None:
    server, engine = live
    for order in (["glacier", "lighthouse", "owl"], ["owl", "glacier", "lighthouse"]):
        usage = ask(server, engine, INITECH, order, "How tall is the lighthouse?")
        assert blend_of(usage) is None  # no blend fields: the mode does not apply to it
    assert metric(server, "prefixcache_blend_requests_total", tenant="initech") == 0


@pytest.mark.model
def test_no_tenant_reuses_another_tenants_chunks(live: tuple[LiveServer, BlendEngine]) -> None:
    server, engine = live
    ask(server, engine, ACME, ["glacier", "lighthouse", "owl"], "How tall is the lighthouse?")
    # globex has never sent these documents: acme's chunks are neither found by hash nor
    # by the embedding fallback (globex's partition is empty)
    usage = ask(server, engine, GLOBEX, ["lighthouse", "owl", "glacier"], "How tall is the lighthouse?")
    assert blend_of(usage) == (0, 0)
    assert metric(server, "prefixcache_blend_chunk_lookups_total", tenant="globex", found="missed") == 3
    # ... and its own, stored by that request, it does reuse
    usage = ask(server, engine, GLOBEX, ["owl", "glacier", "lighthouse"], "Where do owls nest?")
    assert (blend_of(usage) or (0, 0))[0] > 0


@pytest.mark.model
def test_an_edited_document_is_found_by_the_embedding_fallback(
    lm: LoadedModel, live: tuple[LiveServer, BlendEngine]
) -> None:
    server, engine = live
    ask(server, engine, ACME, ["glacier", "owl"], "Where do owls nest?")
    before = metric(server, "prefixcache_blend_chunk_lookups_total", tenant="acme", found="similar")
    usage = ask(server, engine, ACME, ["lighthouse", EDITED], "How many eggs do barn owls lay?")
    reused, recomputed = blend_of(usage) or (0, 0)
    assert metric(server, "prefixcache_blend_chunk_lookups_total", tenant="acme", found="similar") == before + 1
    # the owl document's runs of tokens around the edit are reused, never the edited words
    assert doc_tokens(lm, "lighthouse") < reused + recomputed < doc_tokens(lm, "lighthouse", "owl")


@pytest.mark.model
def test_a_model_that_failed_its_gate_gets_exact_caching_only(lm: LoadedModel, tmp_path: Path) -> None:
    blend = blend_settings(tmp_path / "gate.json", fallback=False)
    write_gate(lm, blend.config(), passed=False)
    server, engine = start(lm, tmp_path, blend)
    try:
        assert engine.blender is None and not engine.gate.passed
        for order in (["glacier", "lighthouse", "owl"], ["owl", "glacier", "lighthouse"]):
            usage = ask(server, engine, ACME, order, "How tall is the lighthouse?")
            assert blend_of(usage) == (0, 0)  # opted in, but the mode is off: zero, told so
        assert metric(server, "prefixcache_blend_requests_total", tenant="acme", outcome="gate_off") == 2
        assert metric(server, "prefixcache_blend_enabled", model=MODEL_ID, plan="epic(k=4)") == 0
        assert metric(server, "prefixcache_blend_gate_passed", model=MODEL_ID, plan="epic(k=4)") == 0
        assert metric(server, "prefixcache_blend_reused_tokens_total") == 0
    finally:
        stop(server, engine)


@pytest.mark.model
def test_no_gate_figures_is_off_and_a_missing_eval_set_is_an_error(lm: LoadedModel, tmp_path: Path) -> None:
    config = blend_settings(tmp_path / "none.json").config()
    status = read_gate(config, lm, MODEL_ID)
    assert not status.passed and status.report is None and "gate_on_start" in status.reason
    with pytest.raises(ValueError, match=r"blend\.eval_set: cannot read"):
        read_gate(replace(config, eval_set=tmp_path / "missing.json"), lm, MODEL_ID)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"blend\.gate_file"):
        read_gate(replace(config, gate_file=tmp_path / "bad.json"), lm, MODEL_ID)


@pytest.mark.model
def test_gate_on_start_measures_missing_figures_once(lm: LoadedModel, tmp_path: Path) -> None:
    doc = json.loads(EVAL.read_text())
    doc["items"] = [item for item in doc["items"] if item["id"] == "reorder-01"]
    small = tmp_path / "eval.json"
    small.write_text(json.dumps(doc))
    base = blend_settings(tmp_path / "gate.json", eval_set=str(small), gate_on_start=True).config()
    config = replace(base, gate_steps=2, thresholds=GateThresholds(0.0, 0.0, math.inf, math.inf))
    first = read_gate(config, lm, MODEL_ID)
    assert first.passed and first.report is not None and first.report.figures.items == 1
    assert first.report.figures.recomputed > 0  # epic(k=4) recomputed the first tokens of each chunk
    again = read_gate(replace(config, gate_on_start=False), lm, MODEL_ID)  # read back, not measured
    assert again.report is not None and again.report.figures == first.report.figures


@pytest.mark.model
def test_build_service_opens_the_blend_mode_past_the_gate(lm: LoadedModel, tmp_path: Path) -> None:
    blend = blend_settings(tmp_path / "gate.json", fallback=False)
    write_gate(lm, blend.config(), passed=True)
    settings = Settings(
        auth=AuthSettings(api_keys=KEYS, admin_key=ADMIN),
        model=ModelSettings(models_dir=str(MODELS_DIR), device="cpu"),
        cache=CacheConfig(
            block_size=16, partial_blocks=True, tiers=(TierConfig(kind="memory", capacity_bytes=128 << 20),)
        ),
        blend=blend,
    )
    service = build_service(settings)
    try:
        assert isinstance(service.engine, BlendEngine) and service.engine.blender is not None
        assert service.engine.gate.passed and describe(settings)["blend"]["tenants"] == ["acme", "globex"]
        assert service.cache is not None  # chunks are blocks of the one cache, which has the tier whole
        assert service.engine.blender.chunks.cache is service.cache
        assert service.cache.config.tiers[0].capacity_bytes == 128 << 20
    finally:
        service.close()


BAD = [
    ({"tenants": ["acme", "nobody"]}, "blend.tenants names ['nobody'], no tenant of this server; valid: acme"),
    ({"tenants": "acme, acme"}, "lists a tenant twice"),
    ({"tenants": ["acme"], "plan": "fast"}, "blend.plan: Input should be 'epic', 'cacheblend' or 'epicblend'"),
    ({"r": 150}, "blend.r: Input should be less than or equal to 100"),
    ({"k": -1}, "blend.k: Input should be greater than or equal to 0"),
    ({"min_top1": 1.5}, "blend.min_top1"),
    ({"min_chunk_tokens": 900}, "min_chunk_tokens (900) is above max_chunk_tokens (512)"),
    ({"tenant": ["acme"]}, "unknown setting blend.tenant"),
]


@pytest.mark.parametrize(("blend", "message"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_blend_settings_are_clear_errors(blend: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=r"^(invalid|unknown) setting") as error:
        load_settings(env={}, overrides={"auth": {"api_keys": {"sk-a": "acme"}}, "blend": blend})
    assert message in str(error.value)


def test_blend_settings_from_a_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[auth]\napi_keys = {sk-a = "acme", sk-b = "globex"}\n[blend]\ntenants = ["acme"]\nplan = "epic"\n')
    settings = load_settings(path, env={"PREFIXCACHE_BLEND_K": "8"})
    config = settings.blend.config()
    assert config.serves("acme") and not config.serves("globex")
    assert config.plan.k == 8  # type: ignore[union-attr]
    assert not load_settings(env={}).blend.enabled  # off by default
    env = {"PREFIXCACHE_BLEND_TENANTS": "local"}  # local mode's one tenant
    assert load_settings(env=env).blend.config().tenants == frozenset({"local"})


@pytest.mark.model
def test_purge_prefix_and_an_epoch_bump_remove_chunks_and_their_index_entries(
    lm: LoadedModel, live: tuple[LiveServer, BlendEngine]
) -> None:
    server, engine = live
    blender = engine.blender
    assert blender is not None
    ask(server, engine, GLOBEX, ["owl", "glacier"], "How tall is the lighthouse?")  # globex's own copy
    ask(server, engine, ACME, ["glacier", "lighthouse", "owl"], "How tall is the lighthouse?")
    acme = engine.context("acme")
    owl = lm.tokenizer.encode(DOCS["owl"], add_special_tokens=False)
    assert blender.chunks.contains(acme, owl)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    prefix = "Barn owls hunt at dusk"  # the operator's purge of a document by its start
    assert lm.tokenizer.encode(prefix, add_special_tokens=False) == owl[:5]
    body = {"tenant": "acme", "prompt": prefix}
    purged = httpx.post(server.url + "/admin/purge", json=body, headers=headers).json()
    assert purged["removed_chunk_tokens"] >= len(owl) // 16 * 16 and purged["prefix_tokens"] == 5
    assert not blender.chunks.contains(acme, owl)
    left = [e for _, e in list(blender.known._entries.items()) if e.tokens[:5] == tuple(owl[:5])]
    assert left and {e.ctx.tenant for e in left} == {"globex"}  # globex's own copy stays
    usage = ask(server, engine, ACME, ["owl", "glacier", "lighthouse"], "When did measurements start?")
    assert (blend_of(usage) or (0, 0))[0] > 0  # glacier and lighthouse still reused; owl stored again
    assert blender.chunks.contains(acme, owl)

    assert httpx.post(server.url + "/admin/epoch", json={"model": MODEL_ID}, headers=headers).status_code == 200
    assert not blender.chunks.contains(acme, owl) and len(blender.known) == 0
    assert blender.index is not None and len(blender.index) == 0
    usage = ask(server, engine, ACME, ["lighthouse", "owl", "glacier"], "How tall is the lighthouse?")
    assert blend_of(usage) == (0, 0) and usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.model
def test_purging_a_tenant_removes_its_chunks(live: tuple[LiveServer, BlendEngine]) -> None:
    server, engine = live
    ask(server, engine, ACME, ["glacier", "lighthouse", "owl"], "How tall is the lighthouse?")
    headers = {"Authorization": f"Bearer {ADMIN}"}
    purged = httpx.post(server.url + "/admin/purge", json={"tenant": "acme"}, headers=headers).json()
    assert purged["removed_chunks"] >= 3 and purged["removed_blocks"] > 0
    usage = ask(server, engine, ACME, ["owl", "glacier", "lighthouse"], "When did measurements start?")
    assert blend_of(usage) == (0, 0) and usage.prompt_tokens_details.cached_tokens == 0
