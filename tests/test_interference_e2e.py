"""End to end on the real cost model: profile (sim) -> fit -> eval via the CLI commands, tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from interference_model.artifact import DEFAULT_ITL_TARGET, default_predictor, load_predictor
from interference_model.labels import DEFAULT_HORIZON_S
from train.cli import main


def run(*argv: str) -> int:
    """The ``crossflow`` entry point itself, in process."""
    return main(list(argv))


def test_profile_fit_eval(tmp_path: Path) -> None:
    pytest.importorskip("envs.cost_model")
    common = (
        "--gpu",
        "H200",
        "--model",
        "gpt-oss-120b",
        "--tp",
        "1",
        "--repeats",
        "3",
        "--checkpoints",
        "0,64,160",
    )
    assert (
        run(
            "profile",
            *common,
            "--n-states",
            "150",
            "--seed",
            "0",
            "--out",
            str(tmp_path / "train.parquet"),
            "--json",
            str(tmp_path / "profile.json"),
        )
        == 0
    )
    assert (
        run("profile", *common, "--n-states", "60", "--seed", "1", "--out", str(tmp_path / "test.parquet"))
        == 0
    )
    assert (
        run(
            "profile",
            *common,
            "--n-states",
            "60",
            "--seed",
            "1",
            "--no-noise",
            "--out",
            str(tmp_path / "clean.parquet"),
        )
        == 0
    )
    assert json.loads((tmp_path / "profile.json").read_text())["states"] == 150
    assert (
        run(
            "fit-interference",
            "--no-wandb",
            "--profiles",
            str(tmp_path / "train.parquet"),
            "--itl-target",
            "1.5x",
            "--out",
            str(tmp_path / "art"),
            "--json",
            str(tmp_path / "fit.json"),
        )
        == 0
    )
    fit = json.loads((tmp_path / "fit.json").read_text())
    assert fit["n_states"] == 150 and 0 <= fit["cv_metrics"]["unsafe_share"] <= 0.05
    assert (
        run(
            "eval-interference",
            "--no-wandb",
            "--artifact",
            str(tmp_path / "art"),
            "--profiles",
            str(tmp_path / "test.parquet"),
            "--train-profiles",
            str(tmp_path / "train.parquet"),
            "--reference-profiles",
            str(tmp_path / "clean.parquet"),
            "--plots",
            str(tmp_path / "plots"),
            "--json",
            str(tmp_path / "eval.json"),
        )
        == 0
    )
    report = json.loads((tmp_path / "eval.json").read_text())
    rows = {"lightgbm", "datasheet_roofline", "linear", "utilisation_threshold", "simulator_cost_model"}
    assert set(report["metrics"]) == rows and report["reference_rows"] == ["simulator_cost_model"]
    assert set(report["at_equal_unsafe"]) == rows - {"lightgbm"}
    # Every baseline, scaled to the model's unsafe share, has that share (up to ties).
    share = report["metrics"]["lightgbm"]["unsafe_share"]
    assert report["at_equal_unsafe"]["linear"]["unsafe_share"] <= share + 1e-9
    # The datasheet roofline has no calibration: optimistic, so mostly unsafe before scaling.
    assert report["metrics"]["datasheet_roofline"]["mean_pred_over_true"] > 1.5
    assert report["label_spec"]["horizon_s"] == 8.0 and report["label_spec"]["tpot_slo_ms"] == 50.0
    assert [t["target"].split()[0] for t in report["targets"]] == [
        "MAPE",
        "unsafe",
        "single",
        "datasheet_roofline",
    ]
    assert all(t["met"] in (True, False) for t in report["targets"])
    assert (
        report["latency_us"]["fast_predictor_us"] > 0 and report["latency_us"]["lightgbm_one_thread_us"] > 0
    )
    assert (tmp_path / "plots" / "calibration.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "error_by_region.png").stat().st_size > 1000
    pred = load_predictor(
        tmp_path / "art", gpu="h200", model="gpt-oss-120b", tp=1, itl_target="1.5x", horizon_s=8.0
    )
    assert pred.safe_prefill_tokens_per_s(32, 4000.0, 800.0, 300.0, 0.2) > 0
    assert "--horizon 8 " in pred.metadata["command"] and "--seed 0" in pred.metadata["command"]


def test_eval_refuses_profiles_of_another_setup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("envs.cost_model")
    assert run("profile", "--n-states", "40", "--repeats", "2", "--out", str(tmp_path / "a.parquet")) == 0
    assert (
        run("fit-interference", "--profiles", str(tmp_path / "a.parquet"), "--out", str(tmp_path / "art"))
        == 0
    )
    # logged to W&B by default, offline, beside the artifact
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert (
        run(
            "profile",
            "--n-states",
            "10",
            "--repeats",
            "1",
            "--model",
            "GLM-5",
            "--tp",
            "8",
            "--out",
            str(tmp_path / "b.parquet"),
        )
        == 0
    )
    capsys.readouterr()
    code = run(
        "eval-interference", "--artifact", str(tmp_path / "art"), "--profiles", str(tmp_path / "b.parquet")
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "crossflow eval-interference: error:" in err and "profiles are for ('h200', 'glm-5', 8)" in err


@pytest.mark.parametrize(("gpu", "model", "tp"), [("H200", "gpt-oss-120b", 1), ("H200", "GLM-5", 8)])
def test_shipped_defaults_load(gpu: str, model: str, tp: int) -> None:
    pred = default_predictor(gpu, model, tp)
    meta = pred.metadata
    assert meta["itl_target"]["spec"] == DEFAULT_ITL_TARGET and meta["horizon_s"] == DEFAULT_HORIZON_S
    # Refitted by the project's own command, recorded with its seed.
    assert meta["command"].startswith("crossflow fit-interference ") and "--seed 0" in meta["command"]
    assert meta["profiles_note"].startswith("crossflow profile ") and "--seed 0" in meta["profiles_note"]
    small = pred.safe_prefill_tokens_per_s(4, 2000.0, 500.0, 200.0, 0.05)
    assert small > 0
    # A full cache lends nothing: the KV room is exact, not learned.
    assert pred.safe_prefill_tokens_per_s(4, 2000.0, 500.0, 200.0, 1.0) == 0.0


def test_wandb_logging_is_offline_and_optional(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from interference_model.artifact import DATA_DIR, log_artifact_to_wandb

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    folder = DATA_DIR / "h200_gpt-oss-120b_tp1"
    assert log_artifact_to_wandb(folder, wandb_dir=tmp_path) is True
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if not installed
    assert log_artifact_to_wandb(folder) is False


def test_a_fit_on_too_few_states_names_the_profiles_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("profile", "--n-states", "3", "--repeats", "2", "--out", str(tmp_path / "few.parquet")) == 0
    capsys.readouterr()
    code = run(
        "fit-interference",
        "--no-wandb",
        "--profiles",
        str(tmp_path / "few.parquet"),
        "--out",
        str(tmp_path / "m"),
    )
    err = capsys.readouterr().err
    assert code == 2 and "few.parquet: need at least 5 state groups" in err
    assert not (tmp_path / "m").exists()


def test_the_simulator_reports_how_each_batch_drains() -> None:
    """Every control interval, the node states' drain features are those of the running requests."""
    from envs.cluster_config import ClusterConfig
    from envs.cost_model import CostModel
    from envs.estimator import ClusterEstimator
    from envs.simulator import Simulator
    from policies.ledger import LeaseLedger
    from policies.node_policies import HeuristicPolicy
    from policies.scheduler import ClusterScheduler
    from tests.fakes import ConstantPredictor, session_trace

    checked: list[int] = []

    class Checking(ClusterScheduler):
        def on_control_interval(self, now_s: float, states: Any) -> Any:
            for state, worker in zip(states, sim.decode, strict=True):
                running = [r for r in worker.running if not r.needs_recompute]
                if len(running) < 2:
                    continue
                rem = [r.output - r.generated for r in running]
                ctx = [r.context for r in running]
                assert state.remaining_output_tokens_max == max(rem)
                weighted = sum(c * r for c, r in zip(ctx, rem, strict=True)) / sum(ctx)
                assert state.remaining_output_tokens_context_weighted == pytest.approx(weighted)
                checked.append(len(running))
            return super().on_control_interval(now_s, states)

    trace = session_trace(n_sessions=6, turns=2, first_input=2000, grow=1000, output=120, think_s=0.2)
    cfg = ClusterConfig(n_prefill=1, n_decode=1, page_tokens=256, control_interval_s=0.1)
    cm = CostModel(cfg.gpu, cfg.model, cfg.tp)
    policy = HeuristicPolicy(ConstantPredictor(10_000.0), ttl_s=2.0)
    scheduler = Checking(policy, LeaseLedger(), ClusterEstimator(cfg, cm), control_interval_s=0.1)
    sim = Simulator(trace, cfg, scheduler=scheduler, cost_model=cm, session_rate_per_s=20.0, seed=1)
    sim.run()
    assert checked, "no control interval saw a batch of two or more"


def test_shipped_label_promises_the_heuristics_itl_budget() -> None:
    """The artifacts' per-step ITL target is the budget the heuristic sizes borrowed chunks to, and the
    label's TPOT cap the SLO policies use: one fact, two packages (interference_model cannot import
    policies)."""
    from interference_model.labels import DEFAULT_TPOT_SLO_MS, ItlTarget
    from policies.slo import DEFAULT_TPOT_SLO_S, itl_budget_s

    target = ItlTarget.parse(DEFAULT_ITL_TARGET)
    assert target.kind == "absolute_ms"
    assert target.value / 1000.0 == pytest.approx(itl_budget_s(DEFAULT_TPOT_SLO_S))
    assert DEFAULT_TPOT_SLO_MS / 1000.0 == pytest.approx(DEFAULT_TPOT_SLO_S)


def test_a_pooled_shift_fit_records_how_it_was_made(tmp_path: Path) -> None:
    assert run("profile", "--n-states", "60", "--repeats", "2", "--out", str(tmp_path / "p.parquet")) == 0
    out = tmp_path / "art"
    args = ["fit-interference", "--no-wandb", "--profiles", str(tmp_path / "p.parquet"), "--out", str(out)]
    assert run(*args, "--shift-allocation", "pooled", "--json", str(tmp_path / "fit.json")) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["fit_config"]["shift_allocation"] == "pooled"
    assert "--shift-allocation pooled" in meta["command"]
    assert json.loads((tmp_path / "fit.json").read_text())["cv_metrics"]["unsafe_share"] <= 0.02
