"""Synthetic workloads: deterministic, validated, and shaped the way they claim (chat
histories grow, documents and vendor prompts are shared, scans never repeat), with
hash_ids that share exactly what the tokens share."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixcache.sim.traces import read_trace
from prefixcache.sim.workload_spec import KINDS, WorkloadSpec
from prefixcache.sim.workloads import generate, repeated_prefix, tenant_names, write_jsonl

SMALL = WorkloadSpec(
    requests=300,
    tenants=4,
    duration_s=60.0,
    shared_system_prompt_tokens=37,
    system_prompt_tokens=21,
    turn_tokens=(3, 30),
    output_tokens=(2, 25),
    sessions_per_tenant=3,
    documents=12,
    document_tokens=(20, 60),
    tool_prompt_tokens=45,
    scan_tokens=(5, 60),
    block_size=8,
)


def records(spec: WorkloadSpec = SMALL, **changes: Any) -> list[dict[str, Any]]:
    return list(generate(dataclasses.replace(spec, **changes)))


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


# ---------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", ["w.jsonl", "w.jsonl.gz"])
def test_same_spec_same_bytes(tmp_path: Path, name: str) -> None:
    a, b = tmp_path / "a" / name, tmp_path / "b" / name
    a.parent.mkdir()
    b.parent.mkdir()
    assert write_jsonl(SMALL, a) == write_jsonl(SMALL, b) == SMALL.requests
    assert a.read_bytes() == b.read_bytes()
    assert not list(tmp_path.glob("*/*.tmp"))


def test_different_seed_different_bytes(tmp_path: Path) -> None:
    write_jsonl(SMALL, tmp_path / "a.jsonl")
    write_jsonl(dataclasses.replace(SMALL, seed=1), tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "b.jsonl").read_bytes()


def test_mix_order_does_not_matter() -> None:
    a = records(mix={"chat": 1, "rag": 2}, requests=60)
    b = records(mix={"rag": 2, "chat": 1}, requests=60)
    assert a == b


def test_file_holds_what_generate_yields(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    write_jsonl(SMALL, path)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records()


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"requests": -1}, "requests"),
        ({"requests": 1.5}, "requests"),
        ({"tenants": 0}, "tenants"),
        ({"tenants": True}, "tenants"),
        ({"seed": -3}, "seed"),
        ({"duration_s": -1.0}, "duration_s"),
        ({"duration_s": math.inf}, "duration_s"),
        ({"mix": {}}, "mix"),
        ({"mix": {"chat": 1, "batch": 1}}, "batch"),
        ({"mix": {"chat": 0}}, "mix"),
        ({"mix": {"chat": -0.5}}, "mix"),
        ({"mix": {"chat": True}}, "mix"),
        ({"shared_system_prompt_tokens": -1}, "shared_system_prompt_tokens"),
        ({"system_prompt_tokens": -1}, "system_prompt_tokens"),
        ({"turn_tokens": (5, 4)}, "turn_tokens"),
        ({"turn_tokens": (-1, 4)}, "turn_tokens"),
        ({"turn_tokens": 5}, "turn_tokens"),
        ({"output_tokens": (1, 2, 3)}, "output_tokens"),
        ({"sessions_per_tenant": 0}, "sessions_per_tenant"),
        ({"documents": 0}, "documents"),
        ({"document_tokens": (10, 1)}, "document_tokens"),
        ({"zipf_alpha": -1.0}, "zipf_alpha"),
        ({"docs_per_query": -1}, "docs_per_query"),
        ({"docs_per_query": 13}, "docs_per_query"),
        ({"tool_prompt_tokens": -1}, "tool_prompt_tokens"),
        ({"scan_tokens": (0, 10)}, "scan_tokens"),
        ({"models": ()}, "models"),
        ({"models": ("a", "")}, "models"),
        ({"emit": "text"}, "emit"),
        ({"block_size": 0}, "block_size"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"vocab_size": 2**33}, "vocab_size"),
    ],
)
def test_bad_spec_names_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(SMALL, **changes)


def test_spec_defaults_are_valid_and_normalized() -> None:
    spec = WorkloadSpec(turn_tokens=[1, 2], models=["a"])  # type: ignore[arg-type]
    assert spec.turn_tokens == (1, 2) and spec.models == ("a",)
    assert list(spec.mix) == ["chat", "rag", "agent", "scan"]


# ---------------------------------------------------------------------------- shape


def test_mix_shares_are_respected() -> None:
    counts = Counter(r["endpoint"] for r in records(requests=1000, mix={"chat": 1, "rag": 2, "scan": 1}))
    assert counts == {"chat": 250, "rag": 500, "scan": 250}
    n = 997
    counts = Counter(r["endpoint"] for r in records(requests=n))
    for kind, share in WorkloadSpec().mix.items():
        assert abs(counts[kind] - share * n) <= 1, (kind, counts)


def test_kinds_are_interleaved_in_time() -> None:
    kinds = [r["endpoint"] for r in records()]
    assert set(kinds[:100]) == set(KINDS) and set(kinds[-100:]) == set(KINDS)


def test_timestamps_are_non_decreasing_within_the_duration() -> None:
    times = [r["timestamp"] for r in records(requests=2000)]
    assert times == sorted(times)
    assert times[0] >= 0.0 and times[-1] <= SMALL.duration_s
    first_half = sum(t < SMALL.duration_s / 2 for t in times)
    assert 900 < first_half < 1100  # a Poisson process spreads arrivals evenly


def test_tenants_and_models() -> None:
    recs = records(tenants=5, models=("a", "b"))
    model_of: dict[str, set[str]] = defaultdict(set)
    for r in recs:
        model_of[r["tenant"]].add(r["model"])
    assert sorted(model_of) == [f"tenant-{i:02d}" for i in range(5)]
    assert all(len(models) == 1 for models in model_of.values())  # one model per tenant
    assert set().union(*model_of.values()) == {"a", "b"}
    assert tenant_names(101)[0] == "tenant-000" and tenant_names(101)[-1] == "tenant-100"


def test_chat_history_grows_turn_by_turn() -> None:
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records(emit="tokens"):
        if r["endpoint"] == "chat":
            by_session[r["session"]].append(r)
        else:
            assert "session" not in r
    assert len(by_session) == SMALL.tenants * SMALL.sessions_per_tenant
    for name, turns in by_session.items():
        assert name.startswith(turns[0]["tenant"] + "/chat-")
        assert len(turns) >= 2
        for earlier, later in itertools.pairwise(turns):
            sent = earlier["tokens"] + earlier["output_tokens"]
            assert later["tokens"][: len(sent)] == sent
            assert len(later["tokens"]) >= len(sent) + SMALL.turn_tokens[0]


def test_vendor_prompt_is_shared_across_tenants_and_tenant_prompts_are_not() -> None:
    heads: dict[tuple[int, ...], set[str]] = defaultdict(set)
    for r in records(emit="tokens"):
        if r["endpoint"] == "chat":
            heads[tuple(r["tokens"][: SMALL.system_prompt_tokens])].add(r["tenant"])
    owners = sorted(len(tenants) for tenants in heads.values())
    assert owners == [1] * SMALL.tenants + [SMALL.tenants]  # each tenant's prompt, and the vendor's


def test_rag_documents_are_shared_across_tenants() -> None:
    sp = SMALL.system_prompt_tokens
    first_doc: dict[tuple[int, ...], set[str]] = defaultdict(set)
    for r in records(emit="tokens"):
        if r["endpoint"] == "rag":
            first_doc[tuple(r["tokens"][sp : sp + SMALL.document_tokens[0]])].add(r["tenant"])
    assert len(first_doc) <= SMALL.documents
    assert max(len(tenants) for tenants in first_doc.values()) >= 2


def test_agents_share_their_tenants_tool_prompt() -> None:
    heads: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for r in records(emit="tokens"):
        if r["endpoint"] == "agent":
            heads[r["tenant"]].add(tuple(r["tokens"][: SMALL.tool_prompt_tokens]))
    assert len(heads) == SMALL.tenants and all(len(h) == 1 for h in heads.values())
    assert len(set().union(*heads.values())) == SMALL.tenants


def test_scans_never_repeat() -> None:
    recs = records()
    uses = Counter(i for r in recs for i in r["hash_ids"])
    scans = [r for r in recs if r["endpoint"] == "scan"]
    assert scans
    for r in scans:
        assert all(uses[i] == 1 for i in r["hash_ids"])  # no block of a scan appears anywhere else


# ---------------------------------------------------------------------------- hash ids


# NOTE: a vocabulary of 3 with blocks of 2 makes equal block content after different
# prefixes common, which is where a hash that forgot the prefix would show.
TINY_VOCAB = dataclasses.replace(SMALL, vocab_size=3, block_size=2)


@pytest.mark.parametrize("spec", [SMALL, TINY_VOCAB], ids=["small", "tiny-vocab"])
def test_hash_ids_share_exactly_the_full_blocks_the_tokens_share(spec: WorkloadSpec) -> None:
    bs = spec.block_size
    hashed = records(spec, requests=160)
    tokens = records(spec, requests=160, emit="tokens")
    for h, t in zip(hashed, tokens, strict=True):
        assert h["input_length"] == len(t["tokens"]) and h["output_length"] == len(t["output_tokens"])
        assert len(h["hash_ids"]) == -(-len(t["tokens"]) // bs) and h["block_size"] == bs
        assert {k: v for k, v in h.items() if k not in ("hash_ids", "block_size", "input_length", "output_length")} == {
            k: v for k, v in t.items() if k not in ("tokens", "output_tokens")
        }
    shared = 0
    for i in range(len(tokens)):
        for j in range(i):
            a, b = tokens[i]["tokens"], tokens[j]["tokens"]
            full = lcp(a, b) // bs
            same_partial = a == b and len(a) % bs != 0
            assert lcp(hashed[i]["hash_ids"], hashed[j]["hash_ids"]) == full + same_partial, (i, j)
            shared += full > 0
    assert shared > 100  # the property was tested on pairs that do share blocks


@pytest.mark.parametrize("spec", [SMALL, TINY_VOCAB], ids=["small", "tiny-vocab"])
def test_an_id_names_its_block_and_everything_before_it(spec: WorkloadSpec) -> None:
    """Across all records and positions: one id, one prefix; one prefix, one id. (Equal
    block content after different prefixes, e.g. a document after two tenants' prompts
    of equal length, must get different ids.)"""
    bs = spec.block_size
    prefix_of: dict[int, tuple[int, ...]] = {}
    id_of: dict[tuple[int, ...], int] = {}
    for h, t in zip(records(spec), records(spec, emit="tokens"), strict=True):
        for pos, block_id in enumerate(h["hash_ids"]):
            prefix = tuple(t["tokens"][: (pos + 1) * bs])
            assert prefix_of.setdefault(block_id, prefix) == prefix
            assert id_of.setdefault(prefix, block_id) == block_id
    assert len(prefix_of) == len(id_of) < sum(len(r["hash_ids"]) for r in records(spec))


def test_hash_ids_are_consecutive_in_order_of_first_appearance() -> None:
    top = -1
    for r in records():
        for i in r["hash_ids"]:
            assert i <= top + 1
            top = max(top, i)


# ---------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("emit", ["hash_ids", "tokens"])
def test_every_record_parses(tmp_path: Path, emit: str) -> None:
    spec = dataclasses.replace(SMALL, emit=emit)
    path = tmp_path / "w.jsonl.gz"
    assert write_jsonl(spec, path) == spec.requests
    reqs = list(read_trace(path))
    recs = list(generate(spec))
    assert len(reqs) == len(recs) == spec.requests
    for req, rec in zip(reqs, recs, strict=True):
        assert (req.timestamp, req.tenant, req.model, req.endpoint) == (
            rec["timestamp"],
            rec["tenant"],
            rec["model"],
            rec["endpoint"],
        )
        assert req.session == rec.get("session")
        if emit == "tokens":
            assert req.tokens == tuple(rec["tokens"]) and req.output_tokens == tuple(rec["output_tokens"])
        else:
            assert req.hash_ids == tuple(rec["hash_ids"]) and req.block_size == SMALL.block_size
            assert (req.input_length, req.output_length) == (rec["input_length"], rec["output_length"])


def test_empty_workload(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    assert write_jsonl(dataclasses.replace(SMALL, requests=0), path) == 0
    assert list(read_trace(path)) == []


# ---------------------------------------------------------------------------- known answers


def chained_hits(recs: list[dict[str, Any]], bs: int, per_tenant: bool) -> list[int]:
    """Reference: tokens each request finds in an unlimited cache of full blocks, matched
    as chained prefixes (and, per tenant, in separate namespaces)."""
    seen: set[tuple[Any, ...]] = set()
    hits = []
    for r in recs:
        ns = r["tenant"] if per_tenant else ""
        toks = r["tokens"]
        full = len(toks) // bs
        k = 0
        while k < full and (ns, *toks[: (k + 1) * bs]) in seen:
            k += 1
        hits.append(k * bs)
        seen.update((ns, *toks[: (m + 1) * bs]) for m in range(full))
    return hits


def content_hits(recs: list[dict[str, Any]], bs: int) -> list[int]:
    """Reference: the same, with blocks keyed by their own content only (no chaining)."""
    seen: set[tuple[int, ...]] = set()
    hits = []
    for r in recs:
        toks = r["tokens"]
        blocks = [tuple(toks[m * bs : (m + 1) * bs]) for m in range(len(toks) // bs)]
        k = 0
        while k < len(blocks) and blocks[k] in seen:
            k += 1
        hits.append(k * bs)
        seen.update(blocks)
    return hits


@pytest.mark.parametrize(("prefix", "suffix", "bs"), [(64, 20, 16), (47, 1, 16), (0, 30, 16), (40, 33, 8), (5, 3, 16)])
def test_repeated_prefix_known_answers(prefix: int, suffix: int, bs: int) -> None:
    n, tenants = 12, 3
    recs = list(repeated_prefix(prefix, suffix, n, tenants=tenants, block_size=bs, seed=4))
    assert [r["tenant"] for r in recs] == [f"tenant-0{i % tenants}" for i in range(n)]
    assert [r["timestamp"] for r in recs] == [float(i) for i in range(n)]
    assert all(len(r["tokens"]) == prefix + suffix for r in recs)
    for i in range(n):
        for j in range(i):
            assert lcp(recs[i]["tokens"], recs[j]["tokens"]) == prefix  # token-granular answer
    full = prefix // bs * bs
    assert chained_hits(recs, bs, per_tenant=False) == [0] + [full] * (n - 1)
    assert chained_hits(recs, bs, per_tenant=True) == [0] * tenants + [full] * (n - tenants)
    assert content_hits(recs, bs) == [0] + [full] * (n - 1)


@pytest.mark.parametrize(("prefix", "bs"), [(40, 16), (48, 16), (0, 8), (3, 4)])
def test_repeated_prefix_marks_every_block_that_holds_suffix_tokens(prefix: int, bs: int) -> None:
    """The guarantee behind the known answers, independent of random content: each such
    block holds a marker token (>= 32,000) that appears nowhere else in the trace."""
    suffix = 37
    recs = list(repeated_prefix(prefix, suffix, 6, block_size=bs))
    markers = [tok for r in recs for tok in r["tokens"] if tok >= 32_000]
    assert len(markers) == len(set(markers))
    for r in recs:
        toks = r["tokens"]
        assert all(tok < 32_000 for tok in toks[:prefix])
        for start in range(prefix // bs * bs, prefix + suffix, bs):
            assert max(toks[start : start + bs]) >= 32_000, start


def test_repeated_prefix_is_deterministic_and_valid(tmp_path: Path) -> None:
    assert list(repeated_prefix(30, 10, 5, seed=1)) == list(repeated_prefix(30, 10, 5, seed=1))
    assert list(repeated_prefix(30, 10, 5, seed=1)) != list(repeated_prefix(30, 10, 5, seed=2))
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in repeated_prefix(30, 10, 5)))
    assert [req.input_length for req in read_trace(path)] == [40] * 5
    with pytest.raises(ValueError, match="suffix_tokens"):
        repeated_prefix(10, 0, 5)
    with pytest.raises(ValueError, match="tenants"):
        repeated_prefix(10, 1, 5, tenants=0)


def test_max_turns_ends_sessions_and_starts_fresh_ones() -> None:
    """With max_turns, no conversation runs longer than that; its slot starts a new one
    (a new session name, a history back at its head prompt)."""
    spec = WorkloadSpec(
        requests=600, tenants=2, seed=3, mix={"chat": 1.0}, sessions_per_tenant=2, max_turns=3, emit="tokens"
    )
    turns = _by_session(spec)
    assert all(len(prompts) <= 3 for prompts in turns.values())
    assert len(turns) >= 600 // 3
    restarted = [name for name in turns if "." in name.rsplit("/", 1)[1]]
    assert restarted
    for prompts in turns.values():  # within a session, each turn extends the previous one
        for earlier, later in itertools.pairwise(prompts):
            assert later[: len(earlier)] == earlier
    unlimited = WorkloadSpec(requests=600, tenants=2, seed=3, mix={"chat": 1.0}, sessions_per_tenant=2, emit="tokens")
    assert max(len(p) for p in _by_session(unlimited).values()) > 3


def _by_session(spec: WorkloadSpec) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for rec in generate(spec):
        out.setdefault(rec["session"], []).append(rec["tokens"])
    return out


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_max_turns_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="max_turns"):
        WorkloadSpec(max_turns=bad)  # type: ignore[arg-type]
