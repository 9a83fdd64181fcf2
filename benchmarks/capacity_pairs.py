"""Capacity at SLO of one policy against others, paired per seed, from a ``crossflow compare`` run.

``crossflow compare`` reports every policy against static; this prints, per (trace, model, shape,
side), the change of ``--policy``'s capacity against each of ``--against``, paired on the seeds both
searched (``train.stats.paired_change``: geometric mean of the per-seed ratios, t-interval on the
log-ratios), with the verdict rule the report uses (a win or loss only when the interval excludes 0).

    python benchmarks/capacity_pairs.py runs/compare-rl/results.json --policy rl \
        --against heuristic,heuristic-shed,greedy-model,dynamo-load
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from train.stats import paired_change, verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="results.json of a crossflow compare run")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--against", required=True, help="comma-separated policies")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
