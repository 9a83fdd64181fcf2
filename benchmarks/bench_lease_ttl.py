"""How the heuristic's lease TTL (its prefill-budget horizon) trades TTFT against ITL.

    python benchmarks/bench_lease_ttl.py

Runs static and the heuristic at several TTLs on two bundled traces (gpt-oss-120b / H200, 2P4D,
seed 0) and prints one row each. The figures in docs/leases.md come from this script.
"""

from __future__ import annotations

import time

from envs.cost_model import CostModel
from envs.simulator import simulate
from interference_model.artifact import default_predictor
from train.experiment import Point, build_scheduler, prepare_trace

CASES = [
    ("agent", 1.0, 100, 0.004),  # trace, load factor, first N sessions/requests, sessions per s
    ("mooncake", 1.3, 3000, None),
]
TTLS_S = [1.0, 2.0, 8.0]


def main() -> None:
    print(
        f"{'trace':<10} {'ttl':>6} {'wall s':>6} {'ttft mean/p99 s':>16} "
        f"{'itl mean/p99 ms':>16} {'borrowed':>8}"
    )
    for name, load, n, rate in CASES:
        point = Point(trace=name, max_requests=n, session_rate_per_s=rate, load=load)
        trace = prepare_trace(point)
        cfg = point.cluster()
        cm = CostModel(cfg.gpu, cfg.model, cfg.tp)
        predictor = default_predictor(cfg.gpu, cfg.model, cfg.tp)
        for ttl in [None, *TTLS_S]:
            scheduler = None
            if ttl is not None:
                scheduler = build_scheduler(
                    "heuristic", cfg, cm, predictor=predictor, params={"node.ttl_s": ttl}
                )
            start = time.perf_counter()
            m = simulate(
                trace,
                cfg,
                scheduler=scheduler,
                cost_model=cm,
                session_rate_per_s=rate,
                load_factor=load,
                seed=0,
            ).metrics
            label = "static" if ttl is None else f"{ttl:g} s"
            print(
                f"{name:<10} {label:>6} {time.perf_counter() - start:>6.1f} "
                f"{m.ttft_mean_s:>7.2f} / {m.ttft_p99_s:<6.1f} "
                f"{1e3 * m.itl_mean_s:>7.2f} / {1e3 * m.itl_p99_s:<6.1f} "
                f"{100 * m.borrowed_share:>7.1f}%",
                flush=True,
            )


if __name__ == "__main__":
    main()
