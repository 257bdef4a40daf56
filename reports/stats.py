"""The significance test the gate and the report share: a two-sided Mann-Whitney U test over per-repeat
samples, implemented here (exact permutation distribution, or the tie-corrected normal approximation) so the
package needs no scipy."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

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


def median_ci(samples, confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``samples`` (None dropped): the order statistics
    ``(x_(k), x_(n+1-k))`` with the largest k whose coverage ``1 - 2 P(Binomial(n, 1/2) <= k - 1)`` is at least
    ``confidence`` (exact for any continuous distribution). ``(-inf, inf)`` where even (min, max) covers less
    (95%: fewer than 6 samples)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    vals = sorted(float(v) for v in samples or [] if v is not None)
    n, k, tail = len(vals), 0, 0.0
    while k < n // 2:  # tail: P(B <= k) for the candidate k + 1
        tail += math.comb(n, k) / 2 ** n
        if 1 - 2 * tail < confidence:
            break
        k += 1
    return (vals[k - 1], vals[n - k]) if k else (-math.inf, math.inf)


# ---- the gate's interval: the Hodges-Lehmann shift and its distribution-free (Moses) confidence interval ----------
EXACT_INTERVAL_MAX_N = 100  # the exact null distribution of U up to this many samples in all, the normal beyond
_PAIRS_IN_MEMORY = 1 << 20  # pairwise differences held at once; beyond, order statistics are found by bisection
HL_EFFICIENCY = 3 / math.pi  # of the Hodges-Lehmann shift relative to a difference of means, on normal samples


@dataclass(slots=True)
class ShiftInterval:
    """The shift of candidate samples against baseline samples (candidate - baseline, in their units): the
    Hodges-Lehmann estimate (the median of all pairwise differences) and its two-sided ``level`` confidence interval
    from the order statistics of those differences (Moses; the interval that inverts the Mann-Whitney U test).
    ``low`` and ``high`` are None when these sample sizes are too few for any interval at that level."""

    estimate: float
    low: float | None
    high: float | None
    level: float
    n_baseline: int
    n_candidate: int


@functools.lru_cache(maxsize=1024)
def _u_null_cdf(m: int, n: int) -> tuple[float, ...]:
    """P(U <= u) for u = 0 .. m n under no shift, without ties: the coefficients of the Gaussian binomial
    [m + n choose m]_q (prod_{i=1..m} (1 - q^(n+i)) / (1 - q^i)), in exact integers."""
    size = m * n + 1
    poly = [1] + [0] * (size - 1)
    for i in range(1, m + 1):
        for u in range(size - 1, n + i - 1, -1):  # times (1 - q^(n+i))
            poly[u] -= poly[u - n - i]
        for u in range(i, size):  # divided by (1 - q^i): a running sum with stride i
            poly[u] += poly[u - i]
    total, acc, out = sum(poly), 0, []
    for count in poly:
        acc += count
        out.append(acc / total)
    return tuple(out)


def interval_rank(m: int, n: int, alpha: float) -> int:
    """k such that [D_(k), D_(mn+1-k)] of the m n ordered pairwise differences is a two-sided ``1 - alpha`` interval:
    the largest k with P(U <= k - 1) <= alpha / 2 under no shift. 0 when these sizes give no interval at all."""
    if m < 1 or n < 1:
        return 0
    if m + n <= EXACT_INTERVAL_MAX_N:
        cdf = _u_null_cdf(min(m, n), max(m, n))
        k = 0
        while k < len(cdf) and cdf[k] <= alpha / 2:
            k += 1
        return min(k, (m * n + 1) // 2)
    z = NormalDist().inv_cdf(1 - alpha / 2)
    k = math.floor(m * n / 2 - 0.5 - z * math.sqrt(m * n * (m + n + 1) / 12)) + 1
    return max(0, min(k, (m * n + 1) // 2))


def min_interval_samples(alpha: float) -> int:
    """The fewest samples a side (as many on each) that give a ``1 - alpha`` interval at all (5 at alpha 0.01)."""
    n = 1
    while interval_rank(n, n, alpha) < 1:
        n += 1
    return n


def _kth_difference(b: np.ndarray, c: np.ndarray, k: int) -> float:
    """The k-th smallest (1-based) of the pairwise differences c_j - b_i (b and c sorted)."""
    if len(b) * len(c) <= _PAIRS_IN_MEMORY:
        d = np.subtract.outer(c, b).ravel()
        return float(np.partition(d, k - 1)[k - 1])
    lo, hi = float(c[0] - b[-1]), float(c[-1] - b[0])

    def at_most(x: float) -> int:  # how many differences are <= x: for each c_j, the b_i >= c_j - x
        return int(np.sum(len(b) - np.searchsorted(b, c - x, side="left")))

    while True:  # bisection over the values: hi always has at least k differences at or below it
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            return hi
        if at_most(mid) >= k:
            hi = mid
        else:
            lo = mid


def _listed(values) -> list:
    return [] if values is None else list(values)


def shift_interval(baseline, candidate, alpha: float) -> ShiftInterval:
    """The Hodges-Lehmann shift of ``candidate`` against ``baseline`` (None values dropped) with its two-sided
    ``1 - alpha`` interval (None bounds below :func:`min_interval_samples`). Distribution-free: it assumes only
    that the samples are independent repeats, and one wild sample moves it by at most one order statistic."""
    b = np.sort(np.array([float(v) for v in _listed(baseline) if v is not None]))
    c = np.sort(np.array([float(v) for v in _listed(candidate) if v is not None]))
    if not len(b) or not len(c):
        raise ValueError("shift_interval needs at least one value in each sample")
    total = len(b) * len(c)
    half = (total + 1) // 2
    estimate = _kth_difference(b, c, half) if total % 2 else \
        (_kth_difference(b, c, half) + _kth_difference(b, c, half + 1)) / 2
    k = interval_rank(len(b), len(c), alpha)
    low = _kth_difference(b, c, k) if k else None
    high = _kth_difference(b, c, total + 1 - k) if k else None
    return ShiftInterval(estimate, low, high, 1 - alpha, len(b), len(c))


def robust_sd(samples) -> float | None:
    """A spread of per-repeat samples that one wild sample does not blow up: 1.4826 x the median absolute
    deviation (the standard deviation, for normal samples), or the sample standard deviation where that is 0 (most
    samples equal). None below two samples."""
    vals = np.array([float(v) for v in _listed(samples) if v is not None])
    if len(vals) < 2:
        return None
    mad = 1.4826 * float(np.median(np.abs(vals - np.median(vals))))
    return mad if mad > 0 else float(np.std(vals, ddof=1))


def samples_for_half_width(sd: float, half_width: float, alpha: float) -> int:
    """Samples a side (as many on each) at which the ``1 - alpha`` Hodges-Lehmann interval of a shift between two
    samples of standard deviation ``sd`` is about ``half_width`` wide on either side of its estimate: the normal
    approximation z sd sqrt(2 / n) over the estimator's efficiency 3 / pi."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    if half_width <= 0:
        return 10 ** 6
    return math.ceil(2 * (z * sd / half_width) ** 2 / HL_EFFICIENCY)
