"""Tuned values per model: ``crossflow tune --model M`` writes M's own file, and everything that builds
a policy for M (simulate, compare, bundles, serve) runs M's values, else the default model's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envs.cluster_config import ClusterConfig
from policies import catalog
from policies.catalog import DEFAULT_TUNED_MODEL, model_tuned_file, tuned_entry, tuned_params
from tests.fakes import LinearCostModel

OTHER = "glm-5"


def _doc(model: str, policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": catalog.TUNED_FORMAT,
        "command": f"crossflow tune --model {model}",
        "spec": {"model": model},
        "policies": {name: {"params": params} for name, params in policies.items()},
    }


@pytest.fixture
def tuned_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A tuned-values folder standing in for the shipped one: the shipped default file, and a file of
    OTHER's own holding deflect and heuristic only."""
    shutil.copyfile(catalog.TUNED_FILE, tmp_path / catalog.TUNED_FILE.name)
    other = _doc(
        OTHER,
        {
            "deflect": {"path.itl_slack": 1.0, "path.max_chunk_tokens": 8192, "path.margin": 0.2},
            "heuristic": {"node.ttl_s": 8.0, "node.margin": 1.0, "scheduler.itl_guard": "slo"},
        },
    )
    (tmp_path / f"tuned_policies-{OTHER}.json").write_text(json.dumps(other))
    monkeypatch.setattr(catalog, "TUNED_DIR", tmp_path)
    catalog._shipped_tuned.cache_clear()
    yield tmp_path
    catalog._shipped_tuned.cache_clear()


def test_a_models_own_file_wins_and_what_it_lacks_takes_the_default_models_values(tuned_dir: Path) -> None:
    default = json.loads((tuned_dir / catalog.TUNED_FILE.name).read_text())["policies"]
    assert tuned_params("deflect", OTHER)["path.margin"] == 0.2
    assert tuned_params("deflect") == default["deflect"]["params"]
    assert tuned_params("deflect", DEFAULT_TUNED_MODEL) == default["deflect"]["params"]
    assert tuned_params("deflect")["path.margin"] != 0.2  # the two files differ where the test looks
    assert tuned_entry("deflect", OTHER)[1] == OTHER
    assert tuned_params("deflect", "GLM-5") == tuned_params("deflect", OTHER)  # any case
    assert tuned_entry("deflect", "zai-org/GLM-5")[1] == DEFAULT_TUNED_MODEL  # an id: the default's
    # a policy the model's file does not hold, and a model with no file, run the default model's values
    assert tuned_params("dynamo-load", OTHER) == default["dynamo-load"]["params"]
    assert tuned_entry("dynamo-load", OTHER)[1] == DEFAULT_TUNED_MODEL
    assert tuned_params("deflect", "qwen3-32b") == default["deflect"]["params"]
    # a policy tuned from another inherits that policy's values for the same model
    assert tuned_params("rl", OTHER)["node.ttl_s"] == 8.0
    assert tuned_params("rl")["node.ttl_s"] == default["heuristic"]["params"]["node.ttl_s"]
    described = catalog.describe_params(["deflect"], [DEFAULT_TUNED_MODEL, OTHER])["deflect"]
    assert described[OTHER] == {"params": tuned_params("deflect", OTHER), "tuned_on": OTHER}
    assert described[DEFAULT_TUNED_MODEL]["tuned_on"] == DEFAULT_TUNED_MODEL


def test_a_models_file_tuned_on_another_model_is_refused_naming_the_file(tuned_dir: Path) -> None:
    (tuned_dir / f"tuned_policies-{OTHER}.json").write_text(json.dumps(_doc("gpt-oss-20b", {})))
    refused = rf"tuned_policies-{OTHER}\.json: field 'spec\.model' is 'gpt-oss-20b'"
    with pytest.raises(ValueError, match=refused):
        tuned_params("deflect", OTHER)
    with pytest.raises(ValueError, match="not a catalog model name"):
        model_tuned_file("../elsewhere")
    assert model_tuned_file(DEFAULT_TUNED_MODEL) == tuned_dir / "tuned_policies.json"
    assert model_tuned_file(OTHER, "x") == Path("x") / f"tuned_policies-{OTHER}.json"


def test_a_simulated_cluster_runs_its_models_values(tuned_dir: Path) -> None:
    from train.experiment import build_scheduler

    def margin(model: str) -> float:
        config = ClusterConfig(n_prefill=1, n_decode=1, model=model)
        sched = build_scheduler("deflect", config, LinearCostModel())
        return float(sched.path.margin)

    assert margin(OTHER) == 0.2
    assert margin(DEFAULT_TUNED_MODEL) == tuned_params("deflect")["path.margin"]


def test_compare_pins_a_bundle_over_each_models_values_and_keys_jobs_by_them(tuned_dir: Path) -> None:
    from policies.bundle import write_policy_bundle
    from train.compare import Combo, GridSpec, SimTask, add_bundles, job_config

    write_policy_bundle(tuned_dir / "b", name="mine", policy="deflect", params={"path.itl_slack": 0.75})
    spec = GridSpec(policies=("static", "deflect"), traces=("mooncake",), models=(DEFAULT_TUNED_MODEL, OTHER))
    spec, _, _ = add_bundles(spec, [str(tuned_dir / "b")])
    for model in spec.models:
        combo = Combo("mooncake", model, "heldout")
        pinned = dict(spec.point("mine", combo, "2P4D", 1.0, 0).policy_params)
        assert pinned == {**tuned_params("deflect", model), "path.itl_slack": 0.75}
        assert spec.point("deflect", combo, "2P4D", 1.0, 0).policy_params == ()  # the tuned values apply

    tasks = {
        m: SimTask(spec.point("deflect", Combo("mooncake", m, "heldout"), "2P4D", 1.0, 0))
        for m in spec.models
    }
    tuned = {m: job_config(task)["tuned"] for m, task in tasks.items()}
    assert tuned[OTHER] == tuned_params("deflect", OTHER) != tuned[DEFAULT_TUNED_MODEL]


def test_tune_writes_a_models_own_file_by_default_and_updates_only_it(
    tuned_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from train import tune
    from train.cli import main

    captured: list[tune.TuneSpec] = []

    def fake_run_tune(spec: tune.TuneSpec, **_: Any) -> dict[str, Any]:
        captured.append(spec)
        doc = _doc(spec.model, {"deflect": {"path.margin": 0.0}})
        doc["policies"]["deflect"].update(capacity={"mooncake": 1.0}, score=1.0)
        return {**doc, "spec": {**doc["spec"], "side": spec.side}, "static": {}, "wall_s": 0.0}

    monkeypatch.setattr(tune, "run_tune", fake_run_tune)
    default_before = (tuned_dir / "tuned_policies.json").read_bytes()
    assert main(["tune", "--model", "Qwen3-30B-A3B", "--policies", "deflect", "--traces", "mooncake"]) == 0
    written = tuned_dir / "tuned_policies-qwen3-30b-a3b.json"  # by the model's catalog name
    assert json.loads(written.read_text())["spec"]["model"] == captured[-1].model == "qwen3-30b-a3b"
    assert (tuned_dir / "tuned_policies.json").read_bytes() == default_before  # the default file untouched
    catalog._shipped_tuned.cache_clear()
    assert tuned_params("deflect", "qwen3-30b-a3b") == {"path.margin": 0.0}
    assert main(["tune", "--model", "no-such-model", "--policies", "deflect"]) == 2  # before any search
    assert len(captured) == 1
    # --update reads the model's own file: one tuned with other traces is refused before any search
    n = len(captured)
    assert main(["tune", "--model", OTHER, "--policies", "deflect", "--traces", "mooncake", "--update"]) == 2
    assert len(captured) == n


def test_the_report_says_which_values_each_policy_ran_on_each_model(tuned_dir: Path) -> None:
    from train.report import tuned_values_lines

    results = {
        "policy_params": catalog.describe_params(["deflect", "mine"], [DEFAULT_TUNED_MODEL, OTHER]),
        "bundles": {"mine": {"policy": "deflect"}},
    }
    rows = [line for line in tuned_values_lines(results) if line.startswith("| deflect")]
    assert rows[0].startswith(f"| deflect | {DEFAULT_TUNED_MODEL} | {DEFAULT_TUNED_MODEL} |")
    values = "path.itl_slack=1.0, path.margin=0.2, path.max_chunk_tokens=8192"
    assert rows[1] == f"| deflect | {OTHER} | {OTHER} | {values} |"
    assert not any("| mine" in line for line in tuned_values_lines(results))  # a bundle runs its own


def test_bundles_and_served_policies_take_the_models_values(tuned_dir: Path) -> None:
    from policies.bundle import load_policy_bundle, write_policy_bundle
    from train.serve_cli import served_policy

    pinned = write_policy_bundle(tuned_dir / "all", name="all", policy="deflect", model=OTHER)
    assert dict(pinned.params) == tuned_params("deflect", OTHER)  # every value, the model's own
    part = write_policy_bundle(tuned_dir / "part", name="part", policy="deflect", params={"path.margin": 0.1})
    for model in (DEFAULT_TUNED_MODEL, OTHER):
        assert part.run_params(model) == {**tuned_params("deflect", model), "path.margin": 0.1}
        served = served_policy(str(tuned_dir / "part"), model)
        assert served.params == part.run_params(model)
    assert served_policy("deflect", OTHER).info.params == tuned_params("deflect", OTHER)
    assert load_policy_bundle(tuned_dir / "all").digest == pinned.digest
