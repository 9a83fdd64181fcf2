"""Environment steps per second of ``envs.rl_env.PathLeaseEnv`` on one core.

Default environment (Mooncake development side, 2P4D gpt-oss-120b on H200, shipped interference
model; one step = one decision = 2 s of simulated time), pinned to one CPU. Three action patterns,
because the simulator's cost depends on how much is lent (borrowed prefill is simulated chunk by
chunk): the heuristic's knobs, the greedy knobs, uniform random. Resets (window, simulator
construction and warm-up) are counted in the steps/s figure and also reported on their own.

    python benchmarks/bench_rl_env.py [--steps 300] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from envs.rl_env import EnvConfig, PathLeaseEnv
from policies.rl_policy import GREEDY_KNOBS, HEURISTIC_KNOBS


def measure(env: PathLeaseEnv, pattern: str, steps: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    fixed = {"heuristic": HEURISTIC_KNOBS.to_action(), "greedy": GREEDY_KNOBS.to_action()}
    reset_s = 0.0
    resets = 1
    t0 = time.perf_counter()
    env.reset(seed=seed)
    reset_s += time.perf_counter() - t0
    for _ in range(steps):
        action = fixed[pattern] if pattern in fixed else rng.uniform(-1, 1, 4).astype(np.float32)
        _, _, term, trunc, _ = env.step(action)
        if term or trunc:
            r0 = time.perf_counter()
            env.reset()
            reset_s += time.perf_counter() - r0
            resets += 1
    total_s = time.perf_counter() - t0
    return {
        "steps": steps,
        "steps_per_s": steps / total_s,
        "steps_per_s_without_resets": steps / (total_s - reset_s),
        "reset_ms_mean": 1e3 * reset_s / resets,
        "resets": resets,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="steps per action pattern")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the goal is stated
    t0 = time.perf_counter()
    env = PathLeaseEnv(EnvConfig())
    results: dict[str, object] = {"env_init_s": time.perf_counter() - t0}
    for pattern in ("heuristic", "greedy", "random"):
        results[pattern] = measure(env, pattern, args.steps, args.seed)
        r = results[pattern]
        assert isinstance(r, dict)
        print(
            f"{pattern:<11} {r['steps_per_s']:8.0f} steps/s "
            f"({r['steps_per_s_without_resets']:.0f} without resets; "
            f"reset {r['reset_ms_mean']:.0f} ms x {r['resets']})"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
