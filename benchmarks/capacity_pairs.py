"""Capacity at SLO of one policy against others, paired per seed, from a ``crossflow compare`` run.

``crossflow compare`` reports every policy against static; this prints, per (trace, model, shape,
side), the change of ``--policy``'s capacity against each of ``--against``, paired on the seeds both
searched (``train.stats.paired_change``: geometric mean of the per-seed ratios, t-interval on the
log-ratios), with the verdict rule the report uses (a win or loss only when the interval excludes 0).

    python benchmarks/capacity_pairs.py runs/compare-rl/results.json --policy rl \
        --against heuristic,heuristic-shed,greedy-model,dynamo-load

``--pooled`` also prints the change pooled per side and shape group (the report's headline: all shapes
but 4P2D, and 4P2D), over every trace and model and per trace, as the report pools it against static
(``train.report.capacity_change``: a seed whose search hit the load bound is left out and counted).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from train.report import GROUPS, capacity_by_key, capacity_change, change_cell, group_of, unbracketed_seeds
from train.stats import paired_change, verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="results.json of a crossflow compare run")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--against", required=True, help="comma-separated policies")
    ap.add_argument("--pooled", action="store_true", help="also the change pooled per side and shape group")
    args = ap.parse_args()
    results = json.loads(args.results.read_text())
    loads: dict[tuple[str, ...], dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for entry in results["capacity"]:
        if entry.get("role") != "capacity" or not entry.get("usable", True):
            continue
        p = entry["point"]
        key = (p["trace"], p["model"], p["shape"], p["split"])
        loads[key][p["policy"]][int(p["seed"])] = float(entry["load"])
    for key, by_policy in sorted(loads.items()):
        mine = by_policy.get(args.policy, {})
        print(
            f"{' / '.join(key)}: {args.policy} capacity per seed {[round(mine[s], 3) for s in sorted(mine)]}"
        )
        for other in args.against.split(","):
            ref = by_policy.get(other, {})
            change = paired_change(mine, ref)
            print(
                f"  vs {other:<16} per seed {[round(ref[s], 3) for s in sorted(ref)]}: "
                f"{100 * change.mean:+.1f} % [{100 * change.low:+.1f}, {100 * change.high:+.1f}] "
                f"(n={change.n}) {verdict(change, higher_is_better=True)}"
            )
    if args.pooled:
        caps, censored = capacity_by_key(results), unbracketed_seeds(results)
        traces = sorted({k[0] for k in caps})
        for side in sorted({k[2] for k in caps}):
            for group in GROUPS:
                for only in [None, *traces] if len(traces) > 1 else [None]:
                    keys = [
                        k for k in caps
                        if k[2] == side and group_of(k[3]) == group and (only is None or k[0] == only)
                    ]  # fmt: skip
                    if not keys:
                        continue
                    print(f"pooled {side} / {group} / {only or 'all traces'}: {args.policy}")
                    for other in args.against.split(","):
                        cell = change_cell(capacity_change(caps, keys, args.policy, other, censored))
                        print(f"  vs {other:<16} {cell}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
