"""Is static PD run as SGLang's gateway would? Per-node load of static, and what each fairness setting
does to the heuristic's gain.

    python benchmarks/bench_fairness.py            # agent (60 sessions) and Mooncake (2,000 requests)
    python benchmarks/bench_fairness.py --quick    # Mooncake only

Part 1 prints each worker's busy share under static PD (smg ``cache_aware`` for both pools, the
default) and under ``round_robin``, with max/mean per pool (1.0 is perfect balance). Part 2 prints
the heuristic's change over static at the given loads with the decode prefix cache off (SGLang's
default) and on, so the effect of that one cluster setting is visible. Loads are load factors of the
bundled trace (``--load`` of ``crossflow simulate``); ``compare`` finds static's saturation near
0.6 for both traces on 2P4D gpt-oss-120b / H200.
"""

from __future__ import annotations

import argparse
import time

from train.experiment import Point, prepare_trace, run_point

TRACES = {"agent": 60, "mooncake": 2000}


def _busy(point: Point) -> tuple[dict[str, list[float]], float]:
    t0 = time.perf_counter()
    res = run_point(point, trace=prepare_trace(point))
    busy: dict[str, list[float]] = {}
    for row in res.nodes.to_dict(orient="records"):
        busy.setdefault(str(row["role"]), []).append(float(row["busy_fraction"]))
    return busy, time.perf_counter() - t0


def _balance(values: list[float]) -> str:
    mean = sum(values) / len(values)
    return f"{max(values) / mean:.2f}" if mean > 0 else "n/a"


def _change(new: float, base: float) -> str:
    return f"{100 * (new / base - 1):+.1f} %" if base > 0 else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Mooncake only")
    parser.add_argument("--loads", default="0.6,1.2", help="load factors for part 2 (default: 0.6,1.2)")
    args = parser.parse_args()
    traces = {"mooncake": TRACES["mooncake"]} if args.quick else TRACES
    loads = [float(x) for x in args.loads.split(",")]

    print("Part 1: static PD, busy share per worker (load 0.6)")
    head = ("trace", "routing", "prefill busy %", "max/mean", "decode busy %", "max/mean")
    print("{:<9} {:<12} {:<22} {:>8}  {:<30} {:>8}".format(*head))
    for trace, n in traces.items():
        for routing in ("cache_aware", "round_robin"):
            overrides = (
                ()
                if routing == "cache_aware"
                else (("prefill_routing", routing), ("decode_routing", routing))
            )
            busy, _ = _busy(Point(trace=trace, max_requests=n, load=0.6, cluster_overrides=overrides))
            p = ", ".join(f"{100 * b:.1f}" for b in busy["prefill"])
            d = ", ".join(f"{100 * b:.1f}" for b in busy["decode"])
            bal_p, bal_d = _balance(busy["prefill"]), _balance(busy["decode"])
            print(f"{trace:<9} {routing:<12} {p:<22} {bal_p:>8}  {d:<30} {bal_d:>8}")

    print("\nPart 2: heuristic vs static, decode prefix cache off (default) and on")
    head = ("trace", "load", "decode cache", "in tok/s", "TTFT mean", "TTFT p99")
    head += ("ITL mean", "ITL p99", "borrowed")
    print("{:<9} {:>5} {:<12} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9}".format(*head))
    for trace, n in traces.items():
        for load in loads:
            for cache in (False, True):
                pts = {
                    pol: Point(
                        policy=pol, trace=trace, max_requests=n, load=load, decode_prefix_cache=cache
                    )
                    for pol in ("static", "heuristic")
                }
                m = {pol: run_point(pt, trace=prepare_trace(pt)).metrics for pol, pt in pts.items()}
                s, h = m["static"], m["heuristic"]
                cells = [
                    _change(h.input_tokens_per_s, s.input_tokens_per_s),
                    _change(h.ttft_mean_s, s.ttft_mean_s),
                    _change(h.ttft_p99_s, s.ttft_p99_s),
                    _change(h.itl_mean_s, s.itl_mean_s),
                    _change(h.itl_p99_s, s.itl_p99_s),
                    f"{100 * h.borrowed_share:.1f} %",
                ]
                row = [trace, f"{load:g}", "on" if cache else "off", *cells]
                print("{:<9} {:>5} {:<12} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9}".format(*row), flush=True)


if __name__ == "__main__":
    main()
