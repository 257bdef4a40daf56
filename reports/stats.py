"""The significance test the gate and the report share: a two-sided Mann-Whitney U test over per-repeat
samples, implemented here (exact permutation distribution, or the tie-corrected normal approximation) so the
package needs no scipy."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05
MIN_SAMPLES = 3  # with fewer samples on a side a shift is never called significant
EXACT_MAX_N = 100  # "auto" uses the exact permutation distribution up to this many samples in all


@dataclass(slots=True)
class MannWhitney:
    u: float  # U of the first sample: the number of (x, y) pairs with x > y, ties counting 1/2
    p: float  # two-sided
    method: str  # "exact" | "asymptotic"


def _doubled_midranks(values) -> tuple[list[int], list[int]]:
    """Twice the mid-rank of each value (an integer), and the sizes of the tie groups."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks2, ties, i = [0] * len(values), [], 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks2[order[k]] = i + j + 2  # ranks i+1 .. j+1, doubled mean
        ties.append(j - i + 1)
        i = j + 1
    return ranks2, ties


def _exact_p(ranks2: list[int], n1: int, r1_2: int) -> float:
    """Two-sided p of the first sample's (doubled) rank sum over all C(N, n1) equally likely splits of the
    pooled values - the exact permutation distribution, correct with ties too."""
    total = sum(ranks2)
    dist = np.zeros((n1 + 1, total + 1))  # dist[k, s]: k-subsets of the values so far with doubled rank sum s
    dist[0, 0] = 1.0
    for i, w in enumerate(ranks2):
        for k in range(min(i + 1, n1), 0, -1):
            dist[k, w:] += dist[k - 1, :total + 1 - w]
    d = dist[n1] / dist[n1].sum()
    return float(min(1.0, 2 * min(d[:r1_2 + 1].sum(), d[r1_2:].sum())))


def mann_whitney_u(x, y, method: str = "auto") -> MannWhitney:
    """Two-sided Mann-Whitney U test (scipy.stats.mannwhitneyu's conventions, without scipy).

    ``exact``: the permutation distribution of the rank sum, counted by dynamic programming over (doubled)
    mid-ranks, so ties are handled exactly. ``asymptotic``: the normal approximation with the tie-corrected
    variance ``n1 n2 / 12 * ((N + 1) - sum(t^3 - t) / (N (N - 1)))`` and a 0.5 continuity correction.
    ``auto``: exact up to :data:`EXACT_MAX_N` values in all, asymptotic beyond.
    """
    x, y = [float(v) for v in x], [float(v) for v in y]
    n1, n2 = len(x), len(y)
    if not n1 or not n2:
        raise ValueError("mann_whitney_u needs at least one value in each sample")
    if method not in ("auto", "exact", "asymptotic"):
        raise ValueError(f"method must be auto, exact or asymptotic, got {method!r}")
    ranks2, ties = _doubled_midranks(x + y)
    r1_2 = sum(ranks2[:n1])
    u = r1_2 / 2 - n1 * (n1 + 1) / 2
    n = n1 + n2
    if method == "exact" or (method == "auto" and n <= EXACT_MAX_N):
        return MannWhitney(u, _exact_p(ranks2, n1, r1_2), "exact")
    var = n1 * n2 / 12 * ((n + 1) - sum(t ** 3 - t for t in ties) / (n * (n - 1)))
    if var <= 0:  # every value equal
        return MannWhitney(u, 1.0, "asymptotic")
    z = max(abs(u - n1 * n2 / 2) - 0.5, 0.0) / math.sqrt(var)
    return MannWhitney(u, min(1.0, math.erfc(z / math.sqrt(2))), "asymptotic")


@dataclass(slots=True)
class Shift:
    """Whether candidate samples differ from baseline samples: ``direction`` +1 when the candidate's values
    tend to be larger, -1 smaller, 0 none; ``significant`` needs p < alpha and MIN_SAMPLES on each side."""

    p: float | None
    significant: bool
    direction: int
    n_baseline: int
    n_candidate: int
    powerless: bool  # these sample sizes cannot reach p < alpha at all


def rank_test(baseline, candidate, alpha: float = ALPHA) -> Shift:
    """The gate's (and the report's) significance test over two lists of per-repeat samples (None dropped)."""
    b = [float(v) for v in baseline or [] if v is not None]
    c = [float(v) for v in candidate or [] if v is not None]
    if not b or not c:
        return Shift(None, False, 0, len(b), len(c), True)
    mw = mann_whitney_u(b, c)
    mid = len(b) * len(c) / 2
    direction = 0 if mw.u == mid else (-1 if mw.u > mid else 1)  # U counts baseline > candidate pairs
    best = mann_whitney_u(range(len(b)), range(len(b), len(b) + len(c))).p  # fully separated samples
    powerless = min(len(b), len(c)) < MIN_SAMPLES or best >= alpha
    return Shift(mw.p, not powerless and mw.p < alpha, direction, len(b), len(c), powerless)


@dataclass(slots=True)
class Spread:
    """How far a run's per-repeat samples spread around the median it reports (None dropped)."""

    n: int
    median: float | None
    stdev: float | None  # sample standard deviation (n - 1); None below two samples
    low: float | None
    high: float | None

    def text(self, spec: str = ".1f") -> str:
        """``"91.7 ± 1.3 (n=3)"``; ``"91.7 (n=1)"``; ``"-"`` without samples."""
        if self.median is None:
            return "-"
        sd = "" if self.stdev is None else f" ± {self.stdev:{spec}}"
        return f"{self.median:{spec}}{sd} (n={self.n})"


def spread(samples) -> Spread:
    """The median, sample standard deviation and range of per-repeat samples (the numbers a "± sd" column shows)."""
    vals = [float(v) for v in samples or [] if v is not None and not isinstance(v, bool)]
    if not vals:
        return Spread(0, None, None, None, None)
    n = len(vals)
    mid = sorted(vals)[n // 2] if n % 2 else sum(sorted(vals)[n // 2 - 1:n // 2 + 1]) / 2
    sd = float(np.std(vals, ddof=1)) if n > 1 else None
    return Spread(n, mid, sd, min(vals), max(vals))
