"""The Gittins index of a discrete reuse-time distribution (``GittinsPolicy``'s table).

NOTE: sim/native/_kernel.c computes the same table with the same double operations in the
same order, so that both engines of a replay rank blocks identically (a tie broken
differently would change a victim): change one, change the other.
"""

from __future__ import annotations

__all__ = ["gittins_index"]


def gittins_index(hits: list[float], risk: list[float]) -> list[float]:
    """The index at each age bin of a discrete reuse-time distribution given by its
    hazard ``hits[x] / risk[x]``: ``max_{T > a} sum_{a<=x<T} S(x) h(x) / sum_{a<=x<T} S(x)``.

    NOTE: the maximum over T is the steepest slope from point ``a`` to a later point of
    the curve (cumulative occupancy, cumulative hits); scanning ``a`` from the right
    and keeping the upper convex hull of the points to its right gives every index in
    O(n log n) without numpy (the C kernel can do the same)."""
    n = len(hits)
    xs, ys = [0.0] * (n + 1), [0.0] * (n + 1)
    surv = 1.0
    for x in range(n):
        h = hits[x] / risk[x] if risk[x] > 0 else 0.0
        h = 0.0 if h < 0.0 else (1.0 if h > 1.0 else h)
        xs[x + 1] = xs[x] + surv
        ys[x + 1] = ys[x] + surv * h
        surv *= 1.0 - h
    index = [0.0] * n
    hull: list[int] = []  # upper hull of points a+1..n, leftmost last
    for a in range(n - 1, -1, -1):
        p = a + 1
        # NOTE: points with equal x (survival reached 0) add no occupancy: keep the higher.
        while hull and xs[hull[-1]] <= xs[p]:
            if ys[hull[-1]] > ys[p]:
                p = -1
                break
            hull.pop()
        if p >= 0:
            while len(hull) >= 2 and _cross(xs, ys, p, hull[-1], hull[-2]) >= 0:
                hull.pop()
            hull.append(p)
        # the slope from a to hull[i] rises then falls along the hull: binary search
        lo, hi = 0, len(hull) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if _slope(xs, ys, a, hull[mid]) < _slope(xs, ys, a, hull[mid + 1]):
                lo = mid + 1
            else:
                hi = mid
        index[a] = max(_slope(xs, ys, a, hull[lo]), 0.0) if hull else 0.0
    return index


def _slope(xs: list[float], ys: list[float], a: int, b: int) -> float:
    dx = xs[b] - xs[a]
    return (ys[b] - ys[a]) / dx if dx > 0 else 0.0


def _cross(xs: list[float], ys: list[float], o: int, a: int, b: int) -> float:
    """> 0 when o -> a -> b turns left (a lies below the segment o-b: not on the upper hull)."""
    return (xs[a] - xs[o]) * (ys[b] - ys[o]) - (ys[a] - ys[o]) * (xs[b] - xs[o])
