"""Small helpers shared by the tests."""

from __future__ import annotations


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (the reference for the
    cache's own matching)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Clock:
    """An injected clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
