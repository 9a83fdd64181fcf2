"""``crossflow train-rl``: PPO training of the ``rl`` policy (see ``train.rl_train``).

Also runnable alone (``python -m train.rl_cli train-rl ...``) so it works without the rest of the CLI.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from train.rl_train import TrainConfig


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``train-rl`` on ``subparsers``."""
    defaults = TrainConfig()
    ppo, env = defaults.ppo, defaults.env
    p = subparsers.add_parser(
        "train-rl",
        help="train the RL policy (path choice and lease sizing knobs) with PPO and export it for `rl`",
        description="PPO (train.ppo) on the path-and-lease environment over the simulated PD cluster, on the "
        "development side of the trace only. Writes checkpoints, candidate policies, eval.json (rl against "
        "the baselines on validation windows) and policy.npz/.json to --out; logs the training curves and "
        "evaluations to W&B (offline unless WANDB_MODE says otherwise).",
    )
    p.add_argument("--out", default=defaults.out, help=f"run folder (default: {defaults.out})")
    p.add_argument(
        "--total-steps",
        type=int,
        default=defaults.total_steps,
        help="agent steps in total (default: %(default)s)",
    )
    p.add_argument("--n-envs", type=int, default=defaults.n_envs, help="environments (default: %(default)s)")
    p.add_argument(
        "--no-processes", action="store_true", help="step the environments in this process, not subprocesses"
    )
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of PPO and the environments")
    p.add_argument("--resume", default=None, metavar="CKPT.pt", help="continue from this checkpoint")
    p.add_argument(
        "--predictor",
        default=None,
        help="interference model: artifact folder or constant:N (default: the shipped one)",
    )
    p.add_argument("--export", default=None, metavar="PATH.npz", help="also copy the exported policy here")
    p.add_argument(
        "--eval-every", type=int, default=defaults.eval_every, help="steps between evaluations (%(default)s)"
    )
    p.add_argument(
        "--eval-windows", type=int, default=defaults.eval_windows, help="validation windows (%(default)s)"
    )
    p.add_argument(
        "--n-steps", type=int, default=ppo.n_steps, help="PPO rollout length per env (%(default)s)"
    )
    p.add_argument("--batch-size", type=int, default=ppo.batch_size, help="PPO minibatch (%(default)s)")
    p.add_argument("--n-epochs", type=int, default=ppo.n_epochs, help="PPO epochs per update (%(default)s)")
    p.add_argument("--learning-rate", type=float, default=ppo.learning_rate, help="Adam step (%(default)s)")
    p.add_argument("--gamma", type=float, default=ppo.gamma, help="discount per agent step (%(default)s)")
    p.add_argument("--trace", default=env.trace, help="bundled trace (its development side; %(default)s)")
    p.add_argument("--shape", default=env.shape, help="cluster shape (default: %(default)s)")
    p.add_argument("--load-range", type=float, nargs=2, default=env.load_range, metavar=("LOW", "HIGH"))
    p.add_argument(
        "--warmup-range", type=float, nargs=2, default=env.warmup_s_range, metavar=("LOW_S", "HIGH_S")
    )
    p.add_argument("--episode-steps", type=int, default=env.episode_steps, help="agent steps per episode")
    p.add_argument(
        "--decision-intervals",
        type=int,
        default=env.decision_intervals,
        help="control intervals per agent step (default: %(default)s)",
    )
    p.add_argument(
        "--start",
        default=defaults.start,
        choices=("heuristic", "heuristic-shed"),
        help="the rule the untrained policy starts at (default: %(default)s)",
    )
    p.add_argument("--no-wandb", action="store_true", help="no W&B logging")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--evaluate-only",
        default=None,
        metavar="POLICY.npz",
        help="no training: score this exported policy ('shipped' for the default) against the baselines on "
        "--eval-windows validation windows of the development side",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the final summary as JSON here")
    p.set_defaults(func=run_train_rl)
    return p


def _print_summary(summary: dict[str, dict[str, float]]) -> None:
    print(f"{'policy':<16} {'reward':>8} {'goodput/s':>10} {'SLO share':>10} {'missed':>8} {'shed':>7}")
    for name, s in summary.items():
        print(
            f"{name:<16} {s['reward']:8.1f} {s['goodput_per_s']:10.2f} {100 * s['slo_share']:9.1f}% "
            f"{s['missed']:8.1f} {s['shed']:7.1f}"
        )


def run_train_rl(args: argparse.Namespace) -> int:
    import dataclasses

    from train.jsonio import write_json
    from train.rl_train import evaluate_artifact, train

    defaults = TrainConfig()
    env = dataclasses.replace(
        defaults.env,
        trace=args.trace,
        shape=args.shape,
        load_range=tuple(args.load_range),
        warmup_s_range=tuple(args.warmup_range),
        episode_steps=args.episode_steps,
        decision_intervals=args.decision_intervals,
    )
    if args.evaluate_only:
        artifact = None if args.evaluate_only == "shipped" else args.evaluate_only
        rows, summary = evaluate_artifact(env, artifact, args.eval_windows, args.predictor)
        print(f"validation (development side) of {args.evaluate_only} on {args.eval_windows} windows")
        decisions = summary.pop("rl_decisions")
        _print_summary(summary)
        print(f"rl decisions: {decisions['decisions']}")
        for knob, d in decisions.items():
            if isinstance(d, dict):
                corr = ", ".join(f"{f} {c:+.2f}" for f, c in d["top_correlations"].items())
                print(
                    f"  {knob:<14} mean {d['mean']:.3f} (min {d['min']:.3f}, max {d['max']:.3f}); corr {corr}"
                )
        summary["rl_decisions"] = decisions
        if args.json:
            write_json(Path(args.json), {"rows": rows, "summary": summary})
        return 0
    cfg = dataclasses.replace(
        defaults,
        out=args.out,
        total_steps=args.total_steps,
        n_envs=args.n_envs,
        processes=not args.no_processes,
        seed=args.seed,
        resume=args.resume,
        predictor=args.predictor,
        export=args.export,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
        start=args.start,
        ppo=dataclasses.replace(
            defaults.ppo,
            n_steps=args.n_steps,
            batch_size=args.batch_size,
            n_epochs=args.n_epochs,
            learning_rate=args.learning_rate,
            gamma=args.gamma,
            seed=args.seed,
        ),
        wandb=not args.no_wandb,
        progress=not args.no_progress,
        command=shlex.join(["crossflow", *getattr(args, "argv", sys.argv[1:])]),
        env=env,
    )
    result = train(cfg)
    print(
        f"trained {result['steps']} steps ({result['steps_per_s']:.1f} env steps/s); exported the policy of "
        f"step {result['selected_steps']} (best validation reward) -> {result['artifact']}"
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
