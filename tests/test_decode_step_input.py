"""The decode-step input of the interference model: the decode-step model by hand, the slack it gives
the trees, the monotone constraints that come with it, artifacts that carry it, fits on several
profiles, and configurations recorded before these fields existed."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from interference_model.artifact import ArtifactError, load_predictor, read_metadata, save_artifact
from interference_model.fit import (
    DECODE_STEP_INPUT,
    MODEL_FEATURES,
    DecodeStepModel,
    FitConfig,
    ModelInputs,
    fit_interference_model,
    physical_monotone_constraints,
)
from interference_model.labels import LeaseLabel, concat_labels, derive_labels
from interference_model.schema import FEATURES
from tests.test_interference_model import FAKE, SMALL, TARGET
from train.cli import main


def test_decode_step_model_recovers_a_step_time_by_hand() -> None:
    # h(batch) = 10 ms + 2 ms per doubling, 4e-8 s per context token: exactly representable by the model
    # (linear in log batch between knots), so least squares must give it back.
    rng = np.random.default_rng(0)
    batch = rng.integers(1, 200, 2000).astype(float)
    context_sum = batch * rng.uniform(100, 20_000, 2000)
    step_s = 0.010 + 0.002 * np.log2(batch) + 4e-8 * context_sum
    model = DecodeStepModel.fit(batch, context_sum, step_s)
    assert model.batch_knots[0] == 1.0 and model.batch_knots[-1] == 256.0  # the first knot past 199
    assert model.s_per_context_token == pytest.approx(4e-8, rel=1e-9)
    for knot, t in zip(model.batch_knots, model.knot_times_s, strict=True):
        assert t == pytest.approx(0.010 + 0.002 * math.log2(knot), rel=1e-9)
    # Past the last knot the last segment extends (linear in log batch), and the scalar path agrees.
    assert model.time_s(np.array([512.0]), np.array([0.0]))[0] == pytest.approx(0.010 + 0.002 * 9)
    for b, c in [(1.0, 0.0), (3.0, 5e4), (100.0, 2e6), (300.0, 1e7), (0.5, 10.0)]:
        want = float(model.time_s(np.array([b]), np.array([c]))[0])
        assert model.time_one(b, c) == pytest.approx(want, rel=1e-12)
    assert DecodeStepModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_decode_step_model_never_gets_faster_with_a_larger_batch() -> None:
    # A dip in the measured steps at batch 8 would make the model promise more there; the fit raises it.
    batch = np.repeat([1.0, 2.0, 4.0, 8.0, 16.0], 50)
    step_s = np.select([batch == 8.0], [0.011], 0.010 + 0.001 * np.log2(batch))
    model = DecodeStepModel.fit(batch, np.zeros_like(batch), step_s)
    assert np.all(np.diff(model.knot_times_s) >= 0)
    with pytest.raises(ValueError, match="increase"):
        DecodeStepModel((1.0, 1.0), (0.01, 0.02), 0.0)
    with pytest.raises(ValueError, match="finite"):
        DecodeStepModel((1.0, 2.0), (0.01, float("nan")), 0.0)


@pytest.mark.parametrize(
    ("spec", "want_s"),
    [
        ("20ms", lambda t: min(0.020, 0.050) - t),
        ("1.5x", lambda t: min(1.5 * t, 0.050) - t),
        ("1.5x|25ms", lambda t: min(max(1.5 * t, 0.025), 0.050) - t),
    ],
)
def test_the_slack_input_is_the_label_budget_less_the_modelled_step(spec: str, want_s: object) -> None:
    label = LeaseLabel.parse(spec, horizon_s=2.0)
    step = DecodeStepModel((1.0, 4.0, 64.0), (0.004, 0.008, 0.040), 1e-8)
    inputs = ModelInputs(label, step)
    X = np.array([[b, ctx, 0.0, 100.0, 0.1, 100.0, 100.0] for b, ctx in [(1, 500), (4, 8000), (32, 30000)]])
    Z = inputs(X)
    assert inputs.names == (*MODEL_FEATURES, DECODE_STEP_INPUT) and Z.shape == (3, len(inputs.names))
    for row, z in zip(X, Z, strict=True):
        t = step.time_one(row[0], row[0] * row[1])
        assert z[-1] == pytest.approx(want_s(t), rel=1e-12)  # type: ignore[operator]
        assert inputs.slack_function()(row[0], row[0] * row[1]) == z[-1]
    assert ModelInputs(label).names == MODEL_FEATURES


def test_with_the_step_input_batch_and_context_are_free_and_the_slack_is_constrained() -> None:
    names = (*MODEL_FEATURES, DECODE_STEP_INPUT)
    absolute = dict(zip(names, physical_monotone_constraints(TARGET, names), strict=True))
    assert absolute[DECODE_STEP_INPUT] == 1
    assert absolute["decode_batch_size"] == absolute["context_tokens_mean"] == 0
    assert absolute["context_tokens_sum"] == 0
    assert absolute["kv_occupancy"] == absolute["remaining_output_tokens_mean"] == -1
    without = dict(zip(MODEL_FEATURES, physical_monotone_constraints(TARGET), strict=True))
    assert without["decode_batch_size"] == without["context_tokens_sum"] == -1
    ratio = dict(zip(names, physical_monotone_constraints(LeaseLabel.parse("1.5x"), names), strict=True))
    assert ratio[DECODE_STEP_INPUT] == 0  # a ratio budget grows with the step itself


@pytest.fixture(scope="module")
def two_profiles() -> tuple[pd.DataFrame, ...]:
    from envs.profiler import simulate_profiles

    return tuple(
        simulate_profiles("FAKE", "fake-model", 1, 120, seed=s, repeats=3, **FAKE)  # type: ignore[arg-type]
        for s in (3, 4)
    )


def test_the_fit_is_non_decreasing_along_its_slack_input(two_profiles: tuple[pd.DataFrame, ...]) -> None:
    labels = derive_labels(two_profiles[0], TARGET)
    fit = fit_interference_model(labels, TARGET, SMALL)
    assert fit.inputs.decode_step is not None
    Z = fit.inputs(labels[list(FEATURES)].to_numpy(dtype=float))[:20]
    grid = np.linspace(Z[:, -1].min() - 0.005, Z[:, -1].max() + 0.005, 40)
    for row in Z:
        rows = np.repeat(row[None, :], len(grid), 0)
        rows[:, -1] = grid
        raw = fit.booster.predict(rows)
        assert np.all(np.diff(raw) >= -1e-12)


def test_concat_labels_keeps_each_profile_its_own_states_and_groups(
    two_profiles: tuple[pd.DataFrame, ...],
) -> None:
    first, second = (derive_labels(p, TARGET) for p in two_profiles)
    both = concat_labels([first, second])
    assert len(both) == len(first) + len(second)
    assert both["state_id"].is_unique
    assert not set(both["state_group"][: len(first)]) & set(both["state_group"][len(first) :])
    pd.testing.assert_frame_equal(
        both.iloc[: len(first)].reset_index(drop=True), first.reset_index(drop=True), check_like=True
    )
    with pytest.raises(ValueError, match="no label tables"):
        concat_labels([])


def test_an_artifact_carries_its_decode_step_model(
    tmp_path: Path, two_profiles: tuple[pd.DataFrame, ...]
) -> None:
    labels = derive_labels(two_profiles[0], TARGET)
    fit = fit_interference_model(labels, TARGET, SMALL)
    out = save_artifact(
        tmp_path / "art", fit, hardware="FAKE", model="fake-model", tp=1, data_sha256="0" * 64
    )
    meta = read_metadata(out)
    assert meta["format_version"] == 4 and meta["model_features"][-1] == DECODE_STEP_INPUT
    assert DecodeStepModel.from_dict(meta["decode_step_model"]) == fit.inputs.decode_step
    pred = load_predictor(out)
    X = labels[list(FEATURES)].to_numpy(dtype=float)
    np.testing.assert_allclose(pred.predict(X), fit.predict(X), rtol=1e-9)
    singles = [pred.safe_prefill_tokens_per_s(*row) for row in X[:40]]
    np.testing.assert_allclose(singles, fit.predict(X[:40]), rtol=1e-9)
    # A malformed decode-step model is refused, naming the field.
    meta["decode_step_model"]["batch_knots"] = [4.0, 2.0]
    (out / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="decode_step_model"):
        load_predictor(out)


def test_a_recorded_configuration_keeps_what_applied_before_its_newer_fields() -> None:
    old = FitConfig.from_recorded(
        {"unsafe_target": 0.02, "num_boost_round": 100, "shift_batch_edges": [4, 8]}
    )
    assert old.shift_allocation == "per_bin" and old.decode_step_input is False
    assert old.shift_batch_edges == (4, 8)
    new = FitConfig.from_recorded({"shift_allocation": "pooled", "decode_step_input": True})
    assert new == replace(FitConfig(), shift_allocation="pooled", decode_step_input=True)


def _profile(path: Path, *args: str) -> None:
    assert main(["profile", "--n-states", "40", "--repeats", "2", *args, "--out", str(path)]) == 0


def test_fit_interference_takes_several_profiles_and_records_them(tmp_path: Path) -> None:
    paths = []
    for seed in (5, 6):
        _profile(tmp_path / f"p{seed}.parquet", "--seed", str(seed))
        paths.append(str(tmp_path / f"p{seed}.parquet"))
    out = tmp_path / "art"
    assert main(["fit-interference", "--no-wandb", "--profiles", *paths, "--out", str(out)]) == 0
    meta = read_metadata(out)
    assert meta["n_train_states"] == 80 and len(meta["profiles_sha256"]) == 2
    assert meta["command"].split("--profiles ")[1].startswith(" ".join(paths))
    assert "--shift-allocation pooled" in meta["command"] and "--decode-step-input" in meta["command"]
    assert meta["fit_config"]["decode_step_input"] is True
    # The baselines fit on the same several profiles the model saw.
    _profile(tmp_path / "test.parquet", "--seed", "7")
    report = tmp_path / "eval.json"
    test = str(tmp_path / "test.parquet")
    args = ["eval-interference", "--no-wandb", "--artifact", str(out), "--profiles", test]
    assert main([*args, "--train-profiles", *paths, "--json", str(report)]) == 0
    assert {"linear", "utilisation_threshold"} <= set(json.loads(report.read_text())["metrics"])
    # Profiles of two setups are refused before anything is written.
    other = tmp_path / "other.parquet"
    _profile(other, "--model", "gpt-oss-20b")
    bad = tmp_path / "bad"
    args = ["fit-interference", "--no-wandb", "--profiles", paths[0], str(other), "--out", str(bad)]
    assert main(args) == 2
    assert not bad.exists()
