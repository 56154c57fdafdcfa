"""``prefixcache audit-timing``: the KS test against scipy, the procedure against fake
servers whose cache is known (no model), bad input, and live servers on the stand-in
model in each isolation mode.

No verdict here reads the wall clock: the fake servers answer in virtual time, and the
live servers' audits run on a clock that counts the prompt tokens the model computes (a
millisecond each), so a cached prefix is time saved exactly, and another process's load
moves no p-value. What real TTFTs show is ``benchmarks/``'s to measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import special, stats

from engine_support import LiveServer, Settled, WorkClock
from prefixcache import cli
from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, TierConfig
from prefixcache.engine import Engine
from prefixcache.ops import audit as audit_module
from prefixcache.ops import kstest
from prefixcache.ops.audit import PREFIX_WORDS, AuditConfig, AuditError, AuditResult, audit
from prefixcache.ops.audit_cli import ATTACKER_VAR, VICTIM_VAR, report, to_json
from prefixcache.ops.kstest import kolmogorov_sf, ks_2samp
from prefixcache.server.app import create_app
from prefixcache.settings import AuthSettings, Settings, load_settings
from standin import STANDIN_ID, standin

# ============================================================================ the KS test

values = st.lists(st.integers(-6, 6).map(lambda v: v / 2), min_size=1, max_size=40)  # many ties


def same_as_scipy(a: list[float], b: list[float]) -> None:
    ours = ks_2samp(a, b)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        theirs = stats.ks_2samp(a, b, method="exact")
    assert ours.method == "exact"
    assert ours.statistic == pytest.approx(float(theirs.statistic), abs=1e-12)
    if warned:  # NOTE: scipy's exact sum fails at the smallest D of equal sizes (then p = 1) and falls back
        assert ours.p_value == 1.0 and len(a) == len(b) and ours.statistic == pytest.approx(1 / len(a))
    else:
        assert ours.p_value == pytest.approx(float(theirs.pvalue), rel=1e-9, abs=1e-300)


@given(values, values)
def test_ks_matches_scipy_exact(a: list[float], b: list[float]) -> None:
    same_as_scipy(a, b)


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300),
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300),
)
def test_ks_matches_scipy_on_continuous_samples(a: list[float], b: list[float]) -> None:
    same_as_scipy(a, b)


def test_ks_exact_p_value_of_separated_groups_is_tiny_and_exact() -> None:
    result = ks_2samp([float(i) for i in range(250)], [1000.0 + i for i in range(250)])
    assert result.statistic == 1.0
    assert result.p_value == pytest.approx(2 / math.comb(500, 250), rel=1e-12)
    assert result.p_value == pytest.approx(float(stats.ks_2samp(range(250), range(1000, 1250)).pvalue), rel=1e-9)


@given(st.floats(0, 8))
def test_kolmogorov_sf_matches_scipy(x: float) -> None:
    assert kolmogorov_sf(x) == pytest.approx(float(special.kolmogorov(x)), rel=1e-9, abs=1e-15)


@given(st.lists(st.floats(0, 1), min_size=50, max_size=200), st.lists(st.floats(0, 1), min_size=50, max_size=200))
def test_ks_asymptotic_is_kolmogorovs_limit(a: list[float], b: list[float]) -> None:
    ours = ks_2samp(a, b, method="asymptotic")
    en = len(a) * len(b) / (len(a) + len(b))
    assert ours.method == "asymptotic"
    assert ours.p_value == pytest.approx(float(special.kolmogorov(math.sqrt(en) * ours.statistic)), rel=1e-9)
    assert ours.statistic == ks_2samp(a, b, method="exact").statistic


def test_ks_auto_counts_exactly_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = [0.1, 0.5, 0.9, 1.3], [0.2, 0.3, 1.0]
    assert ks_2samp(a, b).method == "exact"
    monkeypatch.setattr(kstest, "EXACT_LIMIT", 11)
    assert ks_2samp(a, b).method == "asymptotic" and ks_2samp(a, b, method="exact").method == "exact"


def test_ks_refuses_empty_samples_and_unknown_methods() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        ks_2samp([], [1.0])
    with pytest.raises(ValueError, match="valid: auto, exact, asymptotic"):
        ks_2samp([1.0], [2.0], method="bootstrap")


# ============================================================================ fake servers

KEYS = {"sk-victim-000": "victim", "sk-attacker-000": "attacker", "sk-third-000": "third", "sk-fourth-000": "fourth"}
STREAM = (
    'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
    'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
    'data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":%d}}}\n\n'
    "data: [DONE]\n\n"
)


TEMPLATE = 9  # the cached tokens of a chat template's start, before the prompt's first word


class FakeServer:
    """An OpenAI-compatible server whose only latency is its cache, in virtual time: a
    hit takes 0-1 ms, a miss 3-4 ms (seeded, so every run is the same). ``mode``:
    "shared", "isolated", "none" (no cache), or "publish" (a prompt becomes everyone's
    once ``k`` distinct tenants sent it). Its ``cached_tokens`` match a token at a time,
    a word being one: ``TEMPLATE`` and the most words a prompt the tenant may hit on
    starts with, its own earlier prompts included."""

    def __init__(self, mode: str, k: int = 3) -> None:
        self.mode, self.k = mode, k
        self.senders: dict[str, set[str]] = {}
        self.paths: list[str] = []
        self.now = 0.0
        self.rng = random.Random(7)

    def clock(self) -> float:
        return self.now

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        tenant = KEYS.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        if tenant is None:
            return httpx.Response(401, json={"error": {"message": "Incorrect API key provided.", "code": "x"}})
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        words = text.split()
        shared = [common_start(words, t.split()) for t, s in self.senders.items() if self.can_hit(s, tenant)]
        cached = 0 if self.mode == "none" else TEMPLATE + max(shared, default=0)
        hit = self.can_hit(self.senders.get(text, set()), tenant)
        self.senders.setdefault(text, set()).add(tenant)
        self.now += self.rng.uniform(0, 0.001) + (0 if hit else 0.003)
        return httpx.Response(200, content=(STREAM % cached).encode())

    def can_hit(self, senders: set[str], tenant: str) -> bool:
        """Whether ``tenant`` may hit on a prompt ``senders`` sent."""
        return {
            "shared": bool(senders),
            "isolated": tenant in senders,
            "none": False,
            "publish": tenant in senders or len(senders) >= self.k,
        }[self.mode]


def common_start(a: list[str], b: list[str]) -> int:
    """How many words ``a`` and ``b`` start with alike."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def fake_audit(server: FakeServer, victims: tuple[str, ...] = ("sk-victim-000",), **extra: Any) -> AuditResult:
    config = AuditConfig("http://fake:1", "sk-attacker-000", victims, **({"samples": 20, "prompt_words": 30} | extra))
    return audit(config, transport=httpx.MockTransport(server), clock=server.clock)


def test_isolated_cache_no_leak() -> None:
    result = fake_audit(FakeServer("isolated"))
    assert result.verdict == "no leak" and result.exit_code == 0
    assert result.control.runs[0].test.p_value < 1e-6 and len(result.cross.runs) <= 2
    assert result.control.runs[0].median_cached("hit") == TEMPLATE + 30
    assert (result.cross.runs[0].median_cached("hit") or 0) < TEMPLATE + PREFIX_WORDS and not result.cached_reveals
    assert result.model == "fake-model" and result.url == "http://fake:1/v1"


def test_shared_cache_leaks_in_two_runs() -> None:
    result = fake_audit(FakeServer("shared"))
    assert result.verdict == "leak" and result.exit_code == 1 and result.cached_reveals
    assert [run.test.p_value < 1e-6 for run in result.cross.runs] == [True, True]  # found, then confirmed
    assert len(fake_audit(FakeServer("shared"), confirm=False).cross.runs) == 1


@pytest.mark.parametrize("seed", range(12))
def test_the_attackers_own_prompts_are_no_note(seed: int) -> None:
    """Of a couple of hundred words, many of the attacker's prompts start with a word an
    earlier one of its own started with, and a server matching tokens reports that word as
    cached, in either group: by chance more in one. That is not another tenant's prompt.
    (At 50 samples half the attacker's probes start with a word it started one with
    before: the medians' edge, where a note came by chance in 2 of these 12 seeds.)"""
    result = fake_audit(FakeServer("isolated"), seed=seed, samples=50)
    assert result.verdict == "no leak" and not result.cached_reveals
    cached = [s.cached_tokens or 0 for run in result.cross.runs for s in (*run.hit, *run.miss)]
    assert max(cached) <= TEMPLATE + PREFIX_WORDS - 1  # its own history: never more than its first words
    assert "note:" not in report(result) and to_json(result)["cached_reveals"] is False


def test_no_prompt_starts_as_another_did() -> None:
    prompts = audit_module.Prompts(random.Random(0), PREFIX_WORDS)
    drawn = [prompts.fresh() for _ in range(20_000)] + [prompts.every_word() for _ in range(4)]
    assert len({tuple(p.split()[:PREFIX_WORDS]) for p in drawn}) == len(drawn)
    assert all(sorted(p.split()) == sorted(audit_module.WORDS) for p in drawn[-4:])


def test_no_cache_is_inconclusive() -> None:
    result = fake_audit(FakeServer("none"))
    assert result.verdict == "inconclusive" and result.exit_code == 2


def test_publication_shows_from_k_victims_on() -> None:
    """With k = 3, two victims and the attacker make three senders, but the attacker's own
    request is counted only after it was answered: no difference. Three victims publish."""
    two = fake_audit(FakeServer("publish"), victims=("sk-victim-000", "sk-third-000"))
    three = fake_audit(FakeServer("publish"), victims=("sk-victim-000", "sk-third-000", "sk-fourth-000"))
    assert (two.verdict, three.verdict) == ("no leak", "leak")
    assert three.cross.victims == 3 and "cross-tenant (3 victims)" in report(three)


def test_completions_endpoint_and_the_trial_design() -> None:
    server = FakeServer("isolated")
    result = fake_audit(server, endpoint="completions", warmup=2)
    assert set(server.paths) == {"/v1/models", "/v1/completions"}
    n = result.samples
    # the models list, every key's warm-up, 2 warm-up trials, then per trial a victim and the attacker
    assert len(server.paths) == 1 + 2 + 2 * 2 + 4 * n * 2
    assert [len(run.hit) for run in (*result.control.runs, result.cross.runs[0])] == [n, n]


def test_report_and_json_name_no_key() -> None:
    result = fake_audit(FakeServer("shared"))
    text, data = report(result), json.dumps(to_json(result))
    assert "LEAK" in text and "same-tenant control" in text and "p-value" in text
    assert json.loads(data)["verdict"] == "leak" and json.loads(data)["cross"]["detected"] is True
    for key in KEYS:
        assert key not in text and key not in data and key not in repr(AuditConfig("u", key, ("other",)))


def fails(server: Callable[[httpx.Request], httpx.Response]) -> str:
    config = AuditConfig("http://fake:1", "sk-attacker-000", ("sk-victim-000",), samples=20)
    with pytest.raises(AuditError) as caught:
        audit(config, transport=httpx.MockTransport(server))
    return str(caught.value)


def answering(text: str) -> Callable[[httpx.Request], httpx.Response]:
    """A server that lists a model and answers every completion with ``text``."""

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, text=text)

    return server


def refusing_the_victim(request: httpx.Request) -> httpx.Response:
    if "victim" in request.headers["authorization"]:
        return httpx.Response(401, json={"error": {"message": "Incorrect API key provided."}})
    return FakeServer("shared")(request)


def test_bad_answers_are_audit_errors_naming_the_role() -> None:
    assert "refused the victim key's request: 401 Incorrect API key provided." in fails(refusing_the_victim)
    assert "lists no model" in fails(lambda r: httpx.Response(200, json={"data": []}))
    assert "lists no model" in fails(lambda r: httpx.Response(200, text="<html>hello</html>"))
    assert "had no token" in fails(answering("<p>hello</p>"))
    assert "failed mid-stream: engine on fire" in fails(answering('data: {"error": {"message": "engine on fire"}}\n\n'))
    assert "not an OpenAI stream" in fails(answering("data: {nope\n\n"))


# ============================================================================ the command, bad input


def test_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["audit-timing", "http://127.0.0.1:9", "--victim-key", "sk-v-123", "--attacker-key", "sk-a-123"])
    err = capsys.readouterr().err
    assert rc == 3 and "audit-timing: cannot reach http://127.0.0.1:9/v1" in err
    assert "Traceback" not in err and "sk-v-123" not in err and "sk-a-123" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "needs --victim-key"),
        (["--victim-key", "sk-same", "--attacker-key", "sk-same"], "a victim key is the attacker key"),
        (["--victim-key", "sk-v", "--attacker-key", "sk-a", "--samples", "3"], "no p-value can be below alpha"),
        (["--victim-key", "sk-v", "--victim-key", "sk-v", "--attacker-key", "sk-a"], "the victim keys must differ"),
        (["--victim-key", "sk-v", "--attacker-key", "sk-a", "--alpha", "1.5"], "alpha must be between 0 and 1"),
        (["--victim-key", "sk-v", "--attacker-key", "sk-a", "--prompt-tokens", "2"], "prompt words must be >= 3"),
        (["--victim-key", "sk-v", "--attacker-key", "sk-a", "--chat", "--completions"], "not allowed with"),
    ],
)
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["audit-timing", "http://127.0.0.1:9", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer("publish", k=2)
    fake = functools.partial(audit, transport=httpx.MockTransport(server), clock=server.clock)
    monkeypatch.setattr(audit_module, "audit", fake)
    monkeypatch.setenv(VICTIM_VAR, "sk-victim-000, sk-third-000")
    monkeypatch.setenv(ATTACKER_VAR, "sk-attacker-000")
    rc = cli.main(["audit-timing", "http://fake:1", "--samples", "20", "--prompt-tokens", "20", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["verdict"] == "leak" and data["cross"]["victims"] == 2  # two victims publish at k = 2


def test_the_keys_variables_are_no_server_setting() -> None:
    """``prefixcache serve`` refuses unknown PREFIXCACHE_* variables, but not these: one
    shell may run the server and the audit."""
    assert load_settings(env={VICTIM_VAR: "sk-v", ATTACKER_VAR: "sk-a"}).auth.api_keys == {}


# ============================================================================ live servers, stand-in model

# NOTE: on the work clock a miss costs its whole prompt and a hit only what follows the
# cached prefix, exactly: 12 samples a group separate them (D = 1 is p < 1e-5)
SAMPLES, PROMPT_WORDS = 12, 120
LIVE_KEYS = {"sk-victim-0123": "victim", "sk-attacker-0123": "attacker"}


@contextlib.contextmanager
def serving(
    isolation: str, monkeypatch: pytest.MonkeyPatch, *, strict: bool = False, keys: dict[str, str] = LIVE_KEYS
) -> Iterator[tuple[str, WorkClock, Settled]]:
    """A live server on the stand-in in ``isolation`` (``strict``: with strict isolation, its
    cache opened from the validated settings as ``serve`` opens it); the audits the command
    runs meanwhile keep time on its ``WorkClock``, each request after the one before it settled."""
    lm = standin()
    memory = (TierConfig(kind="memory", capacity_bytes=256 << 20),)
    config = CacheConfig(block_size=16, tiers=memory, partial_blocks=True, isolation=isolation, strict_isolation=strict)
    auth = AuthSettings(api_keys=keys, allow_cross_tenant_reuse=isolation == "shared")
    settings = Settings(auth=auth, cache=config) if strict else Settings(auth=auth)
    cache = PrefixCache(dataclasses.replace(config, kv_layout=lm.kv))
    eng = Engine(lm, STANDIN_ID, cache=cache)
    server = LiveServer(create_app(eng, settings, cache), eng).start()
    clock, settled = WorkClock(lm.model), Settled(eng)
    monkeypatch.setattr(audit_module, "audit", functools.partial(audit, clock=clock, transport=settled))
    try:
        yield server.url, clock, settled
    finally:
        clock.close()
        server.stop()
        eng.close()
        cache.close()


def audit_argv(url: str, *extra: str) -> list[str]:
    keys = ["--victim-key", "sk-victim-0123", "--attacker-key", "sk-attacker-0123"]
    return ["audit-timing", url, *keys, "--samples", str(SAMPLES), "--prompt-tokens", str(PROMPT_WORDS), *extra]


@pytest.mark.model
def test_namespace_isolation_shows_no_leak(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with serving("namespace", monkeypatch) as (url, *_):
        rc = cli.main(audit_argv(url, "--json"))
    data = json.loads(capsys.readouterr().out)
    assert data["control"]["runs"][0]["test"]["p_value"] < 0.001
    assert max(run["test"]["p_value"] for run in data["cross"]["runs"]) >= 0.01  # not found, or not confirmed
    assert (rc, data["verdict"]) == (0, "no leak")
    assert data["cross"]["runs"][0]["median_cached_tokens"]["hit"] < PROMPT_WORDS / 2  # only the template's own


@pytest.mark.model
def test_namespace_isolation_gives_no_note_whatever_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeds one after another on one server, so the attacker's history grows: a real
    tokenizer, a chat template, and cached tokens matched within a block. The old note
    (any larger median for the victims' prompts) came from chance here on the third seed."""
    with serving("namespace", monkeypatch) as (url, clock, settled):
        for seed in range(3):
            config = AuditConfig(
                url, "sk-attacker-0123", ("sk-victim-0123",), samples=SAMPLES, prompt_words=PROMPT_WORDS, seed=seed
            )
            result = audit(config, clock=clock, transport=settled)
            assert result.verdict == "no leak" and not result.cached_reveals and "note:" not in report(result)
            cached = [s.cached_tokens or 0 for run in result.cross.runs for s in (*run.hit, *run.miss)]
            assert max(cached) - min(cached) <= 2 * (PREFIX_WORDS - 1)  # a word is a token or two


@pytest.mark.model
def test_partitioned_isolation_shows_no_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    with serving("partitioned", monkeypatch) as (url, clock, settled):
        config = AuditConfig(url, "sk-attacker-0123", ("sk-victim-0123",), samples=SAMPLES, prompt_words=PROMPT_WORDS)
        result = audit(config, clock=clock, transport=settled)
    assert result.control.runs[0].test.p_value < 0.001
    assert not result.cross.detected and result.verdict == "no leak"


STRICT_KEYS = {**LIVE_KEYS, "sk-third-0123": "third", "sk-fourth-0123": "fourth"}


@pytest.mark.model
def test_strict_isolation_shows_no_leak_whatever_the_victims(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Strict isolation (AISVS 5.5.5, docs/operations.md): three victims send each prompt,
    enough to publish it were publication on, and still neither time nor cached_tokens
    tells the attacker anything; the control level shows the audit could see a hit."""
    victims = ["--victim-key", "sk-third-0123", "--victim-key", "sk-fourth-0123"]
    with serving("namespace", monkeypatch, strict=True, keys=STRICT_KEYS) as (url, *_):
        rc = cli.main(audit_argv(url, *victims, "--json"))
    data = json.loads(capsys.readouterr().out)
    assert data["control"]["runs"][0]["test"]["p_value"] < 0.001  # the attacker's own prompts do hit
    assert (rc, data["verdict"], data["cross"]["victims"]) == (0, "no leak", 3)
    assert not data["cross"]["detected"] and data["cached_reveals"] is False
    cross = data["cross"]["runs"][0]["median_cached_tokens"]
    assert cross["hit"] < PROMPT_WORDS / 2 and cross["miss"] < PROMPT_WORDS / 2  # only the template's own


@pytest.mark.model
def test_shared_isolation_leaks(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with serving("shared", monkeypatch) as (url, *_):
        rc = cli.main(audit_argv(url, "--json"))
    out = capsys.readouterr().out
    data = json.loads(out)
    assert data["cross"]["runs"][0]["test"]["p_value"] < 0.001
    assert (rc, data["verdict"], len(data["cross"]["runs"])) == (1, "leak", 2)  # found, then confirmed
    cached = data["cross"]["runs"][0]["median_cached_tokens"]
    assert cached["hit"] > cached["miss"] + PROMPT_WORDS / 2  # and cached_tokens says so outright
    assert data["cached_reveals"] is True
    assert "sk-victim-0123" not in out and "sk-attacker-0123" not in out


@pytest.mark.model
def test_wrong_key_is_the_servers_401(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with serving("namespace", monkeypatch) as (url, *_):
        rc = cli.main(["audit-timing", url, "--victim-key", "sk-wrong-0123", "--attacker-key", "sk-attacker-0123"])
    err = capsys.readouterr().err
    assert rc == 3 and "the server refused the victim key's request: 401 Incorrect API key provided." in err
    assert "Traceback" not in err and "sk-wrong-0123" not in err
