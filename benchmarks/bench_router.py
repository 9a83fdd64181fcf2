"""Crossflow's router on the emulated PD cluster: agreement with ``crossflow simulate`` (``agree``)
and the router's own overhead against direct worker access and smg (``overhead``).

``agree``: the heuristic policy through the router (its lease agents and its own ledger) on the
emulated cluster, and the simulator on the same trace, shape and load; prints both runs' input
throughput, mean TTFT, mean ITL and borrowed share, and the router's path decisions. The emulated
nodes install the leases the router pushes (``--node-leases wire``, as ``crossflow serve --router
crossflow`` runs them) or run the policy themselves (``local``).

The simulator's own answer moves with the phase of its control ticks against the arrivals (each
interval's leases and the mixed-share and ITL-guard rules compound from request to request). The
router measures where its first request fell on its control grid (``Router.control_phase_s``), and
the point is simulated there and at two steps of 5 ms either side
(``train.experiment.phase_neighbourhood``; leases out before the first request, as the router's
are): each aim is printed against that neighbourhood's median. ``--sim-phases K`` also simulates it
with the grid shifted by each of K fractions of an interval and prints that wider spread.
``--decisions-out FILE`` writes, per request, both sides' path decision and the inputs behind it
(queue wait, normal and borrow estimates, each node's mixed-iteration share, the late share) as JSON
lines, and a per-reason table is printed.

``overhead``: an emulated 1P1D cluster whose iterations take ``--iteration-us`` wall microseconds
(``--time-scale`` tiny: workers are nearly instant, so the gateway is what is measured). Sequential
requests give the added latency per request (p50 and p99 over direct dual dispatch by a client that
plays the router itself); ``--concurrency`` requests in flight give requests/s at saturation. The
same for smg 1.13.0 in PD mode when it is installed.

    python benchmarks/bench_router.py agree --requests 60 --load 2 --time-scale 6 --node-leases wire
    python benchmarks/bench_router.py overhead --requests 400 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np

from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.estimator import ClusterEstimator
from envs.live import LiveCluster
from envs.request import Trace
from policies.lease_path import without_prefix_pulls
from serving.gateways import Gateway, GatewaySpec, missing_reason
from serving.node_leases import WireLeases
from serving.pd_cluster import BackgroundCluster, EmulatedCluster
from serving.replay import ReplayConfig, replay
from serving.stack import CrossflowStack
from train.experiment import (
    PHASE_STEP_S,
    PHASE_STEPS,
    Point,
    build_scheduler,
    phase_neighbourhood,
    prepare_trace,
    simulate_at_phase,
)
from train.stats import Interval, difference_interval, log_ratio_interval, mean_interval


def _on(background: BackgroundCluster, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, background.loop).result(timeout=60)


class DecisionLog:
    """Every path decision a scheduler's path policy makes, with the inputs behind it: the query's
    queue wait, the normal and best borrow estimates, and (for ``LeasePath``) each node's
    mixed-iteration share, the late share and each node's lease prefill budget left; with
    ``worker_queued``, also the chosen prefill worker's own count of queued uncomputed tokens at that
    moment (what the router's ``PrefillQueue`` estimates). It wraps the policy's ``choose`` (the
    decision itself is untouched)."""

    def __init__(self, scheduler: Any, worker_queued: Callable[[int], int] | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        path = scheduler.path
        choose = path.choose
        shares = callable(getattr(path, "mixed_share", None))

        def logged(q: Any, now_s: float, ledger: Any) -> Any:
            nodes = ledger.node_ids()
            row: dict[str, Any] = {
                "request_id": q.request_id,
                "time_s": round(now_s, 4),
                "input_tokens": q.input_tokens,
                "output_tokens": q.expected_output_tokens,
                "queued_tokens": q.normal_queued_tokens,
                "prefill_cached_tokens": q.prefill_cached_tokens,
                "prefill_worker": q.normal_prefill_worker,
                "queue_wait_s": round(q.normal_queue_wait_s, 4),
                "lease_prefill_left": {n: ledger.available(n, now_s).prefill_tokens for n in nodes},
            }
            if shares:
                row["mixed_share"] = {n: round(path.mixed_share(n), 5) for n in nodes}
            if worker_queued is not None:
                row["worker_queued_tokens"] = worker_queued(q.normal_prefill_worker)
            d = choose(q, now_s, ledger)
            row.update(
                path=d.path,
                node=d.node_id,
                reservation_id=d.reservation_id,
                reason=d.code.name.lower(),
                est_normal_s=round(d.est_normal_s, 4),
                est_borrow_s=None if d.est_borrow_s is None else round(d.est_borrow_s, 4),
                detail=d.reason,
            )
            if shares:
                row["late_share"] = round(path.late_share(), 4)
            self.rows.append(row)
            return d

        path.choose = logged


def simulate_point(point: Point, trace: Trace, *, delay_s: float | None = None, log: bool = False) -> Any:
    """``point`` simulated by ``train.experiment.simulate_at_phase`` with the point's scheduler (same
    seed and load as ``run_point``); with ``delay_s``, the control ticks start at time 0, so the
    leases are out before the first request, and every arrival comes that much later, so the control
    grid meets the arrivals at another phase. Returns ``(result, DecisionLog or None)``."""
    config, cm = point.cluster(), point.cost_model()
    # what the router serves: no node can pull a prefill worker's cached prefix (without_prefix_pulls)
    scheduler = without_prefix_pulls(build_scheduler(point.policy, config, cm))
    decisions = DecisionLog(scheduler) if log and scheduler is not None else None
    return simulate_at_phase(point, trace, scheduler, delay_s), decisions


def _metrics_row(m: Any) -> tuple[float, float, float, float]:
    """(input tokens/s, mean TTFT s, mean ITL ms, borrowed share) of a simulator result."""
    return (m.input_tokens_per_s, m.ttft_mean_s, m.itl_mean_s * 1e3, m.borrowed_share)


def _match_requests(trace: Trace, rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The router's decision rows by trace request id: the router numbers requests as they come, so
    each row is matched to the earliest unmatched trace request of its input and output lengths."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for r in sorted(trace.requests, key=lambda r: (r.arrival_s, r.request_id)):
        by_shape.setdefault((r.input_tokens, r.output_tokens), []).append(r.request_id)
    matched = {}
    for row in rows:
        ids = by_shape.get((row["input_tokens"], row["output_tokens"]))
        if ids:
            matched[ids.pop(0)] = row
    return matched


def _write_decisions(
    path: str, trace: Trace, sim: DecisionLog | None, router: DecisionLog | None
) -> list[str]:
    """Per request, both sides' decision rows as JSON lines to ``path``; returns the table lines
    (decisions by reason, requests whose path differs)."""
    sim_rows = {row["request_id"]: row for row in (sim.rows if sim else [])}
    router_rows = _match_requests(trace, router.rows if router else [])
    diverged = 0
    with open(path, "w") as f:
        for r in trace.requests:
            a, b = sim_rows.get(r.request_id), router_rows.get(r.request_id)
            diverged += (a or {}).get("path") != (b or {}).get("path")
            f.write(json.dumps({"request_id": r.request_id, "simulate": a, "router": b}) + "\n")
    return [f"per-request decisions: {path} ({diverged} of {len(trace.requests)} took another path)"]


def _note_fallbacks(scheduler: Any, clock: Callable[[], float]) -> list[tuple[int, float]]:
    """Wraps ``scheduler.on_fallback`` to record which reservations fell back and when (``clock``)."""
    fell_back: list[tuple[int, float]] = []
    if scheduler is not None:
        on_fallback = scheduler.on_fallback

        def noted(reservation_id: int) -> None:
            fell_back.append((reservation_id, round(clock(), 3)))
            on_fallback(reservation_id)

        scheduler.on_fallback = noted
    return fell_back


def _fallback_lines(rows: list[dict[str, Any]], fell_back: list[tuple[int, float]]) -> list[str]:
    """One line per fallback: the request the reservation was made for, its node and times."""
    by_reservation = {r["reservation_id"]: r for r in rows if r.get("reservation_id") is not None}
    lines = []
    for res, at_s in fell_back:
        row = by_reservation.get(res, {})
        lines.append(
            f"fallback: reservation {res} (router request {row.get('request_id')}, "
            f"{row.get('input_tokens')} tokens, node {row.get('node')}, decided at "
            f"{row.get('time_s')} s) fell back at {at_s} s"
        )
    return lines


def _queue_error(rows: list[dict[str, Any]]) -> list[str]:
    """How the router's prefill-queue estimate read against the chosen worker's own count, over its
    decisions: mean error (bias) and mean absolute error, in tokens."""
    errors = [r["queued_tokens"] - r["worker_queued_tokens"] for r in rows if "worker_queued_tokens" in r]
    if not errors:
        return []
    bias, mae = sum(errors) / len(errors), sum(abs(e) for e in errors) / len(errors)
    exact = sum(e == 0 for e in errors)
    return [
        f"router prefill-queue estimate against the worker's own count over {len(errors)} decisions: "
        f"mean error {bias:+,.0f} tokens, mean absolute error {mae:,.0f}, exact {exact}"
    ]


def _reason_table(sim: Counter[str], router: Counter[str]) -> list[str]:
    lines = [f"{'decisions by reason':<28}{'simulate':>10}{'router':>10}"]
    for reason in sorted(set(sim) | set(router)):
        lines.append(f"{reason:<28}{sim[reason]:>10}{router[reason]:>10}")
    return lines


def agree(args: argparse.Namespace) -> None:
    # The router refuses a request past the model's context window with a 400, as SGLang does, so the
    # simulator it is held to rejects those too (its default, "compact", would cut and serve them).
    point = Point(
        policy=args.policy,
        trace=args.trace,
        shape=args.shape,
        max_requests=args.requests,
        load=args.load,
        cluster_overrides=(("context_policy", "reject"),),
    )
    trace = prepare_trace(point)
    run, sim_log = simulate_point(point, trace, log=True)
    gaps: list[tuple[float, ...]] = []
    rows: list[tuple[float, ...]] = []
    for k in range(args.runs):
        if args.runs > 1:
            print(f"=== replay {k + 1} of {args.runs}", flush=True)
        row, gap = _replay_once(args, point, trace, run.metrics, sim_log)
        rows.append(row)
        if gap is not None:
            gaps.append(gap)
    if args.runs > 1:
        for line in _pooled(gaps):
            print(line)
        if args.sim_phases > 1 and not trace.closed_loop:
            phases = [_simulated_row(point, trace, d) for d in _grid_delays(point, args.sim_phases)]
            for line in _against_phases(rows, phases):
                print(line)


def _replay_once(
    args: argparse.Namespace, point: Point, trace: Trace, sim: Any, sim_log: DecisionLog | None
) -> tuple[tuple[float, ...], tuple[float, ...] | None]:
    """One replay through a fresh emulated cluster and router, printed against ``sim`` (the point
    simulated at phase 0) and the simulator at the router's own phase; returns the router's four
    figures and its gaps from that neighbourhood's medians (``_spread``; ``None`` on a closed-loop
    trace, which has no phase)."""
    config, cm = point.cluster(), point.cost_model()
    if args.node_leases == "wire":  # the nodes install the router's leases, as with the plugin
        nodes: Any = WireLeases(config.n_decode, burst_s=config.control_interval_s)
    else:  # each node runs the policy itself, in the emulation's simulator
        nodes = build_scheduler(args.policy, config, cm)
    live = LiveCluster(config, cost_model=cm, scheduler=nodes, time_scale=args.time_scale)
    background = BackgroundCluster(EmulatedCluster(live))
    with background as cluster:
        router_scheduler = build_scheduler(args.policy, config, cm)

        def worker_queued(idx: int) -> int:
            return live.sim.prefill[idx].queued_tokens

        router_log = DecisionLog(router_scheduler, worker_queued) if router_scheduler is not None else None
        stack = CrossflowStack(cluster, scheduler=router_scheduler, estimator=ClusterEstimator(config, cm))
        fell_back = _note_fallbacks(router_scheduler, stack.router.now_s)
        _on(background, stack.start())
        t0 = time.monotonic()
        result = replay(trace, ReplayConfig(url=stack.router.url, timeout_s=600, load=args.load))
        wall_s = time.monotonic() - t0
        router = stack.router
        completed = {k[0]: v for k, v in router.m_completed.values.items()}
        decisions = dict(router.m_decisions.values)
        fallbacks = sum(router.m_fallbacks.values.values())
        stuck = _stuck_report(live)
        phase_s = router.control_phase_s()
        _on(background, stack.stop())
    m = result.metrics
    share = completed.get("borrow", 0.0) / max(1.0, sum(completed.values()))
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
    router_reasons: Counter[str] = Counter()
    for (_, reason), n in decisions.items():
        router_reasons[reason] += int(n)
    sim_reasons = Counter(row["reason"] for row in (sim_log.rows if sim_log else []))
    for line in _reason_table(sim_reasons, router_reasons):
        print(line)
    if router_log is not None:
        for line in _queue_error(router_log.rows):
            print(line)
        for line in _fallback_lines(router_log.rows, fell_back):
            print(line)
    if args.decisions_out:
        for line in _write_decisions(args.decisions_out, trace, sim_log, router_log):
            print(line)
    router_row = (
        float(m["input_tokens_per_s"]),
        float(m["ttft_mean_s"]),
        float(m["itl_mean_s"]) * 1e3,
        share,
    )
    gap = None
    if not trace.closed_loop:
        lines, gap = _references(point, trace, phase_s, args.sim_phases, router_row)
        for line in lines:
            print(line)
    for line in stuck + _unfinished(result.records):
        print(line, flush=True)
    return router_row, gap


AGREEMENT_AIMS = (0.10, 0.20, 0.10, 0.05)
"""Issue aims for the router against the simulator: input throughput, mean TTFT and mean ITL
within these fractions, the borrowed share within this many points (as a fraction)."""


_SIMULATED: dict[tuple[Point, float], tuple[float, ...]] = {}


def _simulated_row(point: Point, trace: Trace, delay_s: float) -> tuple[float, ...]:
    """``_metrics_row`` of ``simulate_point(point, trace, delay_s=delay_s)`` and, fifth, the number of
    requests that fell back there; remembered (a point at a delay is deterministic, and every replay
    of a ``--runs`` series asks for the same phases)."""
    key = (point, delay_s)
    if key not in _SIMULATED:
        m = simulate_point(point, trace, delay_s=delay_s)[0].metrics
        _SIMULATED[key] = (*_metrics_row(m), round(m.fallback_share * m.n_requests))
    return _SIMULATED[key]


METRIC_NAMES = ("input tokens/s", "mean TTFT (s)", "mean ITL (ms)", "borrowed share")


def _verdict(gap: float, i: int) -> str:
    aim = AGREEMENT_AIMS[i]
    return f"{'met' if abs(gap) <= aim + 1e-9 else 'MISSED'} ({aim * 100:g}{'pt' if i == 3 else ' %'})"


def _spread(
    point: Point, trace: Trace, delays: list[float], heading: str, router: tuple[float, ...]
) -> tuple[list[str], tuple[float, ...]]:
    """The simulator with its control grid ``delays`` seconds ahead of the arrivals (leases out from
    the start): each figure's range and median, and the router's difference from the median against
    the aims. Returns the lines and the router's gaps: its ratio to the median for the first three
    figures, its difference in share (a fraction) for the last."""
    a = np.array([_simulated_row(point, trace, d) for d in delays])
    lines = [heading]
    lines.append(f"{'':24}{'min':>10}{'median':>10}{'max':>10}{'router':>10}{'diff':>10}  aim")
    gaps = []
    for i, name in enumerate(METRIC_NAMES):
        lo, med, hi = a[:, i].min(), float(np.median(a[:, i])), a[:, i].max()
        gap = router[i] - med if i == 3 else (router[i] - med) / med
        gaps.append(gap if i == 3 else router[i] / med)
        diff = f"{gap * 100:>+9.1f}pt" if i == 3 else f"{gap:>+10.1%}"
        row = f"{name:<24}{lo:>10.4g}{med:>10.4g}{hi:>10.4g}{router[i]:>10.4g}{diff}"
        lines.append(f"{row}  {_verdict(gap, i)}")
    by_delay = " ".join(f"{d:.3f}s {x:.3f}" for d, x in zip(delays, a[:, 3], strict=True))
    lines.append(f"borrowed shares by delay: {by_delay}")
    lines.append(f"simulator fallbacks by delay: {' '.join(str(int(x)) for x in a[:, 4])}")
    return lines, tuple(gaps)


def _grid_delays(point: Point, n_phases: int) -> list[float]:
    """``n_phases`` delays spread evenly over the point's control interval (the ``--sim-phases`` grid)."""
    interval_s = point.cluster().control_interval_s
    return [k / n_phases * interval_s for k in range(n_phases)]


def _references(
    point: Point, trace: Trace, phase_s: float | None, n_phases: int, router: tuple[float, ...]
) -> tuple[list[str], tuple[float, ...] | None]:
    """The router's figures against the simulator at the router's own phase (and its neighbourhood),
    then, with ``n_phases``, at that many phases spread over the control interval. Returns the lines
    and the router's gaps from the neighbourhood (``_spread``; ``None`` without a phase)."""
    interval_s = point.cluster().control_interval_s
    lines: list[str] = []
    gaps = None
    if phase_s is not None:
        heading = (
            f"simulate at the router's phase (its first request {phase_s:.4f} s after its first control "
            f"interval) and {PHASE_STEPS} steps of {PHASE_STEP_S:g} s either side:"
        )
        spread, gaps = _spread(point, trace, phase_neighbourhood(phase_s, interval_s), heading, router)
        lines += spread
    if n_phases > 0:
        heading = f"simulate at {n_phases} phases of the control grid (leases out from the start):"
        lines += _spread(point, trace, _grid_delays(point, n_phases), heading, router)[0]
    return lines, gaps


def _pooled(gaps: list[tuple[float, ...]]) -> list[str]:
    """Over the replays of a ``--runs`` series, each paired with the simulator's median at its own
    phase: the mean gap per figure with its 95 % interval (relative figures as the geometric mean
    ratio, from the per-replay log-ratios; the share in points) against the aims. ``met`` reads the
    mean; ``interval inside`` says whether the whole interval lies within the aim."""
    if not gaps:
        return ["pooled: no replay had a control phase to pair with (a closed-loop trace)"]
    lines = [
        f"pooled over {len(gaps)} replays, each against the simulator's median at its own phase "
        "(mean gap, 95 % interval):"
    ]
    for i in range(len(METRIC_NAMES)):
        if i == 3:
            iv = mean_interval(g[i] for g in gaps)
        else:
            iv = log_ratio_interval(math.log(g[i]) for g in gaps)
        per_run = " ".join(f"{(g[i] if i == 3 else g[i] - 1) * 100:+.1f}" for g in gaps)
        lines.append(f"{_gap_line(i, iv)}  (replays: {per_run})")
    return lines


def _gap_line(i: int, iv: Interval) -> str:
    """Figure ``i``'s pooled gap (a fraction; points for the share) with its interval, the verdict on
    the mean and whether the whole interval lies within the aim."""
    aim = AGREEMENT_AIMS[i]
    if i == 3:
        text = f"{iv.mean * 100:+.1f}pt [{iv.low * 100:+.1f}, {iv.high * 100:+.1f}]"
    else:
        text = f"{iv.mean:+.1%} [{iv.low:+.1%}, {iv.high:+.1%}]"
    inside = iv.n >= 2 and -aim - 1e-9 <= iv.low and iv.high <= aim + 1e-9
    where = "inside" if inside else "not inside"
    return f"{METRIC_NAMES[i]:<24}{text:>28}  {_verdict(iv.mean, i)}, interval {where}"


def _against_phases(router: list[tuple[float, ...]], phases: list[tuple[float, ...]]) -> list[str]:
    """The replays against the simulator over the phases of its control grid, as two independent
    samples (the router's phase is known only to a few milliseconds of network time, and the
    simulator's answer moves by more than the aims within that): the ratio of geometric means for the
    first three figures, the difference of mean shares, each with its Welch 95 % interval."""
    lines = [
        f"the {len(router)} replays against the simulator at {len(phases)} phases (mean gap, 95 % interval):"
    ]
    for i in range(len(METRIC_NAMES)):
        if i == 3:
            iv = difference_interval((r[i] for r in router), (p[i] for p in phases))
        else:
            logs = difference_interval((math.log(r[i]) for r in router), (math.log(p[i]) for p in phases))
            iv = Interval(math.expm1(logs.mean), math.expm1(logs.low), math.expm1(logs.high), logs.n)
        lines.append(_gap_line(i, iv))
    return lines


def _unfinished(records: list[Any]) -> list[str]:
    """One line per request the replay did not see finish: what the client got instead."""
    return [
        f"not finished: trace request {r.request_id} ({r.input_tokens} tokens), status {r.status}, "
        f"rejected {r.rejected}, {r.completion_tokens} of {r.output_tokens} tokens: {r.error or 'no error'}"
        for r in records
        if not r.finished
    ]


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
    a.add_argument(
        "--sim-phases",
        type=int,
        default=8,
        help="also simulate at this many phases of the control grid against the arrivals and print "
        "the spread (0: off)",
    )
    a.add_argument(
        "--runs",
        type=int,
        default=1,
        help="replay this many times (a fresh cluster and router each) and pool the gaps (95 %% intervals)",
    )
    a.add_argument("--decisions-out", help="write both sides' per-request path decisions here (JSON lines)")
    o = sub.add_parser("overhead")
    o.add_argument("--requests", type=int, default=400)
    o.add_argument("--concurrency", type=int, default=32)
    o.add_argument("--iteration-us", type=float, default=50.0)
    args = parser.parse_args()
    (agree if args.mode == "agree" else overhead)(args)


if __name__ == "__main__":
    main()
