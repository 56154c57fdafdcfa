"""``prefixcache audit-timing``: does a server's prompt cache let one tenant see, by time,
what another sent?

The procedure of Gu et al., "Auditing Prompt Caching in Language Model APIs" (ICML
2025): a cache hit answers sooner, so if an attacker's request for a prompt a victim
just sent starts answering sooner than one for a fresh prompt, the cache is shared
between them. Each trial::

    victim(s) ──P──> server                          warms whatever cache there is
    attacker  ──P──> server   (hit group)    ─> time to first token
           or ──Q──> server   (miss group)   ─> time to first token     (Q fresh, as long as P)

P and Q are fresh random prompts (words of one fixed list, from a seeded RNG), none
starting with the first ``PREFIX_WORDS`` words of an earlier prompt of the audit. Whether
a trial is a hit or a miss trial is drawn at random, so both groups follow the same
activity (the victim's request just before) and share any drift of the server's load.
A two-sample Kolmogorov-Smirnov test of the two groups' TTFTs gives a p-value: the
chance of so large a difference if the groups did not differ.

Two levels, their trials shuffled together: a same-tenant control (the attacker is its
own victim), which a prompt cache must show, else the audit has no power and says
nothing; and cross-tenant (the victims are other keys), which an isolated cache must
not show. A cross-tenant difference is called a leak only when a second, independent
run (fresh prompts) finds it again, so that a chance p < alpha (alpha of the runs of an
isolated server) is not reported as one: both runs below alpha happen by chance in
alpha**2 of them.

With several victim keys each sends P before the attacker: a server that publishes a
prefix once k distinct tenants sent it shows no difference with k-1 victims, and one
with k.

The attacker's ``cached_tokens`` can say outright what another tenant sent, but its own
earlier prompts give it cached tokens too: of a couple of hundred words, many of its
prompts begin with the word a later one begins with, and a server that matches single
tokens reports that word as cached, for hit and miss probes alike, by chance more often
in one group. As no probe starts with the first ``PREFIX_WORDS`` words of another, the
attacker's history explains at most the first ``PREFIX_WORDS - 1`` words of a probe (and
one cache block, where the server rounds to blocks); the report says ``cached_tokens``
reveals a victim's prompt only for a difference over half the prompt, which that
history cannot give and a victim's prompt cached whole does.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from prefixcache.ops.kstest import KSResult, ks_2samp

__all__ = [
    "ENDPOINTS",
    "PREFIX_WORDS",
    "WORDS",
    "AuditConfig",
    "AuditError",
    "AuditResult",
    "Level",
    "Run",
    "Sample",
    "audit",
]

ENDPOINTS = ("chat", "completions")
HIT, MISS = "hit", "miss"
CONTROL, CROSS = "same-tenant control", "cross-tenant"

# NOTE: a fixed list of common words, each one token or two with its leading space: the
# warm-up sends every one of them, so a tokenizer's word cache (HF tokenizers keep one)
# holds them all before the first measured trial, and P (just tokenized for the victim)
# is no faster to tokenize than Q.
_WORD_TEXT = """
    time year people way day man thing woman life child world school state family student group
    country problem hand part place case week company system program question work government number
    night point home water room mother area money story fact month lot right study book eye job word
    business issue side kind head house service friend father power hour game line end member law car
    city community name president team minute idea kid body information back parent face others level
    office door health person art war history party result change morning reason research girl guy
    moment air teacher force education foot boy age policy music market sense nation plan college
    interest death experience effect use class control care field development role effort rate heart
    drug show leader light voice wife police mind price report decision son view relationship town road
    arm difference value building action model season society tax director position player record paper
    space ground form event official matter center couple site project activity star table need court
    oil situation cost industry figure street image phone data picture practice piece land product doctor
    wall patient worker news test movie north love support technology step baby computer type attention
    film tree source organization hair window evidence population garden river stone bread summer
"""
WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))
PREFIX_WORDS = 3  # no prompt starts with the first this many words of an earlier one


class AuditError(Exception):
    """The audit could not run: the server is unreachable, refused a key, or answered
    something that is not an OpenAI-compatible stream. The message names the key's role,
    never the key."""


@dataclass(frozen=True)
class AuditConfig:
    url: str  # the server, with or without the /v1 suffix
    attacker_key: str = field(repr=False)
    victim_keys: tuple[str, ...] = field(repr=False)
    model: str | None = None  # None: the first of /v1/models
    samples: int = 250  # per group (hit, miss) and level
    prompt_words: int = 1100  # words per prompt (about as many tokens): above OpenAI's 1,024-token minimum
    alpha: float = 0.01
    seed: int = 0
    endpoint: str = "chat"
    warmup: int = 4  # trials first run and discarded
    confirm: bool = True  # a cross-tenant difference is a leak only if a second run finds it too
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.victim_keys:
            raise ValueError("at least one victim key is needed")
        if len(set(self.victim_keys)) < len(self.victim_keys):
            raise ValueError("the victim keys must differ: each stands for another tenant")
        if self.attacker_key in self.victim_keys:
            raise ValueError("a victim key is the attacker key: the cross-tenant level needs other tenants' keys")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; valid: {', '.join(ENDPOINTS)}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be between 0 and 1, got {self.alpha}")
        if self.prompt_words < PREFIX_WORDS or self.warmup < 0 or self.timeout_s <= 0:
            raise ValueError(f"prompt words must be >= {PREFIX_WORDS}, warm-up trials >= 0 and the timeout > 0")
        smallest = ks_2samp([0.0] * self.samples, [1.0] * self.samples).p_value if self.samples > 0 else 1.0
        if smallest >= self.alpha:
            raise ValueError(
                f"with {self.samples} samples per group no p-value can be below alpha {self.alpha} "
                f"(the smallest is {smallest:.3g}): take more samples"
            )


@dataclass(frozen=True)
class Sample:
    ttft_s: float  # from sending the request to its first content chunk
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, when the server reports it


@dataclass(frozen=True)
class Run:
    """One comparison of the hit and miss groups of a level."""

    hit: tuple[Sample, ...]
    miss: tuple[Sample, ...]
    test: KSResult

    def median_ms(self, group: str) -> float:
        return 1000 * statistics.median(s.ttft_s for s in (self.hit if group == HIT else self.miss))

    def median_cached(self, group: str) -> float | None:
        cached = [s.cached_tokens for s in (self.hit if group == HIT else self.miss) if s.cached_tokens is not None]
        return statistics.median(cached) if cached else None


@dataclass(frozen=True)
class Level:
    name: str  # CONTROL or CROSS
    victims: int  # victim requests before each attacker request
    runs: tuple[Run, ...]  # the first, then the confirming run when one was made
    alpha: float

    @property
    def detected(self) -> bool:
        """Every run found a difference (p < alpha)."""
        return all(run.test.p_value < self.alpha for run in self.runs)


@dataclass(frozen=True)
class AuditResult:
    url: str
    model: str
    endpoint: str
    samples: int
    prompt_words: int
    alpha: float
    seed: int
    control: Level
    cross: Level

    @property
    def verdict(self) -> str:
        if not self.control.detected:
            return "inconclusive"
        return "leak" if self.cross.detected else "no leak"

    @property
    def exit_code(self) -> int:
        return {"no leak": 0, "leak": 1, "inconclusive": 2}[self.verdict]

    @property
    def cached_reveals(self) -> bool:
        """The attacker's ``cached_tokens`` says what another tenant sent: in every cross-tenant
        run, its median for the victims' prompts exceeds that for fresh ones by more than half
        the prompt's words (each word is a token or more).

        NOTE: not a median's chance edge: the attacker's own history shares at most the first
        ``PREFIX_WORDS - 1`` words with a probe of either group, so on an isolated server the
        medians differ by those words' tokens and one cache block at most, under half of any
        prompt more than twice as long as the server's block."""
        return all(
            (run.median_cached(HIT) or 0) - (run.median_cached(MISS) or 0) > self.prompt_words / 2
            for run in self.cross.runs
        )


# ============================================================================ the client


class Target:
    """An OpenAI-compatible server, asked one streamed token at a time."""

    def __init__(
        self,
        url: str,
        endpoint: str,
        timeout_s: float,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.endpoint = endpoint
        self.client = httpx.Client(timeout=timeout_s, transport=transport)
        self.model = ""

    def close(self) -> None:
        self.client.close()

    def first_model(self, key: str, role: str) -> str:
        response = self._call(lambda: self.client.get(self.base + "/models", headers=_auth(key)))
        _check(response, role)
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise AuditError(f"{self.base}/models lists no model; name one with --model") from None

    def ask(self, key: str, role: str, prompt: str) -> Sample:
        """Send ``prompt`` for one token, streamed; the time to its first content chunk."""
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
        body: dict[str, Any] = {"model": self.model, "max_tokens": 1, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        started = self.clock()
        try:
            with self.client.stream("POST", self.base + path, json=body, headers=_auth(key)) as r:
                if r.status_code >= 400:
                    r.read()
                    _check(r, role)
                first, cached = self._read(r, started, role)
        except httpx.HTTPError as exc:
            raise AuditError(f"the {role}'s request to {self.base} failed: {exc or type(exc).__name__}") from None
        return Sample(first - started, cached)

    def _read(self, response: httpx.Response, started: float, role: str) -> tuple[float, int | None]:
        first: float | None = None
        cached: int | None = None
        for chunk in self._chunks(response, role):
            now = self.clock()
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if isinstance(details.get("cached_tokens"), int):
                cached = details["cached_tokens"]
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                # NOTE: content, or the end when the one token was no text; a role-only chunk is not a token
                if first is None and (text or choice.get("finish_reason")):
                    first = now
        if first is None:
            raise AuditError(f"the answer to the {role}'s request had no token: is {self.base} OpenAI-compatible?")
        return first, cached

    def _chunks(self, response: httpx.Response, role: str) -> Iterator[dict[str, Any]]:
        try:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError("a chunk is not an object")
                if "error" in chunk:
                    raise AuditError(f"the {role}'s request failed mid-stream: {_message(chunk)}")
                yield chunk
        except ValueError as exc:
            raise AuditError(f"the answer to the {role}'s request is not an OpenAI stream: {exc}") from None

    def _call(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except httpx.HTTPError as exc:
            raise AuditError(f"cannot reach {self.base}: {exc or type(exc).__name__}") from None


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(error or body)[:300]


def _check(response: httpx.Response, role: str) -> None:
    if response.status_code < 400:
        return
    try:
        message = _message(response.json())
    except ValueError:
        message = response.text[:300] or response.reason_phrase
    raise AuditError(f"the server refused the {role}'s request: {response.status_code} {message}")


# ============================================================================ the procedure


class Prompts:
    """The audit's prompts: random words, each starting with ``PREFIX_WORDS`` words that no
    earlier one started with, so that no prompt shares more than a few words of its start
    with another (whoever sent that)."""

    def __init__(self, rng: random.Random, words: int) -> None:
        self.rng, self.words = rng, words
        self.heads: set[tuple[str, ...]] = set()

    def fresh(self) -> str:
        return self._unique(lambda: [self.rng.choice(WORDS) for _ in range(self.words)])

    def every_word(self) -> str:
        """Every word once, in a random order (a key's warm-up)."""
        return self._unique(lambda: self.rng.sample(WORDS, len(WORDS)))

    def _unique(self, draw: Callable[[], list[str]]) -> str:
        while True:  # NOTE: of len(WORDS) ** PREFIX_WORDS starts (millions), a redraw is rare
            words = draw()
            head = tuple(words[:PREFIX_WORDS])
            if head not in self.heads:
                self.heads.add(head)
                return " ".join(words)


def audit(
    config: AuditConfig,
    progress: Callable[[int, int], None] | None = None,
    transport: httpx.BaseTransport | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> AuditResult:
    """Run the audit against ``config.url``; raises ``AuditError`` when it cannot.
    ``transport`` and ``clock`` are for tests (a fake server and its virtual time)."""
    target = Target(config.url, config.endpoint, config.timeout_s, transport, clock)
    try:
        return _audit(config, target, progress or (lambda done, total: None))
    finally:
        target.close()


def _audit(config: AuditConfig, target: Target, progress: Callable[[int, int], None]) -> AuditResult:
    rng = random.Random(config.seed)
    prompts = Prompts(rng, config.prompt_words)
    roles = {config.attacker_key: "attacker key"}
    for i, key in enumerate(config.victim_keys):
        roles[key] = "victim key" if len(config.victim_keys) == 1 else f"victim key {i + 1}"
    target.model = config.model or target.first_model(config.attacker_key, "attacker key")
    for key, role in roles.items():  # every key works, and every word has been tokenized
        target.ask(key, role, prompts.every_word())
    victims = {CONTROL: (config.attacker_key,), CROSS: config.victim_keys}

    def trial(level: str, group: str) -> Sample:
        p = prompts.fresh()
        for key in victims[level]:
            target.ask(key, roles[key], p)
        measured = p if group == HIT else prompts.fresh()
        return target.ask(config.attacker_key, "attacker key", measured)

    levels = (CONTROL, CROSS)
    for _ in range(config.warmup):
        trial(rng.choice(levels), rng.choice((HIT, MISS)))
    runs = _runs(config, rng, levels, trial, progress)
    cross: tuple[Run, ...] = (runs[CROSS],)
    if config.confirm and runs[CROSS].test.p_value < config.alpha:
        cross += (_runs(config, rng, (CROSS,), trial, progress)[CROSS],)
    return AuditResult(
        target.base,
        target.model,
        config.endpoint,
        config.samples,
        config.prompt_words,
        config.alpha,
        config.seed,
        Level(CONTROL, 1, (runs[CONTROL],), config.alpha),
        Level(CROSS, len(config.victim_keys), cross, config.alpha),
    )


def _runs(
    config: AuditConfig,
    rng: random.Random,
    levels: Sequence[str],
    trial: Callable[[str, str], Sample],
    progress: Callable[[int, int], None],
) -> dict[str, Run]:
    """``config.samples`` trials of each group of each level, in one shuffled order."""
    schedule = [(level, group) for level in levels for group in (HIT, MISS) for _ in range(config.samples)]
    rng.shuffle(schedule)
    got: dict[tuple[str, str], list[Sample]] = {(level, group): [] for level in levels for group in (HIT, MISS)}
    for done, (level, group) in enumerate(schedule, 1):
        got[level, group].append(trial(level, group))
        progress(done, len(schedule))
    out = {}
    for level in levels:
        hit, miss = tuple(got[level, HIT]), tuple(got[level, MISS])
        out[level] = Run(hit, miss, ks_2samp([s.ttft_s for s in hit], [s.ttft_s for s in miss]))
    return out
