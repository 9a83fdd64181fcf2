"""`crossflow compare` / `simulate` ergonomics: any trace, defaults from the dataclasses, resumable runs with
provenance, a rerun command per point, per-request export, policy bundles, the Ray backend."""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from train import compare
from train.cli import build_parser, main, point_from_args, simulate_command
from train.compare import GridSpec, run_compare, spec_from_args
from train.experiment import Point, prepare_trace


def _plain(payload: Any) -> Any:
    from train.jsonio import dumps

    return json.loads(dumps(payload))


def _flush_wandb() -> None:
    """Offline W&B writes its run logs from a service process after ``finish`` returns: stop it."""
    import wandb

    wandb.teardown()


def _parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


# ---- defaults and help from one place ------------------------------------------------------------------
def test_compare_defaults_and_help_come_from_gridspec() -> None:
    assert spec_from_args(_parse("compare")) == GridSpec()
    full = spec_from_args(_parse("compare", "--full"))
    assert (full.traces, full.seeds, full.shapes) == (compare.FULL_TRACES, 5, compare.FULL_SHAPES)
    assert full.policies == compare.FULL_POLICIES and {"dynamo-load", "deflect"} <= set(full.policies)
    assert (full.subset("mooncake"), full.subset("agent")) == (1000, 20)
    assert spec_from_args(_parse("compare", "--full", "--seeds", "2")).seeds == 2
    assert spec_from_args(_parse("compare", "--full", "--policies", "static,heuristic")).policies == (
        "static",
        "heuristic",
    )
    tp2 = spec_from_args(_parse("compare", "--tp", "2"))
    assert tp2.point("static", compare.combos(tp2)[0], "2P4D", 1.0, 0).resolved_tp == 2
    sub = build_parser()._subparsers._group_actions[0].choices["compare"]  # type: ignore[union-attr]
    helps = {a.dest: a.help or "" for a in sub._actions}
    d = GridSpec()
    assert "default: 0.25,0.5,0.75,1" in helps["latency_loads"] and d.latency_loads == (0.25, 0.5, 0.75, 1.0)
    assert f"default: {d.seeds}; --full: {compare.FULL_SEEDS}" in helps["seeds"]
    assert f"default: {d.open_loop_arrivals}" in helps["open_loop_arrivals"]


def test_simulate_defaults_come_from_point() -> None:
    assert point_from_args(_parse("simulate")) == Point()


def test_simulate_command_reruns_the_same_point() -> None:
    point = Point(
        policy="rl",
        trace="mooncake",
        shape="3P5D",
        load=1.2345678901234,
        max_requests=30,
        seed=4,
        split="heldout",
        open_loop_arrivals="poisson",
        slo_ttft_s=2.5,
        decode_prefix_cache=True,
        cluster_overrides=(("prefill_routing", "round_robin"),),
        policy_params=(("path.artifact", "policies/data/rl_policy.npz"), ("path.prefix_reuse_share", 0.25)),
    )
    argv = shlex.split(simulate_command(point, artifact_dir="x", max_sim_time_s=99.5))[1:]
    args = _parse(*argv)
    assert point_from_args(args) == point
    assert (args.interference_model, args.max_sim_time) == ("x", 99.5)


# ---- any trace, and what --max-requests / --max-sessions count --------------------------------------------
def test_max_requests_counts_requests_and_max_sessions_sessions() -> None:
    spec = GridSpec(traces=("agent", "mooncake"), max_requests=7, max_sessions=3, seeds=1)
    assert (spec.subset("agent"), spec.subset("mooncake")) == (3, 7)
    c_agent, c_moon = (compare.Combo(t, "gpt-oss-120b", "heldout") for t in ("agent", "mooncake"))
    agent = prepare_trace(spec.point("static", c_agent, "2P4D", 1.0, 0))
    assert len(agent.session_ids) == 3 and len(agent.requests) > 7
    assert len(prepare_trace(spec.point("static", c_moon, "2P4D", 1.0, 0)).requests) == 7
    lines = compare.describe_traces(spec)
    assert "first 3 sessions (--max-sessions;" in lines[0] and "first 7 requests (--max-requests;" in lines[1]
    # compare: --max-requests alone on the agent trace keeps the fewest whole sessions holding N requests
    only = GridSpec(traces=("agent",), max_requests=1000, seeds=1)
    held_point = only.point("static", c_agent, "2P4D", 1.0, 0)
    assert held_point.max_requests > 1 and len(prepare_trace(held_point).requests) >= 1000
    fewer_point = replace(held_point, max_requests=held_point.max_requests - 1)
    assert len(prepare_trace(fewer_point).requests) < 1000
    # simulate: --max-requests on the agent trace keeps whole sessions that hold at least N requests
    point = point_from_args(_parse("simulate", "--trace", "agent", "--max-requests", "100"))
    trace = prepare_trace(point)
    assert len(trace.requests) >= 100
    fewer = prepare_trace(Point(trace="agent", max_requests=point.max_requests - 1))
    assert len(fewer.requests) < 100


def _mooncake_jsonl(path: Path, n: int = 120) -> Path:
    rng = np.random.default_rng(3)
    with path.open("w") as f:
        for i in range(n):
            row = {
                "timestamp": int(i * 900),  # ms: ~67 requests per minute
                "input_length": int(rng.integers(500, 4000)),
                "output_length": int(rng.integers(20, 300)),
                "hash_ids": list(range(i % 5, i % 5 + 3)),
            }
            f.write(json.dumps(row) + "\n")
    return path


def _azure_csv(path: Path, n: int = 120) -> Path:
    rng = np.random.default_rng(4)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        sec = 0.9 * i
        lines.append(
            f"2023-11-16 18:{int(sec // 60):02d}:{sec % 60:09.6f},"
            f"{rng.integers(200, 3000)},{rng.integers(10, 200)}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_compare_runs_trace_files_of_every_format(tmp_path: Path) -> None:
    files = [_mooncake_jsonl(tmp_path / "mine.jsonl"), _azure_csv(tmp_path / "azure.csv")]
    spec = GridSpec(
        policies=("static",),
        traces=tuple(str(f) for f in files),
        max_requests=40,
        seeds=1,
        latency_loads=(1.0,),
        throughput_loads=(2.0,),
        gpus_needed=False,
    )
    compare.check_names(spec)
    assert spec.splits_for(str(files[0])) == ("all",)  # a file has no shared split
    results = run_compare(spec, tmp_path / "run")
    assert not results["failed"]
    assert {p["trace"] for p in results["points"]} == {str(f) for f in files}
    assert all(p["split"] == "all" and p["point"]["max_requests"] == 40 for p in results["points"])
    assert results["grid"]["subset_units"] == {str(f): "requests" for f in files}
    md = (tmp_path / "run" / "report.md").read_text()
    assert f"{files[0]} (split sides all, first 40 requests)" in md


def test_compare_names_a_missing_or_malformed_trace_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never"
    assert main(["compare", "--traces", str(tmp_path / "none.jsonl"), "--out", str(out), "--no-wandb"]) == 2
    assert "neither a bundled trace" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": []}\n{oops\n')
    assert main(["compare", "--traces", str(bad), "--out", str(out), "--no-wandb"]) == 2
    assert "bad.jsonl" in capsys.readouterr().err
    assert not out.exists()


# ---- resumable, with provenance -------------------------------------------------------------------------
def _tiny(**kw: Any) -> GridSpec:
    base: dict[str, Any] = dict(
        policies=("static",),
        traces=("mooncake",),
        max_requests=30,
        seeds=1,
        latency_loads=(0.5, 1.0),
        throughput_loads=(2.0,),
        gpus_needed=False,
    )
    return GridSpec(**{**base, **kw})


@pytest.mark.slow
def test_interrupted_run_keeps_finished_jobs_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = compare.simulate_task
    calls = {"n": 0}

    def interrupt_on_second(task: Any) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(compare, "simulate_task", interrupt_on_second)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_compare(_tiny(), out, command="crossflow compare --out run")
    note = json.loads((out / "interrupted.json").read_text())
    finished = list((out / "finished").glob("*.json"))
    assert note["finished_total"] == len(finished) >= 2  # the static search and one simulation
    assert all(json.loads(p.read_text())["code"]["source_sha256"] for p in finished)
    assert not (out / "results.json").exists()

    def counting(task: Any) -> dict[str, Any]:
        calls["n"] += 1
        return real(task)

    monkeypatch.setattr(compare, "simulate_task", counting)
    calls["n"] = 0
    results = run_compare(_tiny(), out)
    assert calls["n"] == 2 and results["jobs_reused"] == 2  # 3 simulations: one was kept
    assert not (out / "interrupted.json").exists()
    calls["n"] = 0
    again = run_compare(_tiny(), out)
    assert calls["n"] == 0 and again["jobs_run"] == 0
    assert _plain(again["points"]) == _plain(results["points"])
    # another configuration (a different SLO) shares nothing, and the stale files go once it completes
    before = len(list((out / "finished").glob("*.json")))
    other = run_compare(_tiny(slo_ttft_s=4.0), out)
    assert other["jobs_reused"] == 0 and other["jobs_pruned"] == before == 4
    assert len(list((out / "finished").glob("*.json"))) == other["jobs_run"]


@pytest.mark.slow
def test_each_point_records_the_command_that_reruns_it(tmp_path: Path) -> None:
    spec = _tiny(policies=("static", "utilisation"), latency_loads=(1.0,), throughput_loads=(2.0,))
    parquet = tmp_path / "all.parquet"
    results = run_compare(spec, tmp_path / "run", requests_out=parquet)
    df = pd.read_parquet(parquet)
    sims = {p["label"]: p["metrics"]["n_requests"] for p in results["points"]}
    assert len(df) == sum(sims.values()) == results["requests_out"]["rows"]
    assert set(df["point"]) == set(sims) and set(df["policy"]) == {"static", "utilisation"}
    row = results["points"][-1]
    argv = [*shlex.split(row["rerun"])[1:], "--no-progress", "--json", str(tmp_path / "one.json")]
    assert main(argv) == 0
    assert json.loads((tmp_path / "one.json").read_text())["metrics"] == row["metrics"]


def test_a_corrupt_interference_model_fails_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from interference_model.artifact import DATA_DIR

    art = tmp_path / "im"
    shutil.copytree(DATA_DIR / "h200_gpt-oss-120b_tp1", art)
    (art / "model.txt").write_text("tree\nnot a model\n")
    out = tmp_path / "never"
    argv = ["compare", "--policies", "static,heuristic", "--interference-model", str(art)]
    assert main([*argv, "--out", str(out), "--no-wandb", "--no-progress"]) == 2
    assert "model.txt" in capsys.readouterr().err
    assert not out.exists()


def test_a_bundle_parameter_value_the_policy_refuses_fails_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from policies.bundle import write_policy_bundle
    from policies.catalog import tuned_params

    bad = {**tuned_params("heuristic"), "node.itl_budget_share": 1.6}  # at most 1 (policies.slo)
    refused = tmp_path / "refused"
    assert main(["bundle", "--policy", "heuristic", "--out", str(refused), "--params", json.dumps(bad)]) == 2
    assert "--params" in capsys.readouterr().err and not refused.exists()
    # written past the CLI (by hand or an older version): compare builds its scheduler before anything
    from interference_model.artifact import DATA_DIR

    folder = write_policy_bundle(
        tmp_path / "hb", name="hb", policy="heuristic", params=bad,
        interference_model=DATA_DIR / "h200_gpt-oss-120b_tp1",
    ).folder  # fmt: skip
    out = tmp_path / "never"
    argv = ["compare", "--policy-bundle", str(folder), "--out", str(out), "--no-wandb", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "policy bundle 'hb'" in err and "share" in err
    assert not out.exists()


# ---- per-request export --------------------------------------------------------------------------------
def test_simulate_requests_out_has_one_row_per_request(tmp_path: Path) -> None:
    from train.requests_out import COLUMNS

    path = tmp_path / "req.parquet"
    argv = ["simulate", "--trace", "mooncake", "--max-requests", "80", "--policy", "heuristic"]
    assert (
        main([*argv, "--no-progress", "--requests-out", str(path), "--json", str(tmp_path / "m.json")]) == 0
    )
    df = pd.read_parquet(path)
    metrics = json.loads((tmp_path / "m.json").read_text())["metrics"]
    assert tuple(df.columns) == COLUMNS and len(df) == metrics["n_requests"] == 80
    assert df["ttft_s"].mean() == pytest.approx(metrics["ttft_mean_s"])
    borrowed = df[df["path"] == "borrowed"]
    assert len(borrowed) == round(metrics["borrowed_share"] * 80)
    assert borrowed["lease_id"].notna().all() and df.loc[df["path"] == "normal", "lease_id"].isna().all()
    assert df["decision_reason"].notna().all()
    assert main([*argv, "--no-progress", "--requests-out", str(tmp_path)]) == 2  # a folder: refused first
    out = tmp_path / "never"
    assert main(["compare", "--requests-out", str(tmp_path), "--out", str(out), "--no-wandb"]) == 2
    assert not out.exists()


# ---- policy bundles ------------------------------------------------------------------------------------
def test_policy_bundle_round_trip_tamper_and_wandb_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from policies.bundle import load_policy_bundle, resolve_bundle
    from policies.catalog import tuned_params

    folder = tmp_path / "heur"
    assert (
        main(["bundle", "--policy", "heuristic", "--out", str(folder), "--params", '{"node.ttl_s": 4.0}'])
        == 0
    )
    bundle = load_policy_bundle(folder)
    # --params is laid over the tuned values, so the bundle pins every value it runs with
    pinned = {**tuned_params("heuristic"), "node.ttl_s": 4.0}
    assert (bundle.policy, bundle.version, dict(bundle.params)) == ("heuristic", 1, pinned)
    assert main(["bundle", "--policy", "heuristic", "--out", str(tmp_path / "bad"), "--params", "[1]"]) == 2
    assert "--params: a JSON object" in capsys.readouterr().err
    assert main(["bundle", "--policy", "utilisation", "--out", str(tmp_path / "u"), "--log-wandb"]) == 0
    _flush_wandb()
    (logged,) = (tmp_path / "wandb").glob("offline-run-*")  # offline: uploaded by `wandb sync`
    assert b"policy-bundle" in next(logged.glob("*.wandb")).read_bytes()
    assert bundle.interference_model == folder / "interference_model" and bundle.rl_policy is None
    base = ["simulate", "--trace", "mooncake", "--max-requests", "60", "--no-progress"]
    assert main([*base, "--policy-bundle", str(folder), "--json", str(tmp_path / "b.json")]) == 0
    named = [*base, "--policy", "heuristic", "--policy-param", "node.ttl_s=4.0"]
    assert main([*named, "--json", str(tmp_path / "n.json")]) == 0
    read = [json.loads((tmp_path / f"{k}.json").read_text())["metrics"] for k in ("b", "n")]
    assert read[0] == read[1]
    # a W&B reference resolves from the local cache, with no network and W&B offline
    monkeypatch.setenv("CROSSFLOW_BUNDLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(FileNotFoundError, match="not in the local bundle cache"):
        resolve_bundle("wandb:me/crossflow/heur:v0")
    shutil.copytree(folder, tmp_path / "cache" / "me" / "crossflow" / "heur" / "v0")
    assert load_policy_bundle(resolve_bundle("wandb:me/crossflow/heur:v0")).digest == bundle.digest
    with pytest.raises(ValueError, match="ENTITY/PROJECT/NAME:VERSION"):
        resolve_bundle("wandb:heur")
    # a changed file is refused, naming it
    (folder / "interference_model" / "model.txt").write_text("tree\n")
    assert main([*base, "--policy-bundle", str(folder)]) == 2
    assert "model.txt: SHA-256 differs" in capsys.readouterr().err


def test_rl_policy_flag_loads_the_given_weights_and_names_a_broken_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from policies.rl_policy import DEFAULT_ARTIFACT

    base = ["simulate", "--trace", "mooncake", "--max-requests", "40", "--policy", "rl", "--no-progress"]
    assert main([*base, "--json", str(tmp_path / "a.json")]) == 0
    shutil.copyfile(DEFAULT_ARTIFACT, tmp_path / "mine.npz")
    shutil.copyfile(DEFAULT_ARTIFACT.with_suffix(".json"), tmp_path / "mine.json")
    assert main([*base, "--rl-policy", str(tmp_path / "mine.npz"), "--json", str(tmp_path / "b.json")]) == 0
    read = [json.loads((tmp_path / f"{k}.json").read_text())["metrics"] for k in ("a", "b")]
    assert read[0] == read[1]
    (tmp_path / "mine.npz").write_bytes(DEFAULT_ARTIFACT.read_bytes()[:100])
    assert main([*base, "--rl-policy", str(tmp_path / "mine.npz")]) == 2
    assert "mine.npz" in capsys.readouterr().err
    assert main(["simulate", "--policy", "static", "--rl-policy", str(DEFAULT_ARTIFACT)]) == 2
    assert "needs --policy rl" in capsys.readouterr().err


# ---- Ray ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.ray
def test_ray_backend_gives_the_process_backends_results(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from policies.bundle import write_policy_bundle

    write_policy_bundle(tmp_path / "lend", name="lend", policy="utilisation")
    bundles = [str(tmp_path / "lend")]
    spec = _tiny(latency_loads=(1.0,), throughput_loads=(2.0,))
    local = run_compare(spec, tmp_path / "local", jobs=2, bundles=bundles)
    backend = compare.RayBackend(None, num_cpus=2)
    try:
        remote = run_compare(spec, tmp_path / "ray", backend=backend, bundles=bundles)
    finally:
        backend.ray.shutdown()
    assert remote["backend"] == "ray" and not remote["failed"]
    assert {p["policy"] for p in remote["points"]} == {"static", "lend"}  # a bundle runs on Ray too
    strip = ("wall_s", "rerun")
    assert _plain([{k: v for k, v in p.items() if k not in strip} for p in remote["points"]]) == _plain(
        [{k: v for k, v in p.items() if k not in strip} for p in local["points"]]
    )


@pytest.mark.slow
def test_compare_runs_a_policy_bundle_under_its_name(tmp_path: Path) -> None:
    from interference_model.artifact import DATA_DIR
    from policies.bundle import write_policy_bundle
    from policies.catalog import tuned_params

    folder = tmp_path / "mine"
    write_policy_bundle(
        folder, name="mine", policy="heuristic", interference_model=DATA_DIR / "h200_gpt-oss-120b_tp1"
    )
    spec = _tiny(policies=("static", "heuristic"), latency_loads=(1.0,), throughput_loads=(2.0,))
    write_policy_bundle(tmp_path / "clash", name="static", policy="utilisation")
    with pytest.raises(ValueError, match="already a catalog policy"):
        run_compare(spec, tmp_path / "never", bundles=[str(tmp_path / "clash")])
    assert not (tmp_path / "never").exists()
    # a bundle naming one parameter runs it over the policy's other tuned values, as simulate does
    write_policy_bundle(
        tmp_path / "part", name="part", policy="heuristic", params={"node.ttl_s": 2.0},
        interference_model=DATA_DIR / "h200_gpt-oss-120b_tp1",
    )  # fmt: skip
    assert tuned_params("heuristic")["node.ttl_s"] == 2.0 and len(tuned_params("heuristic")) > 1
    results = run_compare(spec, tmp_path / "run", bundles=[str(folder), str(tmp_path / "part")])
    assert not results["failed"] and results["bundles"]["mine"]["policy"] == "heuristic"
    rows = {(p["policy"], p["regime"]): p for p in results["points"]}
    assert {p for p, _ in rows} == {"static", "heuristic", "mine", "part"}
    expected = [list(kv) for kv in sorted(tuned_params("heuristic").items())]
    for name in ("mine", "part"):
        assert _plain(rows[(name, "latency")]["point"]["policy_params"]) == expected
        for regime in ("latency", "throughput"):  # the shipped values, bundled: the same simulation
            assert rows[(name, regime)]["metrics"] == rows[("heuristic", regime)]["metrics"]
        # its rerun names the policy it bundles (the alias exists only inside compare)
        assert " --policy heuristic " in rows[(name, "latency")]["rerun"]
    caps = {c["point"]["policy"]: c["load"] for c in results["capacity"]}
    assert caps["mine"] == caps["heuristic"]


# ---- W&B -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_wandb_offline_runs_tables_plots_and_results_artifact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from policies.bundle import load_policy_bundle, write_policy_bundle
    from policies.catalog import tuned_params

    write_policy_bundle(tmp_path / "lend", name="lend", policy="utilisation")
    spec = _tiny(policies=("static", "utilisation"), seeds=2, latency_loads=(1.0,), throughput_loads=(2.0,))
    results = run_compare(spec, tmp_path / "run", use_wandb=True, bundles=[str(tmp_path / "lend")])
    info = results["wandb"]
    assert info["runs"] == 7 and info["group"].startswith("run@")  # 2 points x 3 policies + the summary
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 7
    # each bundle a run ran is logged as a policy-bundle artifact (offline W&B refuses use_artifact, so
    # as the run's output, uploaded by `wandb sync`): --policy-bundle's own, and for the catalog
    # policy with a scheduler (utilisation) a bundle of its tuned values written into the run folder
    _flush_wandb()
    logs = [next(r.glob("*.wandb")).read_bytes() for r in runs]  # offline: config lives in the log
    lend = load_policy_bundle(tmp_path / "lend")
    made = load_policy_bundle(tmp_path / "run" / "bundles" / "utilisation-gpt-oss-120b")
    assert made.policy == "utilisation" and dict(made.params) == tuned_params("utilisation")
    assert info["policy_bundles"] == {
        "lend|gpt-oss-120b": str(tmp_path / "lend"),
        "utilisation|gpt-oss-120b": str(made.folder),
    }
    assert made.digest == lend.digest, "the same policy and values: the same digest, whatever the name"
    with_bundle = [b for b in logs if b"policy-bundle" in b]
    assert len(with_bundle) == 4, "two points x (lend, utilisation); static has no bundle"
    assert all(b"log_artifact" in b and made.digest.encode() in b for b in with_bundle)
    assert sum(b"utilisation-gpt-oss-120b" in b for b in logs) == 2
    assert not any(b"model_sha256" in b for b in logs)  # neither static nor utilisation uses a model
    assert sum(b"compare-results" in b for b in logs) == 1  # results.json + report.md, as an artifact
    media = [p.relative_to(tmp_path) for r in runs for p in (r / "files" / "media").rglob("*") if p.is_file()]
    names = [p.name for p in media]
    assert sum(n.startswith("seeds_") and n.endswith(".table.json") for n in names) == 6
    assert sum(n.startswith("comparison_") for n in names) == 1
    assert sum(n.endswith(".png") for n in names) == len(list((tmp_path / "run").glob("*.png")))
    seeds = next(p for r in runs for p in (r / "files" / "media").rglob("seeds_*.table.json"))
    table = json.loads(seeds.read_text())
    assert len(table["data"]) == 2 and table["columns"][0] == "seed"
    assert json.loads((tmp_path / "run" / "results.json").read_text())["wandb"]["runs"] == 7
