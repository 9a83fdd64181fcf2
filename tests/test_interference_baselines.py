"""Baselines, equal-safety metrics and targets, checked by hand or against the label derivation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from envs.cost_model import CostModel
from envs.profiler import datasheet_roofline, simulate_profiles
from interference_model.baselines import (
    InvertedTimeModel,
    LinearBaseline,
    UtilisationThresholdBaseline,
    assumed_checkpoints,
)
from interference_model.evaluate import Targets, check_targets, evaluate
from interference_model.fit import FitConfig
from interference_model.labels import LABEL, LeaseLabel, derive_labels
from interference_model.metrics import metrics_at_unsafe_share, scale_to_unsafe_share
from interference_model.schema import FEATURES
from tests.test_interference_model import FakeCostModel

LABEL_SPEC = LeaseLabel.parse("1.5x|25ms", horizon_s=2.0)
CHUNKS = (64, 256, 1024, 4096)


def test_inverted_model_reproduces_a_single_checkpoint_profile() -> None:
    # With one checkpoint there is no evolution to assume: inverting the very timer that made the
    # noise-free profile must give its labels back.
    cm = FakeCostModel()
    profile = simulate_profiles(
        "FAKE",
        "m",
        1,
        60,
        seed=5,
        repeats=1,
        noise=None,
        cost_model=cm,
        chunk_sizes=CHUNKS,
        checkpoint_steps=(0,),
    )
    labels = derive_labels(profile, LABEL_SPEC)
    model = InvertedTimeModel(cm, LABEL_SPEC, CHUNKS, (0,), cm.kv_capacity_tokens)
    np.testing.assert_allclose(model.predict(labels[list(FEATURES)].to_numpy()), labels[LABEL], rtol=1e-9)


def test_assumed_checkpoints_by_hand() -> None:
    X = np.array([[10, 100.0, 0.0, 50.0, 0.1]])
    mean = assumed_checkpoints(X, (0, 40, 60), "all_at_mean")
    assert mean[["decode_step", "step_batch_size"]].to_numpy().tolist() == [[0, 10], [40, 10]]
    assert mean["step_context_tokens"].tolist() == [1000.0, 1400.0]
    exp = assumed_checkpoints(X, (0, 40, 60), "exponential")
    # round(10 * e^-0.8) = 4 requests of 140 tokens; round(10 * e^-1.2) = 3 of 160.
    assert exp["step_batch_size"].tolist() == [10, 4, 3]
    assert exp["step_context_tokens"].tolist() == [1000.0, 560.0, 480.0]
    with pytest.raises(ValueError, match="evolution"):
        assumed_checkpoints(X, (0,), "uniform")  # type: ignore[arg-type]


@pytest.mark.parametrize(("model", "tp"), [("gpt-oss-120b", 1), ("GLM-5", 8)])
def test_datasheet_roofline_is_a_lower_bound_of_the_calibrated_times(model: str, tp: int) -> None:
    sheet, cm = datasheet_roofline("H200", model, tp), CostModel("H200", model, tp=tp)
    rng = np.random.default_rng(0)
    chunk = rng.choice([0, 8, 256, 2048], 500)
    pairs = np.array([cm.prefill_attention_pairs(int(c), 0) for c in chunk])
    batch = rng.integers(1, 256, 500)
    ctx = batch * rng.uniform(100, 20000, 500)
    ideal = np.asarray(sheet.iteration_times_s(chunk, pairs, batch, ctx))
    real = cm.iteration_times_s(chunk, pairs, batch, ctx)
    assert (ideal < real).all() and (ideal > 0.2 * real).all()
    assert sheet.kv_capacity_tokens == cm.kv_capacity_tokens  # memory is not calibrated


def test_scaling_to_an_unsafe_share_by_hand() -> None:
    y = np.array([100.0, 100, 100, 100])
    pred = np.array([105.0, 210, 420, 100])
    # Ratios to the unsafe line (105): 1, 2, 4, 0.95. One unsafe state of four allowed: divide by 2.
    assert scale_to_unsafe_share(y, pred, 0.25) == pytest.approx(2.0)
    m = metrics_at_unsafe_share(y, pred, 0.25)
    assert m["unsafe_share"] == 0.25 and m["mape"] == pytest.approx((0.475 + 0.05 + 1.1 + 0.5) / 4)
    # A pessimistic predictor is scaled *up* to the same share.
    assert scale_to_unsafe_share(y, pred / 10, 0.25) == pytest.approx(0.2)
    zeros = metrics_at_unsafe_share(np.zeros(4), np.ones(4), 0.25)
    assert np.isnan(zeros["mape"])


def test_targets_by_hand() -> None:
    report = {
        "metrics": {"lightgbm": {"mape": 0.04, "unsafe_share": 0.015}},
        "at_equal_unsafe": {"datasheet_roofline": {"mape": 0.10}},
    }
    rows = check_targets(report, {"fast_predictor_us": 9.0, "fast_predictor_cpu_us": 12.0}, Targets())
    assert [r["met"] for r in rows] == [True, True, False, False]
    assert rows[3]["value"] == pytest.approx(2.5)
    assert check_targets(report, None)[2]["met"] is None


@pytest.fixture(scope="module")
def labels() -> pd.DataFrame:
    profile = simulate_profiles(
        "FAKE",
        "m",
        1,
        300,
        seed=2,
        repeats=2,
        cost_model=FakeCostModel(),
        chunk_sizes=CHUNKS,
        checkpoint_steps=(0, 32),
    )
    return derive_labels(profile, LABEL_SPEC)


def test_linear_and_utilisation_baselines(labels: pd.DataFrame) -> None:
    config = FitConfig(n_folds=3)
    linear = LinearBaseline(LABEL_SPEC, config).fit(labels)
    util = UtilisationThresholdBaseline().fit(labels)
    X = labels[list(FEATURES)].to_numpy()
    pred = linear.predict(X)
    assert (pred <= labels[LABEL].to_numpy() * 1.05 + 1e-9).mean() >= 0.95  # conservative in sample
    lent = util.predict(X)
    assert set(np.unique(lent)) <= {0.0, util.rate_}
    assert (lent[util.utilisation(X) >= util.threshold_] == 0).all()
    report = evaluate(labels, {"lightgbm": linear, "utilisation_threshold": util})
    eq = report["at_equal_unsafe"]["utilisation_threshold"]
    assert eq["unsafe_share"] <= report["metrics"]["lightgbm"]["unsafe_share"] + 1e-12
    with pytest.raises(RuntimeError, match="before fit"):
        LinearBaseline(LABEL_SPEC).predict(X)
