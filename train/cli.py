"""The ``crossflow`` command line: one subcommand per user journey step.

Every subcommand that produces figures takes ``--json PATH`` and writes them machine-readable too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from train.cli_types import non_negative_int, positive_float, positive_int
from train.jsonio import write_json
from train.model_args import add_model_arguments, describe_deployment, model_from_args, model_options
from train.run_table import metric_rows, node_rows

# W&B stays offline unless the user logged in and asked for online mode.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay one trace through one simulated PD cluster and print its metrics",
        description="Replay a bundled trace (or a trace file of a supported format) through a simulated "
        "prefill/decode-disaggregated cluster and print the figures an SGLang operator looks at.",
    )
    p.add_argument(
        "--trace", default="agent", help="bundled trace name or path to a trace file (default: agent)"
    )
    p.add_argument("--shape", default="2P4D", help="cluster shape xPyD (default: 2P4D)")
    p.add_argument("--gpu", default="H200", help="GPU of every worker (default: H200)")
    p.add_argument("--model", default="gpt-oss-120b", help="served model (default: gpt-oss-120b)")
    p.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel degree per worker (default: per model)"
    )
    p.add_argument("--policy", default="static", help="lease policy: static, utilisation, heuristic, rl")
    p.add_argument(
        "--load", type=positive_float, default=1.0, help="load factor: scales arrival (or session start) rate"
    )
    p.add_argument(
        "--session-rate",
        type=positive_float,
        default=None,
        help="closed-loop traces: sessions started per second at load 1 (default: trace's own)",
    )
    p.add_argument(
        "--rate-curve",
        default=None,
        metavar="MODEL[@DAY]",
        help="closed-loop traces: start sessions along a ServeGen day curve (m-large, m-mid, "
        "m-small, deepseek-r1, mm-image) instead of a constant rate",
    )
    p.add_argument(
        "--max-requests",
        type=positive_int,
        default=None,
        help="replay only the first N requests (open-loop traces) or sessions (closed-loop)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of every random choice")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--interference-model",
        default=None,
        metavar="DIR",
        help="interference-model artifact for heuristic/rl (default: the shipped one for --gpu/--model)",
    )
    add_model_arguments(p)
    add_cluster_arguments(p)
    p.set_defaults(func=_run_simulate)


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """Serving settings of the simulated cluster that every policy of a run shares (defaults: SGLang's
    and smg 1.13.0's, from ``ClusterConfig``)."""
    from envs.cluster_config import ClusterConfig
    from policies.routing import ROUTING_POLICIES

    d = ClusterConfig()
    p.add_argument(
        "--context-policy",
        choices=("compact", "reject"),
        default=d.context_policy,
        help="requests past the model's context window: cut to fit (default) or rejected",
    )
    p.add_argument(
        "--prefill-routing", choices=ROUTING_POLICIES, default=d.prefill_routing, help="prefill selection"
    )
    p.add_argument(
        "--decode-routing", choices=ROUTING_POLICIES, default=d.decode_routing, help="decode selection"
    )
    p.add_argument(
        "--decode-prefix-cache",
        action="store_true",
        default=d.decode_prefix_cache,
        help="decode workers keep a radix prefix cache (SGLang --disaggregation-decode-enable-radix-cache)",
    )


def cluster_overrides(args: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    """The ``ClusterConfig`` fields ``add_cluster_arguments`` set, as ``Point.cluster_overrides`` (all but
    ``--decode-prefix-cache``, which is ``Point.decode_prefix_cache``)."""
    from envs.cluster_config import ClusterConfig

    d = ClusterConfig()
    chosen = {
        "context_policy": args.context_policy,
        "prefill_routing": args.prefill_routing,
        "decode_routing": args.decode_routing,
    }
    return tuple((k, v) for k, v in chosen.items() if v != getattr(d, k))


def _run_simulate(args: argparse.Namespace) -> int:
    from train.experiment import Point, default_tp, run_point

    spec = model_from_args(args, tp=args.tp if args.tp is not None else default_tp(args.model))
    point = Point(
        policy=args.policy,
        trace=args.trace,
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        shape=args.shape,
        load=args.load,
        session_rate_per_s=args.session_rate,
        max_requests=args.max_requests,
        seed=args.seed,
        rate_curve=args.rate_curve,
        cluster_overrides=cluster_overrides(args),
        decode_prefix_cache=args.decode_prefix_cache,
        **model_options(args),
    )
    from train.experiment import prepare_trace

    trace = prepare_trace(point)
    if not trace.closed_loop and (args.rate_curve is not None or args.session_rate is not None):
        flag = "--rate-curve" if args.rate_curve is not None else "--session-rate"
        raise ValueError(f"{flag}: applies to closed-loop (agent session) traces; {trace.name!r} is not one")
    predictor = None
    if args.interference_model is not None:
        from interference_model.artifact import load_predictor

        predictor = load_predictor(
            args.interference_model, gpu=args.gpu, model=args.model, tp=point.resolved_tp
        )
    result = run_point(point, progress=not args.no_progress, predictor=predictor, trace=trace)
    rows = metric_rows(result.metrics.to_dict()) + node_rows(result.nodes.to_dict(orient="records"))
    cfg = result.config
    deployment = describe_deployment(spec, args)
    print(
        f"{result.trace_name} on {cfg.shape} {spec.name} / {cfg.gpu} TP{cfg.tp}{deployment}, "
        f"policy {args.policy}, load {args.load:g}, seed {args.seed}"
    )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    write_json(args.json, result.to_json_dict())
    return 0


def _optional(
    add: Callable[[argparse._SubParsersAction], None] | None, sub: argparse._SubParsersAction
) -> None:
    if add is not None:
        add(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crossflow",
        description="Crossflow: lease-based prefill borrowing for PD-disaggregated LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_simulate(sub)
    from train import compare as compare_cmd
    from train import interference_cli, replay_cli, router_cli, serve_cli, tune

    compare_cmd.add_parser(sub)
    tune.add_parser(sub)
    interference_cli.add_profile_parser(sub)
    interference_cli.add_fit_parser(sub)
    interference_cli.add_eval_parser(sub)
    replay_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    router_cli.add_parser(sub)
    try:
        from train import rl_cli
    except ImportError:  # the RL extra (torch, stable-baselines3) is not installed
        rl_cli = None  # type: ignore[assignment]
    if rl_cli is not None:
        rl_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # recorded in artifacts as the command that made them
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        # a KeyError's str() is its repr(): print the message, not the quotes around it
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"crossflow {args.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
