"""Token alignment: which spans of a candidate chunk occur in the prompt, and where.

The embedding fallback only says that a cached chunk *reads like* part of the prompt;
similarity is not identity ("I like apples" against "I don't like apples"). What can
be reused is decided here, token for token: the spans of the chunk's tokens that occur
verbatim in the prompt, each at least ``min_length`` long::

    chunk   [ Date: Monday | The quick brown fox ... lazy dog. ]
                 (edited)    \\______________ span _________/
    prompt  [ sys ... Date: Tuesday | The quick brown fox ... lazy dog. | question ]

Spans do not overlap, neither in the chunk nor in the prompt, and are returned in the
chunk's order. NOTE: their prompt positions need not increase: a chunk of two documents
that the prompt quotes in the other order yields both, since each reused span's keys are
re-rotated to its own new position anyway.

How: seed and extend. The prompt's ``min_length``-grams are hashed once (a polynomial
rolling hash, vectorized) and sorted; each chunk position's gram finds the prompt
positions of the same hash by binary search, and each left-maximal one is extended,
token by token from its first token, to a maximal exact match (a hash collision then
costs time, never correctness). The matches are then taken greedily, longest first; one that
overlaps what was taken is cut to its free pieces, which compete again if still long
enough. Time is linear in the tokens for ordinary text. NOTE: in degenerate text
(a token repeated thousands of times) a gram's occurrences are capped, which can only
lose spans, never return a wrong one.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Tokens = Sequence[int] | np.ndarray

MIN_LENGTH = 16
MAX_OCCURRENCES = 64  # per gram: bounds the work on repetitive text
_EXTEND_STEP = 256  # tokens compared per numpy step when extending a match
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication by it is a bijection mod 2**64


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """``chunk[chunk_start : chunk_start + length] == prompt[prompt_start : prompt_start + length]``."""

    chunk_start: int
    prompt_start: int
    length: int

    @property
    def chunk_end(self) -> int:
        return self.chunk_start + self.length

    @property
    def prompt_end(self) -> int:
        return self.prompt_start + self.length


def _as_array(tokens: Tokens) -> np.ndarray:
    arr = np.ascontiguousarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    return arr


class PromptIndex:
    """A prompt's grams, built once and aligned against any number of candidate chunks."""

    def __init__(self, prompt: Tokens, min_length: int = MIN_LENGTH, max_occurrences: int = MAX_OCCURRENCES) -> None:
        if min_length < 1:
            raise ValueError(f"min_length must be at least 1, got {min_length}")
        self.tokens = _as_array(prompt)
        self.min_length = min_length
        self.max_occurrences = max_occurrences
        hashes = _gram_hashes(self.tokens, min_length)
        self._order = np.argsort(hashes, kind="stable")  # stable: each hash's positions ascending
        self._sorted = hashes[self._order]

    def align(self, chunk: Tokens) -> list[Span]:
        """The chunk's spans found in the prompt: long first, non-overlapping, in chunk order."""
        c = _as_array(chunk)
        return sorted(_greedy(self._matches(c), self.min_length))

    def _matches(self, c: np.ndarray) -> list[Span]:
        """Maximal exact matches of at least ``min_length`` tokens (one per diagonal run)."""
        p, k = self.tokens, self.min_length
        hashes = _gram_hashes(c, k)
        lo = np.searchsorted(self._sorted, hashes, side="left")
        hi = np.minimum(np.searchsorted(self._sorted, hashes, side="right"), lo + self.max_occurrences)
        cl, pl = c.tolist(), p.tolist()  # NOTE: Python ints: numpy scalar access is slower per token
        order = self._order.tolist()
        found: list[Span] = []
        for i in np.flatnonzero(hi > lo).tolist():
            for j in order[lo[i] : hi[i]]:
                if i > 0 and j > 0 and cl[i - 1] == pl[j - 1]:
                    continue  # not left-maximal: the match starting one token earlier covers it
                length = _extend(c, i, p, j)
                if length >= k:  # shorter: a hash collision
                    found.append(Span(i, j, length))
        return found


def _gram_hashes(tokens: np.ndarray, k: int) -> np.ndarray:
    """A 64-bit polynomial hash of every ``k``-gram (wrapping arithmetic), by start position."""
    n = len(tokens) - k + 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint64)
    values = tokens.astype(np.uint64)
    hashes = np.zeros(n, dtype=np.uint64)
    for t in range(k):
        hashes = hashes * _BASE + values[t : t + n]
    return hashes


def _extend(a: np.ndarray, i: int, b: np.ndarray, j: int) -> int:
    """How many tokens ``a[i:]`` and ``b[j:]`` share from their starts."""
    n = 0
    limit = min(len(a) - i, len(b) - j)
    while n < limit:
        step = min(_EXTEND_STEP, limit - n)
        differ = np.flatnonzero(a[i + n : i + n + step] != b[j + n : j + n + step])
        if differ.size:
            return n + int(differ[0])
        n += step
    return n


class _Taken:
    """Disjoint half-open intervals, sorted by start, with the free parts of a range."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        at = bisect_right(self.starts, start)
        self.starts.insert(at, start)
        self.ends.insert(at, end)

    def free(self, start: int, end: int) -> list[tuple[int, int]]:
        """The sub-ranges of ``[start, end)`` that no interval covers, in order."""
        out, cursor = [], start
        at = max(bisect_right(self.starts, start) - 1, 0)
        while at < len(self.starts) and self.starts[at] < end:
            s, e = self.starts[at], self.ends[at]
            if e > cursor:
                if s > cursor:
                    out.append((cursor, s))
                cursor = e
            at += 1
        if cursor < end:
            out.append((cursor, end))
        return out


def _greedy(matches: list[Span], min_length: int) -> list[Span]:
    """Longest first; a match overlapping taken spans competes again with its free pieces."""
    heap = [(-m.length, m.chunk_start, m.prompt_start) for m in matches]
    heapq.heapify(heap)
    in_chunk, in_prompt, chosen = _Taken(), _Taken(), []
    while heap:
        neg, cs, ps = heapq.heappop(heap)
        length = -neg
        pieces = _pieces(in_chunk, in_prompt, cs, ps, length)
        if pieces == [(0, length)]:
            chosen.append(Span(cs, ps, length))
            in_chunk.add(cs, cs + length)
            in_prompt.add(ps, ps + length)
            continue
        for lo, hi in pieces:
            if hi - lo >= min_length:
                heapq.heappush(heap, (-(hi - lo), cs + lo, ps + lo))
    return chosen


def _pieces(in_chunk: _Taken, in_prompt: _Taken, cs: int, ps: int, length: int) -> list[tuple[int, int]]:
    """The offsets ``[lo, hi)`` along the match that are free in both the chunk and the prompt."""
    by_chunk = [(lo - cs, hi - cs) for lo, hi in in_chunk.free(cs, cs + length)]
    by_prompt = [(lo - ps, hi - ps) for lo, hi in in_prompt.free(ps, ps + length)]
    out, a, b = [], 0, 0
    while a < len(by_chunk) and b < len(by_prompt):
        lo = max(by_chunk[a][0], by_prompt[b][0])
        hi = min(by_chunk[a][1], by_prompt[b][1])
        if lo < hi:
            out.append((lo, hi))
        if by_chunk[a][1] < by_prompt[b][1]:
            a += 1
        else:
            b += 1
    return out


def align(prompt: Tokens, chunk: Tokens, min_length: int = MIN_LENGTH) -> list[Span]:
    """The spans of ``chunk`` that occur in ``prompt`` (see :class:`PromptIndex`)."""
    return PromptIndex(prompt, min_length).align(chunk)


def covered(spans: Sequence[Span]) -> int:
    """Tokens of the chunk the spans reuse."""
    return sum(s.length for s in spans)
