"""Publication end to end through the server: a server built from a TOML file with
``[cache.publish] min_tenants = 3`` (namespace isolation), driven by the official
``openai`` client with k + 1 = 4 API keys. A shared system prompt becomes every
tenant's only once k distinct tenants sent it; before that a new tenant's
``cached_tokens`` is 0, and the timing audit finds no leak; after it, reuse is visible,
by ``cached_tokens`` and by time, as designed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine_support import LiveServer, Settled, WorkClock
from prefixcache.cache import PrefixCache
from prefixcache.config import PublishConfig
from prefixcache.engine import Engine
from prefixcache.ops.audit import AuditConfig, audit
from prefixcache.server.app import create_app
from prefixcache.settings import load_settings
from standin import STANDIN_ID, standin

pytestmark = pytest.mark.model  # the stand-in model (SmolLM2's tokenizer)

K = 3
KEYS = {f"sk-tenant{i}-0123456789": f"tenant{i}" for i in range(1, K + 2)}  # tenant1 .. tenant4
KEY = {tenant: key for key, tenant in KEYS.items()}
CONFIG = f"""
[cache]
isolation = "namespace"
partial_blocks = true

[[cache.tiers]]
kind = "memory"
capacity_bytes = 268435456

[cache.publish]
min_tenants = {K}
min_tokens = 64

[auth]
api_keys = {{ {", ".join(f'"{key}" = "{tenant}"' for key, tenant in KEYS.items())} }}
"""
SYSTEM = (
    "You are the assistant of the Ridgeway public library. Opening hours are nine to six on weekdays and ten "
    "to four on Saturdays. Members may borrow twelve items for three weeks and renew them twice online. "
    "The reading room on the first floor is quiet; group study rooms can be booked a week ahead at the desk. "
    "Printing costs ten cents a page. Lost cards are replaced for two dollars. Be brief and friendly. "
)
OTHER_SYSTEM = "You are the front desk of the Harbour swimming pool, open every day from seven to nine. " * 4


class Served:
    def __init__(self, server: LiveServer, engine: Engine) -> None:
        self.server, self.engine = server, engine

    @property
    def url(self) -> str:
        return self.server.url

    def ask(self, tenant: str, system: str, question: str) -> int:
        """``tenant`` asks ``question`` under ``system``; the cached tokens it was told of."""
        client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY[tenant], max_retries=0, timeout=60)
        messages: Any = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        reply = client.chat.completions.create(model=STANDIN_ID, messages=messages, max_tokens=1)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        assert self.engine.wait_idle(60)  # its stores done: the next chat (another one) never races them
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    def common(self, a: tuple[str, str], b: tuple[str, str]) -> int:
        """The tokens two chats (system prompt, question) start with alike."""
        ta, tb = (
            self.engine.tokenize_chat([{"role": "system", "content": s}, {"role": "user", "content": q}])
            for s, q in (a, b)
        )
        return next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    path = tmp_path / "prefixcache.toml"
    path.write_text(CONFIG)
    settings = load_settings(path, env={})
    assert settings.cache.publish == PublishConfig(min_tenants=K, min_tokens=64)
    assert set(settings.auth.api_keys.values()) == set(KEY) and settings.cache.isolation == "namespace"
    lm = standin()
    cache = PrefixCache(settings.cache_config(lm.kv))
    engine = Engine(lm, STANDIN_ID, cache=cache)
    server = LiveServer(create_app(engine, settings, cache), engine).start()
    yield Served(server, engine)
    server.stop()
    engine.close()
    cache.close()


def test_a_prefix_is_shared_after_k_distinct_tenants_not_before(served: Served) -> None:
    shared = served.common((SYSTEM, "Apples?"), (SYSTEM, "Zebras!"))  # the system prompt's turn, and a little more
    published = shared // 16 * 16  # the whole blocks of what k tenants' prompts have in common
    assert published >= 64
    assert served.ask("tenant1", SYSTEM, "When do you open on Saturday?") == 0
    assert served.ask("tenant1", SYSTEM, "How many books may I borrow?") >= shared  # its own private hit
    assert served.ask("tenant2", SYSTEM, "Can I renew online?") == 0  # one tenant (twice) before it
    assert served.ask("tenant3", SYSTEM, "Do you have a reading room?") == 0  # two before it: the k-th tenant
    cached = served.ask("tenant4", SYSTEM, "Is there parking nearby?")  # three before it: published
    assert published <= cached <= shared
    # what another system prompt has in common with its own earlier chat, and nothing published
    own = served.common((SYSTEM, "Is there parking nearby?"), (OTHER_SYSTEM, "Is the water heated?"))
    assert served.ask("tenant4", OTHER_SYSTEM, "Is the water heated?") == own < 16


def test_one_tenant_sending_a_prefix_k_times_does_not_publish_it(served: Served) -> None:
    questions = ("Are you open on Sunday?", "How deep is the pool?", "Do you rent towels?", "Any lessons?")
    assert len(questions) > K
    for question in questions:
        served.ask("tenant1", OTHER_SYSTEM, question)
    assert served.ask("tenant2", OTHER_SYSTEM, "Is the water heated?") == 0  # requests are not tenants
    assert served.ask("tenant3", OTHER_SYSTEM, "Is there a sauna?") == 0  # two tenants before it
    assert served.ask("tenant4", OTHER_SYSTEM, "Can children swim alone?") > 0  # three


def test_timing_audit_no_leak_before_k_reuse_after(served: Served) -> None:
    """k-1 victims send P, then the attacker: P is not yet public when the attacker asks
    (its own request is the k-th and publishes only after its answer), so no leak; with
    k victims before it P is public, and the attacker's hit is visible as designed."""

    def run(victims: int) -> Any:
        keys = tuple(KEY[f"tenant{i}"] for i in range(1, victims + 1))
        config = AuditConfig(served.url, KEY["tenant4"], keys, samples=12, prompt_words=120, seed=victims)
        clock = WorkClock(served.engine.loaded.model)  # time is the prefill work: no load moves a p-value
        try:
            return audit(config, clock=clock, transport=Settled(served.engine))  # each request after the last's stores
        finally:
            clock.close()

    before = run(K - 1)
    assert before.control.runs[0].test.p_value < 0.001  # the attacker's own cache shows
    assert before.verdict == "no leak"
    hit, miss = (before.cross.runs[0].median_cached(group) for group in ("hit", "miss"))
    assert hit == miss  # only the chat template's own default system prompt, in the attacker's namespace
    after = run(K)
    assert after.verdict == "leak"  # p < 0.01 twice, in independent runs
    assert (after.cross.runs[0].median_cached("hit") or 0) >= 64  # the published blocks, told by cached_tokens
