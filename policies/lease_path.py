"""Crossflow's path policy: borrow a decode node's lease when the prefill pool is congested and the
lease is faster by a margin; otherwise the normal path.

Rule, per request:

1. Not congested (the normal path's queue wait is at most ``congestion_wait_s``): normal.
2. For each decode node whose live lease has a task slot and prefill budget left, the best way to run
   the request there: compute everything not cached on the node, or first pull the longer prefix
   cached on the prefill worker. Its estimate is the node's queued borrowed tokens at the lease's
   rate, plus the prefill at that rate (never faster than the prefill alone), plus any pull; the
   option must fit what the lease still has (``LeaseLedger.available``) on every budget.
3. Borrow on the fastest option if it beats the normal path's estimate by ``borrow_margin``,
   reserving on the ledger (the next fastest within the margin if the reservation fails).

The reservation is what makes the choice binding: concurrent decisions can never take more than a
lease holds. See ``docs/leases.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.context import CostEstimator, PolicyContext
from policies.lease import LeaseBudgets
from policies.ledger import LeaseLedger
from policies.path import (
    PathDecision,
    PathPolicy,
    PathQuery,
    PathReason,
    normal_path_estimate_s,
    register_path_policy,
)

DEFAULT_CONGESTION_WAIT_S = 0.2
DEFAULT_BORROW_MARGIN = 0.1


@dataclass(frozen=True, slots=True)
class _BorrowOption:
    node_id: int
    est_s: float
    demand: LeaseBudgets


class LeasePath(PathPolicy):
    """Crossflow's lease-bound path choice (the module docstring has the rule).

    Args:
        cost: prefill and KV-transfer timing.
        congestion_wait_s: the prefill pool counts as congested when the normal path's queue wait
            exceeds this; below it every request takes the normal path.
        borrow_margin: borrow only if ``est_borrow_s <= est_normal_s * (1 - borrow_margin)``.
    """

    uses_leases = True

    def __init__(
        self,
        cost: CostEstimator,
        *,
        congestion_wait_s: float = DEFAULT_CONGESTION_WAIT_S,
        borrow_margin: float = DEFAULT_BORROW_MARGIN,
    ) -> None:
        super().__init__()
        if congestion_wait_s < 0 or not 0 <= borrow_margin < 1:
            raise ValueError("congestion_wait_s must be >= 0 and borrow_margin in [0, 1)")
        self.cost = cost
        self.congestion_wait_s = congestion_wait_s
        self.borrow_margin = borrow_margin

    def _borrow_option(
        self, q: PathQuery, node_id: int, now_s: float, ledger: LeaseLedger
    ) -> _BorrowOption | None:
        """Best way to run ``q`` on ``node_id``'s lease, or ``None`` if the lease cannot hold it."""
        lease = ledger.lease(node_id)
        available = ledger.available(node_id, now_s)
        if lease is None or available.tasks == 0 or available.prefill_tokens == 0:
            return None
        safe_tokens_per_s = lease.budgets.prefill_tokens / lease.ttl_s
        local_cached = min(max(0, q.decode_cached_tokens.get(node_id, 0)), q.input_tokens)
        queue_s = ledger.held(node_id).prefill_tokens / safe_tokens_per_s
        best: _BorrowOption | None = None
        # Either compute everything not cached locally, or pull the prefill worker's longer cached prefix.
        pulls = [0]
        if q.prefill_cached_tokens > local_cached:
            pulls.append(min(q.prefill_cached_tokens, q.input_tokens) - local_cached)
        for pull in pulls:
            new_tokens = q.input_tokens - local_cached - pull
            cached = local_cached + pull
            prefill_s = max(
                new_tokens / safe_tokens_per_s, self.cost.prefill_time_s(new_tokens, cached_tokens=cached)
            )
            transfer_s = self.cost.kv_transfer_time_s(pull) if pull else 0.0
            demand = LeaseBudgets(
                prefill_tokens=new_tokens,
                kv_tokens=q.input_tokens + q.expected_output_tokens,
                transfer_tokens=pull,
                decode_tokens=q.expected_output_tokens,
                tasks=1,
            )
            if not demand.fits_within(available):
                continue
            option = _BorrowOption(node_id, queue_s + prefill_s + transfer_s, demand)
            if best is None or option.est_s < best.est_s:
                best = option
        return best

    def choose(self, q: PathQuery, now_s: float, ledger: LeaseLedger) -> PathDecision:
        est_normal_s = normal_path_estimate_s(self.cost, q)
        if q.normal_queue_wait_s <= self.congestion_wait_s:
            reason = f"not congested (queue wait {q.normal_queue_wait_s:.3f} s <= {self.congestion_wait_s} s)"
            return PathDecision("normal", None, None, est_normal_s, None, reason, PathReason.NOT_CONGESTED)
        options = [
            o for n in ledger.node_ids() if (o := self._borrow_option(q, n, now_s, ledger)) is not None
        ]
        if not options:
            return PathDecision(
                "normal",
                None,
                None,
                est_normal_s,
                None,
                "congested but no lease can hold it",
                PathReason.NO_LEASE_FITS,
            )
        options.sort(key=lambda o: (o.est_s, o.node_id))
        best_s = options[0].est_s
        threshold_s = est_normal_s * (1.0 - self.borrow_margin)
        if best_s > threshold_s:
            reason = f"borrow {best_s:.3f} s does not beat normal {est_normal_s:.3f} s by the margin"
            return PathDecision("normal", None, None, est_normal_s, best_s, reason, PathReason.MARGIN_NOT_MET)
        for option in options:
            if option.est_s > threshold_s:
                break
            res = ledger.reserve(option.node_id, option.demand, now_s)
            if res is not None:
                reason = (
                    f"borrow on node {option.node_id}: {option.est_s:.3f} s vs normal {est_normal_s:.3f} s "
                    f"(computes {option.demand.prefill_tokens} tokens, pulls {option.demand.transfer_tokens})"
                )
                return PathDecision(
                    "borrow",
                    option.node_id,
                    res.reservation_id,
                    est_normal_s,
                    option.est_s,
                    reason,
                    PathReason.BORROWED,
                )
        return PathDecision(
            "normal",
            None,
            None,
            est_normal_s,
            best_s,
            "reservation failed on every candidate",
            PathReason.RESERVATION_FAILED,
        )


def _make_lease_path(
    ctx: PolicyContext,
    congestion_wait_s: float = DEFAULT_CONGESTION_WAIT_S,
    borrow_margin: float = DEFAULT_BORROW_MARGIN,
) -> LeasePath:
    return LeasePath(ctx.cost, congestion_wait_s=congestion_wait_s, borrow_margin=borrow_margin)


register_path_policy(
    "lease", _make_lease_path, summary="Crossflow: borrow a lease when congested and faster by a margin"
)

__all__ = ["DEFAULT_BORROW_MARGIN", "DEFAULT_CONGESTION_WAIT_S", "LeasePath"]
