"""The emulated PD cluster behind a real gateway against ``crossflow simulate`` on the same workload.

For one trace, shape and load: ``simulate`` with static PD and the gateway's routing modelled
(``policies.routing``), then the same prepared trace replayed over HTTP (``crossflow replay``'s code)
through smg 1.13.0 (or sglang-router 0.3.2) in PD mode in front of an emulated cluster of that shape
(``serving.pd_cluster``) at ``--time-scale``, ``--runs`` times (the real gateway's tie-breaks are its
own, so runs differ). Prints each run's figures next to the simulation's and to what the emulation's
own simulator recorded for the same requests (the HTTP path's cost is the gap between those two),
the relative differences of the run medians, the lag of the slowest worker and the wall time.

    python benchmarks/bench_emulation.py --trace mooncake --max-requests 200 --time-scale 2 --runs 3
    python benchmarks/bench_emulation.py --trace mooncake --runs 3 --same-instant-race on
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from envs.live import LiveCluster
from serving.gateways import Gateway, missing_reason
from serving.pd_cluster import BackgroundCluster, EmulatedCluster
from serving.replay import ReplayConfig, replay
from train.experiment import Point, prepare_trace, run_point

KEYS = (
    ("input_tokens_per_s", "input tok/s", 1.0, "{:,.0f}"),
    ("output_tokens_per_s", "output tok/s", 1.0, "{:,.0f}"),
    ("ttft_mean_s", "TTFT mean ms", 1e3, "{:,.0f}"),
    ("ttft_p50_s", "TTFT p50 ms", 1e3, "{:,.0f}"),
    ("ttft_p99_s", "TTFT p99 ms", 1e3, "{:,.0f}"),
    ("itl_mean_s", "ITL mean ms", 1e3, "{:.2f}"),
    ("e2e_mean_s", "E2E mean ms", 1e3, "{:,.0f}"),
)
ROUTING = {"smg": "cache_aware", "sglang-router": "sglang_router_cache_aware"}
"""The simulator's model of each gateway's default ``cache_aware``."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="mooncake")
    p.add_argument("--max-requests", type=int, default=200)
    p.add_argument("--shape", default="2P4D")
    p.add_argument("--load", type=float, default=1.0)
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gateway", choices=tuple(ROUTING), default="smg")
    p.add_argument(
        "--policy",
        choices=("cache_aware", "round_robin"),
        default="cache_aware",
        help="the gateway's --policy for both PD legs, modelled in the simulation (default: cache_aware)",
    )
    p.add_argument(
        "--simulated-routing",
        default=None,
        help="routing rule of the simulation (policies.routing; default: the model of the gateway's policy)",
    )
    p.add_argument(
        "--same-instant-race",
        choices=("on", "off"),
        default="off",
        help="model smg's race between selection and load accounting in the simulation "
        "(ClusterConfig.router_same_instant_race; default off, as every comparison runs)",
    )
    args = p.parse_args(argv)
    reason = missing_reason(args.gateway)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    routing = args.simulated_routing or (
        ROUTING[args.gateway] if args.policy == "cache_aware" else args.policy
    )
    race = args.same_instant_race == "on"
    overrides: tuple[tuple[str, object], ...] = ()
    if routing != "cache_aware":
        overrides += (("prefill_routing", routing), ("decode_routing", routing))
    if race:
        overrides += (("router_same_instant_race", True),)
    point = Point(
        trace=args.trace,
        shape=args.shape,
        max_requests=args.max_requests,
        load=args.load,
        cluster_overrides=overrides,
    )
    trace = prepare_trace(point)
    t0 = time.perf_counter()
    simulated = run_point(point, trace=trace).metrics.to_dict()
    print(
        f"{args.trace} first {args.max_requests}, {args.shape}, load {args.load:g}, static PD; simulate "
        f"({routing} routing{', same-instant race' if race else ''}) took {time.perf_counter() - t0:.1f} s"
    )
    runs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for i in range(args.runs):
        live = LiveCluster(point.cluster(), cost_model=point.cost_model(), time_scale=args.time_scale)
        cluster = EmulatedCluster(live)
        with BackgroundCluster(cluster) as running:
            spec = running.gateway_spec(args.gateway, policy=args.policy)
            with Gateway(spec, stop_grace_s=1.0) as gateway:
                result = replay(trace, ReplayConfig(url=gateway.url, load=args.load, timeout_s=3600))
            internal = running.live.sim.result().metrics.to_dict()
        worst_lag = max((r["max_s"] for r in result.lag), default=float("nan"))
        print(
            f"run {i + 1}: {result.metrics['n_finished']}/{result.metrics['n_requests']} finished, "
            f"wall {result.wall_s:.1f} s at x{args.time_scale:g}, worst lag {worst_lag * 1e3:.1f} ms, "
            f"lag check {'ok' if result.lag_failure is None else 'FAILED: ' + result.lag_failure}"
        )
        runs.append((result.metrics, internal))
    header = f"| {'':14} | simulate | " + " | ".join(f"run {i + 1} (internal)" for i in range(len(runs)))
    print()
    print(header + " | median vs simulate |")
    print("|" + "---|" * (3 + len(runs)))
    for key, label, unit, fmt in KEYS:
        sim_v = float(simulated[key]) * unit
        cells = []
        replayed = []
        for metrics, internal in runs:
            value = float(metrics[key]) * unit
            replayed.append(value)
            cells.append(f"{fmt.format(value)} ({fmt.format(float(internal[key]) * unit)})")
        med = statistics.median(replayed)
        print(f"| {label:14} | {fmt.format(sim_v)} | " + " | ".join(cells) + f" | {med / sim_v - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
