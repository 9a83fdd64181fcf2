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


def scale_to_unsafe_share(
    y_true: np.ndarray, y_pred: np.ndarray, unsafe_share: float, unsafe_margin: float = 0.05
) -> float:
    """The divisor ``m`` that makes ``y_pred / m`` unsafe on at most ``unsafe_share`` of the states,
    as few as possible below (the largest such share): one constant, chosen on these very states.

    A state is unsafe under ``m`` iff ``y_pred > m * (1 + margin) * y_true``, i.e. iff ``m`` is below
    its ratio ``r = y_pred / ((1 + margin) * y_true)`` (``inf`` for a positive prediction of a true 0).
    Allowing ``k = floor(unsafe_share * n)`` unsafe states, ``m`` is the ``(k + 1)``-th largest ratio;
    a ratio of ``inf`` there (too many positive predictions of true zeros) cannot be matched and
    raises ``ValueError``. ``m`` may be below 1 (a pessimistic predictor scaled up).
    """
    y_true = np.asarray(y_true, dtype=float)
    y_pred = np.asarray(y_pred, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(
            y_true > 0, y_pred / ((1.0 + unsafe_margin) * y_true), np.where(y_pred > 0, np.inf, 0.0)
        )
    ordered = np.sort(ratio)[::-1]
    k = int(np.floor(unsafe_share * len(ordered) + 1e-9))
    m = float(ordered[min(k, len(ordered) - 1)])
    if not np.isfinite(m):
        raise ValueError("more positive predictions of true zeros than the unsafe share allows")
    # At exactly m the k+1-th state sits on the line (pred == (1 + margin) * true): safe.
    return m if m > 0 else 1.0


def metrics_at_unsafe_share(
    y_true: np.ndarray, y_pred: np.ndarray, unsafe_share: float, unsafe_margin: float = 0.05
) -> dict[str, float]:
    """:func:`accuracy_metrics` of ``y_pred`` scaled by one constant to ``unsafe_share`` (see
    :func:`scale_to_unsafe_share`), plus that ``divisor``; an unmatched share gives NaN metrics."""
    try:
        m = scale_to_unsafe_share(y_true, y_pred, unsafe_share, unsafe_margin)
    except ValueError:
        nan = float("nan")
        return {"divisor": nan, "mape": nan, "unsafe_share": nan, "median_ape": nan, "under_share": nan}
    scaled = accuracy_metrics(y_true, np.asarray(y_pred, dtype=float) / m, unsafe_margin)
    return {"divisor": m, **{k: scaled[k] for k in ("mape", "unsafe_share", "median_ape", "under_share")}}
