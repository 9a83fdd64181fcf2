"""What a `crossflow compare` run means: oracle choice, gains over static, targets, report.md and plots.

Pure functions over the plain dicts ``train.compare`` collects (one per simulated point, see
``train.compare.PointResult``), so every figure can be checked by hand on a tiny fixture. Writing
(``write_report``) is the only side effect: ``report.md`` and PNGs, each written to a temp file and
renamed, so a crashed run never leaves half a report.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from envs.cluster_config import parse_shape

ITL_TOLERANCE = 0.05
"""The oracle may only pick a split whose mean ITL is within this share of the original split's."""

MIN_ORACLE_GAIN = 1e-3
"""Below this relative gain the oracle equals static and a share of its gain is undefined (None)."""

GUARD_SHAPE = (4, 2)
"""The prefill-heavy extreme (4P2D): lending cannot help much there, the target is only 'do no harm'."""

TARGETS = {"input_gain": 0.174, "output_gain": 0.162, "itl_worse": 0.05, "guard_worse": 0.01}
"""The issue's targets (the paper's geo-mean gains, the ITL allowance, the 4P2D allowance)."""

# Metrics in the table and the per-point guard check: name -> (column title, higher is better, scale, unit)
TABLE_METRICS: dict[str, tuple[str, bool, float, str]] = {
    "input_tokens_per_s": ("in tok/s", True, 1.0, ""),
    "output_tokens_per_s": ("out tok/s", True, 1.0, ""),
    "ttft_mean_s": ("TTFT mean", False, 1.0, " s"),
    "ttft_p99_s": ("TTFT p99", False, 1.0, " s"),
    "itl_mean_s": ("ITL mean", False, 1e3, " ms"),
    "itl_p99_s": ("ITL p99", False, 1e3, " ms"),
}


def point_key(point: Mapping[str, Any]) -> tuple[str, str, str, float]:
    """(trace, model, shape, absolute load): the points whose policies are compared with each other."""
    return (point["trace"], point["model"], point["shape"], round(float(point["load"]), 12))


def is_guard_shape(shape: str) -> bool:
    return parse_shape(shape) == GUARD_SHAPE


def choose_oracle(
    original: Mapping[str, float], candidates: Mapping[str, Mapping[str, float]], original_shape: str
) -> str:
    """Best static split in hindsight: the shape among ``candidates`` (shape -> metrics, all static, same
    GPU count, same arrivals; the original included) with the highest input throughput whose mean ITL is
    at most ``1 + ITL_TOLERANCE`` times the original's and which finishes at least as many requests.

    Ties, and gains below ``MIN_ORACLE_GAIN``, keep the original shape. Candidates with a non-finite
    throughput or ITL are skipped.
    """
    original_tps = float(original["input_tokens_per_s"])
    best_shape, best_tps = original_shape, original_tps
    itl_cap_s = (1.0 + ITL_TOLERANCE) * float(original["itl_mean_s"])
    for shape, m in sorted(candidates.items()):
        tps, itl_s = float(m["input_tokens_per_s"]), float(m["itl_mean_s"])
        if not (math.isfinite(tps) and math.isfinite(itl_s)) or itl_s > itl_cap_s:
            continue
        if int(m["n_finished"]) < int(original["n_finished"]):
            continue
        if tps > best_tps:
            best_shape, best_tps = shape, tps
    # A re-roling that gains (almost) nothing is no re-roling: keep the original split.
    return best_shape if best_tps > (1.0 + MIN_ORACLE_GAIN) * original_tps else original_shape


def oracle_share(policy_value: float, static_value: float, oracle_value: float) -> float | None:
    """``(policy - static) / (oracle - static)``; None when the oracle gains (almost) nothing over static."""
    gain = oracle_value - static_value
    if not all(map(math.isfinite, (policy_value, static_value, oracle_value))):
        return None
    if gain <= MIN_ORACLE_GAIN * abs(static_value):
        return None
    return (policy_value - static_value) / gain


def geo_mean_change(ratios: Iterable[float]) -> float | None:
    """Geometric mean of ``ratios`` minus one (``+0.174`` = 17.4 % higher); None if none are usable.

    Non-finite and non-positive ratios are skipped (a metric that is zero or NaN at a point has no
    meaningful ratio)."""
    logs = [math.log(r) for r in ratios if math.isfinite(r) and r > 0]
    if not logs:
        return None
    return math.exp(sum(logs) / len(logs)) - 1.0


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def paired_points(points: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(policy point, static point at the same key) for every non-static grid point with metrics."""
    static = {
        point_key(p["point"]): p for p in points if p["point"]["policy"] == "static" and p.get("metrics")
    }
    pairs = []
    for p in points:
        if p["point"]["policy"] == "static" or not p.get("metrics"):
            continue
        s = static.get(point_key(p["point"]))
        if s is not None:
            pairs.append((p, s))
    return pairs


def summarise(points: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per non-static policy: geo-mean change over static of every table metric (all shapes, and the
    headline shapes = all but 4P2D), the mean share of oracle gain, and how many points entered."""
    by_policy: dict[str, list[tuple[Mapping[str, Any], Mapping[str, Any]]]] = {}
    for p, s in paired_points(points):
        by_policy.setdefault(p["point"]["policy"], []).append((p, s))
    out: dict[str, dict[str, Any]] = {}
    for policy, pairs in sorted(by_policy.items()):
        headline = [(p, s) for p, s in pairs if not is_guard_shape(p["point"]["shape"])]
        row: dict[str, Any] = {"n_points": len(pairs), "n_headline_points": len(headline)}
        for metric in TABLE_METRICS:
            row[f"{metric}_change_all"] = geo_mean_change(
                _ratio(p["metrics"][metric], s["metrics"][metric]) for p, s in pairs
            )
            row[f"{metric}_change"] = geo_mean_change(
                _ratio(p["metrics"][metric], s["metrics"][metric]) for p, s in headline
            )
        shares = [p["oracle_share"] for p, _ in pairs if p.get("oracle_share") is not None]
        row["oracle_share_mean"] = sum(shares) / len(shares) if shares else None
        row["oracle_share_points"] = len(shares)
        out[policy] = row
    return out


def _target(name: str, ok: bool | None, measured: str) -> dict[str, Any]:
    return {
        "target": name,
        "status": "n/a" if ok is None else ("PASS" if ok else "MISS"),
        "measured": measured,
    }


def _worst(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]], metric: str) -> tuple[float, str]:
    """Largest relative worsening of ``metric`` over static and where it happened (NaN if no pairs)."""
    higher_better = TABLE_METRICS[metric][1]
    worst, where = -math.inf, ""
    for p, s in pairs:
        r = _ratio(p["metrics"][metric], s["metrics"][metric])
        if not math.isfinite(r):
            continue
        worse = (1.0 - r) if higher_better else (r - 1.0)
        if worse > worst:
            pt = p["point"]
            where = f"{pt['trace']}/{pt['model']}/{pt['shape']}/load {p['load_fraction']:g}x sat"
            worst = worse
    return (worst if math.isfinite(worst) else math.nan), where


def evaluate_targets(points: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The issue's targets per non-static policy, each PASS / MISS (n/a without applicable points)."""
    summary = summarise(points)
    pairs_by_policy: dict[str, list[tuple[Mapping[str, Any], Mapping[str, Any]]]] = {}
    for p, s in paired_points(points):
        pairs_by_policy.setdefault(p["point"]["policy"], []).append((p, s))
    out: dict[str, list[dict[str, Any]]] = {}
    for policy, pairs in sorted(pairs_by_policy.items()):
        head = [(p, s) for p, s in pairs if not is_guard_shape(p["point"]["shape"])]
        guard = [(p, s) for p, s in pairs if is_guard_shape(p["point"]["shape"])]
        row = summary[policy]
        results = []
        for metric, key in (("input_tokens_per_s", "input_gain"), ("output_tokens_per_s", "output_gain")):
            g = row[f"{metric}_change"]
            results.append(
                _target(
                    f"{TABLE_METRICS[metric][0]} geo-mean gain >= +{100 * TARGETS[key]:.1f} %",
                    None if g is None else g >= TARGETS[key],
                    "no points" if g is None else f"{100 * g:+.1f} % over {len(head)} point(s)",
                )
            )
        for metric in ("ttft_mean_s", "ttft_p99_s"):
            worst, where = _worst(head, metric)
            ok = None if not head or math.isnan(worst) else worst < 0.0
            results.append(
                _target(
                    f"{TABLE_METRICS[metric][0]} lower than static at every point",
                    ok,
                    "no points" if ok is None else f"worst change {100 * worst:+.1f} % at {where}",
                )
            )
        worst, where = _worst(head, "itl_mean_s")
        ok = None if not head or math.isnan(worst) else worst <= TARGETS["itl_worse"]
        results.append(
            _target(
                f"ITL mean at most +{100 * TARGETS['itl_worse']:.0f} % at every point",
                ok,
                "no points" if ok is None else f"worst {100 * worst:+.1f} % at {where}",
            )
        )
        worst_all, where_all, ok_guard = -math.inf, "", None
        for metric in TABLE_METRICS:
            worst, where = _worst(guard, metric)
            if not math.isnan(worst) and worst > worst_all:
                worst_all, where_all = worst, f"{TABLE_METRICS[metric][0]} at {where}"
        if guard and math.isfinite(worst_all):
            ok_guard = worst_all <= TARGETS["guard_worse"]
        results.append(
            _target(
                f"4P2D: no metric worse than static by > {100 * TARGETS['guard_worse']:.0f} %",
                ok_guard,
                "no 4P2D points" if ok_guard is None else f"worst {100 * worst_all:+.1f} % ({where_all})",
            )
        )
        out[policy] = results
    return out


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def normalise_reason(kind: str, reason: str, path: str | None = None) -> str:
    """A decision record's reason with its numbers blanked, so equal reasons group together."""
    label = f"{kind}/{path}" if path else kind
    return f"{label}: {_NUMBER.sub('#', reason)}"


def top_reasons(points: Sequence[Mapping[str, Any]], policy: str, k: int = 5) -> list[tuple[str, int]]:
    """The ``k`` most frequent normalised decision reasons of ``policy`` over all its grid points."""
    total: Counter[str] = Counter()
    for p in points:
        if p["point"]["policy"] == policy:
            total.update(p.get("reasons") or {})
    return total.most_common(k)


# ---- formatting --------------------------------------------------------------------------------------
def _fmt(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    v = float(value) * scale
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f} %"


def points_table(points: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown table: one row per grid point, sorted by trace, model, shape, load, policy."""
    head = ["trace", "model", "shape", "load (x sat)", "policy"]
    head += [f"{title}{unit and ' (' + unit.strip() + ')'}" for title, _, _, unit in TABLE_METRICS.values()]
    head += ["finished", "borrowed", "lease util", "oracle share", "oracle split"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(
        points, key=lambda p: (*point_key(p["point"])[:3], p["load_fraction"], p["point"]["policy"])
    )
    for p in order:
        pt = p["point"]
        cells = [pt["trace"], pt["model"], pt["shape"], f"{p['load_fraction']:g}", pt["policy"]]
        m = p.get("metrics")
        if not m:
            cells += [f"failed: {p.get('error', '?')}"] + [""] * (len(head) - len(cells) - 1)
        else:
            cells += [_fmt(m[k], scale) for k, (_, _, scale, _) in TABLE_METRICS.items()]
            cap = " (time cap)" if p.get("time_capped") else ""
            cells.append(f"{m['n_finished']:,}/{m['n_requests']:,}{cap}")
            cells += [f"{100 * m['borrowed_share']:.1f} %", f"{100 * m['lease_utilisation']:.1f} %"]
            share = p.get("oracle_share")
            cells += ["n/a" if share is None else f"{100 * share:.0f} %", p.get("oracle_shape") or "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def render_markdown(results: Mapping[str, Any], plots: Sequence[str]) -> str:
    """report.md's text from a results dict (``train.compare`` writes the same dict as results.json)."""
    points = results["points"]
    summary = summarise(points)
    targets = evaluate_targets(points)
    grid = results["grid"]
    lines = [f"# Crossflow compare: {results['run_id']}", "", f"Command: `{results['command']}`", ""]
    lines += [
        f"Grid: policies {', '.join(grid['policies'])}; traces {', '.join(grid['traces'])}; "
        f"models {', '.join(grid['models'])}; shapes {', '.join(grid['shapes'])}; "
        f"loads {', '.join(f'{x:g}' for x in grid['load_fractions'])} x static saturation; "
        f"subsets {grid['subsets']}; seed {grid['seed']}. "
        f"Wall time {results['wall_s']:.0f} s with {results['jobs']} job(s).",
        "",
        "## Static saturation (load matching)",
        "",
        f"Saturation = highest load factor at which static keeps >= "
        f"{100 * results['saturation_threshold']:.0f} % of requests within SLO (unfinished count as misses); "
        "where static misses that even when idle, >= that share of its idle SLO share (rule: relative).",
        "",
        "| trace | model | shape | saturation load | rule | probes |",
        "|---|---|---|---|---|---|",
    ]
    for s in results["saturation"]:
        note = "" if s["bracketed"] else " (not bracketed: search bound)"
        rule = f">= {100 * s['threshold']:.0f} %"
        if s["relative"]:
            rule += f" (relative: idle share {100 * s['idle_share']:.1f} %)"
        load = (
            f"{s['load']:.4g}{note}" if s["usable"] else "none: static misses the SLO at every load, skipped"
        )
        lines.append(f"| {s['trace']} | {s['model']} | {s['shape']} | {load} | {rule} | {len(s['probes'])} |")
    lines += ["", "## Every point", ""]
    lines += points_table(points)
    lines += ["", "## Geo-mean change over static (matched points, all shapes but 4P2D)", ""]
    head = ["policy", "points", *[t for t, _, _, _ in TABLE_METRICS.values()], "mean oracle share"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, row in summary.items():
        cells = [policy, str(row["n_headline_points"])]
        cells += [_pct(row[f"{metric}_change"]) for metric in TABLE_METRICS]
        share = row["oracle_share_mean"]
        cells.append("n/a" if share is None else f"{100 * share:.0f} % ({row['oracle_share_points']} pts)")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Targets (issue 4; computed, not asserted)",
        "",
        "Defined on the paper-style grid (`--full`)."
        + ("" if grid.get("full") else " This run is a smaller grid: read them as indicative."),
        "",
    ]
    for policy, rows in targets.items():
        lines += [f"**{policy}**", ""]
        lines += [f"- {r['status']}: {r['target']} ({r['measured']})" for r in rows]
        lines.append("")
    lines += ["## Top decision reasons (numbers blanked; last 10,000 records per simulation)", ""]
    for policy in sorted({p["point"]["policy"] for p in points} - {"static"}):
        reasons = top_reasons(points, policy)
        lines += [f"**{policy}**", ""]
        lines += [f"- {n:,} x {reason}" for reason, n in reasons] or ["- no decision records"]
        lines.append("")
    failed = [p for p in points if not p.get("metrics")] + list(results.get("failed_oracle", []))
    if failed:
        lines += ["## Failed simulations", ""]
        lines += [f"- {p['label']}: {p.get('error')}" for p in failed]
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{name}]({name})" for name in plots]
        lines.append("")
    return "\n".join(lines)


def write_report(results: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """Write report.md and the PNGs into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = write_plots(results["points"], out)
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


def plot_latency_vs_load(points: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """TTFT (mean, p99) and ITL (mean, p99) against load, one line per policy, plus the oracle split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    panels = [
        ("ttft_mean_s", "TTFT mean (s)"),
        ("ttft_p99_s", "TTFT p99 (s)"),
        ("itl_mean_s", "ITL mean (ms)"),
        ("itl_p99_s", "ITL p99 (ms)"),
    ]
    policies = sorted({p["point"]["policy"] for p in points})
    for ax, (metric, ylabel) in zip(axes.flat, panels, strict=True):
        scale = TABLE_METRICS[metric][2]
        for policy in policies:
            rows = sorted(
                (p for p in points if p["point"]["policy"] == policy and p.get("metrics")),
                key=lambda p: p["load_fraction"],
            )
            ax.plot(
                [p["load_fraction"] for p in rows],
                [scale * p["metrics"][metric] for p in rows],
                marker="o",
                label=policy,
                color="black" if policy == "static" else None,
            )
        oracle = sorted(
            (p for p in points if p["point"]["policy"] == "static" and p.get("oracle_metrics")),
            key=lambda p: p["load_fraction"],
        )
        if oracle:
            ax.plot(
                [p["load_fraction"] for p in oracle],
                [scale * p["oracle_metrics"][metric] for p in oracle],
                linestyle="--",
                color="grey",
                marker="x",
                label="oracle split",
            )
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("load (x static saturation)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_borrowed_timeline(points: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path | None:
    """Per lending policy at its highest load: borrowed prefill tokens/s per minute against the offered
    uncached-input : output ratio. None when no point has a timeline with borrowing columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[str, Mapping[str, Any]] = {}
    for p in points:
        tl = p.get("timeline") or {}
        if p["point"]["policy"] == "static" or "borrowed_prefill_tokens" not in tl:
            continue
        best = rows.get(p["point"]["policy"])
        if best is None or p["load_fraction"] > best["load_fraction"]:
            rows[p["point"]["policy"]] = p
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 3.2 * len(rows)), squeeze=False)
    for ax, (policy, p) in zip(axes[:, 0], sorted(rows.items()), strict=True):
        tl = p["timeline"]
        borrowed_per_s = [t / 60.0 for t in tl["borrowed_prefill_tokens"]]
        # Each row covers minute [m, m + 1): draw both series as steps starting at m.
        ax.fill_between(tl["minute"], borrowed_per_s, step="post", alpha=0.4, color="tab:orange")
        ax.set_ylabel("borrowed prefill (tok/s)", color="tab:orange")
        ax.set_title(f"{policy} at load {p['load_fraction']:g} x saturation", fontsize=10)
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


def write_plots(points: Sequence[Mapping[str, Any]], out_dir: Path) -> list[Path]:
    """One latency-vs-load PNG and one borrowed-capacity timeline PNG per (trace, model, shape)."""
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for p in points:
        pt = p["point"]
        groups.setdefault((pt["trace"], pt["model"], pt["shape"]), []).append(p)
    written: list[Path] = []
    for (trace, model, shape), group in sorted(groups.items()):
        title = f"{trace} / {model} / {shape}"
        written.append(
            plot_latency_vs_load(group, out_dir / f"latency_{_slug(trace, model, shape)}.png", title)
        )
        tl = plot_borrowed_timeline(group, out_dir / f"timeline_{_slug(trace, model, shape)}.png", title)
        if tl is not None:
            written.append(tl)
    return written
