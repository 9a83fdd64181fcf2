"""Fit, fast predictor, artifact round trip and bad artifacts, on a tiny fake-cost-model profile."""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from envs.profiler import simulate_profiles
from interference_model.artifact import ArtifactError, load_predictor, save_artifact
from interference_model.fit import (
    DECODE_STEP_INPUT,
    MODEL_FEATURES,
    ConformalShift,
    FitConfig,
    FitResult,
    LeaseCap,
    conformal_log_shift,
    conformal_shift,
    fit_interference_model,
    group_kfold,
    mondrian_shift,
    pooled_shift,
)
from interference_model.labels import ITL_LABEL, LABEL, LeaseLabel, derive_labels
from interference_model.predictor import SafeThroughputPredictor
from interference_model.schema import FEATURES, profiles_sha256


class FakeCostModel:
    """Roofline-shaped stand-in for ``envs.cost_model.CostModel`` (same methods, no catalog)."""

    kv_capacity_tokens = 200_000

    @staticmethod
    def prefill_attention_pairs(new_tokens: float, cached_tokens: float) -> float:
        return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2

    def iteration_times_s(
        self,
        prefill_tokens: np.ndarray,
        prefill_attention_pairs: np.ndarray,
        decode_batch: np.ndarray,
        decode_context_tokens: np.ndarray,
    ) -> np.ndarray:
        memory_s = 4e-3 + np.asarray(decode_context_tokens, float) * 4e-8
        compute_s = (
            np.asarray(prefill_tokens, float) + decode_batch
        ) * 1e-5 + prefill_attention_pairs * 1e-11
        return 5e-4 + np.maximum(memory_s, compute_s) + 0.2 * np.minimum(memory_s, compute_s)


TARGET = LeaseLabel.parse("20ms", horizon_s=2.0)  # absolute: every physical monotone constraint applies
SMALL = FitConfig(num_boost_round=30, n_folds=3, num_leaves=15)
FAKE = {"cost_model": FakeCostModel(), "chunk_sizes": (64, 256, 1024, 4096), "checkpoint_steps": (0, 16, 48)}


@pytest.fixture(scope="module")
def profiles() -> pd.DataFrame:
    return simulate_profiles("FAKE", "fake-model", 1, 240, seed=3, repeats=3, **FAKE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fitted(profiles: pd.DataFrame) -> tuple[pd.DataFrame, FitResult]:
    labels = derive_labels(profiles, TARGET)
    return labels, fit_interference_model(labels, TARGET, SMALL)


@pytest.fixture()
def artifact(tmp_path: Path, fitted: tuple[pd.DataFrame, FitResult], profiles: pd.DataFrame) -> Path:
    return save_artifact(
        tmp_path / "art",
        fitted[1],
        hardware="FAKE",
        model="fake-model",
        tp=1,
        data_sha256=profiles_sha256(profiles),
        extra={"command": "pytest"},
    )


def test_profiler_is_deterministic_and_noise_is_separate(profiles: pd.DataFrame) -> None:
    again = simulate_profiles("FAKE", "fake-model", 1, 240, seed=3, repeats=3, **FAKE)  # type: ignore[arg-type]
    pd.testing.assert_frame_equal(profiles, again)
    clean = simulate_profiles("FAKE", "fake-model", 1, 240, seed=3, repeats=3, noise=None, **FAKE)  # type: ignore[arg-type]
    pd.testing.assert_frame_equal(profiles[list(FEATURES)], clean[list(FEATURES)])
    assert not np.allclose(profiles["iteration_time_s"], clean["iteration_time_s"])
    # Repeats of a noise-free point are identical; the running KV never exceeds capacity.
    point = ["state_id", "decode_step", "chunk_tokens"]
    assert clean.groupby(point)["iteration_time_s"].nunique().max() == 1
    states = profiles.drop_duplicates("state_id")
    used = states["decode_batch_size"] * states["context_tokens_mean"]
    assert (used <= states["kv_occupancy"] * states["kv_capacity_tokens"] + 1e-6).all()
    n_checkpoints = profiles.groupby("state_id")["decode_step"].nunique()
    assert len(profiles) == n_checkpoints.sum() * 4 * 3 and set(n_checkpoints) <= {1, 2, 3}


def test_group_kfold_keeps_groups_together() -> None:
    groups = np.repeat(np.arange(10), 3)
    folds = group_kfold(groups, 5, seed=0)
    seen = np.concatenate([te for _, te in folds])
    assert sorted(seen.tolist()) == list(range(30))
    for tr, te in folds:
        assert not set(groups[tr]) & set(groups[te])
    with pytest.raises(ValueError, match="at least 5 state groups"):
        group_kfold(np.zeros(10), 5, seed=0)


def test_conformal_shift_by_hand() -> None:
    y = np.full(99, 100.0)
    raw = np.log1p(1.05 * y) + np.linspace(-0.5, 0.48, 99)  # excess = -0.5 .. 0.48 in 0.01 steps
    shift = conformal_log_shift(raw, y, unsafe_target=0.05, unsafe_margin=0.05)
    # k = floor(0.05 * 100) - 1 = 4 unsafe allowed: shift = 5th largest excess = 0.44.
    assert shift == pytest.approx(0.44)
    assert np.sum(raw - shift > np.log1p(1.05 * y)) == 4


def test_mondrian_shift_per_batch_bin() -> None:
    batch = np.repeat([2.0, 50.0], 200)
    excess = np.r_[np.linspace(-0.2, 0.0, 200), np.linspace(-0.1, 0.3, 200)]
    config = FitConfig(unsafe_target=0.05, shift_batch_edges=(10.0,), min_states_per_shift_bin=100)
    free = mondrian_shift(excess, batch, config, mono_batch=0)
    # Each bin allows floor(0.05 * 201) - 1 = 9 unsafe states: its 10th largest excess.
    assert free.log_shifts == pytest.approx((excess[:200][-10], excess[200:][-10]))
    assert (
        free.for_batch(np.array([1.0, 9.9, 10.0, 500.0])).tolist()
        == [free.log_shifts[0]] * 2 + [free.log_shifts[1]] * 2
    )
    # Constrained non-increasing in batch: shifts must not fall as batch grows.
    reversed_bins = mondrian_shift(excess, batch[::-1].copy(), config, mono_batch=-1)
    assert reversed_bins.log_shifts[1] >= reversed_bins.log_shifts[0]
    sparse = FitConfig(unsafe_target=0.05, shift_batch_edges=(10.0,), min_states_per_shift_bin=300)
    glob = conformal_shift(excess, 0.05)
    assert mondrian_shift(excess, batch, sparse, mono_batch=0).log_shifts == (glob, glob)


def _hand_states(
    batch: np.ndarray, excess: np.ndarray
) -> tuple[np.ndarray, pd.DataFrame, LeaseCap, np.ndarray]:
    """States of an unbounded KV room whose raw log prediction sits ``excess`` over the unsafe line."""
    y = np.full(len(batch), 100.0)
    states = np.zeros((len(batch), len(FEATURES)))
    states[:, 0] = batch
    labels = pd.DataFrame({LABEL: y, ITL_LABEL: y})
    cap = LeaseCap(
        LeaseLabel.parse("40ms", horizon_s=8.0), kv_capacity_tokens=1e12, min_rate_tokens_per_s=0.0
    )
    return states, labels, cap, np.log1p(1.05 * y) + excess


def test_pooled_shift_spends_one_unsafe_budget_where_it_costs_least() -> None:
    # 300 small-batch and 200 large-batch states predicted exactly, except 7 wild ones in each bin.
    # Per bin (3 and 2 unsafe allowed) both bins must clear the wild ones and shrink every prediction
    # by e; pooled (9 allowed in all) clears them in the smaller bin only.
    exact = np.log1p(100.0) - np.log1p(105.0)  # raw = log1p(y): the excess of an exact prediction
    batch = np.r_[np.full(300, 2.0), np.full(200, 50.0)]
    excess = np.r_[np.full(293, exact), np.full(7, 1.0), np.full(193, exact), np.full(7, 1.0)]
    states, labels, cap, raw = _hand_states(batch, excess)
    config = FitConfig(
        shift_batch_edges=(10.0,),
        min_states_per_shift_bin=100,
        shift_allocation="pooled",
        shift_grid_step=0.01,
    )
    pooled = pooled_shift(raw, states, labels, cap, config, mono_batch=-1)
    per_bin = mondrian_shift(cap.log_excess(raw, states, labels, 0.05), batch, config, mono_batch=-1)
    assert min(per_bin.log_shifts) >= 1.0
    small, large = pooled.log_shifts
    assert small < 0.06 and large >= 1.0  # only the 200-state bin pays for its wild states
    pred = cap.apply(np.expm1(raw - pooled.for_batch(batch)), states)
    assert (pred > 1.05 * labels[LABEL].to_numpy()).sum() <= int(np.floor(0.02 * 501)) - 1
    mape_pooled = np.mean(np.abs(pred - 100.0) / 100.0)
    pred_bin = cap.apply(np.expm1(raw - per_bin.for_batch(batch)), states)
    assert mape_pooled < 0.5 * np.mean(np.abs(pred_bin - 100.0) / 100.0)


def test_pooled_shift_counts_sparse_bins_against_the_budget() -> None:
    # The sparse large-batch bin keeps the global shift (0.5: the 6th largest of 321 states allows 5
    # unsafe); its 5 states at 2.0 stay unsafe and use up the budget, so the dense bin must clear all
    # of its own 6 at 0.5.
    batch = np.r_[np.full(300, 2.0), np.full(20, 50.0)]
    exact = np.log1p(100.0) - np.log1p(105.0)
    excess = np.r_[np.full(294, exact), np.full(6, 0.5), np.full(15, exact), np.full(5, 2.0)]
    states, labels, cap, raw = _hand_states(batch, excess)
    config = FitConfig(shift_batch_edges=(10.0,), min_states_per_shift_bin=100, shift_allocation="pooled")
    shift = pooled_shift(raw, states, labels, cap, config, mono_batch=0)
    glob = conformal_shift(cap.log_excess(raw, states, labels, 0.05), 0.02)
    assert glob == pytest.approx(0.5) and shift.log_shifts[1] == glob
    assert shift.log_shifts[0] >= 0.5
    pred = cap.apply(np.expm1(raw - shift.for_batch(batch)), states)
    assert (pred > 1.05 * 100.0).sum() <= int(np.floor(0.02 * 321)) - 1


def test_fit_with_pooled_shift_meets_the_unsafe_target_out_of_fold(profiles: pd.DataFrame) -> None:
    labels = derive_labels(profiles, TARGET)
    fit = fit_interference_model(labels, TARGET, replace(SMALL, shift_allocation="pooled"))
    assert fit.cv_metrics["unsafe_share"] <= SMALL.unsafe_target
    with pytest.raises(ValueError, match="shift_allocation"):
        FitConfig(shift_allocation="per-bin")


def test_states_the_kv_cap_keeps_safe_do_not_move_the_shift() -> None:
    # Excess -inf: the cap alone keeps the state within the margin. 10 such states with the largest
    # raw errors would otherwise set the shift.
    excess = np.r_[np.full(10, -np.inf), np.linspace(-0.5, 0.48, 89)]
    assert conformal_shift(excess, 0.05) == pytest.approx(excess[-5])
    assert conformal_shift(np.full(20, -np.inf), 0.05) == 0.0


def test_lease_cap_floors_then_caps_by_kv_room() -> None:
    cap = LeaseCap(
        LeaseLabel.parse("1.5x", horizon_s=8.0), kv_capacity_tokens=1000.0, min_rate_tokens_per_s=8.0
    )
    # Rooms: 1000 * (1 - 0.5) - 4 * 100 = 100 tokens -> 12.5 tokens/s; 1000 * 0.9 - 0 -> 112.5; none.
    X = np.array([[4, 1000, 0, 100, 0.5], [4, 1000, 0, 0, 0.1], [4, 1000, 0, 250, 0.0]], dtype=float)
    np.testing.assert_allclose(cap.apply(np.array([50.0, 50.0, 50.0]), X), [12.5, 50.0, 0.0])
    np.testing.assert_allclose(cap.apply(np.array([7.9, 7.9, 7.9]), X), [0.0, 0.0, 0.0])  # under the floor


def test_fast_predictor_applies_per_bin_shift(fitted: tuple[pd.DataFrame, FitResult]) -> None:
    labels, fit = fitted
    shift = ConformalShift((4.0, 32.0), (0.3, -0.1, 0.05))
    pred = SafeThroughputPredictor(fit.booster, shift, fit.cap, inputs=fit.inputs)
    X = labels[list(FEATURES)].to_numpy()
    raw = fit.booster.predict(fit.inputs(X))
    want = fit.cap.apply(np.expm1(raw - shift.for_batch(X[:, 0])), X)
    np.testing.assert_allclose(pred.predict(X), want, rtol=1e-9)
    np.testing.assert_allclose([pred.safe_prefill_tokens_per_s(*row) for row in X[:40]], want[:40], rtol=1e-9)


def test_fit_is_conservative_out_of_fold(fitted: tuple[pd.DataFrame, FitResult]) -> None:
    labels, fit = fitted
    assert fit.cv_metrics["unsafe_share"] <= 0.02 + 1e-9
    assert (labels["limited_by"] == "kv").any() and (labels[LABEL] <= labels[ITL_LABEL]).all()
    assert fit.cv_metrics["mape"] < 0.5
    assert set(fit.feature_importance()) == {*MODEL_FEATURES, DECODE_STEP_INPUT}
    with pytest.raises(ValueError, match="monotone"):
        FitConfig(quantile_alpha=0.1)


@pytest.fixture(scope="module")
def fitted_without_step_input(fitted: tuple[pd.DataFrame, FitResult]) -> FitResult:
    """The fit as it was before the decode-step input: batch and context constrained themselves."""
    return fit_interference_model(fitted[0], TARGET, replace(SMALL, decode_step_input=False))


@pytest.mark.parametrize(
    ("step_input", "feature"),
    [
        (False, "decode_batch_size"),
        (False, "context_tokens_mean"),
        (False, "kv_occupancy"),
        (False, "remaining_output_tokens_mean"),
        (True, "kv_occupancy"),
        (True, "remaining_output_tokens_mean"),
    ],
)
def test_non_increasing_along_constrained_features(
    fitted: tuple[pd.DataFrame, FitResult],
    fitted_without_step_input: FitResult,
    step_input: bool,
    feature: str,
) -> None:
    labels = fitted[0]
    fit = fitted[1] if step_input else fitted_without_step_input
    rng = np.random.default_rng(0)
    base = labels[list(FEATURES)].to_numpy()[rng.choice(len(labels), 20, replace=False)]
    j = FEATURES.index(feature)
    grid = np.linspace(labels[feature].min(), labels[feature].max(), 40)
    for row in base:
        X = np.repeat(row[None, :], len(grid), 0)
        X[:, j] = grid
        pred = fit.predict(X)
        assert np.all(np.diff(pred) <= 1e-9 * pred[:-1] + 1e-12), feature


def test_fast_predictor_equals_lightgbm(artifact: Path, fitted: tuple[pd.DataFrame, FitResult]) -> None:
    labels, fit = fitted
    pred = load_predictor(artifact)
    rng = np.random.default_rng(1)
    X = labels[list(FEATURES)].to_numpy()
    # Also off-grid points and exact split thresholds (the `<=` boundary).
    X = np.vstack([X, X * rng.uniform(0.5, 1.5, X.shape)])
    np.testing.assert_allclose(
        pred.raw_predict(X), fit.booster.predict(fit.inputs(X)), rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(pred.predict(X), fit.predict(X), rtol=1e-6)
    assert pred.fast_path  # LightGBM's C single-row path, not the slow fallback
    singles = np.array([pred.safe_prefill_tokens_per_s(*row) for row in X[:50]])
    np.testing.assert_allclose(singles, fit.predict(X[:50]), rtol=1e-9)
    # Exact split thresholds (the `<=` boundary) of the first tree, through the single call.
    tree = fit.booster.dump_model()["tree_info"][0]["tree_structure"]
    j, threshold = tree["split_feature"], tree["threshold"]
    if j < len(FEATURES):
        edge = X[:3].copy()
        edge[:, j] = threshold
        singles = [pred.safe_prefill_tokens_per_s(*row) for row in edge]
        np.testing.assert_allclose(singles, fit.predict(edge), rtol=1e-9)
    # The drain features default to the mean remaining output; a pickled predictor answers the same.
    row = X[0].copy()
    row[5] = row[6] = row[3]
    assert pred.safe_prefill_tokens_per_s(*row[:5]) == pred.safe_prefill_tokens_per_s(*row)
    again = pickle.loads(pickle.dumps(pred))
    assert again.safe_prefill_tokens_per_s(*X[1]) == pred.safe_prefill_tokens_per_s(*X[1])
    with pytest.raises(ValueError, match="finite"):
        pred.safe_prefill_tokens_per_s(4, float("nan"), 0, 0, 0.1)
    with pytest.raises(ValueError, match="in FEATURES order"):
        pred.predict(np.zeros((3, 4)))


def test_artifact_round_trip_metadata(artifact: Path, profiles: pd.DataFrame) -> None:
    meta = json.loads((artifact / "metadata.json").read_text())
    assert meta["features"] == list(FEATURES)
    assert meta["itl_target"] == {"kind": "absolute_ms", "value": 20.0, "floor_ms": 0.0, "spec": "20ms"}
    assert LeaseLabel.from_dict(meta["label"]) == TARGET and meta["horizon_s"] == 2.0
    assert meta["kv_capacity_tokens"] == FakeCostModel.kv_capacity_tokens
    assert meta["min_rate_tokens_per_s"] == pytest.approx(64.0 / 2.0)
    assert meta["data_sha256"] == profiles_sha256(profiles)
    assert meta["command"] == "pytest" and "lightgbm" in meta["library_versions"]
    pred = load_predictor(artifact, gpu="fake", model="FAKE-MODEL", tp=1, itl_target="20ms")
    assert pred.metadata["hardware"] == "FAKE"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"gpu": "B200"}, "hardware"),
        ({"model": "GLM-5"}, "model"),
        ({"tp": 8}, "tp"),
        ({"itl_target": "1.5x"}, "itl_target"),
        ({"horizon_s": 8.0}, "horizon_s"),
    ],
)
def test_metadata_mismatch_is_a_clear_error(artifact: Path, kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ArtifactError, match=f"metadata.json: field '{field}' is .* caller expects"):
        load_predictor(artifact, **kwargs)  # type: ignore[arg-type]


def test_corrupt_or_missing_files(artifact: Path, tmp_path: Path) -> None:
    model_file = artifact / "model.txt"
    text = model_file.read_text()
    model_file.write_text(text.replace("leaf_value=", "leaf_value=9", 1))
    with pytest.raises(ArtifactError, match=r"model.txt: corrupt or replaced"):
        load_predictor(artifact)
    model_file.unlink()
    with pytest.raises(ArtifactError, match=r"model.txt: missing"):
        load_predictor(artifact)
    (artifact / "metadata.json").write_text("{not json")
    with pytest.raises(ArtifactError, match=r"metadata.json: corrupt JSON"):
        load_predictor(artifact)
    shutil.rmtree(artifact)
    with pytest.raises(ArtifactError, match=r"metadata.json: missing"):
        load_predictor(artifact)


def test_features_mismatch_in_metadata(artifact: Path) -> None:
    meta_path = artifact / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["features"] = list(reversed(meta["features"]))
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="field 'features'"):
        load_predictor(artifact)


def test_labels_of_profile_have_positive_throughput(fitted: tuple[pd.DataFrame, FitResult]) -> None:
    labels, _ = fitted
    assert (labels[LABEL] >= 0).all() and (labels[LABEL] > 0).mean() > 0.5


def test_an_artifact_of_the_instantaneous_label_is_refused(artifact: Path) -> None:
    meta_path = artifact / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=r"format_version' is 1.*refit"):
        load_predictor(artifact)


def test_the_policies_pass_the_drain_features_of_a_node_state() -> None:
    from policies.node_policies import predict_safe
    from policies.node_state import NodeState

    seen: list[dict[str, Any]] = []

    class Recording:
        def safe_prefill_tokens_per_s(self, **kwargs: Any) -> float:
            seen.append(kwargs)
            return 123.0

    state = NodeState(
        node_id=0,
        time_s=0.0,
        decode_batch_size=2,
        context_tokens_mean=2000.0,
        context_tokens_std=1000.0,
        remaining_output_tokens_mean=30.0,
        kv_capacity_tokens=100_000,
        kv_used_tokens=4000,
        kv_reserved_tokens=0,
        queued_decode_requests=0,
        borrowed_tasks=0,
        borrowed_prefill_tokens_queued=0,
        recent_step_time_s=0.0,
        decode_only_step_time_s=0.01,
        max_running_requests=8,
        remaining_output_tokens_max=50.0,
        remaining_output_tokens_context_weighted=40.0,
    )
    assert predict_safe(Recording(), state) == 123.0
    assert seen[-1]["remaining_output_tokens_max"] == 50.0
    assert seen[-1]["remaining_output_tokens_context_weighted"] == 40.0
    # A reporter that does not know them leaves None: the predictor reads the mean.
    predict_safe(Recording(), NodeState(**{**state.to_dict(), "remaining_output_tokens_max": None}))
    assert seen[-1]["remaining_output_tokens_max"] is None


def test_without_the_c_fast_path_the_single_call_falls_back_to_predict(
    fitted: tuple[pd.DataFrame, FitResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    import interference_model.predictor as predictor_module

    labels, fit = fitted
    fast = SafeThroughputPredictor(fit.booster, fit.shift, fit.cap, inputs=fit.inputs)

    def unavailable(*_: Any) -> None:
        raise AttributeError("no single-row entry point in this LightGBM build")

    monkeypatch.setattr(predictor_module, "_SingleRow", unavailable)
    slow = SafeThroughputPredictor(fit.booster, fit.shift, fit.cap, inputs=fit.inputs)
    assert fast.fast_path and not slow.fast_path
    X = labels[list(FEATURES)].to_numpy()[:20]
    assert [slow.safe_prefill_tokens_per_s(*r) for r in X] == [fast.safe_prefill_tokens_per_s(*r) for r in X]
