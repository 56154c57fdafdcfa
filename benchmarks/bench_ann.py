"""usearch against hnswlib for the embedding fallback's chunk index, on the same vectors.

The baseline is exact search (a numpy matrix product and a partial sort over all
vectors), run in this process on the same data: recall@10 is measured against it and
the query time of each library is printed as a ratio to it. Both libraries get the
same graph parameters (connectivity 16, expansion 128 when adding, 64 when searching),
cosine / inner-product metric on float32, one thread, so the comparison is of the
implementations, not of their defaults.

Data: 384-d unit vectors (all-MiniLM-L6-v2's shape); half of them drawn around a few
hundred cluster centres (near-duplicate chunks, as RAG corpora have), half uniform on
the sphere. Queries are perturbed copies of stored vectors (a paraphrase of a cached
chunk; recall "near") and fresh random points (a miss; recall "far", the hard case in
high dimension). Memory is the serialized index size over the raw float32 vectors' size.
A cache's index churns (eviction, purges, epoch bumps), so each library then removes a
third of the vectors, adds as many new ones, and is measured again against exact search
on the live set ("after churn").

Run:  .venv/bin/python benchmarks/bench_ann.py [--sizes 10000 100000] [--queries 500]
"""

from __future__ import annotations

import os

# NOTE: before numpy loads its BLAS: the exact baseline runs on one thread, as both libraries do
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Protocol

import hnswlib
import numpy as np
from usearch.index import Index, MetricKind

DIM = 384
M = 16
EF_ADD = 128
EF_SEARCH = 64
K = 10


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def dataset(n: int, rng: np.random.Generator) -> np.ndarray:
    clusters = max(n // 200, 10)
    centres = unit(rng.standard_normal((clusters, DIM)))
    half = n // 2
    clustered = centres[rng.integers(0, clusters, half)] + 0.35 / np.sqrt(DIM) * rng.standard_normal((half, DIM))
    uniform = rng.standard_normal((n - half, DIM))
    data = unit(np.vstack([clustered, uniform]))
    return data[rng.permutation(n)]


def queries(data: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    near = data[rng.integers(0, len(data), count - count // 4)]
    near = near + 0.5 / np.sqrt(DIM) * rng.standard_normal(near.shape)
    fresh = rng.standard_normal((count // 4, DIM))
    return unit(np.vstack([near, fresh]))


def recall(found: list[np.ndarray], truth: np.ndarray) -> float:
    hits = sum(len(set(f.tolist()) & set(t.tolist())) for f, t in zip(found, truth, strict=True))
    return hits / (len(truth) * K)


class Ann(Protocol):
    name: str

    def add(self, keys: np.ndarray, vectors: np.ndarray) -> None: ...
    def remove(self, keys: np.ndarray) -> None: ...
    def search(self, q: np.ndarray) -> np.ndarray: ...
    def size(self) -> int: ...


class Usearch:
    name = "usearch"

    def __init__(self, capacity: int) -> None:
        self.index = Index(ndim=DIM, metric=MetricKind.IP, dtype="f32", connectivity=M, expansion_add=EF_ADD)
        self.index.expansion_search = EF_SEARCH

    def add(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        self.index.add(keys.astype(np.uint64), vectors, threads=1)

    def remove(self, keys: np.ndarray) -> None:
        self.index.remove(keys.astype(np.uint64))

    def search(self, q: np.ndarray) -> np.ndarray:
        return np.asarray(self.index.search(q, K, threads=1).keys, dtype=np.int64)

    def size(self) -> int:
        return len(self.index.save())


class Hnswlib:
    name = "hnswlib"

    def __init__(self, capacity: int) -> None:
        # NOTE: hnswlib needs its capacity up front (resize_index later) and only marks
        # removed items; replace_deleted lets new items reuse their slots.
        self.index = hnswlib.Index(space="ip", dim=DIM)
        self.index.init_index(max_elements=capacity, M=M, ef_construction=EF_ADD, allow_replace_deleted=True)
        self.index.set_num_threads(1)
        self.index.set_ef(EF_SEARCH)

    def add(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        self.index.add_items(vectors, keys, replace_deleted=True)

    def remove(self, keys: np.ndarray) -> None:
        for key in keys.tolist():
            self.index.mark_deleted(key)

    def search(self, q: np.ndarray) -> np.ndarray:
        labels, _ = self.index.knn_query(q, k=K)
        return np.asarray(labels[0], dtype=np.int64)

    def size(self) -> int:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "h.bin")
            self.index.save_index(path)
            return os.path.getsize(path)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def search_all(ann: Ann, qs: np.ndarray) -> tuple[float, list[np.ndarray]]:
    start = time.perf_counter()
    found = [ann.search(q) for q in qs]
    return (time.perf_counter() - start) / len(qs), found


def exact(data: np.ndarray, qs: np.ndarray) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    for q in qs:
        np.argpartition(-(data @ q), K)[:K]
    per_query = (time.perf_counter() - start) / len(qs)
    return per_query, np.argpartition(-(qs @ data.T), K, axis=1)[:, :K]


def row(name: str, build_s: float, query_s: float, exact_s: float, found: list[np.ndarray], truth: np.ndarray) -> str:
    near = len(truth) - len(truth) // 4
    return (
        f"{name:<22} {build_s:>8.2f} {query_s * 1e6:>9.1f} {exact_s / query_s:>8.1f}x "
        f"{recall(found, truth):>7.3f} {recall(found[:near], truth[:near]):>6.3f} "
        f"{recall(found[near:], truth[near:]):>6.3f}"
    )


def compare(n: int, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    data = dataset(n, rng)
    qs = queries(data, count, rng)
    exact_s, truth = exact(data, qs)
    gone = rng.choice(n, n // 3, replace=False)
    fresh = dataset(len(gone), rng)
    live = np.setdiff1d(np.arange(n), gone)
    after = np.vstack([data[live], fresh])  # row i -> key after_keys[i]
    after_keys = np.concatenate([live, np.arange(n, n + len(gone))])
    qs2 = queries(after, count, rng)
    exact2_s, rows2 = exact(after, qs2)
    truth2 = after_keys[rows2]
    print(f"\n{n:,} vectors x {DIM}, {count} queries, k={K}; exact search {exact_s * 1e3:.2f} ms/query (baseline)")
    print(
        f"{'library':<22} {'build s':>8} {'query us':>9} {'vs exact':>9} {'recall':>7} {'near':>6} {'far':>6}  size/raw"
    )
    for ann in (Usearch(n), Hnswlib(n)):
        build_s = timed(lambda a=ann: a.add(np.arange(n), data))
        query_s, found = search_all(ann, qs)
        print(row(ann.name, build_s, query_s, exact_s, found, truth) + f"  {ann.size() / data.nbytes:>7.2f}")
        churn_s = timed(lambda a=ann: (a.remove(gone), a.add(np.arange(n, n + len(gone)), fresh)))
        query2_s, found2 = search_all(ann, qs2)
        print(row(f"{ann.name} after churn", churn_s, query2_s, exact2_s, found2, truth2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    for n in args.sizes:
        compare(n, args.queries, args.seed)


if __name__ == "__main__":
    main()
