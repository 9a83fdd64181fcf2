"""Capacity at SLO (the highest load a policy sustains within SLO) and the fewest GPUs that serve a trace.

Capacity at SLO is the highest load factor at which at least ``SLO_SHARE_TARGET`` of the requests
meet the per-request SLO (DistServe's goodput rule; unfinished requests count as misses, rejected ones
leave the denominator). :func:`find_capacity` brackets it by stepping up or down from a start load, then
bisects in log space until the passing and failing probes are within ``CAPACITY_RESOLUTION`` (2 %).
The static cluster's capacity is its *saturation*: the anchor of ``compare``'s load points.

The searches take a ``share_at(load)`` (or ``passes(n_prefill, n_decode)``) callable and never simulate
themselves, so they can be checked on synthetic responses; ``train.compare`` runs them on simulations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

SLO_SHARE_TARGET = 0.9
"""A load is sustained when at least this share of requests meets the SLO."""
SATURATION_THRESHOLD = SLO_SHARE_TARGET
CAPACITY_RESOLUTION = 1.02
"""Bisection stops when the highest passing and lowest failing probes are within this factor."""
LOAD_BOUNDS = (2.0**-12, 64.0)
IDLE_LOAD = LOAD_BOUNDS[0]
"""Where a cluster's *idle* SLO share is measured (the relative rule below)."""


def served_slo_share(metrics: dict[str, Any]) -> float:
    """Share of the requests that finished within SLO: unfinished ones count as misses, rejected ones
    (beyond the context window or any worker's KV) are outside the denominator."""
    eligible = int(metrics["n_requests"]) - int(metrics["n_rejected"])
    return int(metrics["n_slo_met"]) / eligible if eligible > 0 else 0.0


def find_capacity(
    share_at: Callable[[float], float],
    *,
    threshold: float = SLO_SHARE_TARGET,
    start_load: float = 1.0,
    step: float = 2.0,
    resolution: float = CAPACITY_RESOLUTION,
    bounds: tuple[float, float] = LOAD_BOUNDS,
) -> tuple[float, float | None, bool, list[tuple[float, float]]]:
    """Highest load with ``share_at(load) >= threshold``, by stepping (``x step``) then log bisection.

    Returns ``(load, fail_load, bracketed, probes)``: the highest passing probe, the lowest failing
    probe above it (None if none), whether the search was bracketed (False when it hit a bound: then
    ``load`` is the highest passing probe, or the lower bound if none passed) and every probe in order.
    Assumes the share falls with load; if it does not, the answer is still a passing load next to a
    failing one within ``resolution``.
    """
    if not (step > 1 and resolution > 1):
        raise ValueError(f"need step > 1 and resolution > 1, got {step}, {resolution}")
    probes: list[tuple[float, float]] = []

    def passes(load: float) -> bool:
        share = share_at(load)
        probes.append((load, share))
        return share >= threshold

    start = min(max(start_load, bounds[0]), bounds[1])
    lo: float | None = None
    hi: float | None = None
    if passes(start):
        lo = start
        while lo < bounds[1]:
            nxt = min(lo * step, bounds[1])
            if not passes(nxt):
                hi = nxt
                break
            lo = nxt
    else:
        hi = start
        while hi > bounds[0]:
            nxt = max(hi / step, bounds[0])
            if passes(nxt):
                lo = nxt
                break
            hi = nxt
    if lo is None or hi is None:
        return (lo if lo is not None else bounds[0]), hi, False, probes
    while hi / lo > resolution:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi, True, probes


def capacity_search(
    share_at: Callable[[float], float],
    *,
    threshold: float = SLO_SHARE_TARGET,
    relative_fallback: bool = True,
    start_load: float = 1.0,
    step: float = 2.0,
    resolution: float = CAPACITY_RESOLUTION,
    share_below: Callable[[float, float], tuple[float, bool]] | None = None,
) -> dict[str, Any]:
    """Capacity at SLO, with a fallback for clusters that miss the SLO even when idle.

    ``share_below(load, threshold)``, when given, replaces ``share_at`` for the probes judged against
    a known threshold: it may stop as soon as the share is certain to end below ``threshold`` and
    return ``(a share below it, True)``, else ``(the share, False)``. Every pass or fail, and so the
    answer, is the same as with ``share_at``; such probes are listed in ``stopped_early``.

    With ``relative_fallback`` (the static cluster's search): if the start load fails, the share at
    ``IDLE_LOAD`` is probed; when even the idle cluster misses ``threshold`` (prompts whose prefill
    alone exceeds the TTFT target, say), the rule becomes relative: ``share >= threshold x idle share``.
    Every policy at that point is then held to that same applied ``threshold`` (pass it in, without
    the fallback). ``usable`` is False when the idle share is zero: no load can be matched.

    Returns ``load``, ``fail_load``, ``bracketed``, ``threshold`` (the one applied), ``relative``,
    ``idle_share`` (None unless probed), ``usable``, every ``probes`` (load, share) in order and
    ``stopped_early``.
    """
    memo: dict[float, float] = {}
    order: list[float] = []
    stopped: list[float] = []
    """Probes ``share_below`` stopped early: their recorded share is only known to be under the threshold."""

    def probe(load: float, stop_below: float | None) -> float:
        if load not in memo:
            if stop_below is None or share_below is None:
                memo[load] = share_at(load)
            else:
                memo[load], early = share_below(load, stop_below)
                if early:
                    stopped.append(load)
            order.append(load)
        return memo[load]

    applied, idle_share = threshold, None
    # the fallback's probes are exact: the idle share sets the threshold every later probe is held to
    if relative_fallback and probe(min(max(start_load, IDLE_LOAD), LOAD_BOUNDS[1]), None) < threshold:
        idle_share = probe(IDLE_LOAD, None)
        if idle_share < threshold:
            applied = threshold * idle_share
    usable = idle_share is None or idle_share > 0
    load, fail, bracketed = IDLE_LOAD, None, False
    if usable:
        load, fail, bracketed, _ = find_capacity(
            lambda x: probe(x, applied),
            threshold=applied,
            start_load=start_load,
            step=step,
            resolution=resolution,
        )
    return {
        "load": load,
        "fail_load": fail,
        "bracketed": bracketed,
        "threshold": applied,
        "relative": idle_share is not None and idle_share < threshold,
        "idle_share": idle_share,
        "usable": usable,
        "probes": [(x, memo[x]) for x in order],
        "stopped_early": stopped,
    }


def fewest_workers(
    passes: Callable[[int, int], tuple[bool, str]],
    *,
    first_prefill_share: float,
    min_workers: int = 2,
    max_workers: int = 64,
) -> dict[str, Any]:
    """The fewest workers ``n`` (over every split ``xPyD``, ``x + y = n``) for which ``passes`` holds.

    ``passes(x, y)`` returns ``(ok, need)`` where ``need`` is ``"prefill"`` when the failure was mostly
    TTFT (more prefill workers would help) and ``"decode"`` otherwise. For each ``n`` the split walk
    starts at ``round(first_prefill_share * n)`` and moves one worker in the direction ``need`` points,
    until a split passes or the walk would revisit a split or leave ``1..n-1`` (so it assumes one best
    split per ``n``). ``n`` is searched by doubling steps above ``min_workers`` and then bisection, so it
    assumes that more workers never hurt. Returns ``workers`` (None when even ``max_workers`` fails),
    ``shape`` and every ``probes`` ``(shape, ok, need)`` in order.
    """
    probes: list[tuple[str, bool, str]] = []
    found: dict[int, str | None] = {}

    def split_walk(n: int) -> str | None:
        if n in found:
            return found[n]
        x = min(max(round(first_prefill_share * n), 1), n - 1)
        seen: set[int] = set()
        result = None
        while 1 <= x <= n - 1 and x not in seen:
            seen.add(x)
            ok, need = passes(x, n - x)
            probes.append((f"{x}P{n - x}D", ok, need))
            if ok:
                result = f"{x}P{n - x}D"
                break
            x = x + 1 if need == "prefill" else x - 1
        found[n] = result
        return result

    lo = max(min_workers, 2)
    if lo > max_workers:
        return {"workers": None, "shape": None, "probes": probes}
    step = 1
    hi = lo
    while split_walk(hi) is None:
        if hi >= max_workers:
            return {"workers": None, "shape": None, "probes": probes}
        lo = hi + 1
        hi = min(hi + step, max_workers)
        step *= 2
    while lo < hi:  # smallest passing n in [lo, hi]; hi passes
        mid = (lo + hi) // 2
        if split_walk(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    return {"workers": hi, "shape": found[hi], "probes": probes}


__all__ = [
    "CAPACITY_RESOLUTION",
    "IDLE_LOAD",
    "LOAD_BOUNDS",
    "SATURATION_THRESHOLD",
    "SLO_SHARE_TARGET",
    "capacity_search",
    "fewest_workers",
    "find_capacity",
    "served_slo_share",
]
