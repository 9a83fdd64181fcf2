"""PPO export round trip, the ``rl`` registry entry, the shipped policy, and ``train-rl`` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from envs.cluster_config import ClusterConfig
from envs.estimator import ClusterEstimator
from policies.context import PolicyContext
from policies.lease import LeaseBudgets
from policies.node_policies import make_node_policy
from policies.rl_policy import DEFAULT_ARTIFACT, FEATURES, RLPolicy, load_artifact, save_artifact
from tests.fakes import LinearCostModel
from tests.test_rl_env import FakePredictor, node_state, tiny_env
from train.rl_train import export_weights

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ppo_and_norm() -> tuple[object, object]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    venv = VecNormalize(DummyVecEnv([tiny_env]), clip_obs=10.0)
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=32, n_epochs=1, seed=0, device="cpu")
    model.learn(128)  # a few updates so weights and running statistics are not at their initial values
    return model, venv


def test_numpy_forward_equals_torch_forward_after_save_and_load(ppo_and_norm: tuple, tmp_path: Path) -> None:
    model, venv = ppo_and_norm
    path = save_artifact(tmp_path / "p.npz", export_weights(model, venv), {"lease_shape": {}, "seed": 0})
    weights, meta = load_artifact(path)
    assert meta["features"] == list(FEATURES) and meta["seed"] == 0
    obs = np.random.default_rng(0).uniform(0, 1, (32, len(FEATURES))).astype(np.float32)
    with torch.no_grad():
        dist = model.policy.get_distribution(torch.as_tensor(venv.normalize_obs(obs)))
        torch_action = dist.distribution.mean.numpy()
    np.testing.assert_allclose(weights.forward(obs), torch_action, rtol=1e-5, atol=1e-5)


def test_make_node_policy_rl_loads_an_artifact(ppo_and_norm: tuple, tmp_path: Path) -> None:
    model, venv = ppo_and_norm
    path = save_artifact(tmp_path / "p.npz", export_weights(model, venv), {"lease_shape": {"ttl_s": 4.0}})
    ctx = PolicyContext(
        ClusterEstimator(ClusterConfig(), LinearCostModel()), ClusterConfig(), FakePredictor()
    )
    policy = make_node_policy("rl", ctx, artifact=path)
    assert isinstance(policy, RLPolicy) and policy.ttl_s == 4.0
    assert isinstance(policy.propose(node_state()), LeaseBudgets)
    assert policy.propose(node_state(queued_decode_requests=2)).is_zero()


def test_artifact_errors_name_the_file_and_field(ppo_and_norm: tuple, tmp_path: Path) -> None:
    model, venv = ppo_and_norm
    path = save_artifact(tmp_path / "p.npz", export_weights(model, venv), {})
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "features": ["x"]}))
    with pytest.raises(ValueError, match=r"p\.json: field 'features'"):
        load_artifact(path)
    meta_path.write_text("{\n  broken")
    with pytest.raises(ValueError, match=r"p\.json: line 2"):
        load_artifact(path)
    with pytest.raises(FileNotFoundError, match="missing"):
        load_artifact(tmp_path / "missing.npz")


def test_shipped_policy_loads_and_says_how_it_was_made() -> None:
    weights, meta = load_artifact(DEFAULT_ARTIFACT)
    assert meta["command"].startswith("crossflow train-rl") and meta["steps"] > 0 and "seed" in meta
    assert DEFAULT_ARTIFACT.stat().st_size < 200_000
    policy = RLPolicy.load(FakePredictor())
    assert policy.propose(node_state(recent_step_time_s=1.0)).is_zero()
    assert weights.forward(np.zeros(len(FEATURES))).shape == (2,)


@pytest.mark.slow
def test_train_rl_end_to_end_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = [
        sys.executable, "-m", "train.rl_cli", "train-rl", "--out", str(out), "--n-envs", "1",
        "--n-steps", "64", "--batch-size", "32", "--eval-windows", "1", "--eval-every", "128",
        "--checkpoint-every", "128", "--episode-intervals", "16", "--n-sessions", "8",
        "--warmup-range", "5", "10", "--predictor", "constant:20000", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    first = subprocess.run(
        [*common, "--total-steps", "256"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "rl" in first.stdout and "heuristic" in first.stdout
    assert (out / "checkpoints" / "ppo_128.zip").is_file()
    assert (out / "checkpoints" / "ppo_128_vecnormalize.pkl").is_file()
    steps = [h["steps"] for h in json.loads((out / "eval.json").read_text())["history"]]
    assert steps == [128, 256]  # the final evaluation at 256 is the in-training one, not run again
    resumed = subprocess.run(
        [*common, "--total-steps", "320", "--resume", str(out / "checkpoints" / "ppo_256.zip"), "--no-wandb"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    _, meta = load_artifact(out / "policy.npz")
    assert meta["steps"] == 320 and "--resume" in meta["command"]
    history = json.loads((out / "eval.json").read_text())["history"]
    assert history[-1]["steps"] == 320 and {"static", "heuristic", "rl"} <= set(history[-1]["summary"])
    assert list((out / "wandb").glob("offline-run-*")), "W&B offline run folder missing"
