"""Means, 95 % intervals and win / loss verdicts over seeds (what ``crossflow compare`` reports).

Every compared point runs the same seeds for every policy (same arrivals per seed), so a change vs
static is **paired by seed**: per seed ``x_s = ln(policy_s / static_s)``, then a Student t-interval on
the mean of ``x_s`` (``n - 1`` degrees of freedom), mapped back with ``exp(.) - 1``. The reported
change is the geometric mean ratio minus one, so +10 % and -9.1 % are the same distance from zero,
and a change aggregated over several points is the per-seed mean of their log-ratios (one value per
seed, then the same interval). A win or loss is claimed only when the interval excludes zero;
otherwise the verdict is ``"n.s."`` (with one seed there is no interval: ``"n.s."`` too).

Plain metrics (a TTFT p99 in seconds) get the arithmetic mean over seeds and the t-interval of that
mean. Pure functions; no dependency beyond the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

CONFIDENCE = 0.95
Verdict = Literal["win", "loss", "n.s."]


def student_t_cdf_abs(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with integer ``df >= 1`` (Abramowitz & Stegun 26.7.3-4)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if t <= 0:
        return 0.0
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 1:
        total, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):  # cos + 2/3 cos^3 + (2*4)/(3*5) cos^5 + ...
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        return (2.0 / math.pi) * (theta + s * total)
    total, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):  # 1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ...
        total += term
        term *= c2 * (2 * k - 1) / (2 * k)
    return s * total


def t_critical(df: int, confidence: float = CONFIDENCE) -> float:
    """Two-sided critical value: ``t`` with ``P(|T| <= t) = confidence`` (12.706 for df=1 at 95 %)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    lo, hi = 0.0, 1.0
    while student_t_cdf_abs(hi, df) < confidence:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf_abs(mid, df) < confidence:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided ``CONFIDENCE`` interval over ``n`` seeds (bounds NaN when ``n < 2``)."""

    mean: float
    low: float
    high: float
    n: int

    def excludes_zero(self) -> bool:
        return self.n >= 2 and (self.low > 0.0 or self.high < 0.0)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


NO_DATA = Interval(math.nan, math.nan, math.nan, 0)


def _finite(values: Iterable[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _t_interval(xs: Sequence[float], confidence: float) -> tuple[float, float, float]:
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_critical(n - 1, confidence) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def mean_interval(values: Iterable[float], confidence: float = CONFIDENCE) -> Interval:
    """Arithmetic mean of the finite ``values`` and the t-interval of that mean."""
    xs = _finite(values)
    if not xs:
        return NO_DATA
    mean, low, high = _t_interval(xs, confidence)
    return Interval(mean, low, high, len(xs))


def log_ratio_interval(log_ratios: Iterable[float], confidence: float = CONFIDENCE) -> Interval:
    """Relative change from per-seed log-ratios: ``exp(mean) - 1`` with ``exp(bounds) - 1``."""
    xs = _finite(log_ratios)
    if not xs:
        return NO_DATA
    mean, low, high = _t_interval(xs, confidence)
    return Interval(math.expm1(mean), math.expm1(low), math.expm1(high), len(xs))


def difference_interval(
    values: Iterable[float], reference: Iterable[float], confidence: float = CONFIDENCE
) -> Interval:
    """``mean(values) - mean(reference)`` of two independent samples (the finite entries) and its
    Welch t-interval, the Welch-Satterthwaite degrees of freedom rounded down (a little wider than
    exact). ``n`` is the smaller sample's size; bounds NaN unless both have two or more values."""
    xs, ys = _finite(values), _finite(reference)
    if not xs or not ys:
        return NO_DATA
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    n = min(len(xs), len(ys))
    if n < 2:
        return Interval(mx - my, math.nan, math.nan, n)
    vx = sum((x - mx) ** 2 for x in xs) / (len(xs) - 1) / len(xs)
    vy = sum((y - my) ** 2 for y in ys) / (len(ys) - 1) / len(ys)
    if vx + vy == 0.0:
        return Interval(mx - my, mx - my, mx - my, n)
    df = (vx + vy) ** 2 / (vx**2 / (len(xs) - 1) + vy**2 / (len(ys) - 1))
    half = t_critical(max(1, math.floor(df)), confidence) * math.sqrt(vx + vy)
    return Interval(mx - my, mx - my - half, mx - my + half, n)


def log_ratio(value: float, reference: float) -> float:
    """``ln(value / reference)``; NaN when either is non-positive or not finite (no ratio exists)."""
    if not (math.isfinite(value) and math.isfinite(reference)) or value <= 0 or reference <= 0:
        return math.nan
    return math.log(value / reference)


def paired_change(
    values: Mapping[int, float], reference: Mapping[int, float], confidence: float = CONFIDENCE
) -> Interval:
    """Change of ``values`` vs ``reference`` (both seed -> value), paired on the seeds they share."""
    seeds = sorted(set(values) & set(reference))
    return log_ratio_interval((log_ratio(values[s], reference[s]) for s in seeds), confidence)


def aggregate_change(pairs: Iterable[tuple[int, float, float]], confidence: float = CONFIDENCE) -> Interval:
    """Change over several points: ``(seed, value, reference)`` triples; per seed the mean log-ratio
    over its points (a geometric mean), then the interval over seeds."""
    by_seed: dict[int, list[float]] = {}
    for seed, value, reference in pairs:
        x = log_ratio(value, reference)
        if math.isfinite(x):
            by_seed.setdefault(seed, []).append(x)
    return log_ratio_interval((sum(xs) / len(xs) for xs in by_seed.values()), confidence)


def verdict(change: Interval, higher_is_better: bool) -> Verdict:
    """``"win"`` / ``"loss"`` when the interval of a change excludes zero, else ``"n.s."``."""
    if not change.excludes_zero():
        return "n.s."
    better = change.low > 0.0 if higher_is_better else change.high < 0.0
    return "win" if better else "loss"


__all__ = [
    "CONFIDENCE",
    "NO_DATA",
    "Interval",
    "Verdict",
    "aggregate_change",
    "log_ratio",
    "log_ratio_interval",
    "mean_interval",
    "paired_change",
    "student_t_cdf_abs",
    "t_critical",
    "verdict",
]
