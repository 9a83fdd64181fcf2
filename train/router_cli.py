"""``crossflow router``: Crossflow's PD router standalone, in front of running SGLang-compatible workers.

Worker flags as smg spells them (``--prefill URL [BOOTSTRAP_PORT]`` per prefill worker, ``--decode
URL`` per decode worker). ``--policy`` names a catalog policy (``static``: every request on the normal
path, no leases); with a lease policy the command also runs one lease agent per decode worker, which
reports to the router's control plane on 127.0.0.1. The model, GPU and TP flags describe the workers
(the policy's cost model; the context window and tokenisation). Against emulated workers the time
scale is read from their ``/server_info``. Runs until Ctrl-C (or ``--run-s``). Needs the ``serving``
extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal

from train.model_args import add_model_arguments


def add_parser(sub: argparse._SubParsersAction) -> None:
    from train.cli import add_cluster_arguments

    p = sub.add_parser(
        "router",
        help="run Crossflow's PD router in front of running prefill and decode workers",
        description="Crossflow's PD router (SGLang /generate and OpenAI APIs, dual dispatch, the lease "
        "path) in front of running workers; with a lease policy, one lease agent per decode worker.",
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        required=True,
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker and its bootstrap port (repeat per worker; port default 8998, SGLang's)",
    )
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode worker (repeat)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to serve on (default 30000; 0: a free one)")
    p.add_argument("--control-port", type=int, default=0, help="control plane port on 127.0.0.1 (0: free)")
    p.add_argument(
        "--policy",
        default="static",
        help="catalog policy, policy bundle folder or wandb:ENTITY/PROJECT/NAME:VERSION (default static)",
    )
    p.add_argument("--gpu", default="H200", help="the workers' GPU (default H200)")
    p.add_argument("--model", default="gpt-oss-120b", help="the served model (default gpt-oss-120b)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree per worker")
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="wall s per emulated s of the workers (default: what their /server_info reports, else 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-s", type=float, default=None, help="stop after this many wall seconds")
    add_model_arguments(p)
    add_cluster_arguments(p)
    p.set_defaults(func=_run_router)


def _workers(args: argparse.Namespace) -> tuple[list[tuple[str, int | None]], list[str]]:
    prefill: list[tuple[str, int | None]] = []
    for entry in args.prefill:
        if len(entry) > 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(entry)}")
        port = 8998
        if len(entry) == 2:
            if not entry[1].isdigit():
                raise ValueError(f"--prefill {entry[0]}: bootstrap port must be a number, got {entry[1]!r}")
            port = int(entry[1])
        prefill.append((entry[0], port))
    for url in [u for u, _ in prefill] + list(args.decode):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL must start with http:// or https://, got {url!r}")
    return prefill, list(args.decode)


async def _time_scale(urls: list[str]) -> float:
    import httpx

    from serving.replay import find_time_scale

    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
        answers = []
        for url in urls:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                answers.append((await client.get(url.rstrip("/") + "/server_info")).json())
    return find_time_scale(answers) or 1.0


def _run_router(args: argparse.Namespace) -> int:
    from serving.router import Router
    from serving.stack import router_config_for, start_lease_agents
    from train.serve_cli import _router_parts, describe_policy, served_point

    prefill, decode = _workers(args)
    if not 0 <= args.port <= 65535 or not 0 <= args.control_port <= 65535:
        raise ValueError("--port and --control-port must be port numbers")
    served, point = served_point(args, f"{len(prefill)}P{len(decode)}D")
    config, cost_model = point.cluster(), point.cost_model()
    parts = _router_parts(served, config, cost_model)

    async def serve() -> None:
        scale = args.time_scale if args.time_scale is not None else await _time_scale(decode)
        router_config = router_config_for(
            config, cost_model, prefill, decode,
            host=args.host, port=args.port, control_port=args.control_port,
            control_token=os.environ.get("CROSSFLOW_CONTROL_TOKEN") or None,
            time_scale=scale, seed=args.seed,
        )  # fmt: skip
        router = Router(router_config, **parts)
        await router.start()
        agents = start_lease_agents(router, decode, config.control_interval_s)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        served_line = f"crossflow, policy {describe_policy(router.policy)}, time scale {scale:g}"
        print(f"router {router.url}  ({served_line})", flush=True)
        print(f"control {router.control_url}  ({len(agents)} lease agents)", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=args.run_s)
        for agent in agents:
            await agent.stop()
        await router.stop()
        print("router stopped", flush=True)

    asyncio.run(serve())
    return 0
