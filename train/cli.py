"""The ``crossflow`` command line: one subcommand per user journey step.

Every subcommand that produces figures takes ``--json PATH`` and writes them machine-readable too.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from train.cli_fields import add_field
from train.cli_types import non_negative_int, positive_float, positive_int
from train.jsonio import write_json
from train.model_args import add_model_arguments, describe_deployment, model_from_args, model_options
from train.run_table import metric_rows, node_rows

# W&B stays offline unless the user logged in and asked for online mode.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    """Register ``crossflow simulate``: defaults and help defaults from ``Point`` (``train.cli_fields``)."""
    from train.experiment import DEFAULT_TP, OPEN_LOOP_ARRIVALS, Point

    p = sub.add_parser(
        "simulate",
        help="replay one trace through one simulated PD cluster and print its metrics",
        description="Replay a bundled trace (or a trace file of a supported format) through a simulated "
        "prefill/decode-disaggregated cluster and print the figures an SGLang operator looks at.",
    )
    P = Point
    add_field(p, P, "trace", "--trace", help="bundled trace name or path to a trace file")
    add_field(p, P, "shape", "--shape", help="cluster shape xPyD")
    add_field(p, P, "gpu", "--gpu", help="GPU of every worker")
    add_field(p, P, "model", "--model", help="served model")
    add_field(
        p, P, "tp", "--tp", type=positive_int, help="tensor-parallel degree per worker",
        default_text="per model: " + ", ".join(f"{m} {t}" for m, t in DEFAULT_TP.items()),
    )  # fmt: skip
    add_field(
        p,
        P,
        "policy",
        "--policy",
        help="lease policy (catalog name: static, utilisation, heuristic, rl, ...)",
    )
    add_field(
        p,
        P,
        "load",
        "--load",
        type=positive_float,
        help="load factor: scales arrival (or session start) rate",
    )
    add_field(
        p, P, "session_rate_per_s", "--session-rate", type=positive_float, default_text="the trace's own",
        help="closed-loop traces: sessions started per second at load 1",
    )  # fmt: skip
    add_field(
        p, P, "rate_curve", "--rate-curve", metavar="MODEL[@DAY]",
        help="closed-loop traces: start sessions along a ServeGen day curve (m-large, m-mid, "
        "m-small, deepseek-r1, mm-image) instead of a constant rate",
    )  # fmt: skip
    p.add_argument(
        "--max-requests",
        type=positive_int,
        default=None,
        help="replay only the first N requests (closed-loop traces: the fewest first whole sessions "
        "that hold N requests; default: all)",
    )
    p.add_argument(
        "--max-sessions",
        type=positive_int,
        default=None,
        help="closed-loop (agent session) traces: replay only the first N sessions (default: all)",
    )
    add_field(p, P, "seed", "--seed", type=non_negative_int, help="seed of every random choice")
    add_field(
        p, P, "split", "--split", choices=("all", "dev", "heldout"),
        help="side of the development / held-out split (envs/splits.py)",
    )  # fmt: skip
    add_field(
        p, P, "open_loop_arrivals", "--arrivals", choices=OPEN_LOOP_ARRIVALS,
        help="open-loop traces: the recorded timestamps or a Poisson re-timing drawn from --seed",
    )  # fmt: skip
    add_field(p, P, "slo_ttft_s", "--slo-ttft", type=positive_float, metavar="S", help="TTFT SLO, s")
    add_field(
        p, P, "slo_tpot_s", "--slo-tpot", type=positive_float, metavar="S", help="TPOT SLO, s per token"
    )
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a dotted policy parameter over the tuned values, e.g. node.ttl_s=4 (repeatable)",
    )
    p.add_argument(
        "--max-sim-time",
        type=positive_float,
        default=None,
        metavar="S",
        help="stop the simulation at S simulated seconds, unfinished requests stay so (compare's time cap)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON here")
    p.add_argument(
        "--requests-out",
        default=None,
        metavar="PATH.parquet",
        help="write one row per request (path, nodes, TTFT, ITL, decision reason, lease id) as Parquet",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--interference-model",
        default=None,
        metavar="DIR",
        help="interference-model artifact for heuristic/rl (default: the shipped one for --gpu/--model)",
    )
    p.add_argument(
        "--rl-policy",
        default=None,
        metavar="PATH",
        help="trained RL policy (.npz with its .json, from `crossflow train-rl`) for --policy rl "
        "(default: the shipped one)",
    )
    p.add_argument(
        "--policy-bundle",
        default=None,
        metavar="DIR|wandb:ENTITY/PROJECT/NAME:VERSION",
        help="run the policy of a policy bundle (docs/policy_bundle.md) instead of --policy",
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


def point_from_args(args: argparse.Namespace) -> Any:
    """The ``train.experiment.Point`` a ``crossflow simulate`` command line runs (checks that the trace
    exists and that ``--max-requests`` / ``--max-sessions`` fit its kind, naming the flag)."""
    from envs.traces import load_trace
    from policies.catalog import policy_spec
    from train.experiment import Point

    policy_spec(args.policy)  # an unknown name fails before the trace is read
    trace = load_trace(args.trace)
    closed = trace.closed_loop
    if args.max_requests is not None and args.max_sessions is not None:
        raise ValueError("--max-requests and --max-sessions: give one")
    if not closed and args.max_sessions is not None:
        raise ValueError(
            f"--max-sessions counts agent sessions; {args.trace!r} is open loop: use --max-requests"
        )
    units = args.max_requests
    if closed:
        units = args.max_sessions
        if args.max_requests is not None:
            units = sessions_holding(trace, args.max_requests)
            print(
                f"simulate: --max-requests {args.max_requests} on closed-loop {args.trace!r}: the first "
                f"{units} whole session(s), which hold at least that many requests (--max-sessions N "
                "counts sessions)",
                file=sys.stderr,
            )
    params: tuple[tuple[str, Any], ...] = tuple(_policy_param(text) for text in args.policy_param)
    if args.rl_policy is not None:
        from policies.rl_policy import ARTIFACT_PARAM, load_artifact, runs_rl_weights

        if not runs_rl_weights(policy_spec(args.policy)):
            raise ValueError(
                f"--rl-policy: needs --policy rl (or a policy whose path policy is rl), not {args.policy!r}"
            )
        load_artifact(args.rl_policy)  # validated before anything runs
        params = (*params, (ARTIFACT_PARAM, str(args.rl_policy)))
    return Point(
        policy=args.policy,
        trace=args.trace,
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        shape=args.shape,
        load=args.load,
        session_rate_per_s=args.session_rate_per_s,
        max_requests=units,
        seed=args.seed,
        rate_curve=args.rate_curve,
        cluster_overrides=cluster_overrides(args),
        decode_prefix_cache=args.decode_prefix_cache,
        split=args.split,
        open_loop_arrivals=args.open_loop_arrivals,
        slo_ttft_s=args.slo_ttft_s,
        slo_tpot_s=args.slo_tpot_s,
        policy_params=tuple(sorted(dict(params).items())),
        **model_options(args),
    )


def _policy_param(text: str) -> tuple[str, Any]:
    import json

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--policy-param: expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string


def simulate_command(
    point: Any,
    *,
    artifact_dir: str | None = None,
    max_sim_time_s: float | None = None,
    closed_loop: bool | None = None,
) -> str:
    """The ``crossflow simulate`` command line that runs ``point`` alone (``point_from_args`` of its
    arguments gives ``point`` back); ``artifact_dir`` and ``max_sim_time_s`` as compare ran it;
    ``closed_loop`` (whether the trace is; None: load it to find out) picks --max-sessions."""
    import json
    import shlex

    from envs.cluster_config import ClusterConfig
    from envs.traces import load_trace
    from train.experiment import MAX_THINK_S, Point

    if point.max_think_s != MAX_THINK_S:
        raise ValueError("simulate has no flag for Point.max_think_s")
    d = Point()
    argv = ["simulate", "--trace", point.trace, "--policy", point.policy, "--model", point.model]
    argv += ["--gpu", point.gpu, "--shape", point.shape, "--load", repr(float(point.load))]
    argv += ["--seed", str(point.seed)]
    if point.tp is not None:
        argv += ["--tp", str(point.tp)]
    if point.max_requests is not None:
        closed = load_trace(point.trace).closed_loop if closed_loop is None else closed_loop
        argv += ["--max-sessions" if closed else "--max-requests", str(point.max_requests)]
    optional = (
        ("session_rate_per_s", "--session-rate"), ("rate_curve", "--rate-curve"), ("dtype", "--dtype"),
        ("kv_dtype", "--kv-dtype"), ("ep", "--ep"), ("dp_attention", "--dp-attention"), ("split", "--split"),
        ("open_loop_arrivals", "--arrivals"), ("slo_ttft_s", "--slo-ttft"), ("slo_tpot_s", "--slo-tpot"),
    )  # fmt: skip
    for name, flag in optional:
        value = getattr(point, name)
        if value != getattr(d, name):
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    for name, value in point.cluster_overrides:
        if value != getattr(ClusterConfig(), name):
            argv += [f"--{name.replace('_', '-')}", str(value)]
    if point.decode_prefix_cache:
        argv.append("--decode-prefix-cache")
    for key, value in point.policy_params:
        if key == "node.artifact":
            argv += ["--rl-policy", str(value)]
        else:
            argv += ["--policy-param", f"{key}={json.dumps(value)}"]
    if artifact_dir is not None:
        argv += ["--interference-model", artifact_dir]
    if max_sim_time_s is not None:
        argv += ["--max-sim-time", repr(float(max_sim_time_s))]
    return "crossflow " + " ".join(shlex.quote(a) for a in argv)


def sessions_holding(trace: Any, n_requests: int) -> int:
    """The fewest first sessions of closed-loop ``trace`` that hold at least ``n_requests`` requests (all
    of them when the trace has fewer)."""
    per: dict[int, int] = {}
    for r in trace.requests:
        per[r.session_id] = per.get(r.session_id, 0) + 1
    total = 0
    for k, sid in enumerate(trace.session_ids, start=1):
        total += per.get(sid, 0)
        if total >= n_requests:
            return k
    return len(trace.session_ids)


def _run_simulate(args: argparse.Namespace) -> int:
    from train.experiment import default_tp, prepare_trace, run_point

    spec = model_from_args(args, tp=args.tp if args.tp is not None else default_tp(args.model))
    bundle = None
    if args.policy_bundle is not None:
        from policies.bundle import load_policy_bundle, resolve_bundle

        bundle = load_policy_bundle(resolve_bundle(args.policy_bundle))
        args.policy = bundle.policy
    point = point_from_args(args)
    if bundle is not None:
        import dataclasses

        point = dataclasses.replace(point, policy_params=bundle.point_params())
    trace = prepare_trace(point)
    if not trace.closed_loop and (args.rate_curve is not None or args.session_rate_per_s is not None):
        flag = "--rate-curve" if args.rate_curve is not None else "--session-rate"
        raise ValueError(f"{flag}: applies to closed-loop (agent session) traces; {trace.name!r} is not one")
    predictor = None
    artifact = args.interference_model or (bundle.interference_model if bundle else None)
    if artifact is not None:
        from interference_model.artifact import load_predictor

        predictor = load_predictor(artifact, gpu=args.gpu, model=args.model, tp=point.resolved_tp)
    if args.requests_out is not None:
        from train.requests_out import check_requests_out

        check_requests_out(args.requests_out)
    result = run_point(
        point,
        progress=not args.no_progress,
        predictor=predictor,
        trace=trace,
        max_time_s=args.max_sim_time if args.max_sim_time is not None else math.inf,
    )
    rows = metric_rows(result.metrics.to_dict()) + node_rows(result.nodes.to_dict(orient="records"))
    cfg = result.config
    deployment = describe_deployment(spec, args)
    print(
        f"{result.trace_name} on {cfg.shape} {spec.name} / {cfg.gpu} TP{cfg.tp}{deployment}, "
        f"policy {bundle.name if bundle else args.policy}, load {args.load:g}, seed {args.seed}"
    )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    write_json(args.json, result.to_json_dict())
    if args.requests_out is not None:
        from train.requests_out import requests_table, write_parquet

        n = write_parquet([requests_table(result)], args.requests_out)
        print(f"  {n} request rows -> {args.requests_out}")
    return 0


def _add_bundle(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bundle",
        help="write a policy bundle: a catalog policy, its parameters and artifacts in one versioned folder",
        description="Copy a catalog policy's parameters (default: the shipped tuned values), its "
        "interference model and RL weights into one folder pinned by SHA-256 (docs/policy_bundle.md); "
        "simulate and compare take it with --policy-bundle DIR.",
    )
    p.add_argument("--policy", required=True, help="catalog policy (heuristic, rl, a peer, ...)")
    p.add_argument("--name", default=None, help="bundle name (default: the --out folder's name)")
    p.add_argument("--version", type=positive_int, default=1, help="bundle version (default: 1)")
    p.add_argument("--out", required=True, metavar="DIR", help="bundle folder to create (must not exist)")
    p.add_argument(
        "--params",
        default=None,
        metavar="JSON",
        help="dotted parameters as a JSON object, laid over the policy's shipped tuned values "
        "(default: the tuned values alone)",
    )
    p.add_argument("--gpu", default="H200", help="GPU of the shipped interference model (default: H200)")
    p.add_argument("--model", default="gpt-oss-120b", help="model of the shipped one (default: gpt-oss-120b)")
    p.add_argument("--tp", type=positive_int, default=None, help="TP of the shipped one (default: per model)")
    p.add_argument(
        "--interference-model", default=None, metavar="DIR",
        help="artifact folder (default: the shipped one for --gpu/--model/--tp, if the policy needs one)",
    )  # fmt: skip
    p.add_argument(
        "--rl-policy", default=None, metavar="PATH",
        help="RL weights (.npz + .json) for policy rl (default: the shipped ones)",
    )  # fmt: skip
    p.add_argument(
        "--log-wandb",
        action="store_true",
        help="also log the bundle as a versioned W&B artifact (type policy-bundle; offline unless you chose "
        "online: `wandb sync` uploads it)",
    )
    p.set_defaults(func=_run_bundle)


def _run_bundle(args: argparse.Namespace) -> int:
    import json
    import shlex

    from policies.bundle import write_policy_bundle
    from policies.catalog import policy_spec
    from train.experiment import default_tp

    spec = policy_spec(args.policy)
    im = args.interference_model
    if im is None and spec.needs_predictor:
        from interference_model.artifact import DATA_DIR, artifact_slug

        tp = args.tp if args.tp is not None else default_tp(args.model)
        im = str(DATA_DIR / artifact_slug(args.gpu, args.model, tp))
    from policies.rl_policy import DEFAULT_ARTIFACT, runs_rl_weights

    rl = args.rl_policy
    if rl is None and runs_rl_weights(spec):
        rl = str(DEFAULT_ARTIFACT)
    try:
        given = None if args.params is None else json.loads(args.params)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--params: not valid JSON ({exc})") from None
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"--params: a JSON object of dotted parameters, got {type(given).__name__}")
    from policies.catalog import tuned_params

    # laid over the shipped tuned values for --model, so the bundle pins every value it runs with
    params = None if given is None else {**tuned_params(args.policy, args.model), **given}
    if params is not None:  # build the scheduler once: a value the policy refuses fails before writing
        from train.experiment import Point, point_scheduler

        tp = args.tp if args.tp is not None else default_tp(args.model)
        point = Point(policy=args.policy, gpu=args.gpu, model=args.model, tp=tp)
        predictor = None
        if spec.needs_predictor and im is not None:
            from interference_model.artifact import load_predictor

            predictor = load_predictor(im, gpu=args.gpu, model=args.model, tp=tp)
        try:
            spec.split_params(dict(params))  # unknown names are named by the catalog first
            point_scheduler(point, predictor=predictor, params=params)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--params: {exc}") from None
    bundle = write_policy_bundle(
        args.out,
        name=args.name or Path(args.out).name,
        policy=args.policy,
        params=params,
        model=args.model,
        interference_model=im,
        rl_policy=rl,
        version=args.version,
        command="crossflow " + " ".join(shlex.quote(a) for a in args.argv),
    )
    print(
        f"bundle {bundle.name} v{bundle.version} ({bundle.policy}, digest {bundle.digest[:12]}) -> {args.out}"
    )
    if args.log_wandb:
        from train.wandb_log import log_bundle

        run_dir = log_bundle(args.out, wandb_dir=Path(args.out).parent)
        print(f"  W&B artifact {bundle.name} (type policy-bundle) logged in {run_dir}")
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
    _add_bundle(sub)
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
    except ImportError:  # the RL extra (torch) is not installed
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
