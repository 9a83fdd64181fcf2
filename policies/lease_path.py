"""Crossflow's path policy: borrow a decode node's lease when the prefill pool is congested and the
lease is faster by a margin; otherwise the normal path.

Rule, per request:

1. Not congested: normal. With the default capacity test (``congestion="capacity"``) the prefill pool
   counts as short of capacity when either this request's queue wait on the normal path exceeds
   ``ttft_share`` of the TTFT SLO (its own first token is at risk), or the prefill work arriving
   (uncached tokens per second over the last ``arrival_window_s``, decayed exponentially) exceeds
   what the pool computes per second (``n_prefill`` workers at the cost estimate's rate for full
   chunks) and the request would wait more than ``congestion_wait_s`` (the backlog grows, so every
   later request waits longer). Below capacity a queue drains by itself and borrowing would only
   trade the decode pool's ITL for TTFT the SLO does not ask for. With ``congestion="wait"`` (the
   older rule) any queue wait above ``congestion_wait_s`` counts.

   1b. Decode-side prefix reuse (``prefix_reuse_share``, when decode nodes keep a prefix cache): an
   uncongested request is still offered the leases of the decode nodes that cache at least that share
   of its prompt (a later turn of a conversation whose earlier turns decoded there). There it
   prefills only the suffix and needs no KV transfer, so rules 2 and 3 usually find it faster than
   the normal path, which moves the whole prompt's KV.
2. For each decode node whose live lease has a task slot and prefill budget left, the best way to run
   the request there: compute everything not cached on the node, or first pull the longer prefix
   cached on the prefill worker. Its estimate is the node's queued borrowed tokens at the lease's
   rate, plus the prefill at that rate (never faster than the prefill alone), plus any pull; the
   option must fit what the lease still has (``LeaseLedger.available``) on every budget.
3. Borrow on the fastest option if it beats the normal path's estimate by ``borrow_margin``,
   reserving on the ledger (the next fastest within the margin if the reservation fails).
3b. Mixed-iteration share budget (``mixed_share_budget``; off in the bare class, on in the catalog's
   ``lease`` path, ``DEFAULT_MIXED_SHARE_BUDGET``): a node whose recent decode
   tokens (decayed over ``mixed_share_window_s``) came out of iterations with borrowed or local
   prefill mixed in more often than that share is not offered new borrows (its committed work goes
   on). Every token of a mixed iteration waits out the whole iteration, and on a mixture of experts
   even a 64-token chunk reads every expert (on gpt-oss-120b it adds 13 ms to a 4 ms step), so the
   *share* of such tokens, not each iteration's length, decides whether the token-weighted ITL tail
   moves: a p99 does not move while well under 1 % of the tokens see a mixed step. With
   ``mixed_share_rescue`` a request may still borrow past the budget when its normal path misses the
   TTFT SLO by the estimate, the borrow meets it, and more than that share of the recent requests
   (decayed over the same window) were late on their normal path: plain PD is then failing the SLO,
   and lending buys SLO-met requests, not faster ones in a burst the queue drains by itself.
4. Admission control (``shed_ttft_factor``): a congested request whose fastest path (normal, or any
   lease that can hold it) is estimated past ``shed_ttft_factor x`` the TTFT SLO is shed: refused at
   arrival, counted as an SLO miss (it stays in the SLO denominator, ``envs.metrics``) and never as
   served work. Past capacity, serving it would only push every request behind it past the SLO too.

The reservation is what makes the choice binding: concurrent decisions can never take more than a
lease holds. See ``docs/leases.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from policies.context import CostEstimator, PolicyContext
from policies.lease import LeaseBudgets
from policies.ledger import LeaseLedger
from policies.node_state import NodeState
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
DEFAULT_TTFT_SHARE = 0.4
"""Under the capacity test a request whose normal-path queue wait exceeds this share of the TTFT SLO
is offered a lease whatever the pool's load (2 s at the default 5 s SLO)."""
DEFAULT_SHED_TTFT_FACTOR = 2.0
"""``lease-shed`` sheds a congested request whose fastest path is estimated past twice the TTFT SLO."""
DEFAULT_PREFIX_REUSE_SHARE = 0.5
"""A decode node caching at least this share of a prompt is offered it even when the pool is not short."""
DEFAULT_MIXED_SHARE_WINDOW_S = 60.0
"""Time constant of the decayed window over which a node's mixed-iteration token share is counted."""
DEFAULT_MIXED_SHARE_BUDGET = 0.0025
"""The catalog's ``lease`` path keeps each node's mixed-iteration token share within 0.25 %: a
quarter of the 1 % of tokens above a p99, so the token-weighted ITL p99 stays put (docs/compare.md,
"Do no harm at 4P2D")."""
DEFAULT_MIXED_SHARE_RESCUE = 0.15
"""... and rescues late requests past it while more than 15 % of recent requests are late on their
normal path (plain PD failing a 90 % SLO target with a margin for bursts)."""
Congestion = Literal["capacity", "wait"]
LenderChoice = Literal["fastest", "least_kv_load"]


class DecayedSum:
    """A sum of values decayed exponentially with time constant ``tau_s`` (a windowed rate)."""

    __slots__ = ("t_s", "tau_s", "total")

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self.total = 0.0
        self.t_s = -math.inf

    def value(self, now_s: float) -> float:
        if now_s <= self.t_s or self.t_s == -math.inf:
            return self.total
        return self.total * math.exp(-(now_s - self.t_s) / self.tau_s)

    def add(self, now_s: float, x: float) -> None:
        self.total = self.value(now_s) + x
        self.t_s = max(self.t_s, now_s)

    def rate(self, now_s: float) -> float:
        """Per second over the window."""
        return self.value(now_s) / self.tau_s


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
        congestion: ``"capacity"`` (the capacity test of the module docstring) or ``"wait"``.
        slo_ttft_s, ttft_share: the capacity test's per-request wait limit, ``ttft_share x slo_ttft_s``.
        pool_tokens_per_s: the prefill pool's rate for the capacity test (required with it).
        arrival_window_s: time constant of the arriving-work rate (default: the TTFT SLO).
        prefix_reuse_share: decode-side prefix reuse (module docstring, rule 1b); ``None``: off.
        shed_ttft_factor: admission control (module docstring, rule 4); ``None``: off.
        mixed_share_budget: the mixed-iteration share budget per node (module docstring, rule 3b), a
            share of its decode tokens in [0, 1); ``None``: off.
        mixed_share_window_s: time constant of that share's decayed window.
        mixed_share_rescue: share of recent requests late on their normal path past which a late
            request may borrow past the budget where that meets its TTFT SLO (rule 3b); ``None``:
            never.
        mixed_share_rescue_window_s: time constant of the window over which that late share is
            counted; ``None``: ``mixed_share_window_s``.
        mixed_share_counts_reserved: the budget also counts the borrowed prefill a node holds on the
            ledger but has not run yet (rule 3b, "reserved work"): its time at the lease's rate, times
            the node's recent decode-token rate, is the mixed decode tokens it will add.
        mixed_share_rescue_ceiling: a rescue past the budget is offered only on a node whose share,
            counting its reserved work and the rescued request's own, stays at or under this
            (``None``: no ceiling).
        mixed_share_ceiling_lift: share of recent requests late on their normal path past which the
            rescue ceiling no longer applies (plain PD failing badly, not at the edge of its SLO);
            ``None``: the ceiling always applies.
        lender_choice: which of the leases that beat the normal path by the margin to borrow on:
            ``"fastest"`` (the earliest first token) or ``"least_kv_load"`` (the node whose decode KV
            the router counts lowest, ``PathQuery.decode_kv_load_tokens``, then the fastest): a
            borrowed request decodes where it was prefilled, outside the decode router's balance.
        prefix_pull: a borrow may pull a prefix cached on the normal path's prefill worker into the
            node instead of computing it (the lease's ``transfer_tokens``). Off where the nodes
            cannot: the served path has no protocol for it (``without_prefix_pulls``).
    """

    uses_leases = True

    def __init__(
        self,
        cost: CostEstimator,
        *,
        congestion_wait_s: float = DEFAULT_CONGESTION_WAIT_S,
        borrow_margin: float = DEFAULT_BORROW_MARGIN,
        congestion: Congestion = "wait",
        slo_ttft_s: float = math.inf,
        ttft_share: float = DEFAULT_TTFT_SHARE,
        pool_tokens_per_s: float = 0.0,
        arrival_window_s: float | None = None,
        prefix_reuse_share: float | None = None,
        shed_ttft_factor: float | None = None,
        mixed_share_budget: float | None = None,
        mixed_share_window_s: float = DEFAULT_MIXED_SHARE_WINDOW_S,
        mixed_share_rescue: float | None = None,
        mixed_share_rescue_window_s: float | None = None,
        mixed_share_counts_reserved: bool = False,
        mixed_share_rescue_ceiling: float | None = None,
        lender_choice: LenderChoice = "fastest",
        mixed_share_ceiling_lift: float | None = None,
        prefix_pull: bool = True,
    ) -> None:
        super().__init__()
        self.prefix_pull = prefix_pull
        if mixed_share_ceiling_lift is not None and not (
            0 <= mixed_share_ceiling_lift < 1 and mixed_share_rescue_ceiling is not None
        ):
            raise ValueError(
                "mixed_share_ceiling_lift must be in [0, 1) with mixed_share_rescue_ceiling set, "
                f"got {mixed_share_ceiling_lift!r}"
            )
        self.mixed_share_ceiling_lift = mixed_share_ceiling_lift
        if lender_choice not in ("fastest", "least_kv_load"):
            raise ValueError(f"lender_choice must be 'fastest' or 'least_kv_load', got {lender_choice!r}")
        self.lender_choice = lender_choice
        if mixed_share_rescue_ceiling is not None and not (
            0 <= mixed_share_rescue_ceiling <= 1 and mixed_share_rescue is not None
        ):
            raise ValueError(
                "mixed_share_rescue_ceiling must be in [0, 1] with mixed_share_rescue set, "
                f"got {mixed_share_rescue_ceiling!r}"
            )
        self.mixed_share_counts_reserved = mixed_share_counts_reserved
        self.mixed_share_rescue_ceiling = mixed_share_rescue_ceiling
        if mixed_share_budget is not None and not 0 <= mixed_share_budget < 1:
            raise ValueError(f"mixed_share_budget must be in [0, 1) or None, got {mixed_share_budget!r}")
        if not 0 < mixed_share_window_s < math.inf:
            raise ValueError(f"mixed_share_window_s must be finite and > 0, got {mixed_share_window_s!r}")
        if mixed_share_rescue is not None and not (0 <= mixed_share_rescue < 1 and slo_ttft_s < math.inf):
            raise ValueError(
                f"mixed_share_rescue must be in [0, 1) with a finite slo_ttft_s, got {mixed_share_rescue!r}"
            )
        self.mixed_share_budget = mixed_share_budget
        self.mixed_share_window_s = mixed_share_window_s
        self.mixed_share_rescue = mixed_share_rescue
        self.slo_ttft_s = slo_ttft_s
        self._tokens: dict[int, tuple[DecayedSum, DecayedSum]] = {}
        self._seen_totals: dict[int, tuple[int, int]] = {}
        """node -> (decode tokens, of them mixed) over the decayed window (rule 3b)."""
        rescue_window_s = (
            mixed_share_window_s if mixed_share_rescue_window_s is None else mixed_share_rescue_window_s
        )
        if not 0 < rescue_window_s < math.inf:
            raise ValueError(f"mixed_share_rescue_window_s must be finite and > 0, got {rescue_window_s!r}")
        self._requests = DecayedSum(rescue_window_s)
        self._late = DecayedSum(rescue_window_s)
        """Requests seen, and of them late on their normal path, over the same window."""
        if shed_ttft_factor is not None and not (shed_ttft_factor >= 1 and slo_ttft_s < math.inf):
            raise ValueError(
                "shed_ttft_factor must be >= 1 with a finite slo_ttft_s, "
                f"got {shed_ttft_factor!r}, {slo_ttft_s!r}"
            )
        self.shed_limit_s = math.inf if shed_ttft_factor is None else shed_ttft_factor * slo_ttft_s
        if prefix_reuse_share is not None and not 0 < prefix_reuse_share <= 1:
            raise ValueError(f"prefix_reuse_share must be in (0, 1] or None, got {prefix_reuse_share!r}")
        self.prefix_reuse_share = prefix_reuse_share
        if congestion_wait_s < 0 or not 0 <= borrow_margin < 1:
            raise ValueError("congestion_wait_s must be >= 0 and borrow_margin in [0, 1)")
        if congestion not in ("capacity", "wait"):
            raise ValueError(f"congestion must be 'capacity' or 'wait', got {congestion!r}")
        if congestion == "capacity":
            window_s = slo_ttft_s if arrival_window_s is None else arrival_window_s
            if not (pool_tokens_per_s > 0 and slo_ttft_s > 0 and 0 < ttft_share and 0 < window_s < math.inf):
                raise ValueError(
                    "the capacity test needs pool_tokens_per_s > 0, slo_ttft_s > 0, ttft_share > 0 and a "
                    f"finite arrival_window_s > 0 (got {pool_tokens_per_s!r}, {slo_ttft_s!r}, "
                    f"{ttft_share!r}, {window_s!r})"
                )
            self.arrival_window_s = window_s
        self.cost = cost
        self.congestion_wait_s = congestion_wait_s
        self.borrow_margin = borrow_margin
        self.congestion = congestion
        self.wait_limit_s = ttft_share * slo_ttft_s
        self.pool_tokens_per_s = pool_tokens_per_s
        self._arrived_tokens = 0.0
        self._arrived_s = -math.inf

    def arrival_tokens_per_s(self) -> float:
        """Prefill work arriving (uncached tokens per second, decayed over ``arrival_window_s``), as of
        the last request seen."""
        return self._arrived_tokens / self.arrival_window_s

    def _note_arrival(self, q: PathQuery, now_s: float) -> None:
        if self._arrived_s > -math.inf and now_s > self._arrived_s:
            self._arrived_tokens *= math.exp(-(now_s - self._arrived_s) / self.arrival_window_s)
        self._arrived_tokens += q.normal_uncached_tokens
        self._arrived_s = max(self._arrived_s, now_s)

    observe_replayable = True  # its observe reads now_s and the token counts, never a state's time_s

    def observe(self, now_s: float, states: Sequence[NodeState]) -> None:
        """Every control interval: fold each node's tokens since the last interval (the difference of
        its running totals; a node seen for the first time, or whose totals went back, counts from 0)
        into its decayed window."""
        super().observe(now_s, states)
        if self.mixed_share_budget is None:
            return
        tokens = self._tokens
        for s in states:
            pair = tokens.get(s.node_id)
            if pair is None:
                pair = tokens[s.node_id] = (
                    DecayedSum(self.mixed_share_window_s),
                    DecayedSum(self.mixed_share_window_s),
                )
            decode, mixed = pair
            seen_decode, seen_mixed = self._seen_totals.get(s.node_id, (0, 0))
            if s.decode_tokens_total < seen_decode or s.mixed_decode_tokens_total < seen_mixed:
                seen_decode = seen_mixed = 0  # the node restarted
            decode.add(now_s, s.decode_tokens_total - seen_decode)
            mixed.add(now_s, s.mixed_decode_tokens_total - seen_mixed)
            self._seen_totals[s.node_id] = (s.decode_tokens_total, s.mixed_decode_tokens_total)

    def mixed_share(self, node_id: int) -> float:
        """Share of ``node_id``'s decode tokens over the decayed window that came out of iterations with
        borrowed or local prefill mixed in (0 before any were observed, and with the budget off)."""
        if node_id not in self._tokens:
            return 0.0
        decode, mixed = self._tokens[node_id]
        return mixed.total / decode.total if decode.total > 0 else 0.0

    def projected_mixed_share(
        self, node_id: int, ledger: LeaseLedger, extra_prefill_tokens: int = 0
    ) -> float:
        """``mixed_share`` counting, too, the borrowed prefill ``node_id`` holds on ``ledger`` but has
        not run, plus ``extra_prefill_tokens`` more: that work's time at the lease's rate, times the
        node's decode-token rate over the window, is the decode tokens its mixed iterations will carry
        (an upper bound: an iteration short of token credit runs without a chunk)."""
        if node_id not in self._tokens:
            return 0.0
        decode, mixed = self._tokens[node_id]
        lease = ledger.lease(node_id)
        pending = 0.0
        if lease is not None and lease.budgets.prefill_tokens > 0:
            tokens = ledger.held(node_id).prefill_tokens + extra_prefill_tokens
            pending = tokens * lease.ttl_s / lease.budgets.prefill_tokens * decode.total / decode.tau_s
        total = decode.total + pending
        return (mixed.total + pending) / total if total > 0 else 0.0

    def over_mixed_share(self, node_id: int, ledger: LeaseLedger | None = None) -> bool:
        """Whether ``node_id`` is past its mixed-iteration share budget (rule 3b; never with it off);
        with ``mixed_share_counts_reserved`` and a ``ledger``, counting its reserved work."""
        if self.mixed_share_budget is None:
            return False
        if self.mixed_share_counts_reserved and ledger is not None:
            return self.projected_mixed_share(node_id, ledger) > self.mixed_share_budget
        return self.mixed_share(node_id) > self.mixed_share_budget

    def under_rescue_ceiling(self, option: _BorrowOption, ledger: LeaseLedger) -> bool:
        """Whether a rescue on ``option`` keeps its node at or under ``mixed_share_rescue_ceiling``."""
        if self.mixed_share_rescue_ceiling is None:
            return True
        if self.mixed_share_ceiling_lift is not None and self.late_share() > self.mixed_share_ceiling_lift:
            return True
        share = self.projected_mixed_share(option.node_id, ledger, option.demand.prefill_tokens)
        return share <= self.mixed_share_rescue_ceiling

    def late_share(self) -> float:
        """Share of the recent requests (decayed over ``mixed_share_window_s``) whose normal-path
        estimate missed the TTFT SLO (counted only with ``mixed_share_rescue``)."""
        return self._late.total / self._requests.total if self._requests.total > 0 else 0.0

    def within_mixed_share(
        self, est_normal_s: float, nodes: list[int], ledger: LeaseLedger | None = None
    ) -> list[int]:
        """Of ``nodes``, those a request with normal-path estimate ``est_normal_s`` may be offered under
        the mixed-iteration share budget (rule 3b): every node for a request ``mixed_share_rescue``
        may rescue (late while plain PD is failing the SLO; ``choose`` then keeps only options past a
        budget that meet the TTFT SLO), otherwise the nodes within their budget."""
        late = est_normal_s > self.slo_ttft_s
        if self.mixed_share_rescue is not None and late and self.late_share() > self.mixed_share_rescue:
            return nodes
        return [n for n in nodes if not self.over_mixed_share(n, ledger)]

    def prefix_nodes(self, q: PathQuery, nodes: list[int]) -> list[int]:
        """Of ``nodes``, those whose decode prefix cache holds at least ``prefix_reuse_share`` of the
        prompt (empty when the share is ``None`` or the decode nodes keep no cache)."""
        if self.prefix_reuse_share is None or not q.decode_cached_tokens:
            return []
        need = self.prefix_reuse_share * q.input_tokens
        return [n for n in nodes if q.decode_cached_tokens.get(n, 0) >= need]

    def congestion_reason(self, q: PathQuery, now_s: float) -> str | None:
        """Why the prefill pool is short of capacity for ``q`` (borrowing may help), or ``None``. Under
        the capacity test every call counts ``q`` as arrived work, so call it once per request."""
        wait_s = q.normal_queue_wait_s
        if self.congestion == "wait":
            if wait_s <= self.congestion_wait_s:
                return None
            return f"queue wait {wait_s:.3f} s > {self.congestion_wait_s} s"
        self._note_arrival(q, now_s)
        if wait_s > self.wait_limit_s:
            return f"queue wait {wait_s:.3f} s > {self.wait_limit_s:.3f} s of the TTFT SLO"
        rate = self.arrival_tokens_per_s()
        if rate > self.pool_tokens_per_s and wait_s > self.congestion_wait_s:
            return (
                f"arriving {rate:.0f} tok/s > pool's {self.pool_tokens_per_s:.0f} tok/s, "
                f"queue wait {wait_s:.3f} s"
            )
        return None

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
        if self.prefix_pull and q.prefill_cached_tokens > local_cached:
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
        congested = self.congestion_reason(q, now_s)
        if self.mixed_share_rescue is not None:
            self._requests.add(now_s, 1.0)
            self._late.add(now_s, 1.0 if est_normal_s > self.slo_ttft_s else 0.0)
        nodes = ledger.node_ids()
        if congested is None:
            nodes = self.prefix_nodes(q, nodes)
            if not nodes:
                reason = f"not congested (queue wait {q.normal_queue_wait_s:.3f} s)"
                return PathDecision(
                    "normal", None, None, est_normal_s, None, reason, PathReason.NOT_CONGESTED
                )
        allowed = self.within_mixed_share(est_normal_s, nodes, ledger)
        if nodes and not allowed:
            reason = (
                "every lease is on a node past its mixed-iteration share budget "
                f"({max(self.mixed_share(n) for n in nodes):.4f} > {self.mixed_share_budget})"
            )
            return PathDecision(
                "normal", None, None, est_normal_s, None, reason, PathReason.MIXED_SHARE_BUDGET
            )
        options = [o for n in allowed if (o := self._borrow_option(q, n, now_s, ledger)) is not None]
        # a late request borrows past a node's budget only where that buys an SLO-met first token
        kept = [
            o
            for o in options
            if not self.over_mixed_share(o.node_id, ledger)
            or (o.est_s <= self.slo_ttft_s and self.under_rescue_ceiling(o, ledger))
        ]
        if options and not kept:
            reason = "late, but no lease past its mixed-iteration share budget meets the TTFT SLO"
            return PathDecision(
                "normal", None, None, est_normal_s, None, reason, PathReason.MIXED_SHARE_BUDGET
            )
        options = kept
        if congested is not None and self.shed_limit_s < math.inf:
            best_any_s = min([est_normal_s, *(o.est_s for o in options)])
            if best_any_s > self.shed_limit_s:
                reason = (
                    f"shed: {congested}; fastest path {best_any_s:.3f} s > {self.shed_limit_s:.3f} s "
                    "(the TTFT SLO cannot be met)"
                )
                return PathDecision("shed", None, None, est_normal_s, None, reason, PathReason.SHED)
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
        if self.lender_choice == "least_kv_load":  # among the options within the margin
            loads = q.decode_kv_load_tokens
            options = [o for o in options if o.est_s <= threshold_s]
            options.sort(key=lambda o: (loads.get(o.node_id, 0), o.est_s, o.node_id))
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


def prefill_pool_tokens_per_s(ctx: PolicyContext) -> float:
    """What the cluster's prefill pool computes per second: its workers at the cost estimate's rate for
    full chunks of fresh prompts."""
    chunk = ctx.cluster.prefill_chunk_tokens
    return ctx.cluster.n_prefill * chunk / ctx.cost.prefill_time_s(chunk)


def _make_lease_path(
    ctx: PolicyContext,
    congestion_wait_s: float = DEFAULT_CONGESTION_WAIT_S,
    borrow_margin: float = DEFAULT_BORROW_MARGIN,
    congestion: Congestion = "capacity",
    ttft_share: float = DEFAULT_TTFT_SHARE,
    arrival_window_s: float | None = None,
    prefix_reuse_share: float | None = DEFAULT_PREFIX_REUSE_SHARE,
    shed_ttft_factor: float | None = None,
    mixed_share_budget: float | None = DEFAULT_MIXED_SHARE_BUDGET,
    mixed_share_window_s: float = DEFAULT_MIXED_SHARE_WINDOW_S,
    mixed_share_rescue: float | None = DEFAULT_MIXED_SHARE_RESCUE,
    mixed_share_rescue_window_s: float | None = None,
    mixed_share_counts_reserved: bool = False,
    mixed_share_rescue_ceiling: float | None = None,
    lender_choice: LenderChoice = "fastest",
    mixed_share_ceiling_lift: float | None = None,
    prefix_pull: bool = True,
) -> LeasePath:
    return LeasePath(
        ctx.cost,
        congestion_wait_s=congestion_wait_s,
        borrow_margin=borrow_margin,
        congestion=congestion,
        slo_ttft_s=ctx.cluster.slo_ttft_s,
        ttft_share=ttft_share,
        pool_tokens_per_s=prefill_pool_tokens_per_s(ctx) if congestion == "capacity" else 0.0,
        arrival_window_s=arrival_window_s,
        prefix_reuse_share=prefix_reuse_share,
        shed_ttft_factor=shed_ttft_factor,
        mixed_share_budget=mixed_share_budget,
        mixed_share_window_s=mixed_share_window_s,
        mixed_share_rescue=mixed_share_rescue,
        mixed_share_rescue_window_s=mixed_share_rescue_window_s,
        mixed_share_counts_reserved=mixed_share_counts_reserved,
        mixed_share_rescue_ceiling=mixed_share_rescue_ceiling,
        lender_choice=lender_choice,
        mixed_share_ceiling_lift=mixed_share_ceiling_lift,
        prefix_pull=prefix_pull,
    )


_S = TypeVar("_S")


def without_prefix_pulls(scheduler: _S) -> _S:
    """``scheduler`` with its path policy planning no prefix pulls (``LeasePath.prefix_pull`` off):
    what the served path can run, as neither the router nor the SGLang plugin has a protocol to
    pull a prefill worker's cached prefix into a lending node, so a node computes the whole prompt
    and reserves it all. The router applies it to the scheduler it serves; a simulation held to a
    served run applies it too. A scheduler whose path policy is not a ``LeasePath`` is unchanged."""
    path = getattr(scheduler, "path", None)
    if isinstance(path, LeasePath):
        path.prefix_pull = False
    return scheduler


register_path_policy(
    "lease", _make_lease_path, summary="Crossflow: borrow a lease when congested and faster by a margin"
)
register_path_policy(
    "lease-shed",
    functools.partial(_make_lease_path, shed_ttft_factor=DEFAULT_SHED_TTFT_FACTOR),
    summary="Crossflow's lease path with admission control (sheds what misses 2x the TTFT SLO on every path)",
)

__all__ = [
    "DEFAULT_BORROW_MARGIN",
    "DEFAULT_CONGESTION_WAIT_S",
    "DEFAULT_MIXED_SHARE_BUDGET",
    "DEFAULT_MIXED_SHARE_RESCUE",
    "DEFAULT_MIXED_SHARE_WINDOW_S",
    "DEFAULT_PREFIX_REUSE_SHARE",
    "DEFAULT_SHED_TTFT_FACTOR",
    "DEFAULT_TTFT_SHARE",
    "DecayedSum",
    "LeasePath",
    "prefill_pool_tokens_per_s",
    "without_prefix_pulls",
]
