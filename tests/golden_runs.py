"""A fixed set of simulations whose results must not change when the simulator is only made faster.

``python -m tests.golden_runs`` rewrites ``tests/data/simulator_golden.json`` (do that only for an
intended change of what the simulator models, and say so in the commit); ``tests/test_golden.py``
replays the set and compares every metric.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from train.experiment import Point, run_point

GOLDEN_PATH = Path(__file__).parent / "data" / "simulator_golden.json"

POINTS: dict[str, Point] = {
    "static-mooncake-2P4D": Point(trace="mooncake", max_requests=400, load=1.5),
    "heuristic-mooncake-2P4D": Point(policy="heuristic", trace="mooncake", max_requests=400, load=1.5),
    "static-agent-2P4D": Point(trace="agent", max_requests=6, session_rate_per_s=0.02),
    "heuristic-agent-2P4D-decode-cache": Point(
        policy="heuristic",
        trace="agent",
        max_requests=6,
        session_rate_per_s=0.02,
        decode_prefix_cache=True,
    ),
    "static-azure-8P16D": Point(trace="azure-code", shape="8P16D", max_requests=600, load=4.0),
    "static-mooncake-round-robin": Point(
        trace="mooncake",
        max_requests=300,
        load=1.0,
        cluster_overrides=(("decode_routing", "round_robin"), ("prefill_routing", "power_of_two")),
    ),
}


def run_all() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, point in POINTS.items():
        res = run_point(point)
        df = res.requests
        out[name] = {
            "metrics": res.metrics.to_dict(),
            "first_token_s_sum": float(df["first_token_s"].sum()),
            "finish_s_sum": float(df["finish_s"].sum()),
            "decode_worker_sum": int(df["decode_worker"].sum()),
            "prefill_worker_sum": int(df["prefill_worker"].sum()),
        }
    return out


if __name__ == "__main__":
    GOLDEN_PATH.write_text(json.dumps(run_all(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN_PATH}")
