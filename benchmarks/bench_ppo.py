"""PPO env steps per second per core: ``train.ppo`` against stable-baselines3, both on CartPole-v1.

Both get the same hyperparameters (``--n-envs`` environments stepped in turn in one process, rollout
``--n-steps`` per env, ``--n-epochs`` epochs of minibatch ``--batch-size``, 64x64 tanh MLPs, Adam
3e-4, observation and reward normalisation) and the same number of env steps; each runs in its own
process pinned to one core (``os.sched_setaffinity``) with one torch thread. The figure is env steps
(rollouts and updates included) per second of wall time; ``--repeats`` runs each and reports the
median. ``--lease-env STEPS`` also times ``train.ppo`` on the ``rl`` environment
(``envs.rl_env.PathLeaseEnv``, default config) for that many steps.

    python benchmarks/bench_ppo.py [--steps 100000] [--repeats 3] [--lease-env 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any


def _pin() -> None:
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)


def run_ours(args: dict[str, Any]) -> float:
    _pin()
    import gymnasium as gym

    from train.ppo import PPO, PPOConfig, make_vector_env

    venv = make_vector_env([lambda: gym.make("CartPole-v1") for _ in range(args["n_envs"])])
    cfg = PPOConfig(
        n_steps=args["n_steps"], n_epochs=args["n_epochs"], batch_size=args["batch_size"], gamma=0.99
    )
    ppo = PPO(venv, cfg)
    t0 = time.perf_counter()
    ppo.learn(args["steps"])
    return ppo.num_timesteps / (time.perf_counter() - t0)


def run_sb3(args: dict[str, Any]) -> float:
    _pin()
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    venv = VecNormalize(make_vec_env("CartPole-v1", n_envs=args["n_envs"], seed=0), gamma=0.99)
    model = PPO(
        "MlpPolicy",
        venv,
        n_steps=args["n_steps"],
        n_epochs=args["n_epochs"],
        batch_size=args["batch_size"],
        device="cpu",
        seed=0,
        verbose=0,
    )
    t0 = time.perf_counter()
    model.learn(args["steps"])
    return model.num_timesteps / (time.perf_counter() - t0)


def run_lease(args: dict[str, Any]) -> float:
    _pin()
    from envs.rl_env import PathLeaseEnv
    from train.ppo import PPO, PPOConfig, make_vector_env

    venv = make_vector_env([PathLeaseEnv for _ in range(args["n_envs"])])
    ppo = PPO(venv, PPOConfig(n_steps=args["lease_steps"] // args["n_envs"], batch_size=args["batch_size"]))
    venv.reset(seed=0)
    t0 = time.perf_counter()
    ppo.learn(args["lease_steps"])
    return ppo.num_timesteps / (time.perf_counter() - t0)


def _in_process(fn: Any, args: dict[str, Any]) -> float:
    with mp.get_context("spawn").Pool(1) as pool:
        return float(pool.apply(fn, (args,)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--n-envs", type=int, default=8)
    p.add_argument("--n-steps", type=int, default=256)
    p.add_argument("--n-epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lease-env", type=int, default=0, metavar="STEPS")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    args = {
        "steps": a.steps,
        "n_envs": a.n_envs,
        "n_steps": a.n_steps,
        "n_epochs": a.n_epochs,
        "batch_size": a.batch_size,
        "lease_steps": a.lease_env,
    }
    results: dict[str, Any] = {"config": args}
    for name, fn in (("train.ppo", run_ours), ("stable_baselines3", run_sb3)):
        runs = [_in_process(fn, args) for _ in range(a.repeats)]
        results[name] = {"steps_per_s": statistics.median(runs), "runs": runs}
        print(
            f"{name:<18} CartPole-v1: {statistics.median(runs):8.0f} env steps/s on one core "
            f"(runs: {', '.join(f'{r:.0f}' for r in runs)})"
        )
    ratio = results["train.ppo"]["steps_per_s"] / results["stable_baselines3"]["steps_per_s"]
    print(f"train.ppo / stable_baselines3: {ratio:.2f}x")
    if a.lease_env:
        rate = _in_process(run_lease, args)
        results["lease_env"] = {"steps_per_s": rate}
        print(f"train.ppo on PathLeaseEnv: {rate:.1f} env steps/s on one core ({a.lease_env} steps)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
