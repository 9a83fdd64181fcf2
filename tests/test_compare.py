"""`crossflow compare`: load matching, oracle, gains and targets by hand, an end-to-end run, W&B offline."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from train import report
from train.compare import GridSpec, oracle_shapes, run_compare
from train.saturation import LOAD_BOUNDS, find_saturation, saturation_search, served_slo_share

REPO = Path(__file__).resolve().parents[1]


def _metrics(**over: float) -> dict[str, float]:
    base = {
        "n_requests": 10,
        "n_finished": 10,
        "input_tokens_per_s": 100.0,
        "output_tokens_per_s": 10.0,
        "ttft_mean_s": 1.0,
        "ttft_p99_s": 4.0,
        "itl_mean_s": 0.010,
        "itl_p99_s": 0.020,
        "borrowed_share": 0.0,
        "lease_utilisation": 0.0,
    }
    return {**base, **over}


def _row(policy: str, shape: str, load: float, oracle_share: float | None = None, **metrics: float) -> dict:
    point = {"policy": policy, "trace": "t", "model": "m", "shape": shape, "load": load}
    return {
        "point": point,
        "load_fraction": load,
        "metrics": _metrics(**metrics),
        "oracle_share": oracle_share,
    }


# ---- load matching -------------------------------------------------------------------------------------
def test_find_saturation_brackets_a_step_within_resolution() -> None:
    def share_at(load: float) -> float:
        return 0.95 if load <= 0.3 else 0.5

    load, bracketed, probes = find_saturation(share_at, resolution=1.1)
    assert bracketed
    assert 0.3 / 1.1 < load <= 0.3
    # 1 -> 0.5 -> 0.25 pass, then bisection of [0.25, 0.5] down to a 1.1 bracket: 3 steps.
    assert [round(x, 4) for x, _ in probes[:3]] == [1.0, 0.5, 0.25]
    assert len(probes) == 6
    assert all(share_at(x) == s for x, s in probes)


def test_find_saturation_reports_bounds_when_not_bracketed() -> None:
    load, bracketed, _ = find_saturation(lambda _: 1.0)
    assert (load, bracketed) == (LOAD_BOUNDS[1], False)
    load, bracketed, probes = find_saturation(lambda _: 0.0)
    assert (load, bracketed) == (LOAD_BOUNDS[0], False)
    assert min(x for x, _ in probes) >= LOAD_BOUNDS[0]


def test_saturation_search_falls_back_to_the_idle_share() -> None:
    calls: list[float] = []

    def plateau(load: float) -> float:  # misses the SLO for 20 % of requests even when idle
        calls.append(load)
        return 0.8 if load <= 0.25 else 0.5

    found = saturation_search(plateau)
    assert found["relative"] and found["usable"] and found["bracketed"]
    assert found["idle_share"] == pytest.approx(0.8)
    assert found["threshold"] == pytest.approx(0.72)
    assert 0.25 / 1.1 < found["load"] <= 0.25
    assert len(calls) == len(set(calls)) == len(found["probes"])  # no load simulated twice
    absolute = saturation_search(lambda load: 0.95 if load <= 0.3 else 0.5)
    assert not absolute["relative"] and absolute["threshold"] == 0.9 and absolute["idle_share"] is None
    assert not saturation_search(lambda _: 0.0)["usable"]


def test_served_slo_share_counts_unfinished_requests_as_misses() -> None:
    # 10 requests, 2 rejected (outside the denominator), 6 within SLO, the rest missed or unfinished
    assert served_slo_share({"n_requests": 10, "n_rejected": 2, "n_slo_met": 6}) == pytest.approx(0.75)
    assert served_slo_share({"n_requests": 2, "n_rejected": 2, "n_slo_met": 0}) == 0.0
    assert served_slo_share({"n_requests": 0, "n_rejected": 0, "n_slo_met": 0}) == 0.0


# ---- oracle ----------------------------------------------------------------------------------------------
def test_oracle_shapes_keep_the_gpu_count() -> None:
    assert oracle_shapes("2P4D") == ["1P5D", "2P4D", "3P3D", "4P2D", "5P1D"]
    assert oracle_shapes("1p1d") == ["1P1D"]


def test_choose_oracle_respects_the_itl_bound_and_finished_count() -> None:
    original = _metrics(input_tokens_per_s=100.0, itl_mean_s=0.010)
    cands = {
        "2P4D": original,
        "3P3D": _metrics(input_tokens_per_s=120.0, itl_mean_s=0.0105),  # exactly +5 %: allowed
        "4P2D": _metrics(input_tokens_per_s=150.0, itl_mean_s=0.0106),  # +6 %: excluded
        "1P5D": _metrics(input_tokens_per_s=130.0, itl_mean_s=0.009, n_finished=9),  # drops a request
    }
    assert report.choose_oracle(original, cands, "2P4D") == "3P3D"
    # A negligible gain (below MIN_ORACLE_GAIN) is no re-roling.
    tiny = {"2P4D": original, "3P3D": _metrics(input_tokens_per_s=100.05)}
    assert report.choose_oracle(original, tiny, "2P4D") == "2P4D"


def test_oracle_share_by_hand() -> None:
    assert report.oracle_share(110.0, 100.0, 120.0) == pytest.approx(0.5)
    assert report.oracle_share(130.0, 100.0, 120.0) == pytest.approx(1.5)  # leases may beat re-roling
    assert report.oracle_share(95.0, 100.0, 120.0) == pytest.approx(-0.25)
    assert report.oracle_share(110.0, 100.0, 100.0) is None
    assert report.oracle_share(math.nan, 100.0, 120.0) is None


# ---- gains and targets -----------------------------------------------------------------------------------
def test_geo_mean_change_by_hand() -> None:
    # geo-mean of 1.1 and 1.21 is 1.1 * sqrt(1.1)
    assert report.geo_mean_change([1.1, 1.21]) == pytest.approx(1.1 * math.sqrt(1.1) - 1.0)
    assert report.geo_mean_change([2.0, 0.5]) == pytest.approx(0.0)
    assert report.geo_mean_change([math.nan, 0.0, -1.0]) is None


def _fixture() -> list[dict]:
    return [
        _row("static", "2P4D", 0.5),
        _row(
            "heuristic",
            "2P4D",
            0.5,
            0.5,
            input_tokens_per_s=110.0,
            output_tokens_per_s=12.1,
            ttft_mean_s=0.5,
            ttft_p99_s=2.0,
            itl_mean_s=0.0104,
        ),
        _row("static", "2P4D", 1.0, input_tokens_per_s=200.0),
        _row(
            "heuristic",
            "2P4D",
            1.0,
            1.0,
            input_tokens_per_s=242.0,
            output_tokens_per_s=12.1,
            ttft_mean_s=0.9,
            ttft_p99_s=4.4,
            itl_mean_s=0.0100,
        ),
        _row("static", "4P2D", 1.0),
        _row("heuristic", "4P2D", 1.0, None, input_tokens_per_s=98.0),
    ]


def test_summarise_geo_mean_over_headline_points() -> None:
    row = report.summarise(_fixture())["heuristic"]
    assert (row["n_points"], row["n_headline_points"]) == (3, 2)
    assert row["input_tokens_per_s_change"] == pytest.approx(1.1 * math.sqrt(1.1) - 1.0)
    assert row["output_tokens_per_s_change"] == pytest.approx(0.21)
    assert row["ttft_mean_s_change"] == pytest.approx(math.sqrt(0.5 * 0.9) - 1.0)
    assert row["input_tokens_per_s_change_all"] == pytest.approx((1.1 * 1.21 * 0.98) ** (1 / 3) - 1.0)
    assert row["oracle_share_mean"] == pytest.approx(0.75)


def test_targets_are_computed_per_point() -> None:
    status = {t["target"]: t["status"] for t in report.evaluate_targets(_fixture())["heuristic"]}
    by_prefix = {k.split(" ")[0] + " " + k.split(" ")[1]: v for k, v in status.items()}
    assert by_prefix["in tok/s"] == "MISS"  # +15.4 % < +17.4 %
    assert by_prefix["out tok/s"] == "PASS"  # +21 %
    assert by_prefix["TTFT mean"] == "PASS"
    assert by_prefix["TTFT p99"] == "MISS"  # +10 % at load 1.0
    assert by_prefix["ITL mean"] == "PASS"  # worst +4 %
    assert by_prefix["4P2D: no"] == "MISS"  # -2 % input throughput


def test_normalise_reason_groups_numbers() -> None:
    a = report.normalise_reason("decision", "borrow 0.123 s does not beat normal 1.5e-3 s", "normal")
    b = report.normalise_reason("decision", "borrow 7 s does not beat normal 2 s", "normal")
    assert a == b == "decision/normal: borrow # s does not beat normal # s"


# ---- end to end ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compare_cli_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "train.cli",
        "compare",
        "--policies",
        "static,utilisation",
        "--traces",
        "mooncake",
        "--max-requests",
        "30",
        "--loads",
        "0.5,1.0",
        "--jobs",
        "2",
        "--no-wandb",
        "--no-progress",
        "--out",
        str(out),
        "--json",
        str(tmp_path / "copy.json"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert json.loads((tmp_path / "copy.json").read_text())["points"] == results["points"]
    assert len(results["points"]) == 4
    assert {"run_id", "grid", "saturation", "points", "summary", "targets", "wall_s"} <= results.keys()
    (sat,) = results["saturation"]
    for p in results["points"]:
        assert {"policy", "trace", "model", "gpu", "tp", "shape", "load", "seed", "max_requests"} <= p[
            "point"
        ].keys()
        assert {"input_tokens_per_s", "ttft_p99_s", "itl_mean_s", "lease_utilisation"} <= p["metrics"].keys()
        assert p["point"]["load"] == pytest.approx(p["load_fraction"] * sat["load"])
        assert "oracle_share" in p and p["oracle_shape"] in oracle_shapes("2P4D")
    # identical arrivals per point: both policies see the same requests at the same load
    by_load: dict[float, set] = {}
    for p in results["points"]:
        by_load.setdefault(p["load_fraction"], set()).add((p["point"]["load"], p["metrics"]["n_requests"]))
    assert all(len(v) == 1 for v in by_load.values())
    assert len(results["oracle_candidates"]) == 2 * 4  # the 4 other splits at each load
    md = (out / "report.md").read_text()
    assert "| trace | model | shape | load (x sat) | policy | in tok/s" in md
    assert "## Targets" in md and "utilisation" in md
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == [
        "latency_mooncake_gpt-oss-120b_2P4D.png",
        "timeline_mooncake_gpt-oss-120b_2P4D.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    # a second run in the same folder reuses the cached saturation search
    assert json.loads((out / "saturation.json").read_text())


class ConstantPredictor:
    """Safe prefill throughput that ignores the node state (picklable: defined at module level)."""

    def safe_prefill_tokens_per_s(self, **_: Any) -> float:
        return 20_000.0


def test_heuristic_with_injected_predictor_records_reasons(tmp_path: Path) -> None:
    spec = GridSpec(
        policies=("static", "heuristic"),
        traces=("mooncake",),
        max_requests=40,
        load_fractions=(1.0,),
        oracle=False,
    )
    results = run_compare(spec, tmp_path, jobs=1, predictor=ConstantPredictor())
    heur = next(p for p in results["points"] if p["point"]["policy"] == "heuristic")
    assert heur["error"] is None, heur["error"]
    assert heur["time_capped"] is False  # capped at 4x the static replay + 1 h, finished well before
    assert sum(heur["reasons"].values()) > 0
    assert all(k.startswith(("decision/", "arrival/")) for k in heur["reasons"])


# ---- W&B -------------------------------------------------------------------------------------------------
def test_wandb_offline_run_and_artifact_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from train import wandb_log

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    art = tmp_path / "h200_tiny_tp1"
    art.mkdir()
    (art / "model.txt").write_text("tree\n")
    meta = {"format_version": 1, "hardware": "H200", "model": "tiny", "tp": 1}
    (art / "metadata.json").write_text(json.dumps(meta))
    ref = wandb_log.artifact_reference(art)
    assert ref["model_sha256"] == hashlib.sha256(b"tree\n").hexdigest()
    assert (ref["name"], ref["model"], ref["tp"]) == ("h200_tiny_tp1", "tiny", 1)
    with pytest.raises(ValueError, match=r"metadata\.json"):
        wandb_log.artifact_reference(tmp_path)
    run = wandb_log.RunLog(
        name="static|t|m",
        group="compare-test",
        tags=["static", "t", "m"],
        config={"load": 0.5},
        summary={"input_tokens_per_s": 1.0},
        history=[{"minute": 0, "borrowed_prefill_tokens": 3.0}],
        artifact_dir=str(art),
    )
    folders = wandb_log.log_runs([run], wandb_dir=tmp_path)
    assert len(folders) == 1
    run_dir = Path(folders[0])
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    assert list(run_dir.glob("*.wandb")), os.listdir(run_dir)


def test_bad_names_fail_before_any_simulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from train.cli import main

    out = tmp_path / "never"
    assert main(["compare", "--policies", "static,nope", "--out", str(out), "--no-wandb"]) == 2
    assert "--policies: unknown policy 'nope'" in capsys.readouterr().err
    assert main(["compare", "--traces", "nope", "--out", str(out), "--no-wandb"]) == 2
    assert not out.exists()
