"""``crossflow replay``: replay a trace against a live server over HTTP and print simulate's table.

The trace is prepared exactly as ``crossflow simulate`` prepares it (same first requests or sessions,
think times capped the same way, the same default session rate), so the two commands' figures can be
compared key by key. Needs the ``serving`` extra (httpx).
"""

from __future__ import annotations

import argparse
import sys

from train.jsonio import write_json
from train.run_table import metric_rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a trace against a live SGLang-compatible server and print simulate's metrics",
        description="Send a trace's requests to POST /generate of a server or gateway (streaming), keeping "
        "its timestamps (open loop) or its sessions and think times (closed loop) and its prefix sharing, "
        "and measure TTFT, ITL and throughput from the stream as SGLang's bench_serving does. When the "
        "server reports crossflow_time_scale in /server_info, figures are in its emulated time.",
    )
    p.add_argument("--url", required=True, help="base URL of the server or gateway (http://HOST:PORT)")
    p.add_argument("--trace", required=True, help="bundled trace name or path to a trace file")
    p.add_argument(
        "--load", type=float, default=1.0, help="load factor: scales arrival (or session start) rate"
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="open loop: replay the first N requests; closed loop: send at most N requests",
    )
    p.add_argument(
        "--max-sessions", type=int, default=None, help="closed-loop traces: replay the first N sessions"
    )
    p.add_argument(
        "--session-rate",
        type=float,
        default=None,
        help="closed-loop traces: sessions started per second at load 1 (default: as simulate)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="wall seconds per emulated second (default: the server's crossflow_time_scale, else 1)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=600.0, help="wall-clock limit of the whole replay (default: 600)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the session starts and the prompt tokens")
    p.add_argument(
        "--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this (default: 32000)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON here")
    p.set_defaults(func=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    from envs.traces import load_trace
    from serving.replay import ReplayConfig, replay
    from train.experiment import MAX_THINK_S, Point, cap_think_time, head, session_rate

    for name in ("max_requests", "max_sessions"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    trace = load_trace(args.trace)
    if trace.closed_loop:
        trace = cap_think_time(head(trace, args.max_sessions), MAX_THINK_S)
    else:
        if args.max_sessions is not None:
            raise ValueError(f"--max-sessions applies to closed-loop traces; {args.trace!r} is open-loop")
        trace = head(trace, args.max_requests)
    rate = session_rate(Point(trace=args.trace, session_rate_per_s=args.session_rate), trace)
    config = ReplayConfig(
        url=args.url,
        load=args.load,
        session_rate_per_s=rate,
        max_requests=args.max_requests,
        timeout_s=args.timeout_s,
        time_scale=args.time_scale,
        seed=args.seed,
        vocab_size=args.vocab_size,
    )
    try:
        result = replay(trace, config)
    except ConnectionError as exc:
        raise ValueError(str(exc)) from None
    clock = (
        "wall time" if result.time_scale_source == "default" else f"emulated time (x{result.time_scale:g})"
    )
    print(f"{result.trace_name} against {args.url} in {clock}, load {args.load:g}, seed {args.seed}")
    rows = metric_rows(result.metrics, measured=True)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if result.timed_out:
        unfinished = result.metrics["n_requests"] - result.metrics["n_finished"]  # type: ignore[operator]
        print(f"  stopped at --timeout-s {args.timeout_s:g}: {unfinished} requests unfinished")
    errors = [r.error for r in result.records if r.error]
    if errors:
        print(f"  {len(errors)} requests failed or were refused; first: {errors[0]}")
    if result.lag:
        worst = max(r["max_s"] for r in result.lag)
        print(
            f"  emulation lag: at most {worst * 1e3:.1f} ms behind schedule over {len(result.lag)} workers "
            f"(replay client: {result.client_lag_s * 1e3:.1f} ms)"
        )
    write_json(args.json, result.to_json_dict())
    if result.lag_failure is not None:
        print(f"crossflow replay: {result.lag_failure}", file=sys.stderr)
        return 1
    return 0
