"""Baselines the LightGBM model is evaluated against, each with ``fit(labels)`` / ``predict(X)``.

What a user has before (or instead of) a learned model:

* :class:`InvertedTimeModel` with a *datasheet roofline* timer -- iteration times from the GPU's peak
  FLOPs and HBM bandwidth alone (no calibration), inverted through the same lease label. The timer
  is built by the caller from its catalog (``envs.profiler.datasheet_roofline``), so this package
  stays free of hardware tables: any object with the two :class:`IterationTimer` methods works.
* :class:`UtilisationThresholdBaseline` -- the naive rule: lend a fixed rate while the node's
  utilisation (the larger of its batch share and its KV occupancy) is under a threshold.
* :class:`LinearBaseline` -- least squares on ``log1p(label)`` over the same inputs as the trees, with
  the same conformal shift (so the two are compared at equal safety).

And one reference a user does *not* have: :class:`InvertedTimeModel` with the simulator's own
calibrated cost model, which in simulation is the ground truth of every iteration time. Its error
is then only that of predicting from the five features: the batch's evolution over the horizon
(who finishes when) is not in them, so both inverted models assume one (:data:`EVOLUTIONS`).

``X`` is always an ``(n, len(FEATURES))`` array in ``FEATURES`` order.
"""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np
import pandas as pd

from interference_model.fit import FitConfig, LeaseCap, ModelInputs, conformal_shift, group_kfold
from interference_model.labels import ITL_LABEL, LABEL, LeaseLabel, derive_labels
from interference_model.schema import FEATURES, PROFILE_COLUMNS, PROFILE_SCHEMA_VERSION

Evolution = Literal["exponential", "all_at_mean"]
EVOLUTIONS: tuple[str, ...] = ("exponential", "all_at_mean")
"""How an inverted model assumes the batch evolves, knowing only the mean remaining output ``r``:
``exponential`` -- remaining outputs exponentially distributed with mean ``r`` (the maximum-entropy
guess: a share ``exp(-k / r)`` still runs after ``k`` steps, each with ``r`` more to go);
``all_at_mean`` -- every request has exactly ``r`` left (the whole batch leaves at step ``r``)."""


class LinearBaseline:
    """``log1p(ITL part) ~ w . [z, log1p(z)] + b`` over the trees' inputs ``z`` (``fit.ModelInputs`` of
    the same ``FitConfig``, so with the decode-step slack when the model has it), shifted conformally
    and capped exactly like the LightGBM model (``fit.LeaseCap``): only the learner differs."""

    name = "linear"

    def __init__(self, label: LeaseLabel, config: FitConfig | None = None) -> None:
        config = config or FitConfig()
        if config.unsafe_target is None:
            raise ValueError("LinearBaseline needs config.unsafe_target (it is compared at equal safety)")
        self.label, self.config = label, config
        self.coef_: np.ndarray | None = None
        self.log_shift_ = 0.0
        self.cap: LeaseCap | None = None
        self.inputs = ModelInputs(label)

    def _design(self, X: np.ndarray) -> np.ndarray:
        Z = self.inputs(X)
        return np.column_stack([Z, np.log1p(np.maximum(Z, 0.0)), np.ones(len(Z))])

    def _solve(self, X: np.ndarray, z: np.ndarray) -> np.ndarray:
        return np.linalg.lstsq(self._design(X), z, rcond=None)[0]

    def fit(self, labels: pd.DataFrame) -> LinearBaseline:
        cfg = self.config
        assert cfg.unsafe_target is not None
        self.cap = LeaseCap.for_labels(labels, self.label, cfg.min_lease_tokens)
        self.inputs = ModelInputs.for_labels(labels, self.label, cfg)
        X = labels[list(FEATURES)].to_numpy(dtype=float)
        z = np.log1p(labels[ITL_LABEL].to_numpy(dtype=float))
        oof = np.empty(len(z))
        for tr, te in group_kfold(labels["state_group"].to_numpy(), cfg.n_folds, cfg.seed):
            oof[te] = self._design(X[te]) @ self._solve(X[tr], z[tr])
        excess = self.cap.log_excess(oof, X, labels, cfg.unsafe_margin)
        self.log_shift_ = conformal_shift(excess, cfg.unsafe_target)
        self.coef_ = self._solve(X, z)
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        if self.coef_ is None or self.cap is None:
            raise RuntimeError("LinearBaseline.predict before fit")
        return self.cap.apply(np.expm1(self._design(X) @ self.coef_ - self.log_shift_), X)


class UtilisationThresholdBaseline:
    """Lend ``rate`` tokens/s while ``max(batch / max_batch, kv_occupancy) < threshold``, else 0.

    ``max_batch`` is the largest training batch (the node's running-request limit as the data show
    it); ``rate`` is the ``unsafe_target`` quantile of the training labels under the threshold (so
    about that share is over-promised there); the threshold is the grid value with the lowest
    training MAPE.
    """

    name = "utilisation_threshold"

    def __init__(self, unsafe_target: float = 0.02) -> None:
        self.unsafe_target = unsafe_target
        self.threshold_ = 1.0
        self.rate_ = 0.0
        self.max_batch_ = 1.0

    def utilisation(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=float)
        batch_share = X[:, FEATURES.index("decode_batch_size")] / self.max_batch_
        return np.maximum(batch_share, X[:, FEATURES.index("kv_occupancy")])

    def fit(self, labels: pd.DataFrame) -> UtilisationThresholdBaseline:
        self.max_batch_ = max(float(labels["decode_batch_size"].max()), 1.0)
        util = self.utilisation(labels[list(FEATURES)].to_numpy(dtype=float))
        y = labels[LABEL].to_numpy(dtype=float)
        best = (np.inf, 1.0, 0.0)
        pos = y > 0
        for threshold in np.linspace(0.05, 1.0, 20):
            under = util < threshold
            if not under.any():
                continue
            rate = float(np.quantile(y[under], self.unsafe_target))
            pred = np.where(under, rate, 0.0)
            mape = float(np.mean(np.abs(pred[pos] - y[pos]) / y[pos])) if pos.any() else np.inf
            if mape < best[0]:
                best = (mape, float(threshold), rate)
        _, self.threshold_, self.rate_ = best
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        return np.where(self.utilisation(X) < self.threshold_, self.rate_, 0.0)


class IterationTimer(Protocol):
    """The cost-model methods an inverted model uses (``envs.cost_model.CostModel`` has them)."""

    def iteration_times_s(
        self,
        prefill_tokens: np.ndarray,
        prefill_attention_pairs: np.ndarray,
        decode_batch: np.ndarray,
        decode_context_tokens: np.ndarray,
    ) -> np.ndarray: ...

    @staticmethod
    def prefill_attention_pairs(new_tokens: int, cached_tokens: int) -> float: ...


def assumed_checkpoints(
    X: np.ndarray, steps: tuple[int, ...], evolution: Evolution = "all_at_mean"
) -> pd.DataFrame:
    """The checkpoints a feature-only model assumes for each state (rows of ``X``): ``state``,
    ``decode_step``, ``step_batch_size``, ``step_context_tokens``.

    Contexts grow by one token per step; the running share follows ``evolution`` (see
    :data:`EVOLUTIONS`), rounded to whole requests; a checkpoint with no request left ends the list
    (as the profilers do).
    """
    if evolution not in EVOLUTIONS:
        raise ValueError(f"evolution must be one of {EVOLUTIONS}, got {evolution!r}")
    X = np.asarray(X, dtype=float)
    batch, ctx, rem = X[:, 0], X[:, 1], X[:, 3]
    k = np.asarray(steps, dtype=float)[None, :]
    r = np.maximum(rem, 1e-9)[:, None]
    alive = np.exp(-k / r) if evolution == "exponential" else (k < r).astype(float)
    running = np.round(batch[:, None] * alive)
    running[:, 0] = batch  # step 0 is the state itself
    ok = np.cumprod(running >= 1, axis=1).astype(bool)
    state, j = np.nonzero(ok)
    b = running[state, j]
    ctx_k = ctx[state] + k[0, j]
    return pd.DataFrame(
        {
            "state": state,
            "decode_step": np.asarray(steps, dtype=np.int64)[j],
            "step_batch_size": b.astype(np.int64),
            "step_context_tokens": b * ctx_k,
        }
    )


class InvertedTimeModel:
    """An iteration-time model inverted through the lease label (no fitting).

    For each state it times the swept chunks on ``timer`` at the checkpoints the state is assumed to
    pass through (:func:`assumed_checkpoints`) and derives the label from those times exactly as from
    a measured profile. ``name`` tells the table which model this is.
    """

    def __init__(
        self,
        timer: IterationTimer,
        label: LeaseLabel,
        chunk_sizes: tuple[int, ...],
        checkpoint_steps: tuple[int, ...],
        kv_capacity_tokens: int,
        *,
        cached_prefix_tokens: int = 0,
        evolution: Evolution = "all_at_mean",
        name: str = "inverted_time_model",
    ) -> None:
        self.timer, self.label, self.name = timer, label, name
        self.chunk_sizes, self.checkpoint_steps = tuple(chunk_sizes), tuple(checkpoint_steps)
        self.kv_capacity_tokens, self.cached_prefix_tokens = int(kv_capacity_tokens), cached_prefix_tokens
        self.evolution: Evolution = evolution

    def fit(self, labels: pd.DataFrame) -> InvertedTimeModel:
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=float)
        cp = assumed_checkpoints(X, self.checkpoint_steps, self.evolution)
        chunks = np.asarray(self.chunk_sizes, dtype=float)
        n_cp, n_c = len(cp), len(chunks)
        pairs = np.array(
            [self.timer.prefill_attention_pairs(int(c), self.cached_prefix_tokens) for c in chunks]
        )
        batch = cp["step_batch_size"].to_numpy()
        ctx = cp["step_context_tokens"].to_numpy()
        t = np.asarray(
            self.timer.iteration_times_s(
                np.r_[np.zeros(n_cp), np.tile(chunks, n_cp)],
                np.r_[np.zeros(n_cp), np.tile(pairs, n_cp)],
                np.r_[batch, np.repeat(batch, n_c)],
                np.r_[ctx, np.repeat(ctx, n_c)],
            ),
            dtype=float,
        )
        rows = cp.loc[cp.index.repeat(n_c)].reset_index(drop=True)
        state = rows["state"].to_numpy()
        table = pd.DataFrame(
            {
                "schema_version": PROFILE_SCHEMA_VERSION,
                "source": "analytic",
                "hardware": "-",
                "model": "-",
                "tp": 1,
                "state_id": state,
                "state_group": 0,
                "repeat": 0,
                **{f: X[state, i] for i, f in enumerate(FEATURES)},
                "kv_capacity_tokens": self.kv_capacity_tokens,
                "decode_step": rows["decode_step"],
                "step_batch_size": rows["step_batch_size"],
                "step_context_tokens": rows["step_context_tokens"],
                "chunk_tokens": np.tile(chunks.astype(np.int64), n_cp),
                "cached_prefix_tokens": self.cached_prefix_tokens,
                "iteration_time_s": t[n_cp:],
                "decode_only_time_s": np.repeat(t[:n_cp], n_c),
            },
            columns=list(PROFILE_COLUMNS),
        )
        labels = derive_labels(table, self.label, cached_prefix_tokens=self.cached_prefix_tokens)
        return labels[LABEL].to_numpy()
