"""Approximate nearest-neighbour search over chunk embeddings, partitioned by tenant.

The embedding fallback asks: which cached chunks read like this piece of the prompt?
Only chunks the requester may reuse can answer, and only chunks whose KV is still
valid. Both rules are structural, not filters applied to a shared result list::

    ChunkIndex
      (namespace, model, epoch) -> partition: one HNSW graph + key -> ChunkEntry
      ("org_1",   "smollm2", 3)    searched by org_1's requests
      ("org_2",   "smollm2", 3)    searched by org_2's requests
      ("",        "smollm2", 3)    the public namespace: searched by everyone
      (namespace, chunk_id) -> where it lives (for remove)

A query searches its own partition and the public one of the same model and epoch and
merges the two result lists; a foreign partition is never opened, so its chunks can
neither be returned nor shape what is (no top-k slot is ever spent on them). A purge
drops a namespace's partitions; an epoch drop discards every partition of that model at
or below the epoch and remembers the floor, so a late insert computed before the bump
is refused rather than resurrected.

NOTE: the graph library is hnswlib, chosen by ``benchmarks/bench_ann.py`` against
usearch on the same vectors and graph parameters. Recall against exact search was the
same on a fresh index, hnswlib built and answered faster, and -- what decides it, since
a cache's index churns with eviction, purges and epoch bumps -- after a third of the
index was replaced hnswlib kept the better recall: a missed candidate is lost reuse.
usearch churned several times faster and grows and removes for real; hnswlib only
marks a removal and reuses the slot on a later insert (re-linking its neighbours, the
slower part), and needs its capacity resized by hand (``_Graph`` doubles it). That
insert cost comes with a new chunk, whose KV prefill costs far more. usearch stays
out of the package; only the benchmark imports it.

Vectors are normalized on the way in, so the inner product is the cosine similarity.
The index holds no KV and no text: a hit is a chunk id, which the blender's book
(``known``) resolves and token alignment (``align``) verifies before anything is reused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import hnswlib
import numpy as np

from prefixcache.tenancy import PUBLIC

ChunkId = bytes  # ``KnownChunks.chunk_id``: a hash of the chunk's context and tokens


@dataclass(frozen=True, slots=True)
class AnnConfig:
    """Graph parameters: ``connectivity`` is HNSW's M, ``expansion_*`` its ef when adding
    and when searching; ``seed`` makes the graph's levels reproducible."""

    dim: int = 384
    connectivity: int = 16
    expansion_add: int = 128
    expansion_search: int = 64
    initial_capacity: int = 64  # per partition; doubled when full
    seed: int = 100


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    """What the index knows of a chunk: whose it is and which KV it names."""

    chunk_id: ChunkId
    namespace: str
    model: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Hit:
    """A candidate chunk, with the cosine similarity of its embedding to the query's."""

    entry: ChunkEntry
    similarity: float

    @property
    def chunk_id(self) -> ChunkId:
        return self.entry.chunk_id


PartitionKey = tuple[str, str, int]  # namespace, model, epoch


class _Graph:
    """One partition's HNSW graph: grows by doubling, reuses the slots of removed keys."""

    def __init__(self, config: AnnConfig) -> None:
        self._ef = config.expansion_search
        self._capacity = config.initial_capacity
        self._marked = 0  # removed keys whose slots a later insert reuses
        self._live = 0
        self._index = hnswlib.Index(space="ip", dim=config.dim)
        self._index.init_index(
            max_elements=self._capacity,
            M=config.connectivity,
            ef_construction=config.expansion_add,
            random_seed=config.seed,
            allow_replace_deleted=True,
        )
        self._index.set_num_threads(1)  # NOTE: one vector at a time; threads would only cost
        self._index.set_ef(self._ef)

    def add(self, key: int, unit: np.ndarray) -> None:
        if self._marked:
            self._marked -= 1
        elif self._live == self._capacity:
            self._capacity *= 2
            self._index.resize_index(self._capacity)
        self._index.add_items(unit.reshape(1, -1), [key], replace_deleted=True)
        self._live += 1

    def remove(self, key: int) -> None:
        self._index.mark_deleted(key)
        self._marked += 1
        self._live -= 1

    def search(self, unit: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Up to ``k`` (key, similarity) pairs, best first."""
        k = min(k, self._live)
        ef = max(self._ef, k)
        while k > 0:
            self._index.set_ef(ef)
            try:
                labels, distances = self._index.knn_query(unit, k=k)
            except RuntimeError:
                # NOTE: hnswlib raises when removals leave fewer than k reachable results at
                # this ef: search wider, and at worst ask for fewer
                k, ef = (k, ef * 4) if ef < 4 * self._live else (k - 1, ef)
                continue
            finally:
                self._index.set_ef(self._ef)
            # inner-product distance is 1 - <a, b>
            return [
                (int(key), 1.0 - float(d)) for key, d in zip(labels[0].tolist(), distances[0].tolist(), strict=True)
            ]
        return []


@dataclass(eq=False)
class _Partition:
    graph: _Graph
    entries: dict[int, ChunkEntry] = field(default_factory=dict)


class ChunkIndex:
    """Chunk embeddings per (namespace, model, epoch); thread-safe, one lock, no I/O."""

    def __init__(self, config: AnnConfig | None = None) -> None:
        self.config = config or AnnConfig()
        self._lock = threading.Lock()
        self._partitions: dict[PartitionKey, _Partition] = {}
        self._where: dict[tuple[str, ChunkId], tuple[PartitionKey, int]] = {}
        self._floors: dict[str, int] = {}  # model -> highest dropped epoch
        self._next_key = 0  # NOTE: keys are never reused, so a stale key can never name a new chunk

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def insert(self, entry: ChunkEntry, vector: np.ndarray) -> bool:
        """Adds (or replaces) ``entry``; False, and nothing stored, when its epoch was dropped."""
        unit = self._unit(vector)[0]
        with self._lock:
            if entry.epoch <= self._floors.get(entry.model, -1):
                return False
            self._remove_locked(entry.namespace, entry.chunk_id)
            pkey = (entry.namespace, entry.model, entry.epoch)
            part = self._partitions.get(pkey)
            if part is None:
                part = self._partitions[pkey] = _Partition(_Graph(self.config))
            key, self._next_key = self._next_key, self._next_key + 1
            part.graph.add(key, unit)
            part.entries[key] = entry
            self._where[(entry.namespace, entry.chunk_id)] = (pkey, key)
            return True

    def remove(self, chunk_id: ChunkId, namespace: str = PUBLIC) -> bool:
        """Removes one chunk of ``namespace``; False when it was not there."""
        with self._lock:
            return self._remove_locked(namespace, chunk_id)

    def purge(self, namespace: str) -> int:
        """Drops every chunk of ``namespace``; returns how many."""
        with self._lock:
            return self._drop(pkey for pkey in self._partitions if pkey[0] == namespace)

    def drop_epoch(self, model: str, epoch: int) -> int:
        """Drops every chunk of ``model`` at ``epoch`` or older, for good: later inserts at
        those epochs are refused. Returns how many were dropped."""
        with self._lock:
            self._floors[model] = max(epoch, self._floors.get(model, -1))
            return self._drop(pkey for pkey in self._partitions if pkey[1] == model and pkey[2] <= epoch)

    def query(
        self,
        vector: np.ndarray,
        namespace: str,
        model: str,
        epoch: int,
        k: int = 5,
        min_similarity: float = 0.0,
    ) -> list[Hit]:
        """The ``k`` most similar chunks that ``namespace`` may reuse (its own and public
        ones) for ``model`` at ``epoch``, at least ``min_similarity``, best first."""
        if k <= 0:
            return []
        unit = self._unit(vector)[0]
        scopes = [namespace] if namespace == PUBLIC else [namespace, PUBLIC]
        hits: list[Hit] = []
        with self._lock:
            for scope in scopes:
                part = self._partitions.get((scope, model, epoch))
                if part is not None and part.entries:
                    hits.extend(self._search(part, unit, k, min_similarity))
        hits.sort(key=lambda h: (-h.similarity, h.entry.namespace, h.chunk_id))
        return hits[:k]

    def entries(self, namespace: str | None = None) -> list[ChunkEntry]:
        """Every live entry (of one namespace when given); for tests and diagnostics."""
        with self._lock:
            return [
                e
                for pkey, part in self._partitions.items()
                if namespace is None or pkey[0] == namespace
                for e in part.entries.values()
            ]

    def _search(self, part: _Partition, unit: np.ndarray, k: int, min_similarity: float) -> list[Hit]:
        hits = []
        for key, similarity in part.graph.search(unit, k):
            entry = part.entries.get(key)
            if entry is not None and similarity >= min_similarity:
                hits.append(Hit(entry, similarity))
        return hits

    def _remove_locked(self, namespace: str, chunk_id: ChunkId) -> bool:
        found = self._where.pop((namespace, chunk_id), None)
        if found is None:
            return False
        pkey, key = found
        part = self._partitions[pkey]
        del part.entries[key]
        if part.entries:
            part.graph.remove(key)
        else:
            del self._partitions[pkey]
        return True

    def _drop(self, pkeys: Iterable[PartitionKey]) -> int:
        dropped = 0
        for pkey in list(pkeys):
            part = self._partitions.pop(pkey)
            for entry in part.entries.values():
                del self._where[(entry.namespace, entry.chunk_id)]
            dropped += len(part.entries)
        return dropped

    def _unit(self, vector: np.ndarray) -> np.ndarray:
        v = np.asarray(vector, dtype=np.float32).reshape(1, -1)
        if v.shape[1] != self.config.dim:
            raise ValueError(f"expected a {self.config.dim}-d vector, got {v.shape[1]}")
        norm = float(np.linalg.norm(v))
        if not np.isfinite(norm) or norm == 0.0:
            raise ValueError("cannot index a zero or non-finite vector")
        return v / norm
