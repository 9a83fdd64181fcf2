"""The peers inside ``crossflow compare`` and ``crossflow tune``: tiny grids, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train import tune
from train.cli import main
from train.compare import GridSpec, check_names, run_compare


def test_compare_runs_peers_and_builds_hindsight_split_from_the_splits(tmp_path: Path) -> None:
    spec = GridSpec(
        policies=("static", "dynamo-load", "deflect", "hindsight-split"),
        traces=("mooncake",),
        max_requests=60,
        seeds=1,
        latency_loads=(),
        throughput_loads=(2.0,),
        gpus_needed=False,
        decode_prefix_cache=True,
    )
    results = run_compare(spec, tmp_path, jobs=1)
    assert not results["failed"]
    rows = {p["policy"]: p for p in results["points"]}
    assert set(rows) == set(spec.policies)
    assert all(r["point"]["decode_prefix_cache"] for r in rows.values())
    assert rows["deflect"]["metrics"]["local_share"] > 0  # at twice static's saturation it deflects
    (hind,) = results["hindsight"]
    assert set(hind["capacities"]) == {"1P5D", "2P4D", "3P3D", "4P2D", "5P1D"}
    assert hind["load"] == max(hind["capacities"].values())
    assert rows["hindsight-split"]["run_shape"] == hind["shape"]  # its chosen split's static run
    assert set(results["policy_params"]) == {"dynamo-load", "deflect"}  # a split has no values


def test_compare_rejects_unknown_policies_by_flag() -> None:
    with pytest.raises(ValueError, match=r"--policies: unknown policy 'dynamo'.*dynamo-isl"):
        check_names(GridSpec(policies=("static", "dynamo")))


def test_tune_end_to_end_on_a_small_development_slice(tmp_path: Path) -> None:
    out = tmp_path / "tuned.json"
    argv = ["tune", "--policies", "llmd-prefix,hindsight-split", "--traces", "mooncake", "--jobs", "1"]
    argv += ["--max-requests", "60", "--max-sessions", "5"]  # sessions count only closed-loop traces
    assert main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "crossflow-tuned-policies/1" and doc["command"].startswith("crossflow tune")
    static = doc["static"]["mooncake"]["load"]
    llmd = doc["policies"]["llmd-prefix"]
    assert len(llmd["grid"]) == 8 and llmd["params"] in [row["params"] for row in llmd["grid"]]
    assert llmd["score"] == max(row["score"] for row in llmd["grid"])
    assert llmd["score"] == pytest.approx(llmd["capacity"]["mooncake"] / static)
    hind = doc["policies"]["hindsight-split"]
    assert len(hind["splits"]) == 5
    assert hind["capacity"]["mooncake"] == max(s["capacity"] for s in hind["splits"])
    from policies.catalog import load_tuned

    assert load_tuned(out)["policies"]["llmd-prefix"]["params"] == llmd["params"]  # what compare reads
    assert doc["spec"]["max_requests"] == 60 and doc["spec"]["max_sessions"] == 5


def test_tune_rejects_bad_arguments_by_flag() -> None:
    assert main(["tune", "--policies", "static"]) == 2  # no grid to tune
    assert main(["tune", "--policies", "nope"]) == 2
    assert main(["tune", "--traces", "nope"]) == 2  # not a bundled trace


def test_tune_evaluate_measures_the_shipped_values_on_the_evaluation_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from policies.catalog import tuned_params

    monkeypatch.setitem(tune.DEFAULT_SUBSET, "mooncake", 60)
    out = tmp_path / "capacity.json"
    argv = ["tune", "--evaluate", "--policies", "dynamo-load", "--traces", "mooncake", "--jobs", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "crossflow-capacity/1" and doc["spec"]["side"] == "evaluation"
    assert doc["traces"]["mooncake"].startswith("mooncake")
    row = doc["policies"]["dynamo-load"]
    assert [g["params"] for g in row["grid"]] == [tuned_params("dynamo-load")]


def test_tune_update_replaces_only_the_named_policies(tmp_path: Path) -> None:
    from train.tune import merge_update

    out = tmp_path / "tuned.json"
    base = ["tune", "--traces", "mooncake", "--jobs", "1", "--max-requests", "40", "--out", str(out)]
    assert main([*base, "--policies", "llmd-prefix,trtllm-local"]) == 0
    first = json.loads(out.read_text())
    assert main([*base, "--policies", "llmd-prefix", "--update"]) == 0
    doc = json.loads(out.read_text())
    assert doc["policies"]["trtllm-local"] == first["policies"]["trtllm-local"]  # left alone
    assert doc["policies"]["llmd-prefix"]["command"].endswith("--update")
    assert [u["policies"] for u in doc["updates"]] == [["llmd-prefix"]]
    # a run on other subsets cannot update the file, and nothing is written
    other = [*base, "--max-requests", "30", "--policies", "llmd-prefix", "--update"]  # the last flag wins
    assert main(other) == 2
    assert json.loads(out.read_text()) == doc
    changed = {**first, "static": {"mooncake": {**first["static"]["mooncake"], "load": 9.0}}}
    with pytest.raises(ValueError, match="static's capacity on 'mooncake' changed"):
        merge_update(doc, changed)
