"""Baselines the LightGBM model is evaluated against, each with ``fit(labels)`` / ``predict(X)``.

* :class:`LinearBaseline` -- least squares on ``log1p(label)``, with the same conformal shift as the
  LightGBM model (so the two are compared at equal safety).
* :class:`UtilisationThresholdBaseline` -- the naive rule: lend a fixed rate while KV occupancy is
  under a threshold, nothing above it (rate and threshold chosen on the training labels).
* :class:`AnalyticInverseBaseline` -- the noise-free cost model inverted: time the swept chunks on the
  cost model and apply the label derivation. In simulation it *is* the truth up to measurement noise;
  on real hardware its error is the cost model's error.

``X`` is always an ``(n, len(FEATURES))`` array in ``FEATURES`` order.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import pandas as pd

from interference_model.fit import conformal_log_shift, group_kfold
from interference_model.labels import LABEL, ItlTarget, derive_labels
from interference_model.schema import FEATURES, PROFILE_SCHEMA_VERSION


class LinearBaseline:
    """``log1p(y) ~ w . [x, log1p(x)] + b``, shifted conformally like the LightGBM model."""

    name = "linear"

    def __init__(
        self, unsafe_target: float = 0.02, unsafe_margin: float = 0.05, n_folds: int = 5, seed: int = 0
    ) -> None:
        self.unsafe_target, self.unsafe_margin, self.n_folds, self.seed = (
            unsafe_target,
            unsafe_margin,
            n_folds,
            seed,
        )
        self.coef_: np.ndarray | None = None
        self.log_shift_ = 0.0

    @staticmethod
    def _design(X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=float)
        return np.column_stack([X, np.log1p(np.maximum(X, 0.0)), np.ones(len(X))])

    @staticmethod
    def _solve(X: np.ndarray, z: np.ndarray) -> np.ndarray:
        return np.linalg.lstsq(LinearBaseline._design(X), z, rcond=None)[0]

    def fit(self, labels: pd.DataFrame) -> LinearBaseline:
        X, y = labels[list(FEATURES)].to_numpy(dtype=float), labels[LABEL].to_numpy(dtype=float)
        z = np.log1p(y)
        oof = np.empty(len(y))
        for tr, te in group_kfold(labels["state_group"].to_numpy(), self.n_folds, self.seed):
            oof[te] = self._design(X[te]) @ self._solve(X[tr], z[tr])
        self.log_shift_ = conformal_log_shift(oof, y, self.unsafe_target, self.unsafe_margin)
        self.coef_ = self._solve(X, z)
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        if self.coef_ is None:
            raise RuntimeError("LinearBaseline.predict before fit")
        return np.maximum(np.expm1(self._design(X) @ self.coef_ - self.log_shift_), 0.0)


class UtilisationThresholdBaseline:
    """Lend ``rate`` tokens/s while ``kv_occupancy < threshold``, else 0.

    ``rate`` is the ``unsafe_target`` quantile of the training labels under the threshold (so about
    that share is over-promised there); the threshold is the grid value with the lowest training MAPE.
    """

    name = "utilisation_threshold"

    def __init__(self, unsafe_target: float = 0.02) -> None:
        self.unsafe_target = unsafe_target
        self.threshold_ = 1.0
        self.rate_ = 0.0

    def fit(self, labels: pd.DataFrame) -> UtilisationThresholdBaseline:
        occ, y = labels["kv_occupancy"].to_numpy(dtype=float), labels[LABEL].to_numpy(dtype=float)
        best = (np.inf, 1.0, 0.0)
        for threshold in np.linspace(0.1, 1.0, 19):
            under = occ < threshold
            if not under.any():
                continue
            rate = float(np.quantile(y[under], self.unsafe_target))
            pred = np.where(under, rate, 0.0)
            pos = y > 0
            mape = float(np.mean(np.abs(pred[pos] - y[pos]) / y[pos]))
            if mape < best[0]:
                best = (mape, float(threshold), rate)
        _, self.threshold_, self.rate_ = best
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        occ = np.asarray(X, dtype=float)[:, FEATURES.index("kv_occupancy")]
        return np.where(occ < self.threshold_, self.rate_, 0.0)


class IterationTimer(Protocol):
    """The cost-model methods the analytic baseline uses (``envs.cost_model.CostModel`` has them)."""

    def iteration_times_s(
        self,
        prefill_tokens: np.ndarray,
        prefill_attention_pairs: np.ndarray,
        decode_batch: np.ndarray,
        decode_context_tokens: np.ndarray,
    ) -> np.ndarray: ...

    @staticmethod
    def prefill_attention_pairs(new_tokens: int, cached_tokens: int) -> float: ...


class AnalyticInverseBaseline:
    """The clean cost model, inverted through the same label derivation (no fitting)."""

    name = "analytic_cost_model"

    def __init__(
        self,
        cost_model: IterationTimer,
        itl_target: ItlTarget,
        chunk_sizes: tuple[int, ...],
        kv_capacity_tokens: int,
        cached_prefix_tokens: int = 0,
    ) -> None:
        self.cost_model, self.itl_target = cost_model, itl_target
        self.chunk_sizes, self.kv_capacity_tokens = tuple(chunk_sizes), int(kv_capacity_tokens)
        self.cached_prefix_tokens = cached_prefix_tokens

    def fit(self, labels: pd.DataFrame) -> AnalyticInverseBaseline:
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=float)
        n, chunks = len(X), np.asarray(self.chunk_sizes, dtype=float)
        batch = np.round(X[:, 0])
        # The cost model sees the context sum; mean x batch is exact for it, the spread is not used.
        ctx_sum = batch * X[:, 1]
        pairs = np.array(
            [self.cost_model.prefill_attention_pairs(int(c), self.cached_prefix_tokens) for c in chunks]
        )
        c_all = np.concatenate([np.zeros(n), np.repeat(chunks[None, :], n, 0).ravel()])
        p_all = np.concatenate([np.zeros(n), np.repeat(pairs[None, :], n, 0).ravel()])
        b_all = np.concatenate([batch, np.repeat(batch, len(chunks))])
        s_all = np.concatenate([ctx_sum, np.repeat(ctx_sum, len(chunks))])
        t = np.asarray(self.cost_model.iteration_times_s(c_all, p_all, b_all, s_all), dtype=float)
        t0, t_mixed = t[:n], t[n:]
        table = pd.DataFrame(
            {
                "schema_version": PROFILE_SCHEMA_VERSION,
                "source": "analytic",
                "hardware": "-",
                "model": "-",
                "tp": 1,
                "state_id": np.repeat(np.arange(n), len(chunks)),
                "state_group": 0,
                "repeat": 0,
                **{f: np.repeat(X[:, i], len(chunks)) for i, f in enumerate(FEATURES)},
                "kv_capacity_tokens": self.kv_capacity_tokens,
                "chunk_tokens": np.tile(chunks.astype(np.int64), n),
                "cached_prefix_tokens": self.cached_prefix_tokens,
                "iteration_time_s": t_mixed,
                "decode_only_time_s": np.repeat(t0, len(chunks)),
            }
        )
        labels = derive_labels(table, self.itl_target, cached_prefix_tokens=self.cached_prefix_tokens)
        return labels[LABEL].to_numpy()
