"""Accuracy and safety metrics of safe-throughput predictions (no plotting, no model imports)."""

from __future__ import annotations

import numpy as np


def accuracy_metrics(y_true: np.ndarray, y_pred: np.ndarray, unsafe_margin: float = 0.05) -> dict[str, float]:
    """MAPE over states with a positive true value, and the unsafe share over all states.

    A prediction is *unsafe* when it exceeds the true safe value by more than ``unsafe_margin``
    (relative); for a true value of 0 any positive prediction is unsafe. ``under_share`` is the share
    predicted more than ``unsafe_margin`` below the truth (capacity left unused).
    """
    y_true = np.asarray(y_true, dtype=float)
    y_pred = np.asarray(y_pred, dtype=float)
    if y_true.shape != y_pred.shape or y_true.ndim != 1 or len(y_true) == 0:
        raise ValueError(
            f"y_true and y_pred must be equal-length 1-D arrays, got {y_true.shape}, {y_pred.shape}"
        )
    pos = y_true > 0
    ape = np.abs(y_pred[pos] - y_true[pos]) / y_true[pos]
    unsafe = y_pred > (1.0 + unsafe_margin) * y_true
    under = y_pred < (1.0 - unsafe_margin) * y_true
    return {
        "n_states": float(len(y_true)),
        "mape": float(ape.mean()) if pos.any() else float("nan"),
        "median_ape": float(np.median(ape)) if pos.any() else float("nan"),
        "unsafe_share": float(unsafe.mean()),
        "under_share": float(under.mean()),
        "mean_pred_over_true": float(y_pred[pos].sum() / y_true[pos].sum()) if pos.any() else float("nan"),
    }
