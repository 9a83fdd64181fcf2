"""Simulator speed: the bundled agent trace, cost against trace length and cluster size, memory for a
million requests, and what a lease policy adds per request.

    python benchmarks/bench_simulator.py                 # every series
    python benchmarks/bench_simulator.py --series agent  # or length, cluster, memory, policy, ticks, search

Single process; wall-clock seconds of the simulation alone (trace loading excluded) on whatever
machine runs it: pin to one core with ``taskset -c 0`` to measure one core. ``memory`` runs each size
in a fresh subprocess and reports its peak resident memory (``ru_maxrss``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from envs.cluster_config import ClusterConfig, parse_shape
from envs.cost_model import CostModel
from envs.request import Request, Trace
from envs.simulator import Simulator
from train.experiment import Point, build_scheduler, prepare_trace

AGENT_RATE = 0.003
"""Agent sessions started per second on 2P4D for the agent and length series."""
MOONCAKE_LOAD_PER_NODE = 0.1
"""Mooncake load factor per 6 workers: constant per-node load for the cluster series (about half of
static 2P4D's saturation)."""


def _simulate(
    trace: Trace,
    shape: str,
    *,
    load: float = 1.0,
    rate: float | None = None,
    policy: str = "static",
    clock: Callable[[], float] = time.perf_counter,
    sim_class: type[Simulator] = Simulator,
) -> tuple[float, Simulator]:
    config = ClusterConfig.from_shape(shape)
    cost_model = CostModel(config.gpu, config.model, config.tp)
    scheduler = build_scheduler(policy, config, cost_model)
    sim = sim_class(
        trace, config, scheduler=scheduler, cost_model=cost_model, load_factor=load, session_rate_per_s=rate
    )
    start = clock()
    sim.run()
    return clock() - start, sim


def _row(label: str, shape: str, n_req: int, wall: float, sim: Simulator) -> str:
    iterations = sum(w.iterations for w in sim.decode)
    return (
        f"{label:>10} {shape:>9} {n_req:>9,} {wall:>8.2f} {1e6 * wall / n_req:>8.1f} "
        f"{iterations / wall:>14,.0f} {sim._seq / wall:>10,.0f}"
    )


HEADER = "{:>10} {:>9} {:>9} {:>8} {:>8} {:>14} {:>10}".format(
    "trace", "shape", "requests", "wall s", "us/req", "decode iters/s", "events/s"
)


def series_agent() -> None:
    print("The bundled agent trace (all 449 sessions), static")
    print(HEADER)
    trace = prepare_trace(Point(trace="agent"))
    wall, sim = _simulate(trace, "2P4D", rate=AGENT_RATE)
    print(_row("agent", "2P4D", len(trace), wall, sim), flush=True)


def series_length() -> None:
    print("Trace length: first N agent sessions, static 2P4D")
    print(HEADER)
    for sessions in (50, 100, 200, 449):
        trace = prepare_trace(Point(trace="agent", max_requests=sessions))
        wall, sim = _simulate(trace, "2P4D", rate=AGENT_RATE)
        print(_row(f"agent {sessions}", "2P4D", len(trace), wall, sim), flush=True)


def series_cluster() -> None:
    print(f"Cluster size at constant per-node load: Mooncake at load {MOONCAKE_LOAD_PER_NODE} per 6 workers")
    print(HEADER)
    trace = prepare_trace(Point(trace="mooncake"))
    base = None
    for shape in ("2P4D", "8P16D", "32P64D", "128P256D"):
        n_p, n_d = parse_shape(shape)
        load = MOONCAKE_LOAD_PER_NODE * (n_p + n_d) / 6
        wall, sim = _simulate(trace, shape, load=load)
        base = base or wall
        print(_row("mooncake", shape, len(trace), wall, sim) + f"   x{wall / base:.2f}", flush=True)


def million_requests(n: int) -> Trace:
    """``n`` requests: the Mooncake trace repeated back to back (new ids, prefix links kept per copy)."""
    base = prepare_trace(Point(trace="mooncake"))
    span = max(r.arrival_s for r in base.requests) + 1.0
    out: list[Request] = []
    copy = 0
    while len(out) < n:
        offset, id0 = copy * span, len(out)
        for r in base.requests:
            if len(out) >= n:
                break
            parent = r.parent_id + id0 if r.parent_id >= 0 and r.parent_id + id0 < len(out) else -1
            out.append(
                dataclasses.replace(
                    r,
                    request_id=len(out),
                    arrival_s=r.arrival_s + offset,
                    parent_id=parent,
                    shared_prefix_tokens=r.shared_prefix_tokens if parent >= 0 else 0,
                )
            )
        copy += 1
    return Trace(f"mooncake x{copy}", out)


def _memory_child(n: int) -> None:
    trace = million_requests(n)
    wall, sim = _simulate(trace, "8P16D", load=4 * MOONCAKE_LOAD_PER_NODE)
    sim.result()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"requests": n, "wall_s": wall, "peak_mb": peak_mb}))


def series_memory() -> None:
    print("Memory: Mooncake repeated to N requests, static 8P16D, peak RSS of a fresh process")
    print(f"{'requests':>10} {'wall s':>8} {'peak MB':>9}")
    for n in (100_000, 1_000_000):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", str(n)], capture_output=True, text=True, check=True
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{row['requests']:>10,} {row['wall_s']:>8.1f} {row['peak_mb']:>9,.0f}", flush=True)


POLICY_CASES: list[tuple[str, Point, float, float | None]] = [
    ("mooncake 2000", Point(trace="mooncake", max_requests=2000), 0.6, None),
    ("agent 60", Point(trace="agent", max_requests=60), 1.0, 0.004 * 0.65),
]
"""The policy and ticks series: (label, trace, load factor, agent session rate)."""
POLICY_RUNS = 3
"""Runs of each policy in the policy series, alternated (static, heuristic, static, ...): runs of a
second or less move by a fifth from one to the next on a shared machine, so the series reports the
median and the range."""


POLICY_SERIES = ("static", "heuristic", "deflect")
"""The lease policy, and the peer that reconsiders every waiting request at every interval."""


def series_policy() -> None:
    print(
        "Policy overhead per request (each / static), 2P4D, CPU seconds of this process, "
        f"median of {POLICY_RUNS} alternated runs [min, max]"
    )
    print(f"{'trace':>14} " + " ".join(f"{p + ' s':>17}" for p in POLICY_SERIES) + "   ratios")
    for label, point, load, rate in POLICY_CASES:
        trace = prepare_trace(point)
        cpu: dict[str, list[float]] = {p: [] for p in POLICY_SERIES}
        for _ in range(POLICY_RUNS):
            for p, runs in cpu.items():
                cpu_s = _simulate(trace, "2P4D", load=load, rate=rate, policy=p, clock=time.process_time)[0]
                runs.append(cpu_s)
        med = {p: statistics.median(runs) for p, runs in cpu.items()}
        cells = " ".join(f"{f'{med[p]:.2f} [{min(r):.2f}, {max(r):.2f}]':>17}" for p, r in cpu.items())
        ratios = ", ".join(f"{p} {med[p] / med['static']:.2f}" for p in POLICY_SERIES[1:])
        print(f"{label:>14} {cells}   {ratios}", flush=True)


class _TimedTicks(Simulator):
    """A simulator that times its control ticks in process CPU time, by kind: replayed, or full with
    none, one, or two or more decode nodes busy (an iteration in flight) as the tick starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tick_cpu: dict[str, tuple[int, float]] = {}
        """kind -> (ticks, CPU seconds in them)"""

    def _on_tick(self) -> None:
        busy = sum(1 for w in self.decode if w.busy)
        replayed = self.ticks_replayed
        start = time.process_time()
        super()._on_tick()
        spent = time.process_time() - start
        if self.ticks_replayed > replayed:
            kind = "replayed"
        else:
            kind = f"full, {busy} busy" if busy < 2 else "full, 2+ busy"
        ticks, cpu_s = self.tick_cpu.get(kind, (0, 0.0))
        self.tick_cpu[kind] = (ticks + 1, cpu_s + spent)


def series_ticks() -> None:
    print("Where a lease policy's time goes: control ticks by kind, heuristic 2P4D, CPU seconds")
    print(f"{'trace':>14} {'kind':>16} {'ticks':>7} {'cpu s':>7} {'us/tick':>8}")
    for label, point, load, rate in POLICY_CASES:
        trace = prepare_trace(point)
        static = statistics.median(
            _simulate(trace, "2P4D", load=load, rate=rate, clock=time.process_time)[0]
            for _ in range(POLICY_RUNS)
        )
        total, sim = _simulate(
            trace,
            "2P4D",
            load=load,
            rate=rate,
            policy="heuristic",
            clock=time.process_time,
            sim_class=_TimedTicks,
        )
        assert isinstance(sim, _TimedTicks)
        in_ticks = 0.0
        for kind, (n, spent) in sorted(sim.tick_cpu.items()):
            in_ticks += spent
            print(f"{label:>14} {kind:>16} {n:>7,} {spent:>7.2f} {1e6 * spent / n:>8.1f}", flush=True)
        rest = total - in_ticks
        print(
            f"{label:>14}: heuristic {total:.2f} s ({in_ticks:.2f} s in ticks, {rest:.2f} s else), "
            f"static {static:.2f} s (median of {POLICY_RUNS}): ratio {total / static:.2f}, "
            f"{rest / static:.2f} if the ticks cost nothing",
            flush=True,
        )


def series_search() -> None:
    """One job of ``crossflow compare --full``: the fewest workers at which deflect serves 1,000 Mooncake
    requests on GLM-5 within SLO at load 1 (five seeds at a 0.9 SLO share, up to 32 workers). Its
    under-provisioned clusters keep long prefill queues, and deflect re-offers every waiting request
    at every control interval."""
    from interference_model.artifact import DATA_DIR, artifact_slug
    from train.compare import GpusJob, gpus_job

    print("A compare search at overload: fewest workers for deflect, Mooncake 1,000, GLM-5 (dev split)")
    print(f"{'wall s':>8} {'simulations':>12} {'workers':>8}")
    point = Point(
        policy="deflect",
        trace="mooncake",
        model="glm-5",
        tp=8,
        max_requests=1000,
        split="dev",
        open_loop_arrivals="poisson",
    )
    artifact = str(DATA_DIR / artifact_slug(point.gpu, point.model, point.resolved_tp))
    start = time.perf_counter()
    out = gpus_job(GpusJob(point, tuple((seed, 0.9) for seed in range(5)), 32, artifact))
    wall = time.perf_counter() - start
    print(f"{wall:>8.1f} {out['n_simulations']:>12} {out['workers']:>8}", flush=True)


SERIES = {
    "agent": series_agent,
    "length": series_length,
    "cluster": series_cluster,
    "memory": series_memory,
    "policy": series_policy,
    "ticks": series_ticks,
    "search": series_search,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", choices=sorted(SERIES), action="append", help="default: all")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child is not None:
        _memory_child(args.memory_child)
        return
    for name in args.series or list(SERIES):
        SERIES[name]()
        print()


if __name__ == "__main__":
    main()
