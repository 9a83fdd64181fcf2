"""``hindsight-split``: the best static split of the same GPUs, chosen after the fact.

Not a per-request rule: static PD runs on every xPyD split with the same worker count as the
cluster, with the same arrivals, and the best one is kept once the runs are done (an operator who
knew the trace in advance and re-roled the workers once). ``crossflow compare`` fills its rows from
the oracle's choice among those runs (``train.report.choose_oracle``) and ``crossflow tune`` takes the
highest capacity at SLO over the splits. ``make_scheduler`` refuses it.
"""

from __future__ import annotations

from policies.catalog import PolicySpec, register_policy

register_policy(
    PolicySpec(
        "hindsight-split",
        "the best static xPyD split of the same GPUs, chosen after the fact",
        grid_level=True,
        source="EVALUATION: static PD on every split with the same worker count, best in hindsight",
    )
)
