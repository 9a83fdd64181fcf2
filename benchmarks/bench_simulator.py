"""Simulator speed: replay the bundled agent trace through 2P4D gpt-oss-120b / H200 and report
simulated requests/s and iterations/s, plus how cost grows with trace length and cluster size.

    python benchmarks/bench_simulator.py            # full trace + scaling table
    python benchmarks/bench_simulator.py --quick    # scaling table only

Single process; the numbers are wall-clock seconds on whatever machine runs it (pin to one core with
``taskset -c 0`` to measure one core).
"""

from __future__ import annotations

import argparse
import time

from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.simulator import Simulator
from train.experiment import Point, prepare_trace


def _run(sessions: int | None, shape: str, rate: float) -> tuple[float, int, int, int]:
    point = Point(shape=shape, max_requests=sessions, session_rate_per_s=rate)
    trace = prepare_trace(point)
    config = ClusterConfig.from_shape(shape)
    cost_model = CostModel(config.gpu, config.model, config.tp)
    sim = Simulator(trace, config, cost_model=cost_model, session_rate_per_s=rate, seed=0)
    start = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - start
    iterations = sum(w.iterations for w in sim.decode)
    events = sim._seq
    return wall, len(trace), iterations, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the full-trace replay")
    parser.add_argument("--rate", type=float, default=0.003, help="agent sessions started per second")
    args = parser.parse_args()
    header = ("sessions", "shape", "requests", "wall s", "req/s", "decode iters/s", "events/s")
    print("{:>8} {:>6} {:>8} {:>7} {:>8} {:>14} {:>9}".format(*header))
    cases = [(50, "2P4D"), (100, "2P4D"), (200, "2P4D"), (100, "4P8D"), (100, "8P16D")]
    if not args.quick:
        cases.insert(0, (None, "2P4D"))
    for sessions, shape in cases:
        wall, n_req, iters, events = _run(sessions, shape, args.rate)
        label = "all" if sessions is None else str(sessions)
        print(
            f"{label:>8} {shape:>6} {n_req:>8} {wall:>7.2f} {n_req / wall:>8.0f} {iters / wall:>14.0f} "
            f"{events / wall:>9.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
