"""``train.ppo`` (learns CartPole; numpy export equals the torch actor; checkpoints), ``train-rl`` end to
end (a tiny run, resume, the artifact's provenance), the shipped policy, and ``rl`` through
``crossflow simulate`` and ``crossflow compare``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from policies.rl_policy import ACTIONS, DEFAULT_ARTIFACT, FEATURES, MlpWeights, load_artifact, save_artifact
from tests.test_rl_env import TINY
from train.ppo import PPO, make_vector_env
from train.ppo_config import PPOConfig
from train.rl_train import TrainConfig, train

torch.set_num_threads(1)


def _cartpole(n: int = 4) -> object:
    return make_vector_env([lambda: gym.make("CartPole-v1") for _ in range(n)])


def test_ppo_learns_cartpole_and_is_deterministic() -> None:
    cfg = PPOConfig(n_steps=128, n_epochs=4, batch_size=128, seed=1)
    ppo = PPO(_cartpole(), cfg)
    ppo.learn(12_000)
    assert ppo.num_timesteps == 12_288
    early, late = np.mean(ppo.episode_returns[:20]), np.mean(ppo.episode_returns[-20:])
    assert early < 40 and late > 100, (early, late)  # random play lasts about 20 steps
    again = PPO(_cartpole(), cfg)
    again.learn(1_024)
    first = PPO(_cartpole(), cfg)
    first.learn(1_024)
    assert again.episode_returns == first.episode_returns


def test_numpy_actor_equals_the_torch_actor_and_checkpoints_restore(tmp_path: Path) -> None:
    venv = make_vector_env([lambda: _BoxEnv() for _ in range(2)])
    ppo = PPO(venv, PPOConfig(n_steps=32, batch_size=32, n_epochs=2, init_action=(0.5, -0.5, 0.0, 0.2)))
    ppo.learn(128)  # weights and statistics away from their initial values
    weights = MlpWeights(ppo.actor_layers(), ppo.obs_rms.mean.copy(), ppo.obs_rms.var.copy())
    path = save_artifact(tmp_path / "p.npz", weights, {"seed": 0, "command": "x"})
    loaded, meta = load_artifact(path)
    obs = np.random.default_rng(0).uniform(0, 1, (16, len(FEATURES)))
    np.testing.assert_allclose(loaded.forward(obs), ppo.predict(obs), rtol=1e-5, atol=1e-5)
    assert meta["actions"] == list(ACTIONS) and meta["seed"] == 0
    state = ppo.state_dict()
    other = PPO(venv, ppo.cfg)
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.predict(obs), ppo.predict(obs))
    assert other.num_timesteps == ppo.num_timesteps


class _BoxEnv(gym.Env[np.ndarray, np.ndarray]):
    """Reward for matching the action to the first features (shapes of the ``rl`` env)."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0.0, 1.0, (len(FEATURES),), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (len(ACTIONS),), np.float32)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._t = 0
        return self.np_random.uniform(0, 1, len(FEATURES)).astype(np.float32), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._t += 1
        obs = self.np_random.uniform(0, 1, len(FEATURES)).astype(np.float32)
        return obs, -float(np.abs(action).sum()), False, self._t >= 10, {}


def _tiny_config(tmp_path: Path, **changes: object) -> TrainConfig:
    base = TrainConfig(
        out=str(tmp_path / "run"),
        total_steps=32,
        n_envs=2,
        processes=False,
        eval_every=16,
        eval_windows=1,
        baselines=("static", "heuristic"),
        ppo=dataclasses.replace(TrainConfig().ppo, n_steps=8, batch_size=8, n_epochs=1),
        predictor="constant:20000",
        wandb=False,
        progress=False,
        command="crossflow train-rl --test",
        env=TINY,
    )
    return dataclasses.replace(base, **changes)


def test_a_tiny_training_run_exports_a_policy_with_its_provenance_and_resumes(tmp_path: Path) -> None:
    result = train(_tiny_config(tmp_path, wandb=True))
    out = tmp_path / "run"
    _, meta = load_artifact(result["artifact"])
    assert meta["command"] == "crossflow train-rl --test" and meta["seed"] == 0 and meta["steps"] == 32
    assert (
        meta["selected_steps"] in (0, 16, 32)
        and meta["start"] == "heuristic-shed"
        and meta["decision_intervals"] == TINY.decision_intervals
    )
    assert {"static", "heuristic", "rl"} <= set(result["summary"])
    evals = json.loads((out / "eval.json").read_text())["evals"]
    assert [e["steps"] for e in evals] == [0, 16, 32]  # the untrained start rule is a candidate too
    assert (out / "checkpoints" / "ppo_16.pt").is_file()
    assert list((out / "wandb").glob("offline-run-*")), "W&B offline run folder missing"
    resumed = train(_tiny_config(tmp_path, total_steps=48, resume=str(out / "checkpoints" / "ppo_32.pt")))
    assert resumed["steps"] == 48


def test_the_shipped_policy_loads_and_records_how_it_was_made() -> None:
    weights, meta = load_artifact(DEFAULT_ARTIFACT)
    assert meta["command"].startswith("crossflow train-rl") and isinstance(meta["seed"], int)
    assert meta["steps"] > 0 and meta["env_config"]["trace"] == "mooncake"
    assert weights.forward(np.zeros(len(FEATURES))).shape == (len(ACTIONS),)


def test_rl_runs_through_simulate_and_compare(tmp_path: Path) -> None:
    from train.cli import main

    base = ["simulate", "--trace", "mooncake", "--max-requests", "40", "--no-progress"]
    for policy in ("rl", "greedy-model"):
        assert main([*base, "--policy", policy, "--json", str(tmp_path / f"{policy}.json")]) == 0
        assert json.loads((tmp_path / f"{policy}.json").read_text())["metrics"]["n_finished"] > 0
    out = tmp_path / "cmp"
    argv = [
        "compare", "--policies", "static,rl,greedy-model", "--traces", "mooncake", "--max-requests", "40",
        "--seeds", "1", "--latency-loads", "1", "--throughput-loads", "2", "--no-gpus-needed",
        "--no-wandb", "--no-progress", "--jobs", "1", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    capacity = json.loads((out / "results.json").read_text())["capacity"]
    assert {"rl", "greedy-model"} <= {c["point"]["policy"] for c in capacity if c["role"] == "capacity"}
