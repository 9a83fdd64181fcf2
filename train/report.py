"""What a `crossflow compare` run means: intervals over seeds, the two regimes, the bound, report.md, plots.

Pure functions over the plain dicts ``train.compare`` collects (``results["points"]``: one row per
policy, point and seed; ``results["capacity"]``: one capacity-at-SLO search per policy, shape and
seed), so every figure can be checked by hand on a tiny fixture. Changes vs static are paired by seed
(``train.stats``). Writing (``write_report``) is the only side effect: ``report.md`` and PNGs, each
written to a temp file and renamed, so a crashed run never leaves half a report.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from envs.cluster_config import parse_shape
from train import stats

GUARD_SHAPE = (4, 2)
"""The prefill-heavy extreme (4P2D): lending cannot help much there, the target is only 'do no harm'."""

TARGETS = {
    "input_gain": 0.174,
    "output_gain": 0.162,
    "itl_worse": 0.05,
    "itl_p99_worse": 0.10,
    "guard_worse": 0.01,
    "capacity_gain": 0.20,
    "peer_capacity_gain": 0.05,
}
"""The paper's geo-mean throughput gains, the mean-ITL and ITL-p99 allowances at every latency point,
the 4P2D allowance, and capacity at SLO over static and over the best peer of the run (geo-means)."""

LATENCY_METRICS: dict[str, tuple[str, float, str]] = {
    "ttft_mean_s": ("TTFT mean", 1.0, "s"),
    "ttft_p50_s": ("TTFT p50", 1.0, "s"),
    "ttft_p99_s": ("TTFT p99", 1.0, "s"),
    "itl_mean_s": ("ITL mean", 1e3, "ms"),
    "itl_p99_s": ("ITL p99", 1e3, "ms"),
}
"""Latency-regime metrics (lower is better): name -> (title, scale, unit)."""
THROUGHPUT_METRICS: dict[str, tuple[str, float, str]] = {
    "input_tokens_per_s": ("in tok/s", 1.0, ""),
    "output_tokens_per_s": ("out tok/s", 1.0, ""),
}
"""Steady-window throughput metrics (higher is better), read from a row's ``steady`` dict."""
HEADLINE_LATENCY = ("ttft_mean_s", "ttft_p99_s", "itl_mean_s", "itl_p99_s")
GROUPS = ("headline", "guard")


def is_guard_shape(shape: str) -> bool:
    return parse_shape(shape) == GUARD_SHAPE


def group_of(shape: str) -> str:
    return "guard" if is_guard_shape(shape) else "headline"


def point_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """(trace, model, split, shape, regime, load fraction): the rows whose policies are compared."""
    return (
        row["trace"],
        row["model"],
        row["split"],
        row["shape"],
        row["regime"],
        float(row["load_fraction"]),
    )


def row_value(row: Mapping[str, Any], metric: str) -> float:
    """A metric of one row: a ``RunMetrics`` field, or ``steady_<field>`` / ``bound_share`` from the
    steady window (served best-case work over the fluid bound)."""
    if metric == "bound_share":
        limit = (row.get("bound") or {}).get("work_per_s", math.nan)
        served = (row.get("steady") or {}).get("work_per_s", math.nan)
        return served / limit if limit and math.isfinite(limit) and limit > 0 else math.nan
    if metric.startswith("steady_"):
        return float((row.get("steady") or {}).get(metric[len("steady_") :], math.nan))
    return float((row.get("metrics") or {}).get(metric, math.nan))


def _ok(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if r.get("metrics")]


def by_point(
    rows: Sequence[Mapping[str, Any]],
) -> dict[tuple[Any, ...], dict[str, dict[int, Mapping[str, Any]]]]:
    """point key -> policy -> seed -> row."""
    out: dict[tuple[Any, ...], dict[str, dict[int, Mapping[str, Any]]]] = {}
    for r in _ok(rows):
        out.setdefault(point_key(r), {}).setdefault(r["policy"], {})[int(r["seed"])] = r
    return out


def point_change(
    policy_rows: Mapping[int, Mapping[str, Any]], static_rows: Mapping[int, Mapping[str, Any]], metric: str
) -> stats.Interval:
    """Change of ``metric`` vs static at one point, paired by seed."""
    return stats.paired_change(
        {s: row_value(r, metric) for s, r in policy_rows.items()},
        {s: row_value(r, metric) for s, r in static_rows.items()},
    )


def point_mean(rows: Mapping[int, Mapping[str, Any]], metric: str) -> stats.Interval:
    return stats.mean_interval(row_value(r, metric) for r in rows.values())


def capacity_by_key(results: Mapping[str, Any]) -> dict[tuple[Any, ...], dict[str, dict[int, float]]]:
    """(trace, model, split, grid shape) -> policy -> seed -> capacity at SLO (hindsight-split too)."""
    out: dict[tuple[Any, ...], dict[str, dict[int, float]]] = {}
    for c in results.get("capacity", []):
        if c.get("error") or not c.get("usable", True) or c.get("role") == "split":
            continue
        p = c["point"]
        key = (p["trace"], p["model"], p["split"], p["shape"])
        out.setdefault(key, {}).setdefault(p["policy"], {})[int(p["seed"])] = float(c["load"])
    for h in results.get("hindsight", []):
        key = (h["trace"], h["model"], h["split"], h["grid_shape"])
        out.setdefault(key, {}).setdefault("hindsight-split", {})[int(h["seed"])] = float(h["load"])
    return out


def unbracketed_seeds(results: Mapping[str, Any]) -> dict[tuple[Any, ...], dict[str, set[int]]]:
    """(trace, model, split, grid shape) -> policy -> the seeds whose capacity search hit a load bound
    (its load is a bound of the capacity, not a measurement of it)."""
    out: dict[tuple[Any, ...], dict[str, set[int]]] = {}
    for c in results.get("capacity", []):
        if (
            c.get("error")
            or not c.get("usable", True)
            or c.get("role") == "split"
            or c.get("bracketed", True)
        ):
            continue
        p = c["point"]
        key = (p["trace"], p["model"], p["split"], p["shape"])
        out.setdefault(key, {}).setdefault(p["policy"], set()).add(int(p["seed"]))
    for h in results.get("hindsight", []):
        if not h.get("bracketed", True):
            key = (h["trace"], h["model"], h["split"], h["grid_shape"])
            out.setdefault(key, {}).setdefault("hindsight-split", set()).add(int(h["seed"]))
    return out


def unbracketed_by_key(results: Mapping[str, Any]) -> dict[tuple[Any, ...], dict[str, int]]:
    """(trace, model, split, grid shape) -> policy -> how many seeds' capacity searches hit a load bound."""
    return {k: {p: len(seeds) for p, seeds in v.items()} for k, v in unbracketed_seeds(results).items()}


def capacity_bound_by_key(results: Mapping[str, Any]) -> dict[tuple[Any, ...], dict[int, float]]:
    out: dict[tuple[Any, ...], dict[int, float]] = {}
    for b in results.get("capacity_bound", []):
        if b.get("load") is None:
            continue
        trace, model, split = b["combo"].split("|")
        out.setdefault((trace, model, split, b["shape"]), {})[int(b["seed"])] = float(b["load"])
    return out


def _entry(change: stats.Interval, higher_is_better: bool) -> dict[str, Any]:
    return {**change.to_dict(), "verdict": stats.verdict(change, higher_is_better)}


def _group_points(
    grouped: Mapping[tuple[Any, ...], Mapping[str, Any]], side: str, group: str, policy: str
) -> list[tuple[tuple[Any, ...], Mapping[str, Any]]]:
    return [
        (k, v)
        for k, v in grouped.items()
        if k[2] == side and group_of(k[3]) == group and policy in v and "static" in v
    ]


def _paired_triples(
    pts: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]], policy: str, regime: str, metric: str
) -> list[tuple[int, float, float]]:
    return [
        (s, row_value(v[policy][s], metric), row_value(v["static"][s], metric))
        for k, v in pts
        if k[4] == regime
        for s in v[policy]
        if s in v["static"]
    ]


def _bound_cells(pts: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]], policy: str) -> dict[str, Any]:
    """``bound_share`` and ``gap_closed`` over the throughput points: per seed the mean over points."""
    share: dict[int, list[float]] = {}
    gap: dict[int, list[float]] = {}
    for k, v in pts:
        if k[4] != "throughput":
            continue
        for s, r in v[policy].items():
            x = row_value(r, "bound_share")
            if math.isfinite(x):
                share.setdefault(s, []).append(x)
            if s in v["static"]:
                b = (r.get("bound") or {}).get("work_per_s", math.nan)
                p_w, s_w = row_value(r, "steady_work_per_s"), row_value(v["static"][s], "steady_work_per_s")
                if math.isfinite(b) and b - s_w > 1e-9 * b:
                    gap.setdefault(s, []).append((p_w - s_w) / (b - s_w))
    out = {"bound_share": stats.mean_interval(sum(x) / len(x) for x in share.values()).to_dict()}
    if policy != "static":
        out["gap_closed"] = stats.mean_interval(sum(x) / len(x) for x in gap.values()).to_dict()
    return out


def capacity_change(
    caps: Mapping[tuple[Any, ...], Mapping[str, Mapping[int, float]]],
    keys: Sequence[tuple[Any, ...]],
    policy: str,
    reference: str = "static",
    censored: Mapping[tuple[Any, ...], Mapping[str, set[int]]] | None = None,
) -> dict[str, Any]:
    """Change of ``policy``'s capacity at SLO against ``reference``'s over the points ``keys``, paired
    by seed (per seed a geometric mean over the points, then the interval over seeds), with its verdict.

    A seed whose search (either policy's) hit a load bound (``censored``, ``unbracketed_seeds``: its
    load bounds the capacity, it does not measure it) is left out at that point and counted in
    ``n_censored``: a ratio against the search bound would be the bound's, not the policy's."""
    censored = censored or {}
    triples, n_censored = [], 0
    for k in keys:
        mine, ref = caps[k].get(policy, {}), caps[k].get(reference)
        if ref is None:
            continue
        at_bound = censored.get(k, {})
        for s in mine:
            if s not in ref:
                continue
            if s in at_bound.get(policy, ()) or s in at_bound.get(reference, ()):
                n_censored += 1
                continue
            triples.append((s, mine[s], ref[s]))
    entry = _entry(stats.aggregate_change(triples), higher_is_better=True)
    return {**entry, "n_censored": n_censored}


def _capacity_cells(
    caps: Mapping[tuple[Any, ...], Mapping[str, Mapping[int, float]]],
    limits: Mapping[tuple[Any, ...], Mapping[int, float]],
    side: str,
    group: str,
    policy: str,
    censored: Mapping[tuple[Any, ...], Mapping[str, set[int]]] | None = None,
) -> dict[str, Any]:
    """``capacity_at_slo`` (change vs static, ``capacity_change``) and ``capacity_bound_share`` over
    the group's shapes."""
    keys = [k for k, pol in caps.items() if k[2] == side and group_of(k[3]) == group and policy in pol]
    out: dict[str, Any] = {}
    if policy != "static":
        out["capacity_at_slo"] = capacity_change(caps, keys, policy, "static", censored)
    share: dict[int, list[float]] = {}
    for k in keys:
        for s, cap in caps[k][policy].items():
            limit = limits.get(k, {}).get(s)
            if limit:
                share.setdefault(s, []).append(cap / limit)
    out["capacity_bound_share"] = stats.mean_interval(sum(x) / len(x) for x in share.values()).to_dict()
    return out


def summarise(results: Mapping[str, Any]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """Per policy -> split side -> group (``headline``: all shapes but 4P2D; ``guard``: 4P2D) -> metric:
    the change vs static over the group's points, per seed a geometric mean over points, with the
    interval over seeds and its verdict. Metrics: the latency ones (latency regime), ``capacity_at_slo``,
    ``steady_input_tokens_per_s`` / ``steady_output_tokens_per_s`` (throughput points), and, for every
    policy static included, ``bound_share`` (served best-case work / fluid bound, mean over points and
    seeds), ``gap_closed`` (``(policy - static) / (bound - static)`` of the same) and
    ``capacity_bound_share`` (capacity at SLO / its fluid bound; open-loop traces)."""
    grouped = by_point(results["points"])
    caps = capacity_by_key(results)
    limits = capacity_bound_by_key(results)
    censored = unbracketed_seeds(results)
    policies = sorted({p for v in grouped.values() for p in v} | {p for v in caps.values() for p in v})
    sides = sorted({k[2] for k in grouped} | {k[2] for k in caps})
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for policy, side, group in itertools.product(policies, sides, GROUPS):
        pts = _group_points(grouped, side, group, policy)
        cell: dict[str, Any] = {}
        if policy != "static":
            for metric in LATENCY_METRICS:
                change = stats.aggregate_change(_paired_triples(pts, policy, "latency", metric))
                cell[metric] = _entry(change, higher_is_better=False)
            for metric in THROUGHPUT_METRICS:
                change = stats.aggregate_change(
                    _paired_triples(pts, policy, "throughput", f"steady_{metric}")
                )
                cell[f"steady_{metric}"] = _entry(change, higher_is_better=True)
        cell.update(_capacity_cells(caps, limits, side, group, policy, censored))
        cell.update(_bound_cells(pts, policy))
        cell["n_points"] = len(pts)
        out.setdefault(policy, {}).setdefault(side, {})[group] = cell
    return out


def _target(name: str, ok: bool | None, measured: str, at: tuple[Any, ...] | None = None) -> dict[str, Any]:
    """One target's verdict; a miss keeps the point it was missed at (``at``: a ``point_key``), whose
    decision records the report lists beside it."""
    out: dict[str, Any] = {
        "target": name,
        "status": "n/a" if ok is None else ("PASS" if ok else "MISS"),
        "measured": measured,
    }
    if ok is False and at is not None:
        out["at"] = list(at)
    return out


def _where(key: tuple[Any, ...]) -> str:
    return f"{key[0]}/{key[1]}/{key[2]}/{key[3]} {key[4]} {key[5]:g}x sat"


def is_peer(results: Mapping[str, Any], policy: str) -> bool:
    """Whether ``policy`` (a catalog name, or a bundle of one in ``results["bundles"]``) is a peer: a
    rule from outside this repository (``policies/peers/``), not static, not a split chosen in
    hindsight."""
    from policies.catalog import CROSSFLOW_SOURCE, policy_names, policy_spec

    base = ((results.get("bundles") or {}).get(policy) or {}).get("policy", policy)
    if base not in policy_names():
        return False
    spec = policy_spec(base)
    return not (spec.passive or spec.grid_level or spec.source.startswith(CROSSFLOW_SOURCE))


def _capacity_targets(
    results: Mapping[str, Any],
    summary: Mapping[str, Any],
    grouped: Mapping[tuple[Any, ...], Mapping[str, Any]],
    policy: str,
    side: str,
) -> list[dict[str, Any]]:
    """Capacity at SLO over static (``capacity_gain``) and, for a policy that is not a peer, over the
    best peer of the run on that side (``peer_capacity_gain``, paired by seed), on the headline group.
    A miss names the overload point nearest capacity of the shape where the change is lowest
    (``grouped``: ``by_point`` of the run's points)."""
    caps = capacity_by_key(results)
    censored = unbracketed_seeds(results)
    keys = [k for k, pol in caps.items() if k[2] == side and group_of(k[3]) == "headline" and policy in pol]

    def headline_capacity(p: str) -> Mapping[str, Any]:
        """``p``'s capacity-at-SLO change over static on ``side``'s headline group (empty: none)."""
        return ((summary.get(p) or {}).get(side) or {}).get("headline", {}).get("capacity_at_slo") or {}

    def weakest(reference: str) -> tuple[Any, ...] | None:
        worst: tuple[float, tuple[Any, ...]] | None = None
        for k in keys:
            e = capacity_change(caps, [k], policy, reference, censored)
            if e.get("n") and math.isfinite(e["mean"]) and (worst is None or e["mean"] < worst[0]):
                worst = (e["mean"], k)
        if worst is None:
            return None
        near = sorted(
            (g for g in grouped if g[:4] == worst[1][:4] and g[4] == "throughput" and policy in grouped[g]),
            key=lambda g: g[5],
        )
        return near[0] if near else None

    out: list[dict[str, Any]] = []
    e = headline_capacity(policy)
    ok = None if not e.get("n") else e["mean"] >= TARGETS["capacity_gain"]
    out.append(
        _target(
            f"[{side}] capacity at SLO: geo-mean gain >= +{100 * TARGETS['capacity_gain']:.0f} % over static",
            ok,
            "no capacities" if ok is None else change_cell(e),
            weakest("static") if ok is False else None,
        )
    )
    if is_peer(results, policy):
        return out
    peers = {p: headline_capacity(p) for p in summary if p != policy and is_peer(results, p)}
    peers = {p: v for p, v in peers.items() if v.get("n")}
    gain = 100 * TARGETS["peer_capacity_gain"]
    name = f"[{side}] capacity at SLO: geo-mean gain >= +{gain:.0f} % over the best peer"
    if not peers:
        out.append(_target(name, None, "no peer in this run"))
        return out
    best = max(peers, key=lambda p: peers[p]["mean"])
    e = capacity_change(caps, keys, policy, best, censored)
    ok = None if not e.get("n") else e["mean"] >= TARGETS["peer_capacity_gain"]
    out.append(
        _target(
            name,
            ok,
            "no paired capacities" if ok is None else f"{change_cell(e)} over {best}",
            weakest(best) if ok is False else None,
        )
    )
    return out


def evaluate_targets(results: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The targets per non-static policy, judged on the seed intervals' point estimates (``TARGETS``):
    capacity at SLO over static and over the best peer of the run, throughput gains at the overload
    points, TTFT never a claimed loss, mean ITL at most +5 % and ITL p99 at most +10 % at any latency
    point (all shapes but 4P2D), and no claimed loss over 1 % on 4P2D."""
    summary = summarise(results)
    grouped = by_point(results["points"])
    out: dict[str, list[dict[str, Any]]] = {}
    for policy, sides in summary.items():
        if policy == "static":
            continue
        res: list[dict[str, Any]] = []
        for side, groups in sides.items():
            head = groups.get("headline", {})
            res += _capacity_targets(results, summary, grouped, policy, side)
            overload = [
                (k, v)
                for k, v in grouped.items()
                if k[2] == side and k[4] == "throughput" and not is_guard_shape(k[3])
                and policy in v and "static" in v
            ]  # fmt: skip
            for metric, key in (
                ("steady_input_tokens_per_s", "input_gain"),
                ("steady_output_tokens_per_s", "output_gain"),
            ):
                e = head.get(metric) or {}
                ok = None if not e.get("n") else e["mean"] >= TARGETS[key]
                title = THROUGHPUT_METRICS[metric[len("steady_") :]][0]
                changes = [(point_change(v[policy], v["static"], metric).mean, k) for k, v in overload]
                weakest = min(
                    ((c, k) for c, k in changes if math.isfinite(c)), default=None, key=lambda ck: ck[0]
                )
                res.append(
                    _target(
                        f"[{side}] {title} at overload: geo-mean gain >= +{100 * TARGETS[key]:.1f} %",
                        ok,
                        "no points"
                        if ok is None
                        else f"{_pct(e['mean'])} {_ci(e)} over {head['n_points']} point(s)",
                        weakest[1] if weakest else None,
                    )
                )
            pts = [
                (k, v)
                for k, v in grouped.items()
                if k[2] == side and k[4] == "latency" and policy in v and "static" in v
            ]
            head_pts = [(k, v) for k, v in pts if not is_guard_shape(k[3])]
            for metric in ("ttft_mean_s", "ttft_p99_s"):
                losses = [
                    k
                    for k, v in head_pts
                    if stats.verdict(point_change(v[policy], v["static"], metric), False) == "loss"
                ]
                ok = None if not head_pts else not losses
                res.append(
                    _target(
                        f"[{side}] {LATENCY_METRICS[metric][0]}: no claimed loss at any latency point",
                        ok,
                        "no points"
                        if ok is None
                        else (f"losses at {', '.join(map(_where, losses))}" if losses else "none"),
                        losses[0] if losses else None,
                    )
                )
            for metric, key in (("itl_mean_s", "itl_worse"), ("itl_p99_s", "itl_p99_worse")):
                worst, worst_key = -math.inf, None
                for k, v in head_pts:
                    ch = point_change(v[policy], v["static"], metric).mean
                    if math.isfinite(ch) and ch > worst:
                        worst, worst_key = ch, k
                ok = None if not head_pts or not math.isfinite(worst) else worst <= TARGETS[key]
                res.append(
                    _target(
                        f"[{side}] {LATENCY_METRICS[metric][0]} at most +{100 * TARGETS[key]:.0f} % at every "
                        "latency point",
                        ok,
                        "no points"
                        if ok is None or worst_key is None
                        else f"worst {_pct(worst)} at {_where(worst_key)}",
                        worst_key,
                    )
                )
            guard = [
                (k, v)
                for k, v in grouped.items()
                if k[2] == side and is_guard_shape(k[3]) and policy in v and "static" in v
            ]
            worst, where, worst_key = -math.inf, "", None
            for k, v in guard:
                metrics = (
                    HEADLINE_LATENCY
                    if k[4] == "latency"
                    else tuple(f"steady_{m}" for m in THROUGHPUT_METRICS)
                )
                for metric in metrics:
                    change = point_change(v[policy], v["static"], metric)
                    higher = metric.startswith("steady_")
                    if stats.verdict(change, higher) == "loss":
                        worse = -change.mean if higher else change.mean
                        if worse > worst:
                            worst, where, worst_key = worse, f"{metric} at {_where(k)}", k
            ok = None if not guard else not (worst > TARGETS["guard_worse"])
            res.append(
                _target(
                    f"[{side}] 4P2D: no claimed loss worse than {100 * TARGETS['guard_worse']:.0f} %",
                    ok,
                    "no 4P2D points"
                    if ok is None
                    else (f"worst {_pct(worst)} ({where})" if where else "no claimed loss"),
                    worst_key,
                )
            )
        out[policy] = res
    return out


def target_lines(results: Mapping[str, Any], policy: str, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """``policy``'s target verdicts as bullets; under each miss, the decision records of the point it
    was missed at (the five most frequent reasons there, numbers blanked), which say what the policy did."""
    lines: list[str] = []
    for r in rows:
        lines.append(f"- {r['status']}: {r['target']} ({r['measured']})")
        if r.get("at"):
            key = tuple(r["at"])
            here = [p for p in results["points"] if p["policy"] == policy and point_key(p) == key]
            reasons = top_reasons(here, policy, 5)
            said = "; ".join(f"{n:,} x {reason}" for reason, n in reasons) or "none recorded"
            lines.append(f"  - decision records at {_where(key)} ({key[4]}): {said}")
    return lines


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def normalise_reason(kind: str, reason: str, path: str | None = None) -> str:
    """A decision record's reason with its numbers blanked, so equal reasons group together."""
    label = f"{kind}/{path}" if path else kind
    return f"{label}: {_NUMBER.sub('#', reason)}"


def top_reasons(rows: Sequence[Mapping[str, Any]], policy: str, k: int = 5) -> list[tuple[str, int]]:
    """The ``k`` most frequent normalised decision reasons of ``policy`` over its rows."""
    total: Counter[str] = Counter()
    for r in rows:
        if r["policy"] == policy:
            total.update(r.get("reasons") or {})
    return total.most_common(k)


# ---- formatting --------------------------------------------------------------------------------------
def _fmt(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    v = float(value) * scale
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{100 * value:+.1f} %"


def _ci(e: Mapping[str, Any]) -> str:
    if not e or e.get("n", 0) < 2 or not math.isfinite(e.get("low", math.nan)):
        return "[no interval]"
    return f"[{100 * e['low']:+.1f}, {100 * e['high']:+.1f}]"


def change_cell(e: Mapping[str, Any] | None) -> str:
    """``-12.3 % [-15.1, -9.4] win``: mean change, 95 % interval, verdict (and how many seed-points were
    left out at the search bound, ``n_censored``)."""
    left_out = f" ({e['n_censored']} at the search bound left out)" if e and e.get("n_censored") else ""
    if not e or not e.get("n"):
        return "n/a" + left_out
    return f"{_pct(e['mean'])} {_ci(e)} {e.get('verdict', '')}".strip() + left_out


def mean_cell(it: stats.Interval | Mapping[str, Any], scale: float = 1.0, pct: bool = False) -> str:
    """``3.41 ± 0.12`` (mean ± half of the 95 % interval) or ``n/a``."""
    d = it.to_dict() if isinstance(it, stats.Interval) else it
    if not d or not d.get("n") or not math.isfinite(d["mean"]):
        return "n/a"
    if pct:
        scale, fmt = 100 * scale, (lambda v: f"{v:.0f} %")
    else:
        fmt = lambda v: _fmt(v, 1.0)  # noqa: E731
    if d["n"] < 2:
        return fmt(scale * d["mean"])
    half = scale * (d["high"] - d["low"]) / 2
    return f"{fmt(scale * d['mean'])} ± {fmt(half).rstrip(' %')}{' %' if pct else ''}"


def _table(head: Sequence[str], body: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines


def headline_tables(summary: Mapping[str, Any]) -> list[str]:
    """The headline: both regimes, every policy vs static, per split side; 4P2D apart."""
    lines: list[str] = []
    sides = sorted({side for s in summary.values() for side in s}, key=lambda x: (x != "heldout", x))
    for group, title in (("headline", "all shapes but 4P2D"), ("guard", "4P2D, do no harm")):
        for side in sides:
            rows = [
                (p, summary[p][side][group])
                for p in summary
                if side in summary[p] and group in summary[p][side]
            ]
            if not any(cell.get("n_points") for _, cell in rows):
                continue
            lines += [
                "",
                f"**{side} side, {title}** (change vs static, 95 % interval over seeds, verdict)",
                "",
            ]
            head = ["policy"]
            head += [f"{LATENCY_METRICS[m][0]} (latency)" for m in HEADLINE_LATENCY]
            head += [
                "capacity at SLO",
                "in tok/s (overload)",
                "share of bound",
                "gap to bound closed",
                "capacity / its bound",
            ]
            body = []
            for policy, cell in rows:
                cells = [policy]
                if policy == "static":
                    cells += ["-"] * (len(HEADLINE_LATENCY) + 2)
                else:
                    cells += [change_cell(cell.get(m)) for m in HEADLINE_LATENCY]
                    cells += [
                        change_cell(cell.get("capacity_at_slo")),
                        change_cell(cell.get("steady_input_tokens_per_s")),
                    ]
                cells += [mean_cell(cell.get("bound_share", {}), pct=True)]
                cells += ["-" if policy == "static" else mean_cell(cell.get("gap_closed", {}), pct=True)]
                cells += [mean_cell(cell.get("capacity_bound_share", {}), pct=True)]
                body.append(cells)
            body.sort(key=lambda c: (c[0] != "static", c[0]))
            lines += _table(head, body)
    return lines


def headline_lines(results: Mapping[str, Any]) -> list[str]:
    """Short text lines for the console: per policy and side, capacity, overload throughput, TTFT."""
    lines = []
    for policy, sides in results["summary"].items():
        if policy == "static":
            continue
        for side, groups in sides.items():
            cell = groups.get("headline") or {}
            if not cell.get("n_points"):
                continue
            lines.append(
                f"{policy} [{side}]: capacity at SLO {change_cell(cell.get('capacity_at_slo'))}; "
                f"in tok/s at overload {change_cell(cell.get('steady_input_tokens_per_s'))}; "
                f"TTFT mean {change_cell(cell.get('ttft_mean_s'))}"
            )
    return lines


def _key_label(key: tuple[Any, ...]) -> list[str]:
    return [str(key[0]), str(key[1]), str(key[2]), str(key[3])]


def latency_table(results: Mapping[str, Any]) -> list[str]:
    grouped = by_point(results["points"])
    head = ["trace", "model", "split", "shape", "load (x sat)", "policy"]
    head += [f"{t} ({u})" for t, _, u in LATENCY_METRICS.values()]
    head += ["SLO met", "TTFT mean vs static", "TTFT p99 vs static", "ITL p99 vs static"]
    body = []
    for key in sorted(k for k in grouped if k[4] == "latency"):
        pols = grouped[key]
        for policy in sorted(pols, key=lambda p: (p != "static", p)):
            rows = pols[policy]
            cells = [*_key_label(key), f"{key[5]:g}", policy]
            cells += [mean_cell(point_mean(rows, m), scale) for m, (_, scale, _) in LATENCY_METRICS.items()]
            cells.append(mean_cell(point_mean(rows, "slo_attainment"), pct=True))
            if policy == "static" or "static" not in pols:
                cells += ["-"] * 3
            else:
                cells += [
                    change_cell(_entry(point_change(rows, pols["static"], m), False))
                    for m in ("ttft_mean_s", "ttft_p99_s", "itl_p99_s")
                ]
            body.append(cells)
    return _table(head, body)


def throughput_table(results: Mapping[str, Any]) -> list[str]:
    grouped = by_point(results["points"])
    head = [
        "trace",
        "model",
        "split",
        "shape",
        "load (x sat)",
        "policy",
        "in tok/s",
        "out tok/s",
        "in tok/s vs static",
    ]
    head += ["served work (GPU-s/s)", "fluid bound (GPU-s/s)", "share of bound", "capped"]
    body = []
    for key in sorted(k for k in grouped if k[4] == "throughput"):
        pols = grouped[key]
        for policy in sorted(pols, key=lambda p: (p != "static", p)):
            rows = pols[policy]
            cells = [*_key_label(key), f"{key[5]:g}", policy]
            cells += [mean_cell(point_mean(rows, f"steady_{m}")) for m in THROUGHPUT_METRICS]
            if policy == "static" or "static" not in pols:
                cells.append("-")
            else:
                cells.append(
                    change_cell(_entry(point_change(rows, pols["static"], "steady_input_tokens_per_s"), True))
                )
            cells.append(mean_cell(point_mean(rows, "steady_work_per_s")))
            limits = [(r.get("bound") or {}) for r in rows.values()]
            bound_mean = stats.mean_interval(b.get("work_per_s", math.nan) for b in limits)
            binding = sorted({b.get("binding", "?") for b in limits})
            cells.append(f"{mean_cell(bound_mean)} ({'/'.join(binding)})")
            cells.append(mean_cell(point_mean(rows, "bound_share"), pct=True))
            cells.append(str(sum(1 for r in rows.values() if r.get("time_capped"))))
            body.append(cells)
    return _table(head, body)


def capacity_table(results: Mapping[str, Any]) -> list[str]:
    caps = capacity_by_key(results)
    limits = capacity_bound_by_key(results)
    unbracketed = unbracketed_by_key(results)
    itl: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    for c in results.get("capacity", []):
        if c.get("error") or c.get("role") == "split":
            continue
        p = c["point"]
        key = (p["trace"], p["model"], p["split"], p["shape"])
        itl.setdefault(key, {}).setdefault(p["policy"], []).append(float(c.get("itl_p99_s", math.nan)))
    for h in results.get("hindsight", []):
        key = (h["trace"], h["model"], h["split"], h["grid_shape"])
        itl.setdefault(key, {}).setdefault("hindsight-split", []).append(float(h.get("itl_p99_s", math.nan)))
    head = [
        "trace",
        "model",
        "split",
        "shape",
        "policy",
        "capacity at SLO (load)",
        "vs static",
        "ITL p99 at capacity (ms)",
    ]
    head += ["fluid capacity bound", "capacity / bound"]
    body = []
    for key in sorted(caps):
        pols = caps[key]
        bound_seeds = limits.get(key, {})
        for policy in sorted(pols, key=lambda p: (p != "static", p)):
            seeds = pols[policy]
            at_bound = unbracketed.get(key, {}).get(policy, 0)
            note = f" ({at_bound} seed(s) at the search bound)" if at_bound else ""
            cells = [*_key_label(key), policy, mean_cell(stats.mean_interval(seeds.values())) + note]
            if policy == "static" or "static" not in pols:
                cells.append("-")
            else:
                cells.append(change_cell(_entry(stats.paired_change(seeds, pols["static"]), True)))
            cells.append(mean_cell(stats.mean_interval(itl.get(key, {}).get(policy, [])), 1e3))
            cells.append(
                mean_cell(stats.mean_interval(bound_seeds.values())) if bound_seeds else "n/a (closed loop)"
            )
            shares = [seeds[s] / bound_seeds[s] for s in seeds if bound_seeds.get(s)]
            cells.append(mean_cell(stats.mean_interval(shares), pct=True) if shares else "n/a")
            body.append(cells)
    return _table(head, body)


def gpus_table(results: Mapping[str, Any]) -> list[str]:
    head = [
        "trace",
        "model",
        "split",
        "policy",
        "GPUs needed",
        "shape",
        "fluid lower bound (GPUs)",
        "simulations",
    ]
    body = []
    for g in sorted(
        results.get("gpus_needed", []),
        key=lambda g: (
            g["point"]["trace"],
            g["point"]["model"],
            g["point"]["split"],
            g["point"]["policy"] != "static",
        ),
    ):
        p = g["point"]
        if g.get("error"):
            body.append(
                [p["trace"], p["model"], p["split"], p["policy"], f"failed: {g['error']}", "", "", ""]
            )
            continue
        tp = int(g.get("tp", 1))
        gpus = "n/a" if g.get("workers") is None else f"{g['gpus']} ({g['workers']} workers x TP{tp})"
        if g.get("workers") is None:
            gpus = f"> {results['grid']['max_workers'] * tp}"
        fluid = g.get("fluid_min_workers")
        body.append(
            [
                p["trace"],
                p["model"],
                p["split"],
                p["policy"],
                gpus,
                g.get("shape") or "-",
                "n/a (closed loop)" if fluid is None else str(fluid * tp),
                str(g.get("n_simulations", "")),
            ]
        )
    return _table(head, body)


def _loads(values: Iterable[float]) -> str:
    return ", ".join(f"{x:g}" for x in values)


def tuned_values_lines(results: Mapping[str, Any]) -> list[str]:
    """The values each catalog policy ran with on each model, and the model they were tuned on (a
    model without a tuned file of its own runs the default model's; a bundle runs its own)."""
    bundles = results.get("bundles") or {}
    body = [
        [policy, model, entry.get("tuned_on") or "not tuned (defaults)", _values(entry.get("params") or {})]
        for policy, per_model in sorted((results.get("policy_params") or {}).items())
        if policy not in bundles
        for model, entry in per_model.items()
        if isinstance(entry, Mapping)
    ]
    if not body:
        return []
    head = "## Tuned values (`crossflow tune`, shipped per model in `policies/data/`)"
    return ["", head, "", *_table(["policy", "model", "tuned on", "values"], body)]


def _values(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "none"


def render_markdown(results: Mapping[str, Any], plots: Sequence[str]) -> str:
    """report.md's text from a results dict (``train.compare`` writes the same dict as results.json)."""
    grid = results["grid"]
    summary = results.get("summary") or summarise(results)
    targets = results.get("targets") or evaluate_targets(results)
    seeds = grid["seed_list"]
    lines = [f"# Crossflow compare: {results['run_id']}", "", f"Command: `{results['command']}`", ""]
    lines += [
        f"Grid: policies {', '.join(grid['policies'])}; traces "
        + ", ".join(
            f"{t} (split sides {','.join(grid['splits_run'][t])}, first {grid['subsets'][t]} "
            f"{grid['subset_units'][t]})"
            for t in grid["traces"]
        )
        + f"; models {', '.join(grid['models'])}; shapes "
        f"{', '.join(grid['shapes'])}; latency loads {_loads(grid['latency_loads'])} and throughput loads "
        f"{_loads(grid['throughput_loads'])} x static saturation; "
        f"**{len(seeds)} seed(s)** ({', '.join(map(str, seeds))}); open-loop arrivals "
        f"{grid['open_loop_arrivals']}; SLO: TTFT <= {grid['slo_ttft_s']:g} s and TPOT <= "
        f"{1e3 * grid['slo_tpot_s']:g} ms for >= {100 * results['slo_share_target']:.0f} % of requests. "
        f"Wall time {results['wall_s']:.0f} s with {results['jobs']} job(s).",
        "",
        "Intervals are 95 % t-intervals over seeds; changes vs static are paired by seed (geometric mean "
        "of per-seed ratios). A win or loss is claimed only where the interval excludes zero (`n.s.` "
        "otherwise)." + ("" if len(seeds) >= 2 else " **One seed: no interval, no claim.**"),
        "",
        "## Headline",
    ]
    lines += headline_tables(summary)
    lines += [
        "",
        "Share of bound: served best-case work in the steady window over the fluid bound at the overload "
        "points (train/bound.py); gap closed: (policy - static) / (bound - static) of the same. "
        "Capacity at SLO leaves out a seed at a point where the policy's or static's search hit the load "
        "bound (its load bounds the capacity, it does not measure it; the capacity table lists them).",
        "",
        "## Static saturation (the load points' anchor)",
        "",
    ]
    head = ["trace", "model", "split", "shape", "capacity per seed", "geo-mean", "rule"]
    body = []
    for s in results["saturation"]:
        per_seed = ", ".join(f"{v:.4g}" for _, v in sorted(s["loads"].items()))
        rule = f">= {100 * results['slo_share_target']:.0f} %"
        if s["relative"]:
            idle = [v for v in s["idle_shares"].values() if v is not None]
            rule = f"relative: >= 90 % of the idle share ({', '.join(f'{100 * v:.1f} %' for v in idle)})"
        if not s["usable"]:
            rule = "none: static misses the SLO at every load (skipped)" + (
                f"; {s['errors']}" if s["errors"] else ""
            )
        note = "" if s["bracketed"] else " (not bracketed: search bound)"
        body.append(
            [s["trace"], s["model"], s["split"], s["shape"], per_seed + note, f"{s['load']:.4g}", rule]
        )
    lines += _table(head, body)
    lines += ["", "## Capacity regime: capacity at SLO", ""]
    lines += capacity_table(results)
    lines += ["", "## Capacity regime: steady-window throughput past saturation", ""]
    lines += throughput_table(results)
    lines += ["", "## Latency regime", ""]
    lines += latency_table(results)
    lines += ["", "## GPUs needed at the recorded rate (load 1) within SLO", ""]
    lines += gpus_table(results)
    if results.get("hindsight"):
        lines += ["", "## hindsight-split: the split chosen per seed (highest static capacity at SLO)", ""]
        merged: dict[tuple[Any, ...], list[str]] = {}  # grid shapes of the same GPUs share a choice
        for h in results["hindsight"]:
            caps = ", ".join(f"{s} {v:.3g}" for s, v in sorted(h["capacities"].items()))
            key = (h["trace"], h["model"], h["split"], str(h["seed"]), h["shape"], caps)
            merged.setdefault(key, []).append(h["grid_shape"])
        body = [[*k[:3], ", ".join(shapes), *k[3:]] for k, shapes in merged.items()]
        lines += _table(["trace", "model", "split", "grid shapes", "seed", "chosen", "capacities"], body)
    lines += tuned_values_lines(results)
    lines += [
        "",
        "## Targets (computed, not asserted)",
        "",
        "Defined on the reviewer's grid (`--full`)."
        + ("" if grid.get("full") else " This run is a smaller grid: read them as indicative."),
        "",
    ]
    for policy, rows in targets.items():
        lines += [f"**{policy}**", ""]
        lines += target_lines(results, policy, rows)
        lines.append("")
    lines += ["## Top decision reasons (numbers blanked; first seed, last 10,000 records per simulation)", ""]
    for policy in sorted({r["policy"] for r in results["points"]} - {"static", "hindsight-split"}):
        reasons = top_reasons(results["points"], policy)
        lines += [f"**{policy}**", ""]
        lines += [f"- {n:,} x {reason}" for reason, n in reasons] or ["- no decision records"]
        lines.append("")
    failed = results.get("failed") or []
    if failed:
        lines += ["## Failed jobs", ""]
        lines += [f"- {f.get('label') or f.get('name')}: {f.get('error')}" for f in failed]
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{name}]({name})" for name in plots]
        lines.append("")
    return "\n".join(lines)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_report(results: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """Write report.md and the PNGs into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = write_plots(results, out)
    report = out / "report.md"
    _atomic_write_text(report, render_markdown(results, [p.name for p in pngs]) + "\n")
    return [report, *pngs]


# ---- plots ------------------------------------------------------------------------------------------
def _slug(*parts: str) -> str:
    return "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", p) for p in parts)


def _save(fig: Any, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)
    return path


def _errorbar(ax: Any, xs: Sequence[float], its: Sequence[stats.Interval], scale: float, **kw: Any) -> None:
    ys = [scale * it.mean for it in its]
    err = [
        [scale * (it.mean - it.low) if it.n >= 2 else 0.0 for it in its],
        [scale * (it.high - it.mean) if it.n >= 2 else 0.0 for it in its],
    ]
    ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, **kw)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _policy_lines(
    ax: Any, grouped: Mapping[tuple[Any, ...], Mapping[str, Any]], metric: str, scale: float
) -> None:
    """One error-bar line per policy: ``metric``'s seed mean and interval against the load fraction."""
    policies = sorted({p for v in grouped.values() for p in v}, key=lambda p: (p != "static", p))
    for policy in policies:
        keys = sorted(k for k, v in grouped.items() if policy in v)
        _errorbar(
            ax,
            [k[5] for k in keys],
            [point_mean(grouped[k][policy], metric) for k in keys],
            scale,
            label=policy,
            color="black" if policy == "static" else None,
        )
    ax.grid(alpha=0.3)


def plot_latency_vs_load(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """TTFT (mean, p99) and ITL (mean, p99) against load, one line per policy, 95 % intervals as bars."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    grouped = by_point([r for r in rows if r["regime"] == "latency"])
    for ax, metric in zip(axes.flat, HEADLINE_LATENCY, strict=True):
        name, scale, unit = LATENCY_METRICS[metric]
        _policy_lines(ax, grouped, metric, scale)
        ax.set_ylabel(f"{name} ({unit})")
    for ax in axes[1]:
        ax.set_xlabel("load (x static saturation)")
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{title}: latency regime (95 % intervals over seeds)")
    fig.tight_layout()
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_capacity(
    rows: Sequence[Mapping[str, Any]], results: Mapping[str, Any], path: Path, title: str
) -> Path | None:
    """Left: capacity at SLO per policy (bars with 95 % intervals) and its fluid bound; right: steady
    input throughput and the share of the fluid bound at the overload points."""
    caps = capacity_by_key(results)
    key = (rows[0]["trace"], rows[0]["model"], rows[0]["split"], rows[0]["shape"])
    grouped = by_point([r for r in rows if r["regime"] == "throughput"])
    if key not in caps and not grouped:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    pols = caps.get(key, {})
    names = sorted(pols, key=lambda p: (p != "static", p))
    its = [stats.mean_interval(pols[p].values()) for p in names]
    axes[0].bar(
        names,
        [it.mean for it in its],
        yerr=[
            [it.mean - it.low if it.n >= 2 else 0 for it in its],
            [it.high - it.mean if it.n >= 2 else 0 for it in its],
        ],
        capsize=4,
        color=["black" if p == "static" else "tab:blue" for p in names],
    )
    limit = capacity_bound_by_key(results).get(key)
    if limit:
        axes[0].axhline(
            stats.mean_interval(limit.values()).mean, color="grey", linestyle="--", label="fluid bound"
        )
        axes[0].legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("capacity at SLO (load factor, log)")
    axes[0].tick_params(axis="x", rotation=20)
    _load_panels(
        axes[1:],
        grouped,
        [
            ("steady_input_tokens_per_s", "steady in tok/s", 1.0),
            ("bound_share", "share of fluid bound (%)", 100.0),
        ],
    )
    axes[1].legend(fontsize=8)
    return _finish(plt, fig, path, f"{title}: capacity regime (95 % intervals over seeds)")


def _load_panels(
    axes: Any, grouped: Any, panels: Sequence[tuple[str, str, float]], saturation_line: bool = False
) -> None:
    """One axis per (metric, label, scale) against load, one line per policy; the last panel is the
    share of the fluid bound (its 100 % line drawn)."""
    for ax, (metric, label, scale) in zip(axes, panels, strict=True):
        _policy_lines(ax, grouped, metric, scale)
        if saturation_line:
            ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("load (x static saturation)")
        ax.set_ylabel(label)
    axes[-1].axhline(100.0, color="grey", linestyle="--")


def _finish(plt: Any, fig: Any, path: Path, title: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_throughput_vs_load(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Served input and output tokens/s over the steady window against offered load, both regimes on
    one axis (x static saturation), one line per policy with 95 % intervals; the bound's share right."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [
        ("steady_input_tokens_per_s", "steady input tok/s", 1.0),
        ("steady_output_tokens_per_s", "steady output tok/s", 1.0),
        ("bound_share", "share of fluid bound (%)", 100.0),
    ]
    _load_panels(axes, by_point(rows), panels, saturation_line=True)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    title = f"{title}: throughput against load (dotted: static saturation; 95 % intervals over seeds)"
    return _finish(plt, fig, path, title)


def plot_borrowed_timeline(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path | None:
    """Per lending policy at its highest load (first seed): borrowed prefill tokens/s per minute against
    the offered uncached-input : output ratio. None when no row has a timeline with borrowing columns."""
    chosen: dict[str, Mapping[str, Any]] = {}
    for r in rows:
        tl = r.get("timeline") or {}
        if r["policy"] in ("static", "hindsight-split") or "borrowed_prefill_tokens" not in tl:
            continue
        best = chosen.get(r["policy"])
        if best is None or r["load_fraction"] > best["load_fraction"]:
            chosen[r["policy"]] = r
    if not chosen:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(chosen), 1, figsize=(10, 3.2 * len(chosen)), squeeze=False)
    for ax, (policy, r) in zip(axes[:, 0], sorted(chosen.items()), strict=True):
        tl = r["timeline"]
        borrowed_per_s = [t / 60.0 for t in tl["borrowed_prefill_tokens"]]
        # Each row covers minute [m, m + 1): draw both series as steps starting at m.
        ax.fill_between(tl["minute"], borrowed_per_s, step="post", alpha=0.4, color="tab:orange")
        ax.set_ylabel("borrowed prefill (tok/s)", color="tab:orange")
        ax.set_title(f"{policy} at load {r['load_fraction']:g} x saturation, seed {r['seed']}", fontsize=10)
        ax2 = ax.twinx()
        ax2.step(tl["minute"], tl["uncached_to_output"], where="post", color="tab:blue", linewidth=0.8)
        ax2.set_ylabel("offered uncached input : output", color="tab:blue")
        ax2.set_yscale("log")
        ax.set_xlabel("minute of the replay")
    fig.suptitle(title)
    fig.tight_layout()
    path = _save(fig, path)
    plt.close(fig)
    return path


def write_plots(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Per (trace, model, split, shape): latency-vs-load, throughput-vs-load, capacity-regime and
    borrowing-timeline PNGs."""
    groups: dict[tuple[str, str, str, str], list[Mapping[str, Any]]] = {}
    for r in _ok(results["points"]):
        groups.setdefault((r["trace"], r["model"], r["split"], r["shape"]), []).append(r)
    written: list[Path] = []
    for (trace, model, split, shape), rows in sorted(groups.items()):
        title = f"{trace} [{split}] / {model} / {shape}"
        slug = _slug(trace, model, split, shape)
        written.append(plot_latency_vs_load(rows, out_dir / f"latency_{slug}.png", title))
        written.append(plot_throughput_vs_load(rows, out_dir / f"throughput_{slug}.png", title))
        for made in (
            plot_capacity(rows, results, out_dir / f"capacity_{slug}.png", title),
            plot_borrowed_timeline(rows, out_dir / f"timeline_{slug}.png", title),
        ):
            if made is not None:
                written.append(made)
    return written
