"""Evaluation report: the model and its baselines on held-out labelled states, with plots.

:func:`evaluate` returns a JSON-ready dict (per predictor: MAPE, unsafe share, ...; MAPE and unsafe
share by region of batch size x mean context; feature importance) and, given ``plot_dir``, writes
``calibration.png`` (predicted vs true) and ``error_by_region.png`` (MAPE heat map per predictor).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from interference_model.labels import LABEL
from interference_model.metrics import accuracy_metrics
from interference_model.schema import FEATURES

BATCH_EDGES: tuple[float, ...] = (0, 4, 16, 64, 256, np.inf)
CONTEXT_EDGES: tuple[float, ...] = (0, 1024, 4096, 16384, np.inf)


class Predicts(Protocol):
    def predict(self, X: np.ndarray) -> np.ndarray: ...


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


def evaluate(
    labels: pd.DataFrame,
    predictors: dict[str, Predicts],
    *,
    unsafe_margin: float = 0.05,
    plot_dir: str | os.PathLike[str] | None = None,
    reference: np.ndarray | None = None,
) -> dict[str, Any]:
    """Evaluate every predictor on ``labels`` (one row per held-out state, from ``derive_labels``).

    ``reference``, if given, is a second truth (e.g. the noise-free labels of the same simulated
    states); metrics against it are reported under ``"vs_reference"``.
    """
    X = labels[list(FEATURES)].to_numpy(dtype=float)
    y = labels[LABEL].to_numpy(dtype=float)
    preds = {name: np.asarray(p.predict(X), dtype=float) for name, p in predictors.items()}
    report: dict[str, Any] = {
        "n_states": len(y),
        "unsafe_margin": unsafe_margin,
        "metrics": {name: accuracy_metrics(y, p, unsafe_margin) for name, p in preds.items()},
        "by_region": {name: region_metrics(labels, p, unsafe_margin) for name, p in preds.items()},
    }
    if reference is not None:
        report["vs_reference"] = {
            name: accuracy_metrics(reference, p, unsafe_margin) for name, p in preds.items()
        }
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
    fig, axes = plt.subplots(1, len(preds), figsize=(4.2 * len(preds), 3.6), squeeze=False)
    for ax, (name, p) in zip(axes[0], preds.items(), strict=True):
        ape = pd.Series(np.where(y > 0, np.abs(p - y) / np.where(y > 0, y, 1), np.nan))
        grid = ape.groupby([batch, ctx]).mean().unstack().reindex(index=b_order, columns=c_order)
        im = ax.imshow(grid.to_numpy(dtype=float) * 100, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(c_order)), c_order, rotation=30, fontsize=7)
        ax.set_yticks(range(len(b_order)), b_order, fontsize=7)
        ax.set(xlabel="mean context tokens", ylabel="decode batch", title=f"{name}: MAPE %")
        fig.colorbar(im, ax=ax)
    error_by_region = plot_dir / "error_by_region.png"
    fig.savefig(error_by_region, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [str(calibration), str(error_by_region)]
