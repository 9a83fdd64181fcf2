"""The static cluster's saturation load: the anchor of ``compare``'s matched load points.

Saturation is the highest load factor at which static PD keeps at least ``SATURATION_THRESHOLD`` of
all requests within SLO (unfinished or rejected requests count as misses), found by doubling/halving
then log-space bisection to within ``SATURATION_RESOLUTION``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from train.experiment import Point, prepare_trace, run_point

SATURATION_THRESHOLD = 0.9
"""Static saturates where fewer than this share of requests finish within SLO (DistServe's goodput rule)."""
SATURATION_RESOLUTION = 1.1
"""Bisection stops when the pass/fail bracket is within this factor."""
LOAD_BOUNDS = (2.0**-12, 64.0)


def served_slo_share(metrics: dict[str, Any]) -> float:
    """Share of the requests that finished within SLO: unfinished ones count as misses, rejected ones
    (beyond the context window or any worker's KV) are outside the denominator."""
    eligible = int(metrics["n_requests"]) - int(metrics["n_rejected"])
    return int(metrics["n_slo_met"]) / eligible if eligible > 0 else 0.0


def find_saturation(
    share_at: Callable[[float], float],
    *,
    threshold: float = SATURATION_THRESHOLD,
    start_load: float = 1.0,
    resolution: float = SATURATION_RESOLUTION,
    bounds: tuple[float, float] = LOAD_BOUNDS,
) -> tuple[float, bool, list[tuple[float, float]]]:
    """Highest load with ``share_at(load) >= threshold``, by doubling/halving then log-space bisection.

    Returns (load, bracketed, probes). ``bracketed`` is False when the search hit a bound: then the load
    is the highest passing probe, or the lower bound if no probe passed. Assumes the share falls with
    load; if it does not, the answer is still a passing load next to a failing one within ``resolution``.
    """
    probes: list[tuple[float, float]] = []

    def passes(load: float) -> bool:
        share = share_at(load)
        probes.append((load, share))
        return share >= threshold

    lo: float | None = None
    hi: float | None = None
    if passes(start_load):
        lo = start_load
        while lo * 2 <= bounds[1]:
            if not passes(lo * 2):
                hi = lo * 2
                break
            lo *= 2
    else:
        hi = start_load
        while hi / 2 >= bounds[0]:
            if passes(hi / 2):
                lo = hi / 2
                break
            hi /= 2
    if lo is None or hi is None:
        return (lo if lo is not None else bounds[0]), False, probes
    while hi / lo > resolution:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, True, probes


def _saturation_job(key: tuple[Any, ...]) -> dict[str, Any]:
    """Worker: static saturation of one (trace, model, shape, gpu, max_requests, seed[, options]),
    ``options`` being the ``Point`` precision/parallelism fields as (name, value) pairs."""
    trace_name, model, shape, gpu, max_requests, seed = key[:6]
    base = Point(
        policy="static",
        trace=trace_name,
        model=model,
        gpu=gpu,
        shape=shape,
        max_requests=max_requests,
        seed=seed,
        **dict(key[6] if len(key) > 6 else ()),
    )
    trace = prepare_trace(base)

    def share_at(load: float) -> float:
        return served_slo_share(
            run_point(Point(**{**asdict(base), "load": load}), trace=trace).metrics.to_dict()
        )

    t0 = time.perf_counter()
    found = saturation_search(share_at)
    return {
        "trace": trace_name,
        "model": model,
        "shape": shape,
        "gpu": gpu,
        "max_requests": max_requests,
        "seed": seed,
        **found,
        "wall_s": time.perf_counter() - t0,
    }


def saturation_search(
    share_at: Callable[[float], float], *, threshold: float = SATURATION_THRESHOLD
) -> dict[str, Any]:
    """Static saturation with a fallback for clusters that miss the SLO even when idle.

    First the absolute rule (``share >= threshold``). If no probed load passes, down to the lower
    bound, the cluster misses the SLO for reasons load does not cause (e.g. prompts whose prefill alone
    exceeds the TTFT target); then the rule becomes relative: ``share >= threshold x idle share``
    (the share at the lowest probed load). ``usable`` is False when even the idle share is zero: no load
    is matched and the grid skips that (trace, model, shape).

    Returns ``load``, ``bracketed``, ``threshold`` (the one applied), ``relative``, ``idle_share``
    (None for the absolute rule), ``usable`` and every ``probes`` (load, share) in probing order.
    """
    memo: dict[float, float] = {}

    def cached(load: float) -> float:
        if load not in memo:
            memo[load] = share_at(load)
        return memo[load]

    load, bracketed, probes = find_saturation(cached, threshold=threshold)
    applied, idle_share = threshold, None
    if not any(share >= threshold for _, share in probes):
        idle_share = min(probes)[1]
        if idle_share > 0:
            applied = threshold * idle_share
            load, bracketed, _ = find_saturation(cached, threshold=applied)
    return {
        "load": load,
        "bracketed": bracketed,
        "threshold": applied,
        "relative": idle_share is not None,
        "idle_share": idle_share,
        "usable": idle_share is None or idle_share > 0,
        "probes": list(memo.items()),
    }
