"""Seed intervals and verdicts on hand-made samples."""

from __future__ import annotations

import math

import pytest

from train import stats


@pytest.mark.parametrize(
    ("df", "expected"),
    [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622), (29, 2.0452), (200, 1.9719)],
)
def test_t_critical_matches_the_tables(df: int, expected: float) -> None:
    assert stats.t_critical(df) == pytest.approx(expected, abs=1e-4)


def test_t_cdf_is_a_distribution() -> None:
    for df in (1, 2, 5, 8):
        values = [stats.student_t_cdf_abs(t, df) for t in (0.0, 0.5, 1.0, 3.0, 1e4)]
        assert values[0] == 0.0 and values == sorted(values) and values[-1] == pytest.approx(1.0, abs=1e-3)
    # df = 1 is Cauchy: P(|T| <= 1) = 1/2
    assert stats.student_t_cdf_abs(1.0, 1) == pytest.approx(0.5)


def test_paired_change_by_hand() -> None:
    static = {0: 100.0, 1: 100.0, 2: 100.0}
    policy = {0: 110.0, 1: 121.0, 2: 100.0}
    change = stats.paired_change(policy, static)
    logs = [math.log(1.1), math.log(1.21), 0.0]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    half = 4.302653 * sd / math.sqrt(3)
    assert change.n == 3
    assert change.mean == pytest.approx(math.exp(mean) - 1)  # geometric mean: +10 %
    assert change.mean == pytest.approx(0.1)
    assert (change.low, change.high) == pytest.approx((math.exp(mean - half) - 1, math.exp(mean + half) - 1))
    assert change.low < 0 < change.high
    assert stats.verdict(change, higher_is_better=True) == "n.s."


def test_verdicts_follow_the_direction_of_the_metric() -> None:
    static = {s: 10.0 for s in range(5)}
    lower = {s: v for s, v in enumerate([8.0, 8.2, 7.9, 8.1, 8.0])}  # ~-20 %, tight
    change = stats.paired_change(lower, static)
    assert change.high < 0
    assert stats.verdict(change, higher_is_better=False) == "win"  # e.g. a TTFT
    assert stats.verdict(change, higher_is_better=True) == "loss"  # e.g. a throughput
    # pairing: a seed only the policy has is ignored
    assert stats.paired_change({**lower, 9: 100.0}, static) == change


def test_one_seed_gives_no_interval_and_no_claim() -> None:
    change = stats.paired_change({0: 2.0}, {0: 1.0})
    assert change.mean == pytest.approx(1.0) and math.isnan(change.low) and change.n == 1
    assert stats.verdict(change, higher_is_better=True) == "n.s."
    assert stats.paired_change({}, {}) == stats.NO_DATA


def test_aggregate_change_is_a_per_seed_geometric_mean() -> None:
    # seed 0: ratios 2 and 0.5 (geo-mean 1); seed 1: 1.21 and 1 (geo-mean 1.1)
    pairs = [(0, 2.0, 1.0), (0, 0.5, 1.0), (1, 12.1, 10.0), (1, 3.0, 3.0), (1, math.nan, 1.0)]
    change = stats.aggregate_change(pairs)
    assert change.n == 2
    assert change.mean == pytest.approx(math.sqrt(1.1) - 1)


def test_mean_interval_by_hand() -> None:
    it = stats.mean_interval([1.0, 2.0, 3.0, math.nan])
    assert it.n == 3 and it.mean == pytest.approx(2.0)
    assert (it.low, it.high) == pytest.approx((2 - 4.302653 / math.sqrt(3), 2 + 4.302653 / math.sqrt(3)))
    assert stats.log_ratio(0.0, 1.0) != stats.log_ratio(0.0, 1.0)  # NaN: no ratio with a zero


def test_difference_interval_by_hand() -> None:
    xs, ys = [1.0, 2.0, 3.0], [0.0, 0.0, 1.0, 3.0]
    it = stats.difference_interval(xs, ys)
    vx, vy = 1.0 / 3, 2.0 / 4  # sample variances 1 and 2, over the sizes
    df = (vx + vy) ** 2 / (vx**2 / 2 + vy**2 / 3)  # 4.86: rounded down to 4
    half = 2.776445 * math.sqrt(vx + vy)
    assert math.floor(df) == 4
    assert it.n == 3 and it.mean == pytest.approx(1.0)
    assert (it.low, it.high) == pytest.approx((1.0 - half, 1.0 + half), abs=1e-5)
    # equal samples with no spread: a point; one value on a side: no interval, no claim
    assert stats.difference_interval([2.0, 2.0], [1.0, 1.0, math.nan]) == stats.Interval(1.0, 1.0, 1.0, 2)
    one = stats.difference_interval([2.0], [1.0, 3.0])
    assert one.mean == 0.0 and math.isnan(one.low) and not one.excludes_zero()
    assert stats.difference_interval([], [1.0]) is stats.NO_DATA
