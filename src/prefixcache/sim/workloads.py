"""Deterministic synthetic multi-tenant traffic, written as our JSONL trace format.

Four kinds of request, each built from token content the way a real client builds it,
so the reuse a replay finds is the reuse that structure implies::

    chat   [vendor prompt | tenant prompt] [turn 1 user + output] ... [turn k-1 ...] [turn k user]
    rag    [tenant prompt] [doc a] [doc b] [question]      docs: Zipf-popular, shared by all tenants
    agent  [tenant tool prompt (long)] [task]
    scan   [random tokens]                                 never repeated

Every record is a request of ``prefixcache.sim.traces`` JSONL: ``endpoint`` is the kind
and chat turns carry ``session`` ("tenant-03/chat-07"). With ``emit="tokens"`` the
records hold ``tokens`` and ``output_tokens``; with ``emit="hash_ids"`` they hold
Mooncake-style prefix block ids (``hash_ids``, ``block_size``, ``input_length``,
``output_length``), which are far smaller and give the same hits at that block size.

The same spec gives byte-identical output: all randomness comes from generators seeded
by ``spec.seed``, and each piece of fixed content (a document, a tenant's prompt) from
its own stream, so it is the same whenever it is first needed. What to generate is a
``workload_spec.WorkloadSpec``.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.config import check_int
from prefixcache.sim.blocks import prefix_ids
from prefixcache.sim.workload_spec import WorkloadSpec

# ---------------------------------------------------------------------------- prefix ids


class PrefixIds:
    """Mooncake-style prefix block ids: id i names block i and every block before it, and
    ids are small consecutive ints in order of first appearance.

    Block i's key is the simulator's chained block hash (``blocks.prefix_ids``): it
    names the whole prefix up to block i's end. A last, partial block gets a key too;
    it never equals a full block's, so it is shared only by prompts that are equal to
    the end.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self, tokens: np.ndarray, known: Sequence[int] = ()) -> list[int]:
        """The ids of ``tokens`` (uint32). ``known`` are the already computed ids of some
        of its first full blocks (a session's history, a shared head), not hashed again."""
        data = np.ascontiguousarray(tokens, dtype="<u4").data.cast("B")
        out, ids = list(known), self._ids
        for key in prefix_ids(data, self.block_size, len(out)):
            out.append(ids.setdefault(key, len(ids)))
        return out


# ---------------------------------------------------------------------------- content


_VENDOR, _TENANT_PROMPT, _TOOLS, _DOC = range(4)  # streams of fixed content


class _Content:
    """Fixed token content, each piece drawn from its own seeded stream when first used
    and kept: the vendor prompt, tenant prompts and tool prompts, the document pool."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self._spec = spec
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def get(self, stream: int, index: int, length: int | tuple[int, int]) -> np.ndarray:
        key = (stream, index)
        if key not in self._cache:
            rng = np.random.default_rng((self._spec.seed, stream, index))
            n = length if isinstance(length, int) else _uniform(rng, length)
            self._cache[key] = rng.integers(0, self._spec.vocab_size, n, dtype=np.uint32)
        return self._cache[key]

    def vendor(self) -> np.ndarray:
        return self.get(_VENDOR, 0, self._spec.shared_system_prompt_tokens)

    def tenant_prompt(self, tenant: int) -> np.ndarray:
        return self.get(_TENANT_PROMPT, tenant, self._spec.system_prompt_tokens)

    def tools(self, tenant: int) -> np.ndarray:
        return self.get(_TOOLS, tenant, self._spec.tool_prompt_tokens)

    def document(self, doc: int) -> np.ndarray:
        return self.get(_DOC, doc, self._spec.document_tokens)


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _random_tokens(rng: np.random.Generator, bounds: tuple[int, int], vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, _uniform(rng, bounds), dtype=np.uint32)


@dataclass(slots=True)
class _Session:
    """An open chat: what the next turn sends before its new user tokens."""

    name: str
    history: np.ndarray  # head prompt + every earlier turn's user tokens and output
    known_ids: list[int] = field(default_factory=list)  # ids of the full blocks of the last prompt
    turns: int = 0


@dataclass(slots=True)
class _Prompt:
    tokens: np.ndarray
    output: np.ndarray
    session: _Session | None = None
    known_ids: Sequence[int] = ()  # ids of some first full blocks, when already computed


# ---------------------------------------------------------------------------- generation


def tenant_names(count: int) -> list[str]:
    """``tenant-00`` .. ``tenant-NN`` (wider when there are more than 100)."""
    width = max(2, len(str(count - 1)))
    return [f"tenant-{i:0{width}d}" for i in range(count)]


class _Generator:
    """The state of one generation: the RNG, fixed content, open sessions, the id map."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.content = _Content(spec)
        self.tenants = tenant_names(spec.tenants)
        self.prefix_ids = PrefixIds(spec.block_size) if spec.emit == "hash_ids" else None
        self.sessions: dict[tuple[int, int], _Session] = {}
        self.restarts: dict[tuple[int, int], int] = {}  # sessions replaced after max_turns, per slot
        self.head_ids: dict[tuple[int, int], list[int]] = {}
        self.doc_p = _zipf(spec.documents, spec.zipf_alpha)

    def records(self) -> Iterator[dict[str, Any]]:
        spec = self.spec
        times = np.sort(self.rng.uniform(0.0, spec.duration_s, spec.requests))
        kinds = _kind_sequence(spec.mix, spec.requests, self.rng)
        build = {"chat": self.chat, "rag": self.rag, "agent": self.agent, "scan": self.scan}
        for t, kind in zip(times, kinds, strict=True):
            tenant = int(self.rng.integers(spec.tenants))
            prompt = build[kind](tenant)
            record = self.record(float(t), tenant, kind, prompt)
            if prompt.session is not None:  # the next turn sends this prompt and its answer
                prompt.session.history = np.concatenate([prompt.tokens, prompt.output])
            yield record

    def output(self) -> np.ndarray:
        return _random_tokens(self.rng, self.spec.output_tokens, self.spec.vocab_size)

    def chat(self, tenant: int) -> _Prompt:
        index = int(self.rng.integers(self.spec.sessions_per_tenant))
        session = self.sessions.get((tenant, index))
        limit = self.spec.max_turns
        if session is not None and limit is not None and session.turns >= limit:
            self.restarts[(tenant, index)] = self.restarts.get((tenant, index), 0) + 1
            session = None  # the conversation ended: a new one takes its slot
        if session is None:
            session = self.sessions[(tenant, index)] = self.new_session(tenant, index)
        session.turns += 1
        turn = _random_tokens(self.rng, self.spec.turn_tokens, self.spec.vocab_size)
        return _Prompt(np.concatenate([session.history, turn]), self.output(), session, session.known_ids)

    def new_session(self, tenant: int, index: int) -> _Session:
        # NOTE: even sessions start with the vendor prompt every tenant shares (reuse across
        # tenants, if isolation allows it), odd ones with the tenant's own prompt.
        head = self.content.vendor() if index % 2 == 0 else self.content.tenant_prompt(tenant)
        known = self.known((_VENDOR, 0) if index % 2 == 0 else (_TENANT_PROMPT, tenant), head)
        width = max(2, len(str(self.spec.sessions_per_tenant - 1)))
        restart = self.restarts.get((tenant, index), 0)
        name = f"{self.tenants[tenant]}/chat-{index:0{width}d}" + (f".{restart}" if restart else "")
        return _Session(name, head, list(known))

    def rag(self, tenant: int) -> _Prompt:
        spec = self.spec
        docs = self.rng.choice(spec.documents, size=spec.docs_per_query, replace=False, p=self.doc_p)
        question = _random_tokens(self.rng, spec.turn_tokens, spec.vocab_size)
        head = self.content.tenant_prompt(tenant)
        parts = [head, *(self.content.document(int(d)) for d in docs), question]
        return _Prompt(np.concatenate(parts), self.output(), known_ids=self.known((_TENANT_PROMPT, tenant), head))

    def agent(self, tenant: int) -> _Prompt:
        task = _random_tokens(self.rng, self.spec.turn_tokens, self.spec.vocab_size)
        head = self.content.tools(tenant)
        return _Prompt(np.concatenate([head, task]), self.output(), known_ids=self.known((_TOOLS, tenant), head))

    def scan(self, tenant: int) -> _Prompt:
        return _Prompt(_random_tokens(self.rng, self.spec.scan_tokens, self.spec.vocab_size), self.output())

    def known(self, key: tuple[int, int], head: np.ndarray) -> list[int]:
        """Ids of a shared head's full blocks, hashed once (agents repeat 6,000 tokens)."""
        if self.prefix_ids is None:
            return []
        if key not in self.head_ids:
            full = len(head) // self.spec.block_size
            self.head_ids[key] = self.prefix_ids.ids(head[: full * self.spec.block_size])
        return self.head_ids[key]

    def record(self, t: float, tenant: int, kind: str, prompt: _Prompt) -> dict[str, Any]:
        spec = self.spec
        rec: dict[str, Any] = {
            "timestamp": round(t, 6),  # NOTE: rounding is monotone, so the order survives
            "tenant": self.tenants[tenant],
            "model": spec.models[tenant % len(spec.models)],
            "endpoint": kind,
        }
        if prompt.session is not None:
            rec["session"] = prompt.session.name
        if self.prefix_ids is None:
            rec["tokens"] = prompt.tokens.tolist()
            rec["output_tokens"] = prompt.output.tolist()
            return rec
        ids = self.prefix_ids.ids(prompt.tokens, prompt.known_ids)
        if prompt.session is not None:
            prompt.session.known_ids = ids[: len(prompt.tokens) // spec.block_size]
        rec.update(
            hash_ids=ids,
            block_size=spec.block_size,
            input_length=len(prompt.tokens),
            output_length=len(prompt.output),
        )
        return rec


def _zipf(n: int, alpha: float) -> np.ndarray:
    """Popularity of n items, the item of rank r weighted 1 / r**alpha."""
    weights: np.ndarray = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return weights / float(weights.sum())


def _kind_sequence(mix: Mapping[str, float], n: int, rng: np.random.Generator) -> list[str]:
    """Kinds in exact proportion (largest remainder), in a seeded random order.

    NOTE: exact counts rather than independent draws, so a small trace still has the
    mix it was asked for; the shuffle keeps kinds interleaved in time.
    """
    kinds = list(mix)
    shares = np.array([mix[k] for k in kinds]) / sum(mix.values())
    exact = shares * n
    counts = np.floor(exact).astype(np.int64)
    by_remainder = sorted(range(len(kinds)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - int(counts.sum())]:
        counts[i] += 1
    order = rng.permutation(np.repeat(np.arange(len(kinds)), counts))
    return [kinds[i] for i in order]


def generate(spec: WorkloadSpec) -> Iterator[dict[str, Any]]:
    """The records of the workload (our JSONL), timestamps non-decreasing.

    Arrivals are a Poisson process over ``[0, duration_s]`` conditioned on
    ``spec.requests`` arrivals, i.e. sorted uniform times.
    """
    return _Generator(spec).records()


def write_jsonl(spec: WorkloadSpec, path: str | Path) -> int:
    """Write the workload to ``path`` (gzip when it ends in ``.gz``); the number of requests.

    The file appears whole or not at all (written aside, then renamed), and a ``.gz``
    carries no time stamp, so the same spec gives the same bytes.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    try:
        with tmp.open("wb") as raw:
            out = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) if path.suffix == ".gz" else raw
            with out:
                for record in generate(spec):
                    out.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
                    count += 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count


# ---------------------------------------------------------------------------- known answers


_CONTENT_VOCAB = 32_000  # repeated_prefix draws content below this, markers from it up


def repeated_prefix(
    prefix_tokens: int,
    suffix_tokens: int,
    requests: int,
    tenants: int = 1,
    block_size: int = 16,
    seed: int = 0,
) -> Iterator[dict[str, Any]]:
    """A trace of known answer: every request is one fixed prefix plus a fresh suffix.

    Request r (tenant ``r % tenants``, at ``r`` seconds) shares exactly ``prefix_tokens``
    tokens with every earlier one and nothing more: each block that holds suffix tokens
    contains a marker token (ids from 32,000 up) used nowhere else, so even a matcher
    keyed by block content alone finds no more. With an unlimited cache and full-block
    matching, request r > 0 (shared isolation) hits ``prefix_tokens // block_size *
    block_size`` tokens; with token-granular matching, ``prefix_tokens``; under per-tenant
    isolation a tenant's first request hits nothing. Records carry ``tokens``.
    """
    for name, value, minimum in (
        ("prefix_tokens", prefix_tokens, 0),
        ("suffix_tokens", suffix_tokens, 1),
        ("requests", requests, 0),
        ("tenants", tenants, 1),
        ("block_size", block_size, 1),
        ("seed", seed, 0),
    ):
        check_int(name, value, minimum)
    return _repeated_prefix(prefix_tokens, suffix_tokens, requests, tenants, block_size, seed)


def _repeated_prefix(
    prefix_tokens: int, suffix_tokens: int, requests: int, tenants: int, block_size: int, seed: int
) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, _CONTENT_VOCAB, prefix_tokens, dtype=np.int64)
    names = tenant_names(tenants)
    # Positions (within the suffix) of its first token and of every block start after it.
    first_block = -(-prefix_tokens // block_size) * block_size
    marks = np.array([0, *range(first_block - prefix_tokens, suffix_tokens, block_size)], dtype=np.int64)
    marks = np.unique(marks[marks < suffix_tokens])
    next_marker = _CONTENT_VOCAB
    for r in range(requests):
        suffix = rng.integers(0, _CONTENT_VOCAB, suffix_tokens, dtype=np.int64)
        suffix[marks] = np.arange(next_marker, next_marker + len(marks))
        next_marker += len(marks)
        yield {
            "timestamp": float(r),
            "tenant": names[r % tenants],
            "model": "model-a",
            "endpoint": "repeated",
            "tokens": prefix.tolist() + suffix.tolist(),
        }
