"""Crossflow's router on the emulated PD cluster: agreement with ``crossflow simulate`` (``agree``)
and the router's own overhead against direct worker access and smg (``overhead``).

``agree``: the heuristic policy through the router (its lease agents and its own ledger) on the
emulated cluster, and the simulator on the same trace, shape and load; prints both runs' input
throughput, mean TTFT, mean ITL and borrowed share, and the router's path decisions. The emulated
nodes install the leases the router pushes (``--node-leases wire``, as ``crossflow serve --router
crossflow`` runs them) or run the policy themselves (``local``).

``overhead``: an emulated 1P1D cluster whose iterations take ``--iteration-us`` wall microseconds
(``--time-scale`` tiny: workers are nearly instant, so the gateway is what is measured). Sequential
requests give the added latency per request (p50 and p99 over direct dual dispatch by a client that
plays the router itself); ``--concurrency`` requests in flight give requests/s at saturation. The
same for smg 1.13.0 in PD mode when it is installed.

    python benchmarks/bench_router.py agree --requests 150 --load 2 --time-scale 2
    python benchmarks/bench_router.py overhead --requests 400 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np

from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.estimator import ClusterEstimator
from envs.live import LiveCluster
from serving.gateways import Gateway, GatewaySpec, missing_reason
from serving.node_leases import WireLeases
from serving.pd_cluster import BackgroundCluster, EmulatedCluster
from serving.replay import ReplayConfig, replay
from serving.stack import CrossflowStack
from train.experiment import Point, build_scheduler, prepare_trace, run_point


def _on(background: BackgroundCluster, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, background.loop).result(timeout=60)


def agree(args: argparse.Namespace) -> None:
    point = Point(
        policy=args.policy, trace=args.trace, shape=args.shape, max_requests=args.requests, load=args.load
    )
    trace = prepare_trace(point)
    run = run_point(point, trace=trace)
    sim = run.metrics
    config, cm = point.cluster(), point.cost_model()
    if args.node_leases == "wire":  # the nodes install the router's leases, as with the plugin
        nodes: Any = WireLeases(config.n_decode, burst_s=config.control_interval_s)
    else:  # each node runs the policy itself, in the emulation's simulator
        nodes = build_scheduler(args.policy, config, cm)
    live = LiveCluster(config, cost_model=cm, scheduler=nodes, time_scale=args.time_scale)
    background = BackgroundCluster(EmulatedCluster(live))
    with background as cluster:
        stack = CrossflowStack(
            cluster,
            scheduler=build_scheduler(args.policy, config, cm),
            estimator=ClusterEstimator(config, cm),
        )
        _on(background, stack.start())
        t0 = time.monotonic()
        result = replay(trace, ReplayConfig(url=stack.router.url, timeout_s=600, load=args.load))
        wall_s = time.monotonic() - t0
        router = stack.router
        completed = {k[0]: v for k, v in router.m_completed.values.items()}
        decisions = dict(router.m_decisions.values)
        fallbacks = sum(router.m_fallbacks.values.values())
        stuck = _stuck_report(live)
        _on(background, stack.stop())
    m = result.metrics
    share = completed.get("borrow", 0.0) / max(1.0, sum(completed.values()))
    sim_decisions = Counter(d["code"] for d in run.decisions if d["kind"] == "decision")
    lag = result.lag_failure or "ok"
    print(f"{args.policy} on {args.shape}, {args.trace}, {args.requests} requests, load {args.load:g}, "
          f"time scale {args.time_scale:g}, node leases {args.node_leases} "
          f"(replay {wall_s:.0f} s wall, lag check: {lag})")  # fmt: skip
    print(f"{'':24}{'simulate':>12}{'router':>12}{'diff':>10}")
    rows = [
        ("input tokens/s", sim.input_tokens_per_s, float(m["input_tokens_per_s"])),
        ("mean TTFT (s)", sim.ttft_mean_s, float(m["ttft_mean_s"])),
        ("mean ITL (ms)", sim.itl_mean_s * 1e3, float(m["itl_mean_s"]) * 1e3),
    ]
    for name, a, b in rows:
        print(f"{name:<24}{a:>12.4g}{b:>12.4g}{(b - a) / a:>+10.1%}")
    points = (share - sim.borrowed_share) * 100
    print(f"{'borrowed share':<24}{sim.borrowed_share:>12.3f}{share:>12.3f}{points:>+9.1f}pt")
    print(f"finished: simulate {sim.n_finished}, router {m['n_finished']}; router fallbacks {fallbacks:g}")
    print(f"decisions: simulate {dict(sim_decisions)}")
    print(f"           router   { ({f'{p}/{r}': int(n) for (p, r), n in decisions.items()}) }")
    for line in stuck:
        print(line)


def _stuck_report(live: LiveCluster) -> list[str]:
    """One line per request the emulated cluster still holds when the replay ended (none when every
    request finished): where it is in the simulator, and its decode node's lease and credit."""
    lines = []
    sim = live.sim
    for rid in sorted(live._live):
        req = sim.reqs[rid]
        line = (
            f"still in the cluster: request {rid} path {req.path} prefill worker {req.prefill_worker} "
            f"decode worker {req.decode_worker} reservation {req.reservation} started {req.started} "
            f"done {req.done}/{req.input} generated {req.generated}/{req.output} has_kv {req.has_kv}"
        )
        if req.decode_worker >= 0:
            w = sim.decode[req.decode_worker]
            bucket, now = w.bucket, sim.now_s
            line += (
                f"; node {w.idx}: running {len(w.running)} borrowed {len(w.borrowed)} waiting "
                f"{len(w.waiting)} prealloc {len(w.prealloc)} credit {bucket.available_tokens(now):.0f} "
                f"rate {bucket.rate_tokens_per_s:.0f}/s lease until {bucket.expires_s:.2f} (now {now:.2f})"
            )
        lines.append(line)
    return lines


# ---------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout_s:g} s")


@contextlib.contextmanager
def _process(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _direct(
    client: httpx.AsyncClient, urls: tuple[str, str, int], body: dict[str, Any], room: int
) -> None:
    """Dual dispatch by the client itself (the baseline without a gateway)."""
    prefill_url, decode_url, bootstrap_port = urls
    legs = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    p, d = await asyncio.gather(
        client.post(prefill_url + "/generate", json={**legs, "stream": False}),
        client.post(decode_url + "/generate", json=legs),
    )
    assert p.status_code == d.status_code == 200, (p.text, d.text)


async def _through(client: httpx.AsyncClient, url: str, body: dict[str, Any], room: int) -> None:
    resp = await client.post(url + "/generate", json=body)
    assert resp.status_code == 200, resp.text


async def _measure(send: Any, n: int, concurrency: int) -> tuple[list[float], float]:
    body = {"input_ids": [5] * 64, "sampling_params": {"max_new_tokens": 1}}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(trust_env=False, timeout=60.0, limits=limits) as client:
        for i in range(20):  # warm up
            await send(client, body, 10**9 + i)
        latencies = []
        for i in range(n):
            t0 = time.perf_counter()
            await send(client, body, i)
            latencies.append(time.perf_counter() - t0)
        rooms = iter(range(2 * 10**9, 3 * 10**9))

        async def worker() -> None:
            for _ in range(n // concurrency):
                await send(client, body, next(rooms))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rate = (n // concurrency) * concurrency / (time.perf_counter() - t0)
    return latencies, rate


def overhead(args: argparse.Namespace) -> None:
    """Each server in its own process (workers, router, smg), the client in this one."""
    config = ClusterConfig(n_prefill=1, n_decode=1)
    cm = CostModel("H200", "gpt-oss-120b", 1)
    scale = args.iteration_us * 1e-6 / cm.prefill_time_s(64, 0, config.prefill_chunk_tokens)
    base = _free_port()
    prefill_url, decode_url, bootstrap = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}", base + 2
    crossflow = [sys.executable, "-m", "train.cli"]
    serve = [*crossflow, "serve", "--emulate", "1P1D", "--port", str(base), "--time-scale", f"{scale:.6g}"]
    results: dict[str, tuple[list[float], float]] = {}

    def run(send: Any) -> tuple[list[float], float]:
        return asyncio.run(_measure(send, args.requests, args.concurrency))

    with _process(serve):
        _wait_ready(prefill_url)
        _wait_ready(decode_url)
        results["direct"] = run(lambda c, b, r: _direct(c, (prefill_url, decode_url, bootstrap), b, r))
        port = _free_port()
        router = [*crossflow, "router", "--prefill", prefill_url, str(bootstrap), "--decode", decode_url,
                  "--port", str(port)]  # fmt: skip
        with _process(router):
            _wait_ready(f"http://127.0.0.1:{port}")
            results["crossflow"] = run(lambda c, b, r: _through(c, f"http://127.0.0.1:{port}", b, r))
        if missing_reason("smg") is None:
            spec = GatewaySpec("smg", prefill=((prefill_url, bootstrap),), decode=(decode_url,))
            with Gateway(spec, stop_grace_s=1.0) as gateway:
                results["smg"] = run(lambda c, b, r: _through(c, gateway.url, b, r))
        else:
            print(f"smg: skipped ({missing_reason('smg')})")
    direct = np.array(results["direct"][0])
    print(f"1P1D, instant workers (a 64-token prefill takes {args.iteration_us:g} us), {args.requests} "
          f"sequential requests, then {args.concurrency} in flight; each server its own process")  # fmt: skip
    print(f"{'':12}{'p50 ms':>10}{'p99 ms':>10}{'added p50':>12}{'added p99':>12}{'req/s':>10}")
    for name, (lat, rate) in results.items():
        a = np.array(lat)
        p50, p99 = np.percentile(a, 50) * 1e3, np.percentile(a, 99) * 1e3
        add50 = p50 - np.percentile(direct, 50) * 1e3
        add99 = p99 - np.percentile(direct, 99) * 1e3
        print(f"{name:<12}{p50:>10.2f}{p99:>10.2f}{add50:>+12.2f}{add99:>+12.2f}{rate:>10.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("agree")
    a.add_argument("--policy", default="heuristic")
    a.add_argument("--trace", default="mooncake-synthetic")
    a.add_argument("--shape", default="2P4D")
    a.add_argument("--requests", type=int, default=150)
    a.add_argument("--load", type=float, default=2.0)
    a.add_argument("--time-scale", type=float, default=2.0)
    a.add_argument(
        "--node-leases",
        choices=("local", "wire"),
        default="wire",
        help="wire: the nodes install the leases the router pushes (crossflow serve's); local: each "
        "node's lease comes from the policy run in the emulation itself",
    )
    o = sub.add_parser("overhead")
    o.add_argument("--requests", type=int, default=400)
    o.add_argument("--concurrency", type=int, default=32)
    o.add_argument("--iteration-us", type=float, default=50.0)
    args = parser.parse_args()
    (agree if args.mode == "agree" else overhead)(args)


if __name__ == "__main__":
    main()
