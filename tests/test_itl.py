"""The ITL histogram: exact mean, quantiles within the stated bound, one result however iterations group."""

from __future__ import annotations

import math

import numpy as np
import pytest

from envs.itl import QUANTILE_RELATIVE_ERROR, ItlHistogram, bucket_of, buckets_of, to_ns
from envs.metrics import weighted_quantiles


def test_quantiles_are_within_the_documented_bound_of_exact() -> None:
    rng = np.random.default_rng(7)
    values = np.concatenate([rng.lognormal(np.log(0.006), 0.4, 20_000), rng.uniform(0.02, 2.0, 300)])
    weights = rng.integers(1, 64, len(values))
    hist = ItlHistogram()
    for v, w in zip(values.tolist(), weights.tolist(), strict=True):
        hist.add(v, w)
    qs = [0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0]
    exact = weighted_quantiles(np.rint(values * 1e9) * 1e-9, weights.astype(float), qs)
    for got, want in zip(hist.quantiles_s(qs), exact, strict=True):
        assert abs(got - want) <= QUANTILE_RELATIVE_ERROR * want + 1e-12
    exact_mean = float(np.sum(np.rint(values * 1e9) * weights) / weights.sum()) * 1e-9
    assert hist.mean_s == pytest.approx(exact_mean, rel=1e-15)
    assert hist.tokens == int(weights.sum())


def test_scalar_array_and_ascending_paths_agree_exactly() -> None:
    times = 0.005 + np.arange(5000) * 3e-8  # a long jump: slowly growing iterations
    one_by_one, vector, ascending = ItlHistogram(), ItlHistogram(), ItlHistogram()
    for t in times.tolist():
        one_by_one.add(t, 7)
    vector.add_many(times, 7)
    ascending.add_many(times, 7, ascending=True)
    for h in (vector, ascending):
        assert h.weighted_ns == one_by_one.weighted_ns and h.tokens == one_by_one.tokens
        np.testing.assert_array_equal(h.values_and_weights()[1], one_by_one.values_and_weights()[1])
    ns = np.array([1, 2047, 2048, 2049, 4095, 4096, 10**9, 123_456_789], dtype=np.int64)
    assert buckets_of(ns).tolist() == [bucket_of(int(v)) for v in ns]
    assert to_ns(0.0000000015) == 2 and to_ns(0.0000000025) == 2  # half to even, as numpy.rint


def test_empty_histogram_is_nan_not_an_error() -> None:
    h = ItlHistogram()
    assert math.isnan(h.mean_s) and all(math.isnan(q) for q in h.quantiles_s([0.5, 0.99]))
    h.add(0.01, 0)
    assert h.tokens == 0
