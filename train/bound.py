"""A fluid upper bound on what any policy can serve, from the simulator's own cost model.

**Why a fluid bound.** The alternative, an elastic split re-chosen every interval at zero re-role
cost, is itself a scheduling policy: it is only as good as the split rule, it needs a simulator that
re-roles workers mid-run, and nothing proves that a lease policy (which re-roles per request and per
iteration) cannot beat it. The fluid bound is a relaxation instead: every one of the cluster's ``G``
workers serves prefill and decode work with perfect packing (no queueing, no KV limit, no imbalance,
no transfer, perfect prefix reuse, the most efficient batch for every token). Whatever a policy does,
it cannot exceed it, and a test checks that on the grid.

**Best-case work of a request** (worker-seconds, :func:`request_work`). Every iteration the cost model
times is ``token part(T) + LM head(rows) + prefill attention + decode attention + fixed costs``
(``envs.cost_model``). With ``u`` uncached prompt tokens after ``c`` cached ones and ``o`` output
tokens, a request costs at least

* prefill: ``u * prefill_token_s + (u * c + u * (u + 1) / 2) * prefill_pair_s`` (causal pairs, whatever
  the chunking), with ``u = max(1, input - shared_prefix_tokens)``: the prefix shared with an earlier
  request is the most any cache can hold (the simulator never caches more);
* decode: ``(o - 1) * decode_token_s + ((o - 1) * input + (o - 1)(o - 2) / 2) * decode_context_token_s``
  (one step per output token after the first, each reading its whole context).

The coefficients are per-token *infima* of the cost model (:func:`work_coefficients`): the token part
and LM head per token at the largest batch, with every per-iteration cost (launches, overhead, fixed
attention costs, sliding-window attention) left out, so any iteration of any batch costs at least the
sum of its tokens' coefficients. Hence: over any interval of length ``W`` the cluster executes at
most ``G * W`` worker-seconds of best-case work.

**Two bounds follow.**

* Throughput over a steady window ``[a, b]`` (:func:`throughput_bound`): served best-case work is at
  most ``min(G * W, A(b))``, ``A(b)`` the best-case work of every request that can have arrived by
  ``b`` (closed loop: with zero service time). A policy's served work in the window
  (:func:`window_served`) attributes prefill work to the first token and decode work evenly over the
  decode; that attribution can place in the window work done just before ``a`` or after ``b`` (at
  most the work of requests in service at the window's edges, reported as ``edge_work_s``).
* Capacity at SLO (:func:`capacity_bound`, open loop): at load ``L`` a request meeting its SLO has
  its prefill done by ``arrival / L + slo_ttft_s`` and its decode by that plus ``(o - 1) * slo_tpot_s``;
  at most ``(1 - threshold)`` of the requests may miss, so for every deadline ``tau`` the work due by
  then, less the largest requests that may be dropped, must fit in ``G * tau`` worker-seconds (the
  cluster is empty at time 0). A request whose own prefill exceeds the TTFT target on one worker
  misses at any load. The highest load where all that holds bounds every policy's capacity at SLO;
  the fewest workers for which it holds at load 1 bounds the GPUs needed. Closed-loop arrivals
  follow completions, so no finite load bound follows from the trace alone (None).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from envs.cluster_config import ClusterConfig
from envs.context import fit_context_window
from envs.cost_model import TABLE_TOKENS, CostModel
from envs.request import Trace

WARMUP_SHARE = 0.1
"""The steady window starts after this share of the arrival span (open loop: of all arrivals; closed
loop: of the session starts) and ends at the last of them, so warm-up and drain are excluded."""
_LARGE = 2**22
"""Batch sizes where every cost-model term is affine (past the last GEMM-efficiency knot)."""


@dataclass(frozen=True)
class WorkCoefficients:
    """Per-token infima of one worker's iteration cost (seconds)."""

    prefill_token_s: float
    """Per prefill token: token part and per-token prefill attention cost."""
    prefill_pair_s: float
    """Per causal query-key pair of prefill attention (full-attention layers)."""
    decode_token_s: float
    """Per decode token: token part, LM head row and per-request decode attention cost."""
    decode_context_token_s: float
    """Per context token a decode step reads."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def work_coefficients(cost_model: CostModel) -> WorkCoefficients:
    """The cost model's per-token infima, found through its public ``iteration_times_s``.

    Each is the smaller of the slope at very large batches (where every term is affine, so fixed costs
    cancel) and the per-token cost at every batch size up to ``TABLE_TOKENS`` (a guard in case an
    efficiency curve peaks below its last knot). Decode takes the smaller of a decode-only and a mixed
    iteration's slope (a mixed one may use another MoE dispatch kernel).
    """

    def it(prefill: Any, pairs: Any, batch: Any, ctx: Any) -> np.ndarray:
        return cost_model.iteration_times_s(
            np.asarray(prefill), np.asarray(pairs, dtype=np.float64), np.asarray(batch), np.asarray(ctx)
        )

    small = np.arange(1, TABLE_TOKENS + 1)
    zeros = np.zeros_like(small)
    big = np.array([_LARGE, 2 * _LARGE])
    zb = np.zeros(2, dtype=np.int64)

    def slope(values: np.ndarray, step: float) -> float:
        return float(values[1] - values[0]) / step

    prefill_token_s = min(
        slope(it(big, zb, zb, zb), _LARGE), float(np.min(it(small, zeros, zeros, zeros) / small))
    )
    decode_token_s = min(
        slope(it(zb, zb, big, zb), _LARGE),
        slope(it(zb + 1, zb, big, zb), _LARGE),
        float(np.min(it(zeros, zeros, small, zeros) / small)),
    )
    pairs = np.array([float(_LARGE) ** 2, 2.0 * float(_LARGE) ** 2])
    prefill_pair_s = slope(it(zb + 1, pairs, zb, zb), float(_LARGE) ** 2)
    decode_context_token_s = slope(it(zb, zb, zb + 1, big), _LARGE)
    return WorkCoefficients(
        max(prefill_token_s, 0.0),
        max(prefill_pair_s, 0.0),
        max(decode_token_s, 0.0),
        max(decode_context_token_s, 0.0),
    )


def served_trace(trace: Trace, config: ClusterConfig) -> Trace:
    """``trace`` as the simulator serves it (fitted to the context window the same way)."""
    return fit_context_window(trace, config.context_window_tokens, config.context_policy)[0]


def request_work(trace: Trace, coeffs: WorkCoefficients) -> tuple[np.ndarray, np.ndarray]:
    """Best-case (prefill, decode) worker-seconds of every request of a served trace, by request id."""
    inp = np.array([r.input_tokens for r in trace.requests], dtype=np.float64)
    out = np.array([r.output_tokens for r in trace.requests], dtype=np.float64)
    shared = np.array([r.shared_prefix_tokens for r in trace.requests], dtype=np.float64)
    uncached = np.maximum(inp - shared, np.minimum(inp, 1.0))
    cached = inp - uncached
    pairs = uncached * cached + uncached * (uncached + 1.0) / 2.0
    prefill = uncached * coeffs.prefill_token_s + pairs * coeffs.prefill_pair_s
    steps = np.maximum(out - 1.0, 0.0)
    context = steps * inp + steps * np.maximum(steps - 1.0, 0.0) / 2.0
    decode = steps * coeffs.decode_token_s + context * coeffs.decode_context_token_s
    return prefill, decode


def _roots(trace: Trace) -> np.ndarray:
    return np.array([r.depends_on < 0 for r in trace.requests], dtype=bool)


def steady_window(requests: pd.DataFrame, trace: Trace) -> tuple[float, float]:
    """``(a, b)``: from ``WARMUP_SHARE`` of the arrival span to its end (closed loop: the span of the
    requests released at session start, which no policy moves). ``requests`` is
    ``SimResult.requests`` of a run of ``trace``; any policy's run at the same point gives the same."""
    arrivals = requests["arrival_s"].to_numpy(dtype=np.float64)
    if trace.closed_loop:
        arrivals = arrivals[_roots(trace)[requests["request_id"].to_numpy()]]
    arrivals = arrivals[np.isfinite(arrivals)]
    if arrivals.size == 0:
        return (math.nan, math.nan)
    t0, t1 = float(arrivals.min()), float(arrivals.max())
    return (t0 + WARMUP_SHARE * (t1 - t0), t1)


def window_served(
    requests: pd.DataFrame, window: tuple[float, float], prefill_s: np.ndarray, decode_s: np.ndarray
) -> dict[str, float]:
    """Tokens and best-case work a run served in ``window``, per second of it.

    Input tokens, the first output token and the prefill work count at the first token; the other
    output tokens and the decode work are spread evenly from the first token to the finish. Requests
    that never finished count their prefill only. ``edge_work_s`` is the best-case work of requests in
    service across ``a`` or ``b`` (the most the attribution can misplace).
    """
    a, b = window
    span = b - a
    if not (span > 0):
        return {"window_s": 0.0, "input_tokens_per_s": math.nan, "output_tokens_per_s": math.nan,
                "work_per_s": math.nan, "edge_work_s": math.nan}  # fmt: skip
    rid = requests["request_id"].to_numpy()
    first = requests["first_token_s"].to_numpy(dtype=np.float64)
    finish = requests["finish_s"].to_numpy(dtype=np.float64)
    arrival = requests["arrival_s"].to_numpy(dtype=np.float64)
    inp = requests["input_tokens"].to_numpy(dtype=np.float64)
    out = requests["output_tokens"].to_numpy(dtype=np.float64)
    pw, dw = prefill_s[rid], decode_s[rid]
    has_first = np.isfinite(first)
    first_in = has_first & (first >= a) & (first <= b)
    done = has_first & np.isfinite(finish)
    length = np.where(done, finish - first, 0.0)
    overlap = np.clip(np.minimum(finish, b) - np.maximum(first, a), 0.0, None)
    share = np.where(done & (length > 0), overlap / np.where(length > 0, length, 1.0), 0.0)
    share = np.where(done & (length <= 0), first_in.astype(np.float64), share)
    decode_tokens = np.maximum(out - 1.0, 0.0)
    in_tokens = float(np.sum(inp[first_in]))
    out_tokens = float(np.sum(first_in)) + float(np.sum(decode_tokens * share))
    work = float(np.sum(pw[first_in])) + float(np.sum(dw * share))
    # in service at a (arrived before a, first token after it; or decoding across a) and across b
    end = np.where(np.isfinite(finish), finish, np.inf)
    edge_prefill = first_in & (arrival < a)
    edge_decode = done & (((first < a) & (end > a)) | ((first < b) & (end > b)))
    edge = float(np.sum(pw[edge_prefill])) + float(np.sum(dw[edge_decode]))
    return {
        "window_s": span,
        "input_tokens_per_s": in_tokens / span,
        "output_tokens_per_s": out_tokens / span,
        "work_per_s": work / span,
        "edge_work_s": edge,
    }


def earliest_arrivals(requests: pd.DataFrame, trace: Trace) -> np.ndarray:
    """Per request id, the earliest time it can arrive under any policy: open loop, its arrival;
    closed loop, its session-start release plus the think times of its dependency chain (zero service
    time). Requests a run never released are +inf."""
    n = len(trace.requests)
    observed = np.full(n, np.inf)
    observed[requests["request_id"].to_numpy()] = requests["arrival_s"].to_numpy(dtype=np.float64)
    observed[~np.isfinite(observed)] = np.inf
    if not trace.closed_loop:
        return observed
    earliest = np.full(n, np.inf)
    for r in trace.requests:  # depends_on < request_id: one pass in id order
        if r.depends_on < 0:
            earliest[r.request_id] = observed[r.request_id]
        else:
            earliest[r.request_id] = earliest[r.depends_on] + max(0.0, r.think_time_s)
    return earliest


def throughput_bound(
    n_workers: int, window: tuple[float, float], earliest_s: np.ndarray, work_s: np.ndarray
) -> dict[str, Any]:
    """Most best-case work per second any policy can serve in ``window``: ``min(G, A(b) / W)``."""
    a, b = window
    span = b - a
    if not (span > 0):
        return {"work_per_s": math.nan, "capacity_work_per_s": float(n_workers), "binding": "n/a"}
    arrived = float(np.sum(work_s[earliest_s <= b]))
    capacity = float(n_workers)
    return {
        "work_per_s": min(capacity, arrived / span),
        "capacity_work_per_s": capacity,
        "arrived_work_per_s": arrived / span,
        "binding": "capacity" if capacity * span <= arrived else "offered",
    }


def _prefix_feasible(
    prefill_deadline_s: np.ndarray,
    decode_deadline_s: np.ndarray,
    prefill_s: np.ndarray,
    decode_s: np.ndarray,
    misses: int,
    n_workers: int,
) -> bool:
    """Can ``G`` workers, fluidly from time 0, do every request's prefill by its prefill deadline and
    its decode by its decode deadline, for all but ``misses`` requests?

    Checked at every deadline ``tau``: the work due by ``tau`` minus the ``misses`` largest request
    totals among the requests already due (a relaxation: a dropped request may not have all its work
    due yet) must fit in ``G * tau``.
    """
    n = len(prefill_s)
    deadline = np.concatenate([prefill_deadline_s, decode_deadline_s])
    work = np.concatenate([prefill_s, decode_s])
    total_of = prefill_s + decode_s
    order = np.argsort(deadline, kind="stable")
    due = 0.0
    largest: list[float] = []  # min-heap of the ``misses`` largest totals of requests already due
    dropped = 0.0
    for i in order:
        due += float(work[i])
        if i < n and misses > 0:  # request i's prefill falls due: it may be one of the misses
            t = float(total_of[i])
            if len(largest) < misses:
                heapq.heappush(largest, t)
                dropped += t
            elif t > largest[0]:
                dropped += t - heapq.heapreplace(largest, t)
        if due - dropped > n_workers * float(deadline[i]) * (1 + 1e-12):
            return False
    return True


def _allowed_misses(threshold: float, n_requests: int) -> int:
    return math.floor((1.0 - threshold) * n_requests + 1e-9)


class _SloCheck:
    """The fluid SLO check of one open-loop trace: per-request deadlines at load 1 and best-case work.

    A request whose best-case prefill alone exceeds the TTFT target, or whose decode exceeds its TPOT
    budget, on one worker misses at any load (no policy splits one request's prefill or decode over
    workers): it uses up one of the allowed misses and leaves the check.
    """

    def __init__(
        self, trace: Trace, prefill_s: np.ndarray, decode_s: np.ndarray, threshold: float,
        slo_ttft_s: float, slo_tpot_s: float,
    ) -> None:  # fmt: skip
        arrivals = np.array([r.arrival_s for r in trace.requests], dtype=np.float64)
        out = np.array([r.output_tokens for r in trace.requests], dtype=np.float64)
        budget = np.maximum(out - 1.0, 0.0) * slo_tpot_s
        hopeless = (prefill_s > slo_ttft_s) | (decode_s > budget + 1e-12)
        self.misses = _allowed_misses(threshold, len(arrivals)) - int(hopeless.sum())
        keep = ~hopeless
        self.arrivals = arrivals[keep]
        self.ttft_s, self.budget_s = slo_ttft_s, budget[keep]
        self.prefill_s, self.decode_s = prefill_s[keep], decode_s[keep]

    def feasible(self, load: float, n_workers: int) -> bool:
        if self.misses < 0:
            return False
        prefill_due = self.arrivals / load + self.ttft_s
        return _prefix_feasible(
            prefill_due, prefill_due + self.budget_s, self.prefill_s, self.decode_s, self.misses, n_workers
        )


def capacity_bound(
    trace: Trace,
    prefill_s: np.ndarray,
    decode_s: np.ndarray,
    n_workers: int,
    *,
    threshold: float,
    slo_ttft_s: float,
    slo_tpot_s: float,
    bounds: tuple[float, float] = (2.0**-12, 64.0),
    resolution: float = 1.001,
) -> float | None:
    """Highest load factor at which ``n_workers`` could, fluidly, meet the SLO for ``threshold`` of an
    open-loop ``trace``'s requests (its arrivals at load 1 divided by the load). None for closed loops;
    ``bounds[1]`` when even that load is feasible; ``bounds[0]`` when none is."""
    if trace.closed_loop:
        return None
    check = _SloCheck(trace, prefill_s, decode_s, threshold, slo_ttft_s, slo_tpot_s)
    lo, hi = bounds
    if check.feasible(hi, n_workers):
        return hi
    if not check.feasible(lo, n_workers):
        return lo
    while hi / lo > resolution:
        mid = math.sqrt(lo * hi)
        if check.feasible(mid, n_workers):
            lo = mid
        else:
            hi = mid
    return lo


def fewest_workers_bound(
    trace: Trace,
    prefill_s: np.ndarray,
    decode_s: np.ndarray,
    *,
    threshold: float,
    slo_ttft_s: float,
    slo_tpot_s: float,
    max_workers: int = 4096,
) -> int | None:
    """Fewest workers that could, fluidly, meet the SLO for ``threshold`` of an open-loop trace at load
    1: a lower bound for any policy and split. None for closed loops or beyond ``max_workers``."""
    if trace.closed_loop:
        return None
    check = _SloCheck(trace, prefill_s, decode_s, threshold, slo_ttft_s, slo_tpot_s)
    lo, hi = 1, 1
    while not check.feasible(1.0, hi):  # feasibility grows with workers
        if hi >= max_workers:
            return None
        lo, hi = hi + 1, min(2 * hi, max_workers)
    while lo < hi:
        mid = (lo + hi) // 2
        if check.feasible(1.0, mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


__all__ = [
    "WARMUP_SHARE",
    "WorkCoefficients",
    "capacity_bound",
    "earliest_arrivals",
    "fewest_workers_bound",
    "request_work",
    "served_trace",
    "steady_window",
    "throughput_bound",
    "window_served",
    "work_coefficients",
]
