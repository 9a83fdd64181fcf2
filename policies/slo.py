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

__all__ = ["DEFAULT_CONTROL_INTERVAL_S", "DEFAULT_TPOT_SLO_S", "DEFAULT_TTFT_SLO_S"]
