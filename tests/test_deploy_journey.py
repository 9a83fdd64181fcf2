"""The deploy journey on the emulated cluster: ``--policy`` takes a policy bundle (a folder or a
``wandb:`` reference from the local cache) and ``/server_info`` serves its identity; a policy reload on
the router's control plane swaps the scheduler while requests stream, and none is dropped."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from envs.cluster_config import ClusterConfig  # noqa: E402
from envs.cost_model import CostModel  # noqa: E402
from envs.estimator import ClusterEstimator  # noqa: E402
from interference_model.artifact import DATA_DIR, artifact_slug  # noqa: E402
from policies.bundle import CACHE_ENV, write_policy_bundle  # noqa: E402
from policies.catalog import tuned_params  # noqa: E402
from serving.router import POLICY_PATH  # noqa: E402
from tests.test_router import BORROW_TOKENS, MODEL, BorrowMarked, _events, _stack  # noqa: E402
from train.experiment import build_scheduler  # noqa: E402
from train.serve_cli import _router_parts, served_policy  # noqa: E402

PARAMS = {"node.ttl_s": 3.0, "node.margin": 0.7, "scheduler.itl_guard": None}
"""Not the shipped tuned values (so a test sees the bundle's, not the catalog's)."""


def _bundle(root: Path, name: str = "heuristic-h200", version: int = 3) -> Any:
    return write_policy_bundle(
        root / name,
        name=name,
        policy="heuristic",
        params=PARAMS,
        interference_model=DATA_DIR / artifact_slug(*MODEL),
        version=version,
    )


def test_policy_takes_a_catalog_name_a_bundle_folder_or_a_cached_wandb_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, cm = ClusterConfig(n_prefill=1, n_decode=2), CostModel(*MODEL)
    bundle = _bundle(tmp_path)
    catalog = served_policy("heuristic")
    assert catalog.params is None and catalog.info.source == "catalog" and catalog.info.name == "heuristic"
    served = served_policy(str(bundle.folder))
    assert (served.policy, served.params, served.interference_model) == (
        "heuristic",
        dict(PARAMS),
        bundle.interference_model,
    )
    info = served.info
    assert (info.name, info.version, info.sha256) == ("heuristic-h200", "3", bundle.digest)
    scheduler = served.scheduler(config, cm)
    assert scheduler._policy.margin == 0.7 and scheduler._policy.ttl_s == 3.0, "the bundle's values"
    assert build_scheduler("heuristic", config, cm)._policy.margin != 0.7, "not the shipped ones"
    # a bundle naming some parameters is served with the policy's other tuned values, as simulated
    part = write_policy_bundle(
        tmp_path / "part", name="part", policy="heuristic", params={"node.margin": 0.7},
        interference_model=DATA_DIR / artifact_slug(*MODEL),
    )  # fmt: skip
    assert served_policy(str(part.folder)).params == {**tuned_params("heuristic"), "node.margin": 0.7}
    # a W&B reference, offline, from the local cache (as `wandb artifact get` or a download left it)
    cache = tmp_path / "cache"
    shutil.copytree(bundle.folder, cache / "lab" / "crossflow" / "heuristic-h200" / "v0")
    monkeypatch.setenv(CACHE_ENV, str(cache))
    monkeypatch.setenv("WANDB_MODE", "offline")
    ref = "wandb:lab/crossflow/heuristic-h200:v0"
    cached = served_policy(ref)
    assert cached.info.sha256 == bundle.digest and cached.info.source == ref
    with pytest.raises(FileNotFoundError, match="not in the local bundle cache"):
        served_policy("wandb:lab/crossflow/heuristic-h200:v9")
    with pytest.raises(ValueError, match=r"unknown policy 'no-such-policy': neither a catalog policy"):
        served_policy("no-such-policy")
    # the router serves the bundle's identity
    parts = _router_parts(served, config, cm)
    with _stack(config, **parts) as (_, _, stack), httpx.Client(trust_env=False, timeout=30) as c:
        info = c.get(f"{stack.router.url}/server_info").json()["crossflow_router"]["policy"]
        assert info == {
            "name": "heuristic-h200", "version": "3", "sha256": bundle.digest, "policy": "heuristic",
            "source": str(bundle.folder), "params": PARAMS,
        }  # fmt: skip
        assert len(stack.agents) == 2


def test_serve_command_runs_a_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from train.cli import main

    bundle = _bundle(tmp_path)
    command = ["serve", "--emulate", "1P2D", "--port", "0", "--router", "crossflow", "--time-scale", "8"]
    # long enough that a start-up stall on a busy machine stays within the lag check's 5 % of the run
    # (a fresh-clone run under `pytest -n 2` once stalled 234 ms before any iteration: 5.9 % of 4 s)
    assert main([*command, "--policy", str(bundle.folder), "--run-s", "8"]) == 0
    out = capsys.readouterr().out
    assert f"policy heuristic-h200 v3 (heuristic, bundle digest {bundle.digest[:12]})" in out
    assert "(2 lease agents)" in out


def test_a_policy_reload_while_requests_stream_drops_none(tmp_path: Path) -> None:
    """Borrowed and normal requests streaming on the first policy while the control plane reloads a
    bundle: every request completes in full; the borrowed ones finish on the scheduler that admitted
    them (its ledger ends empty, the new one never sees them); later requests are decided by the new
    scheduler; ``/server_info`` reports the bundle; a bad token or reference changes nothing."""
    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=1, control_interval_s=0.1)
    bundle = _bundle(tmp_path)
    first = BorrowMarked()
    chosen_by_first = 0
    decide = first.choose_path

    def counted(q: Any, now_s: float) -> Any:
        nonlocal chosen_by_first
        chosen_by_first += 1
        return decide(q, now_s)

    first.choose_path = counted  # type: ignore[method-assign]

    def loader(ref: str) -> Any:
        other = served_policy(ref)
        return other.scheduler(config, cm), other.info

    with _stack(
        config,
        worker_scheduler=build_scheduler("utilisation", config, cm),
        scheduler=first,
        estimator=ClusterEstimator(config, cm),
        policy_loader=loader,
        control_token="t0ken",
    ) as (_, cluster, stack):
        router = stack.router
        url, control = router.url, router.control_url
        auth = {"Authorization": "Bearer t0ken"}

        async def stream(ac: Any, input_ids: list[int], n_out: int) -> list[Any]:
            body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": n_out}, "stream": True}
            resp = await ac.post(f"{url}/generate", json=body)
            assert resp.status_code == 200, resp.text
            return _events(resp.text)

        async def run() -> tuple[list[list[Any]], list[list[Any]], Any]:
            async with httpx.AsyncClient(
                trust_env=False, timeout=60.0, limits=httpx.Limits(max_connections=None)
            ) as ac:
                warm = asyncio.ensure_future(stream(ac, [9] * 500, 200))  # keeps the node's leases ticking
                await asyncio.sleep(3 * config.control_interval_s * 4.0)
                before = [
                    asyncio.ensure_future(
                        stream(ac, [100 + i] * BORROW_TOKENS if i % 2 == 0 else [300 + i] * 700, 40)
                    )
                    for i in range(8)
                ]
                deadline = time.monotonic() + 30
                while "started" not in first.calls and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert "started" in first.calls, "a borrowed request was streaming at the reload"
                bad = await ac.post(control + POLICY_PATH, json={"policy": "heuristic"})
                assert bad.status_code == 401
                wrong = await ac.post(control + POLICY_PATH, json={"policy": "nope"}, headers=auth)
                assert wrong.status_code == 400 and "neither a catalog policy" in wrong.text
                assert router.scheduler is first
                t0 = time.perf_counter()
                reload = await ac.post(
                    control + POLICY_PATH, json={"policy": str(bundle.folder)}, headers=auth
                )
                reload_s = time.perf_counter() - t0
                assert reload.status_code == 200, reload.text
                assert not all(t.done() for t in before), "requests were in flight during the reload"
                after = [asyncio.ensure_future(stream(ac, [500 + i] * 800, 20)) for i in range(4)]
                done_before = await asyncio.gather(warm, *before)
                done_after = await asyncio.gather(*after)
                return done_before, done_after, (reload.json(), reload_s)

        done_before, done_after, (answer, reload_s) = asyncio.run(asyncio.wait_for(run(), timeout=120))
        for events, n_out in (
            [(done_before[0], 200)] + [(e, 40) for e in done_before[1:]] + [(e, 20) for e in done_after]
        ):
            assert events[-1] == "[DONE]" and events[-2]["meta_info"]["completion_tokens"] == n_out
        assert answer["previous"]["name"] == "static" and answer["policy"]["sha256"] == bundle.digest
        assert reload_s < 10.0
        # the borrowed requests admitted by the first scheduler ended there, each exactly once
        borrowed = first.calls.count("started")
        assert borrowed >= 1 and first.calls.count("finished") + first.calls.count("fallback") == 4
        assert first.ledger.active_ids() == [], "no reservation left behind in the old ledger"
        assert chosen_by_first == 9, "the warm request and the eight before the reload"
        assert router.scheduler is not first and router.policy_generation == 1
        decisions = sum(router.m_decisions.values.values())
        assert decisions == 13, "the four after the reload were decided by the new scheduler"
        with httpx.Client(trust_env=False, timeout=30) as c:
            info = c.get(f"{url}/server_info").json()["crossflow_router"]["policy"]
            assert (info["name"], info["version"], info["sha256"]) == ("heuristic-h200", "3", bundle.digest)
            assert c.get(control + POLICY_PATH, headers=auth).json()["policy"] == info
            metrics = c.get(f"{url}/metrics").text
        assert 'crossflow:policy_reloads_total{policy="heuristic-h200"} 1' in metrics
        assert 'crossflow:requests_total{api="generate",status="200"} 13' in metrics
        assert len(cluster.live.sim.reqs) == 13


def test_the_serve_lag_check_fails_a_worker_that_ran_but_only_reports_an_idle_stall() -> None:
    from envs.live import lag_check
    from train.serve_cli import lag_summary

    def report(max_s: float, iterations: int) -> dict[str, object]:
        return {"max_s": max_s, "mean_s": 0.0, "iterations": iterations, "check": lag_check(max_s, 8.0)}

    lines, failed = lag_summary([("prefill 0", report(0.45, 0)), ("decode 0", report(0.01, 12))])
    assert not failed and "no timing is affected" in lines[0] and "lagged" not in lines[0]
    lines, failed = lag_summary([("prefill 0", report(0.01, 5)), ("decode 0", report(0.45, 12))])
    assert failed and "lagged 0.450 s" in lines[1] and lines[0].endswith("over 5 iterations")
