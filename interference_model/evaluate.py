"""Evaluation report: the model and its baselines on held-out labelled states, with plots.

:func:`evaluate` returns a JSON-ready dict (per predictor: MAPE, unsafe share, ...; the same at the
reference model's unsafe share, so every predictor is compared at equal safety; MAPE and unsafe
share by region of batch size x mean context) and, given ``plot_dir``, writes ``calibration.png``
(predicted vs true) and ``error_by_region.png`` (MAPE heat map per predictor).
:func:`decision_latency_us` times one hot-path decision; :func:`check_targets` compares a report
with :class:`Targets`.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from interference_model.labels import LABEL
from interference_model.metrics import accuracy_metrics, metrics_at_unsafe_share
from interference_model.schema import FEATURES

BATCH_EDGES: tuple[float, ...] = (0, 4, 16, 64, 256, np.inf)
CONTEXT_EDGES: tuple[float, ...] = (0, 1024, 4096, 16384, np.inf)


class Predicts(Protocol):
    def predict(self, X: np.ndarray) -> np.ndarray: ...


def _bin_label(edges: tuple[float, ...], k: int, unit: str) -> str:
    """Short tick label of bin ``k``: ``4-16``, ``256+`` (``unit="k"`` writes thousands: ``1k-4k``)."""

    def fmt(x: float) -> str:
        return f"{x / 1024:g}k" if unit == "k" and x >= 1024 else f"{x:g}"

    lo, hi = edges[k], edges[k + 1]
    return f"{fmt(lo)}+" if not math.isfinite(hi) else f"{fmt(lo)}-{fmt(hi)}"


def _region_labels(labels: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    batch = pd.cut(labels["decode_batch_size"], BATCH_EDGES, right=False)
    ctx = pd.cut(labels["context_tokens_mean"], CONTEXT_EDGES, right=False)
    return batch.astype(str), ctx.astype(str)


def region_metrics(
    labels: pd.DataFrame, y_pred: np.ndarray, unsafe_margin: float = 0.05
) -> list[dict[str, Any]]:
    """Metrics per (batch-size bin, mean-context bin) region with at least one state."""
    batch, ctx = _region_labels(labels)
    y = labels[LABEL].to_numpy(dtype=float)
    out = []
    for (b, c), idx in pd.Series(np.arange(len(y))).groupby([batch, ctx]).groups.items():
        rows = np.asarray(list(idx))
        out.append(
            {"batch_bin": b, "context_bin": c, **accuracy_metrics(y[rows], y_pred[rows], unsafe_margin)}
        )
    return out


def _block(
    y: np.ndarray, preds: dict[str, np.ndarray], matched_to: str | None, margin: float
) -> dict[str, Any]:
    metrics = {name: accuracy_metrics(y, p, margin) for name, p in preds.items()}
    out: dict[str, Any] = {"metrics": metrics}
    if matched_to in preds:
        share = metrics[matched_to]["unsafe_share"]
        out["at_equal_unsafe"] = {
            name: metrics_at_unsafe_share(y, p, share, margin)
            for name, p in preds.items()
            if name != matched_to
        }
    return out


def evaluate(
    labels: pd.DataFrame,
    predictors: dict[str, Predicts],
    *,
    unsafe_margin: float = 0.05,
    plot_dir: str | os.PathLike[str] | None = None,
    reference: np.ndarray | None = None,
    matched_to: str | None = "lightgbm",
) -> dict[str, Any]:
    """Evaluate every predictor on ``labels`` (one row per held-out state, from ``derive_labels``).

    ``metrics``: per predictor against the labels. ``at_equal_unsafe``: every other predictor divided
    by the one constant that brings its unsafe share down (or up) to ``matched_to``'s on these very
    states (chosen on the evaluation set itself, which favours the baselines). ``reference``, if
    given, is a second truth (e.g. the noise-free labels of the same simulated states); the same two
    blocks against it are under ``vs_reference`` and ``vs_reference_at_equal_unsafe``.
    """
    X = labels[list(FEATURES)].to_numpy(dtype=float)
    y = labels[LABEL].to_numpy(dtype=float)
    preds = {name: np.asarray(p.predict(X), dtype=float) for name, p in predictors.items()}
    block = _block(y, preds, matched_to, unsafe_margin)
    report: dict[str, Any] = {
        "n_states": len(y),
        "unsafe_margin": unsafe_margin,
        "metrics": block["metrics"],
        "at_equal_unsafe": block.get("at_equal_unsafe", {}),
        "by_region": {name: region_metrics(labels, p, unsafe_margin) for name, p in preds.items()},
    }
    if reference is not None:
        ref = _block(np.asarray(reference, dtype=float), preds, matched_to, unsafe_margin)
        report["vs_reference"] = ref["metrics"]
        report["vs_reference_at_equal_unsafe"] = ref.get("at_equal_unsafe", {})
    if plot_dir is not None:
        report["plots"] = write_plots(Path(plot_dir), labels, preds)
    return report


def write_plots(plot_dir: Path, labels: pd.DataFrame, preds: dict[str, np.ndarray]) -> list[str]:
    """``calibration.png`` and ``error_by_region.png`` under ``plot_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    y = labels[LABEL].to_numpy(dtype=float)
    fig, ax = plt.subplots(figsize=(6, 6))
    top = float(max(y.max(), *(p.max() for p in preds.values()))) * 1.05
    for name, p in preds.items():
        ax.scatter(y, p, s=4, alpha=0.5, label=name)
    ax.plot([0, top], [0, top], "k-", lw=1, label="ideal")
    ax.plot([0, top], [0, 1.05 * top], "r--", lw=1, label="unsafe above (+5%)")
    ax.set(
        xlabel="true safe prefill tokens/s",
        ylabel="predicted",
        title="Calibration on held-out states",
        xlim=(0, top),
        ylim=(0, top),
    )
    ax.legend(fontsize=7)
    calibration = plot_dir / "calibration.png"
    fig.savefig(calibration, dpi=110, bbox_inches="tight")
    plt.close(fig)

    batch, ctx = _region_labels(labels)
    b_order = [str(x) for x in pd.cut(pd.Series(BATCH_EDGES[:-1]), BATCH_EDGES, right=False).cat.categories]
    c_order = [
        str(x) for x in pd.cut(pd.Series(CONTEXT_EDGES[:-1]), CONTEXT_EDGES, right=False).cat.categories
    ]
    grids = {}
    for name, p in preds.items():
        ape = pd.Series(np.where(y > 0, np.abs(p - y) / np.where(y > 0, y, 1), np.nan))
        grid = ape.groupby([batch, ctx]).mean().unstack().reindex(index=b_order, columns=c_order)
        grids[name] = grid.to_numpy(dtype=float) * 100
    finite = np.concatenate([g[np.isfinite(g)] for g in grids.values()] or [np.zeros(0)])
    # One logarithmic colour scale for every panel: MAPE spans 1 % to hundreds of percent.
    norm = matplotlib.colors.LogNorm(
        vmin=max(0.1, float(finite.min()) if len(finite) else 0.1),
        vmax=max(1.0, float(finite.max()) if len(finite) else 1.0),
    )
    fig, axes = plt.subplots(
        1, len(preds), figsize=(3.6 * len(preds) + 1.2, 3.8), squeeze=False, constrained_layout=True
    )
    im = None
    for ax, (name, grid) in zip(axes[0], grids.items(), strict=True):
        im = ax.imshow(grid, cmap="viridis", norm=norm, aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            if np.isfinite(value):
                shade = "black" if norm(value) > 0.6 else "white"  # readable on viridis' light end
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6, color=shade)
        ax.set_xticks(range(len(c_order)), [_bin_label(CONTEXT_EDGES, k, "k") for k in range(len(c_order))])
        ax.set_yticks(range(len(b_order)), [_bin_label(BATCH_EDGES, k, "") for k in range(len(b_order))])
        ax.tick_params(labelsize=7)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("mean context tokens", fontsize=7)
    axes[0][0].set_ylabel("decode batch", fontsize=7)
    if im is not None:
        fig.colorbar(im, ax=list(axes[0]), label="MAPE % (one scale for all panels)", shrink=0.9)
    error_by_region = plot_dir / "error_by_region.png"
    fig.savefig(error_by_region, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [str(calibration), str(error_by_region)]


@dataclass(frozen=True, slots=True)
class Targets:
    """What the interference model must reach on held-out profiles (drawn with another seed)."""

    mape: float = 0.05
    unsafe_share: float = 0.02
    """Share of states predicted more than the unsafe margin (5%) above the truth."""
    single_decision_us: float = 10.0
    """One ``safe_prefill_tokens_per_s`` call of the fast predictor, in process CPU time (wall-clock
    time on a loaded machine also counts waiting for a core; both are reported)."""
    datasheet_mape_ratio: float = 3.0
    """The datasheet roofline's MAPE at the model's unsafe share over the model's MAPE."""


def _per_call_us(fn: Any, args: list[Any], calls: int, rounds: int) -> tuple[float, float]:
    """Median over ``rounds`` of (wall-clock, process CPU) microseconds per call."""
    wall, cpu = [], []
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        for i in range(calls):
            fn(args[i % len(args)])
        cpu.append((time.process_time() - start_cpu) / calls * 1e6)
        wall.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(wall), statistics.median(cpu)


def decision_latency_us(
    predictor: Any, X: np.ndarray, booster: Any = None, *, calls: int = 2000, rounds: int = 7
) -> dict[str, float]:
    """Median over ``rounds`` of the mean time of one ``safe_prefill_tokens_per_s`` call, cycling
    through the rows of ``X``; with ``booster`` also LightGBM's own ``predict`` of one row on one
    thread (``num_threads=1``: its default spin-waits a thread pool), over a tenth of the calls.
    ``*_us`` is wall-clock time; ``*_cpu_us`` the process's CPU time (what the call costs on a core of
    its own: on a shared, loaded machine wall-clock time also counts the time the process waits)."""
    rows = [tuple(float(v) for v in r) for r in np.asarray(X, dtype=float)[:256]]
    wall, cpu = _per_call_us(lambda r: predictor.safe_prefill_tokens_per_s(*r), rows, calls, rounds)
    out = {"fast_predictor_us": wall, "fast_predictor_cpu_us": cpu}
    if booster is not None:
        inputs = [predictor.inputs(np.asarray([r])) for r in rows]
        wall, cpu = _per_call_us(
            lambda z: booster.predict(z, num_threads=1), inputs, max(calls // 10, 50), rounds
        )
        out.update({"lightgbm_one_thread_us": wall, "lightgbm_one_thread_cpu_us": cpu})
    return out


def repeated_latency_us(
    predictor: Any, X: np.ndarray, booster: Any = None, *, runs: int = 1
) -> dict[str, float]:
    """:func:`decision_latency_us` ``runs`` times: the median of each figure, its minimum under
    ``<name>_min``, and the 1-minute load average before and after (``load_average``, ``os.getloadavg``;
    on a shared machine it says how much the wall-clock figures include waiting for a core)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    before = os.getloadavg()[0]
    measured = [decision_latency_us(predictor, X, booster) for _ in range(runs)]
    out = {k: float(statistics.median(r[k] for r in measured)) for k in measured[0]}
    out.update({f"{k}_min": float(min(r[k] for r in measured)) for k in measured[0]})
    out["load_average"] = (before + os.getloadavg()[0]) / 2
    out["runs"] = float(runs)
    return out


def check_targets(
    report: dict[str, Any],
    latency_us: dict[str, float] | None,
    targets: Targets = Targets(),
    model: str = "lightgbm",
    datasheet: str = "datasheet_roofline",
) -> list[dict[str, Any]]:
    """One row per target: ``target``, ``value``, ``limit``, ``met`` (``None`` when not measured)."""
    m = report["metrics"].get(model, {})
    rows = [
        {"target": "MAPE", "value": m.get("mape"), "limit": targets.mape, "kind": "<="},
        {
            "target": "unsafe share",
            "value": m.get("unsafe_share"),
            "limit": targets.unsafe_share,
            "kind": "<=",
        },
        {
            "target": "single decision (us, CPU)",
            "value": (latency_us or {}).get("fast_predictor_cpu_us"),
            "limit": targets.single_decision_us,
            "kind": "<=",
        },
    ]
    sheet = report.get("at_equal_unsafe", {}).get(datasheet, {}).get("mape")
    ratio = sheet / m["mape"] if sheet is not None and m.get("mape") and m["mape"] > 0 else None
    rows.append(
        {
            "target": f"{datasheet} MAPE / {model} MAPE at equal unsafe share",
            "value": ratio,
            "limit": targets.datasheet_mape_ratio,
            "kind": ">=",
        }
    )
    for row in rows:
        v = row["value"]
        ok = v is not None and math.isfinite(v)
        row["met"] = (v <= row["limit"] if row["kind"] == "<=" else v >= row["limit"]) if ok else None
    return rows
