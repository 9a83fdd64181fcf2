"""``crossflow serve --emulate 2P4D``: an emulated SGLang PD cluster (and a real gateway) on loopback.

Starts every prefill and decode worker of the shape in this process (``serving.pd_cluster``: the
simulator's workers and cost model in scaled wall time), optionally smg 1.13.0 in PD mode over them,
prints where each listens, and runs until Ctrl-C (or ``--run-s``). On exit it stops the gateway by
pid, then the workers, and prints what was served and each worker's lag behind its schedule; a run
whose lag exceeded 5 % of its duration on a worker that ran iterations says so and exits with
status 1. Needs the ``serving`` extra.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.model_args import add_model_arguments, model_from_args, model_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    from train.cli import add_cluster_arguments

    p = sub.add_parser(
        "serve",
        help="run an emulated SGLang PD cluster (and a gateway) on loopback",
        description="Start emulated SGLang prefill and decode workers on 127.0.0.1, timed by the "
        "simulator's cost model (iterations take cost-model time x --time-scale), optionally with smg in PD "
        "mode in front, and serve until Ctrl-C. Replay a trace against the router with crossflow replay.",
    )
    p.add_argument("--emulate", required=True, metavar="SHAPE", help="cluster shape xPyD, e.g. 2P4D")
    p.add_argument(
        "--port",
        type=int,
        default=30000,
        help="the router's port, workers on the following ones (without a router the first worker's); "
        "0: free ports (default: 30000)",
    )
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="wall seconds per emulated second (default: 1)"
    )
    p.add_argument(
        "--router",
        choices=("none", "smg", "crossflow"),
        default="none",
        help="gateway in front of the workers: smg (smg 1.13.0 in PD mode), crossflow (Crossflow's router "
        "running --policy, with a lease agent per decode worker) or none (default)",
    )
    p.add_argument(
        "--router-policy",
        default="cache_aware",
        help="smg's --policy for both PD legs (default: cache_aware)",
    )
    p.add_argument(
        "--control-port",
        type=int,
        default=0,
        help="--router crossflow: the control plane's port on 127.0.0.1 (lease reports; default: a free one)",
    )
    p.add_argument("--gpu", default="H200", help="GPU of every worker (default: H200)")
    p.add_argument("--model", default="gpt-oss-120b", help="served model (default: gpt-oss-120b)")
    p.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel degree per worker (default: per model)"
    )
    p.add_argument(
        "--policy",
        default="static",
        help="decode nodes' lease policy: a catalog name (static: no lease; utilisation, heuristic, rl), a "
        "policy bundle folder or a W&B reference wandb:ENTITY/PROJECT/NAME:VERSION (docs/policy_bundle.md); "
        "with a lease a "
        "decode worker prefills do_local_prefill requests itself (default: static)",
    )
    p.add_argument(
        "--stream-interval", type=int, default=1, help="stream every N tokens (SGLang --stream-interval)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the cluster's random choices")
    p.add_argument("--run-s", type=float, default=None, help="stop after this many wall seconds")
    p.add_argument(
        "--node-leases",
        choices=("wire", "local"),
        default="wire",
        help="--router crossflow: wire (default): the decode workers install the leases the router "
        "pushes, as workers running the plugin; local: each runs --policy itself, as the simulator "
        "(a policy reload then does not reach them)",
    )
    add_model_arguments(p)
    add_cluster_arguments(p)
    p.set_defaults(func=_run_serve)


def _check(args: argparse.Namespace) -> None:
    if not (args.time_scale > 0):
        raise ValueError(f"--time-scale must be positive, got {args.time_scale}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be a port number, got {args.port}")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.run_s is not None and not args.run_s > 0:
        raise ValueError(f"--run-s must be positive, got {args.run_s}")


def _build(args: argparse.Namespace) -> Any:
    from envs.cluster_config import parse_shape
    from envs.live import LiveCluster
    from serving.pd_cluster import EmulatedCluster
    parse_shape(args.emulate)
    served, point = served_point(args, args.emulate)
    config, cost_model = point.cluster(), point.cost_model()
    if args.router == "crossflow" and args.node_leases == "wire":
        from serving.node_leases import WireLeases

        # as workers running the plugin: each node installs the lease Crossflow's router pushes to it
        # (so a policy reload reaches the nodes through their next leases)
        scheduler: Any = WireLeases(config.n_decode, burst_s=config.control_interval_s)
    else:
        scheduler = served.scheduler(config, cost_model)  # the emulated workers' own (their lease checks)
    with_router = args.router != "none"
    first = args.port + 1 if (with_router and args.port) else args.port
    live = LiveCluster(
        config,
        cost_model=cost_model,
        scheduler=scheduler,
        time_scale=args.time_scale,
        stream_interval=args.stream_interval,
        seed=args.seed,
    )
    cluster = EmulatedCluster(live, port=first)
    router_parts = None
    if args.router == "crossflow":
        router_parts = _router_parts(served, config, cost_model)
    return point, cluster, router_parts, served


@dataclass(frozen=True)
class ServedPolicy:
    """What ``--policy REF`` names: a catalog policy (its shipped tuned values) or a policy bundle (a
    folder or a ``wandb:ENTITY/PROJECT/NAME:VERSION`` reference, ``policies.bundle``), with the
    identity ``/server_info`` serves."""

    policy: str
    """The catalog policy it runs."""
    params: Mapping[str, Any] | None
    """Dotted parameters (None: the shipped tuned values)."""
    info: Any
    """``serving.router.PolicyInfo``."""
    interference_model: Path | None = None
    """The bundle's interference model (None: the shipped one, for a policy that needs one)."""

    def scheduler(self, config: Any, cost_model: Any) -> Any:
        """A fresh ``ClusterScheduler`` (its own ledger) on ``config``; None for a passive policy."""
        from train.experiment import build_scheduler

        predictor = None
        if self.interference_model is not None:
            from interference_model.artifact import load_predictor

            predictor = load_predictor(
                self.interference_model, gpu=config.gpu, model=config.model, tp=config.tp
            )
        return build_scheduler(self.policy, config, cost_model, predictor=predictor, params=self.params)

    def point_params(self) -> tuple[tuple[str, Any], ...]:
        """``Point.policy_params`` (empty: the tuned values)."""
        return tuple(sorted(self.params.items())) if self.params is not None else ()


def served_point(args: argparse.Namespace, shape: str) -> tuple[ServedPolicy, Any]:
    """The policy ``--policy`` names and the ``train.experiment.Point`` it is served at: the model,
    hardware, seed and cluster flags of ``args`` on an ``shape`` cluster (``crossflow serve`` and
    ``crossflow router`` alike)."""
    from train.cli import cluster_overrides
    from train.experiment import Point, default_tp

    model_from_args(args, tp=args.tp if args.tp is not None else default_tp(args.model))
    served = served_policy(args.policy, args.model)
    point = Point(
        policy=served.policy,
        policy_params=served.point_params(),
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        shape=shape,
        seed=args.seed,
        cluster_overrides=cluster_overrides(args),
        **model_options(args),
    )
    return served, point


def served_policy(ref: str, model: str | None = None) -> ServedPolicy:
    """Resolve ``--policy REF`` for ``model``: a catalog name first, then a bundle folder or ``wandb:``
    reference (loaded and verified by ``policies.bundle``); a ``ValueError`` naming the choices
    otherwise. Values a bundle does not pin are the policy's shipped tuned values for ``model``."""
    from importlib.metadata import version

    from policies.bundle import WANDB_PREFIX, load_policy_bundle, resolve_bundle
    from policies.catalog import policy_names, tuned_params
    from serving.router import PolicyInfo

    if ref in policy_names():
        info = PolicyInfo.from_catalog(ref, tuned_params(ref, model), version("crossflow"))
        return ServedPolicy(ref, None, info)
    if ref.startswith(WANDB_PREFIX) or Path(ref).exists():
        bundle = load_policy_bundle(resolve_bundle(ref))
        return ServedPolicy(
            bundle.policy,
            bundle.run_params(model),
            PolicyInfo.from_bundle(bundle, ref),
            bundle.interference_model,
        )
    raise ValueError(
        f"--policy: unknown policy {ref!r}: neither a catalog policy ({', '.join(policy_names())}) nor a "
        "policy bundle folder nor a wandb:ENTITY/PROJECT/NAME:VERSION reference"
    )


def _router_parts(served: ServedPolicy, config: Any, cost_model: Any) -> dict[str, Any]:
    """The router's own scheduler (its own ledger, fed by the lease agents), its queue estimator, the
    served policy's identity, and the loader a policy reload on the control plane calls (any catalog
    name, bundle folder or ``wandb:`` reference, on the same cluster and cost model)."""
    from envs.estimator import ClusterEstimator

    def load(ref: str) -> tuple[Any, Any]:
        other = served_policy(ref, config.model)
        return other.scheduler(config, cost_model), other.info

    return {
        "scheduler": served.scheduler(config, cost_model),
        "estimator": ClusterEstimator(config, cost_model),
        "policy": served.info,
        "policy_loader": load,
    }


def lag_summary(reports: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], bool]:
    """One line per worker's lag report, and whether the run failed its lag check: only a worker that
    ran iterations can have timings the lag spoils (an event-loop stall while nothing ran, say at
    start-up on a busy machine, is reported, not failed)."""
    lines: list[str] = []
    failed = False
    for name, report in reports:
        line = f"  {name:<10} lag max {report['max_s'] * 1e3:.1f} ms, mean {report['mean_s'] * 1e3:.2f} ms"
        line += f" over {report['iterations']} iterations"
        if report["check"] is not None and report["iterations"]:
            failed = True
            line += f": {report['check']}"
        elif report["check"] is not None:
            line += " (an event-loop stall while no iteration ran: no timing is affected)"
        lines.append(line)
    return lines, failed


def _run_serve(args: argparse.Namespace) -> int:
    from serving.gateways import Gateway, missing_reason
    from serving.pd_cluster import BackgroundCluster

    _check(args)
    if args.router == "smg" and (reason := missing_reason("smg")) is not None:
        raise ValueError(f"--router smg: {reason}")
    point, cluster, router_parts, served = _build(args)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    gateway: Gateway | None = None
    stack: Any = None
    background = BackgroundCluster(cluster)
    try:
        with background as running:
            cfg = running.live.config
            print(
                f"emulated {point.shape} {point.model} / {point.gpu} TP{point.resolved_tp}, "
                f"policy {describe_policy(served.info)}, "
                f"time scale {args.time_scale:g} (wall s per emulated s)",
                flush=True,
            )
            for w in running.workers:
                extra = f"  bootstrap port {w.bootstrap_port}" if w.bootstrap_port is not None else ""
                print(f"  {w.name:<10} {w.url}{extra}", flush=True)
            if args.router == "smg":
                spec = running.gateway_spec("smg", policy=args.router_policy, port=args.port)
                gateway = Gateway(spec, stop_grace_s=10.0)
                gateway.start()
                print(f"  router     {gateway.url}  (smg 1.13.0, PD mode, pid {gateway.pid})", flush=True)
            if router_parts is not None:
                stack = _start_stack(background, running, router_parts, args)
                router = stack.router
                served_line = f"crossflow, policy {describe_policy(router.policy)}"
                print(f"  router     {router.url}  ({served_line})", flush=True)
                print(f"  control    {router.control_url}  ({len(stack.agents)} lease agents)", flush=True)
            print(f"serving {cfg.n_prefill + cfg.n_decode} workers; Ctrl-C stops", flush=True)
            stop.wait(timeout=args.run_s)
            print("stopping", flush=True)
            if gateway is not None:
                code = gateway.stop()
                print(f"  router stopped (exit status {code})", flush=True)
                gateway = None
            if stack is not None:
                _run_on(background, stack.stop())
                print(f"  router stopped ({_decisions(stack.router)})", flush=True)
                stack = None
            served = running.live.sim.counters
            reports = running.lag_reports()
    finally:
        if gateway is not None:
            gateway.stop()
        if stack is not None and background.loop.is_running():
            _run_on(background, stack.stop())
        for s, handler in previous.items():
            signal.signal(s, handler)
    wall_s = time.monotonic() - started
    print(f"served {served.finished} requests ({served.rejected} refused) in {wall_s:.1f} s")
    lines, failed = lag_summary(reports)
    for line in lines:
        print(line)
    if failed:
        print("crossflow serve: the emulation did not keep its schedule (see above)", file=sys.stderr)
        return 1
    return 0


def describe_policy(info: Any) -> str:
    """A served policy in one line: the catalog name, or a bundle's name, version, policy and digest."""
    if info.source == "catalog":
        return str(info.name)
    return f"{info.name} v{info.version} ({info.policy}, bundle digest {info.sha256[:12]})"


def _run_on(background: Any, coro: Any) -> Any:
    import asyncio

    return asyncio.run_coroutine_threadsafe(coro, background.loop).result(timeout=30)


def _start_stack(background: Any, cluster: Any, parts: dict[str, Any], args: argparse.Namespace) -> Any:
    import os

    from serving.stack import CrossflowStack

    stack = CrossflowStack(
        cluster,
        port=args.port,
        control_port=args.control_port,
        control_token=os.environ.get("CROSSFLOW_CONTROL_TOKEN") or None,
        seed=args.seed,
        **parts,
    )
    _run_on(background, stack.start())
    return stack


def _decisions(router: Any) -> str:
    counts: dict[str, float] = {}
    for (path, _), n in router.m_decisions.values.items():
        counts[path] = counts.get(path, 0.0) + n
    return ", ".join(f"{p} {int(n)}" for p, n in sorted(counts.items())) or "no path decisions"
