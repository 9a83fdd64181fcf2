"""The service-level defaults every part of Crossflow derives from (one home for each number).

The per-request SLO is the one reviewers use for PD serving (DistServe's goodput): a request meets it
when its time to first token is within ``DEFAULT_TTFT_SLO_S`` and its mean inter-token time (TPOT,
``(finish - first token) / (output tokens - 1)``) is within ``DEFAULT_TPOT_SLO_S``. Cluster configs,
node policies (their ITL target) and the comparison all take these defaults from here.
"""

from __future__ import annotations

DEFAULT_TTFT_SLO_S = 5.0
"""Time to first token a request may take and still meet its SLO."""
DEFAULT_TPOT_SLO_S = 0.05
"""Mean inter-token time (time per output token after the first) a request may take."""
DEFAULT_CONTROL_INTERVAL_S = 0.5
"""How often decode nodes report their state and leases are refreshed."""
DEFAULT_ITL_BUDGET_SHARE = 0.8
"""A lending decode node's ITL budget, as a share of the TPOT SLO: no iteration that mixes borrowed
prefill into its decode batch may take longer than ``DEFAULT_ITL_BUDGET_SHARE x DEFAULT_TPOT_SLO_S``
(40 ms at the default SLO). Every iteration is an inter-token gap of each request in the batch, so a
node whose mixed iterations stay inside the budget keeps its ITL p99 inside it too (unless its
decode-only iterations alone exceed it, and then it does not lend). The share leaves the TPOT SLO's
other 70 % to the decode-only iterations' own growth and to the cost estimate's error."""


def itl_budget_s(slo_tpot_s: float, share: float = DEFAULT_ITL_BUDGET_SHARE) -> float:
    """The absolute ITL budget of a lending node (seconds) under a TPOT SLO of ``slo_tpot_s``."""
    if not slo_tpot_s > 0 or not 0 < share <= 1:
        raise ValueError(
            f"itl_budget_s: need slo_tpot_s > 0 and 0 < share <= 1, got {slo_tpot_s!r}, {share!r}"
        )
    return share * slo_tpot_s


__all__ = [
    "DEFAULT_CONTROL_INTERVAL_S",
    "DEFAULT_ITL_BUDGET_SHARE",
    "DEFAULT_TPOT_SLO_S",
    "DEFAULT_TTFT_SLO_S",
    "itl_budget_s",
]
