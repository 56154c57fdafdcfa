"""The two-sample Kolmogorov-Smirnov test, without scipy: is one sample's distribution
different from the other's?

The statistic D is the largest gap between the two empirical CDFs. Its p-value is the
chance that D is at least as large when both samples come from one continuous
distribution, i.e. among all ways of splitting the pooled sample into groups of ``m``
and ``n``. Seen as a lattice path from (0, 0) to (m, n) (a step right for each value of
the first sample, up for the second, in sorted order), D is the largest
``|i/m - j/n|`` on the path, and the p-value the share of the ``C(m+n, m)`` paths that
reach it::

    j ^         . . . . *      a path stays inside the band |i*n - j*m| < D*m*n;
      |       . . . * * .      the p-value is 1 - (paths inside) / C(m+n, m)
      |     . . * * . . .
      |   . * * . . . . .
      +-*-*---------------> i

The count is exact (Python integers), so even a tiny p-value is exact, and it matches
scipy's ``ks_2samp(method="exact")``. Past ``EXACT_LIMIT`` (m*n) the count would take
long, and the p-value is Kolmogorov's limit distribution at ``sqrt(mn/(m+n)) * D``.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EXACT_LIMIT", "KSResult", "kolmogorov_sf", "ks_2samp"]

EXACT_LIMIT = 4_000_000  # m*n up to which the p-value is counted exactly (under a second)


@dataclass(frozen=True)
class KSResult:
    statistic: float  # D, the largest gap between the two empirical CDFs, in [0, 1]
    p_value: float
    method: str  # "exact" or "asymptotic"
    n1: int
    n2: int


def ks_2samp(a: Sequence[float], b: Sequence[float], method: str = "auto") -> KSResult:
    """Two-sided two-sample KS test of ``a`` against ``b``. ``method``: "exact",
    "asymptotic", or "auto" (exact up to ``EXACT_LIMIT``)."""
    if not a or not b:
        raise ValueError("the KS test needs two non-empty samples")
    if method not in ("auto", "exact", "asymptotic"):
        raise ValueError(f"unknown method {method!r}; valid: auto, exact, asymptotic")
    m, n = len(a), len(b)
    gap = _largest_gap(sorted(a), sorted(b))
    exact = method == "exact" or (method == "auto" and m * n <= EXACT_LIMIT)
    p = _exact_p(m, n, gap) if exact else kolmogorov_sf(math.sqrt(m * n / (m + n)) * gap / (m * n))
    return KSResult(gap / (m * n), min(1.0, max(0.0, p)), "exact" if exact else "asymptotic", m, n)


def _largest_gap(a: list[float], b: list[float]) -> int:
    """D * m * n, an integer: the CDFs are compared at every pooled value, after all the
    values tied with it (so ties never make a gap of their own)."""
    m, n = len(a), len(b)
    return max(abs(bisect_right(a, x) * n - bisect_right(b, x) * m) for x in (*a, *b))


def _exact_p(m: int, n: int, gap: int) -> float:
    """The share of lattice paths from (0, 0) to (m, n) that touch ``|i*n - j*m| >= gap``."""
    if gap == 0:
        return 1.0
    # NOTE: row by row, inside[j] is the number of paths to (i, j) that stayed inside the band.
    inside = [1 if j * m < gap else 0 for j in range(n + 1)]
    for j in range(1, n + 1):
        inside[j] = inside[j - 1] if inside[j] else 0
    for i in range(1, m + 1):
        inside[0] = inside[0] if i * n < gap else 0
        for j in range(1, n + 1):
            inside[j] = inside[j] + inside[j - 1] if abs(i * n - j * m) < gap else 0
    total = math.comb(m + n, m)
    return (total - inside[n]) / total  # NOTE: int / int is correctly rounded, even for huge ints


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for Kolmogorov's distribution (scipy.special.kolmogorov): two series, each
    where it converges in a few terms."""
    if x < 0.1:
        return 1.0  # the CDF is below 1e-50 here
    if x < 1.0:  # the CDF's theta-function form: sqrt(2 pi)/x * sum exp(-(2k-1)^2 pi^2 / (8 x^2))
        w = -(math.pi**2) / (8 * x * x)
        cdf = math.sqrt(2 * math.pi) / x * sum(math.exp(w * (2 * k - 1) ** 2) for k in range(1, 8))
        return 1.0 - cdf
    return 2 * sum((1 if k % 2 else -1) * math.exp(-2 * k * k * x * x) for k in range(1, 12))
