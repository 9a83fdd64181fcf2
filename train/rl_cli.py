"""``crossflow train-rl``: PPO training of the ``rl`` lease policy (see ``train.rl_train``).

Also runnable alone (``python -m train.rl_cli train-rl ...``) so it works without the rest of the CLI.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from envs.rl_env import EnvConfig, RewardWeights
from policies.rl_policy import LeaseShape


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``train-rl`` on ``subparsers``."""
    p = subparsers.add_parser(
        "train-rl",
        help="train the RL lease policy with PPO and export it for the `rl` node policy",
        description="PPO (stable-baselines3) on the lease environment over the simulated PD cluster. "
        "Writes checkpoints, eval.json (rl vs static vs heuristic on held-out windows) and policy.npz/.json "
        "to --out; logs to W&B (offline unless WANDB_MODE says otherwise).",
    )
    p.add_argument("--out", default="runs/train-rl", help="run folder (default: runs/train-rl)")
    p.add_argument(
        "--total-steps", type=int, default=200_000, help="environment steps in total (default: 200000)"
    )
    p.add_argument(
        "--n-envs", type=int, default=2, help="parallel environments, subprocesses if > 1 (default: 2)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of PPO and the environments (default: 0)")
    p.add_argument("--resume", default=None, metavar="CKPT.zip", help="continue from this checkpoint")
    p.add_argument(
        "--predictor",
        default=None,
        help="interference model: artifact folder or constant:N (default: the shipped one)",
    )
    p.add_argument("--export", default=None, metavar="PATH.npz", help="also copy the final policy here")
    p.add_argument(
        "--eval-every", type=int, default=50_000, help="steps between evaluations (default: 50000)"
    )
    p.add_argument("--eval-windows", type=int, default=6, help="held-out evaluation windows (default: 6)")
    p.add_argument("--checkpoint-every", type=int, default=50_000, help="steps between checkpoints")
    p.add_argument("--n-steps", type=int, default=512, help="PPO rollout length per env (default: 512)")
    p.add_argument("--batch-size", type=int, default=256, help="PPO minibatch (default: 256)")
    p.add_argument("--learning-rate", type=float, default=3e-4, help="Adam step size (default: 3e-4)")
    p.add_argument("--trace", default="agent", help="bundled trace or trace file (default: agent)")
    p.add_argument("--shape", default="2P4D", help="cluster shape (default: 2P4D)")
    p.add_argument("--n-sessions", type=int, default=48, help="sessions per episode window (default: 48)")
    p.add_argument("--episode-intervals", type=int, default=240, help="control intervals per episode")
    p.add_argument("--load-range", type=float, nargs=2, default=(1.0, 4.0), metavar=("LOW", "HIGH"))
    p.add_argument("--warmup-range", type=float, nargs=2, default=(30.0, 240.0), metavar=("LOW_S", "HIGH_S"))
    p.add_argument("--ttl", type=float, default=8.0, help="lease TTL in seconds (default: 8)")
    p.add_argument("--max-tasks", type=int, default=8, help="largest borrowed-task budget (default: 8)")
    p.add_argument("--no-shield", action="store_true", help="allow lending above the prediction")
    p.add_argument("--no-wandb", action="store_true", help="no W&B logging")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--evaluate-only",
        default=None,
        metavar="POLICY.npz",
        help="no training: evaluate this exported policy ('shipped' for the default) against static and "
        "heuristic on --eval-windows held-out windows",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the final summary as JSON here")
    p.set_defaults(func=run_train_rl)
    return p


def _print_summary(summary: dict[str, dict[str, float]]) -> None:
    print(
        f"{'policy':<20} {'reward':>8} {'in tok/s':>10} {'out tok/s':>10} {'TTFT mean':>10} {'TTFT p99':>9} "
        f"{'ITL miss':>9} {'in gain':>8} {'out gain':>8}"
    )
    for name, s in summary.items():
        print(
            f"{name:<20} {s['reward']:8.2f} {s['input_tokens_per_s']:10.0f} {s['output_tokens_per_s']:10.1f} "
            f"{s['ttft_mean_s']:9.2f}s {s['ttft_p99_s']:8.2f}s {100 * s['itl_miss_share']:8.2f}% "
            f"{100 * s.get('input_tokens_per_s_geomean_gain', 0.0):+7.1f}% "
            f"{100 * s.get('output_tokens_per_s_geomean_gain', 0.0):+7.1f}%"
        )


def run_train_rl(args: argparse.Namespace) -> int:
    from train.jsonio import write_json
    from train.rl_train import TrainConfig, evaluate_artifact, train

    env = EnvConfig(
        trace=args.trace,
        shape=args.shape,
        n_sessions=args.n_sessions,
        episode_intervals=args.episode_intervals,
        load_range=tuple(args.load_range),
        warmup_s_range=tuple(args.warmup_range),
        lease_shape=LeaseShape(ttl_s=args.ttl, max_tasks=args.max_tasks, shield=not args.no_shield),
        reward=RewardWeights(),
    )
    if args.evaluate_only:
        artifact = None if args.evaluate_only == "shipped" else args.evaluate_only
        rows, summary = evaluate_artifact(env, artifact, args.eval_windows, args.predictor)
        print(f"held-out evaluation of {args.evaluate_only} on {args.eval_windows} windows")
        decisions = summary.pop("rl_decisions")
        _print_summary(summary)
        print(
            f"rl decisions: {decisions['decisions']}, compute scale mean {decisions['scale_mean']:.2f} "
            f"(min {decisions['scale_min']:.2f}, max {decisions['scale_max']:.2f}), "
            f"tasks histogram {decisions['tasks_histogram']}"
        )
        for name, c in decisions["correlations"].items():
            print(f"  corr({name}, scale) {c['scale']:+.2f}   corr({name}, tasks) {c['tasks']:+.2f}")
        summary["rl_decisions"] = decisions
        if args.json:
            write_json(Path(args.json), {"rows": rows, "summary": summary})
        return 0
    cfg = TrainConfig(
        out=args.out,
        total_steps=args.total_steps,
        n_envs=args.n_envs,
        seed=args.seed,
        resume=args.resume,
        predictor=args.predictor,
        export=args.export,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
        checkpoint_every=args.checkpoint_every,
        n_steps=args.n_steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        wandb=not args.no_wandb,
        progress=not args.no_progress,
        command=shlex.join(["crossflow", *getattr(args, "argv", sys.argv[1:])]),
        env=env,
    )
    result = train(cfg)
    print(
        f"trained {result['steps']} steps; exported the policy of step {result['selected_steps']} "
        f"(best validation reward) -> {result['artifact']}"
    )
    _print_summary(result["summary"])
    if args.json:
        write_json(Path(args.json), result)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m train.rl_cli train-rl ...``: the same as ``crossflow train-rl ...``."""
    from train.cli import main as crossflow_main

    return crossflow_main(argv)


if __name__ == "__main__":
    sys.exit(main())
