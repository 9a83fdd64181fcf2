"""Fit the conservative LightGBM model of safe prefill throughput from labelled node states.

The lease label is ``min(ITL part, KV room / horizon)`` (``interference_model.labels``); the KV room
is a closed-form function of the state, so only the ITL part is learned and the cap is applied
exactly on top (:class:`LeaseCap`). The model regresses ``log1p(ITL part)`` (so errors are
relative, which is what MAPE and the "unsafe" criterion measure) with LightGBM, conservative twice
over:

1. monotone constraints where the physics is monotone (below), which keep noise from carving
   physically impossible bumps that would over-promise in some region;
2. a split-conformal shift: from out-of-fold (grouped K-fold) predictions, the smallest log-shift
   ``s`` such that at most ``unsafe_target`` of states get ``prediction > (1 + unsafe_margin) * true``
   (the full prediction, KV cap and floor included, against the full label).
   The shift is applied as ``expm1(raw - s)``; it may be negative when the model alone is more
   conservative than needed, which buys accuracy back at the same safety. It is *Mondrian*: one
   shift per decode-batch-size bin (``shift_batch_edges``), because label noise and model error
   differ a lot between regions (largest where the MoE step time has its knee), and one global
   shift would make every region pay for the worst one. A bin with fewer than
   ``min_states_per_shift_bin`` states uses the global shift.

Predictions below ``min_lease_tokens`` over the horizon are reported as 0: a lease for fewer prefill
tokens than that is no lease, and where nothing fits the step budget the label is exactly 0, which
a model in log space can only come close to. The conformal shift is chosen for the floored
prediction, so those states do not inflate it.

A quantile objective (``quantile_alpha``) is available instead of L2, but LightGBM refuses monotone
constraints with it (it re-fits leaf values after the split search), so it needs ``monotone=False``.

Monotone constraints encode physics that holds for the ITL part: it never rises with the mean
remaining output at a fixed longest one (the batch stays longer) or with KV occupancy (a fuller cache
never speeds a step up); with an *absolute* ITL target it never rises with batch size or mean context
either (more decode work leaves less time). With a *ratio* target the budget grows with the decode
step itself, so batch and context are left free. The drain features are free too
(:func:`physical_monotone_constraints` says why).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightgbm as lgb
import numpy as np
import pandas as pd

from interference_model.labels import ITL_LABEL, LABEL, LeaseLabel, kv_room_tokens
from interference_model.metrics import accuracy_metrics
from interference_model.schema import FEATURES

SHIFT_ALLOCATIONS: tuple[str, ...] = ("per_bin", "pooled")


@dataclass(frozen=True, slots=True)
class FitConfig:
    """Hyper-parameters of :func:`fit_interference_model`; each field is recorded in the artifact."""

    quantile_alpha: float | None = None
    """Quantile objective level; ``None`` fits the conditional mean (L2). Needs ``monotone=False``."""
    unsafe_target: float | None = 0.02
    """Out-of-fold share of unsafe predictions the conformal shift allows; ``None``: no shift."""
    unsafe_margin: float = 0.05
    """A prediction is unsafe when it exceeds the true value by more than this fraction."""
    shift_batch_edges: tuple[float, ...] = (4, 8, 16, 24, 32, 48, 64, 128)
    """Decode-batch-size bin edges of the Mondrian conformal shift; ``()`` for one global shift."""
    min_states_per_shift_bin: int = 200
    shift_allocation: str = "pooled"
    """``"pooled"``: the bins share one budget -- shifts (on a grid of ``shift_grid_step``) that minimise
    the out-of-fold MAPE while the *overall* out-of-fold unsafe share stays within ``unsafe_target``
    (:func:`pooled_shift`): the marginal guarantee the target asks for, spent where it buys most.
    ``"per_bin"`` (the default until 2026-12-06): every batch bin holds its own out-of-fold unsafe
    share to ``unsafe_target``, so each bin spends its whole budget -- an accurate model is even
    shifted *up* until 2 % of its states are unsafe, which costs MAPE and buys nothing."""
    shift_grid_step: float = 0.005
    min_lease_tokens: float = 64.0
    """Predictions below this many tokens over the label's horizon are 0 (module docstring)."""
    num_boost_round: int = 100
    """Few, larger trees: the fast predictor's batch cost grows with the tree count."""
    learning_rate: float = 0.15
    num_leaves: int = 31
    min_data_in_leaf: int = 10
    n_folds: int = 5
    monotone: bool = True
    decode_step_input: bool = True
    """Give the trees :data:`DECODE_STEP_INPUT`, the step budget a :class:`DecodeStepModel` (fitted on
    the profiles' decode-only steps) says the decode batch leaves. With an absolute ITL target the
    label never falls as that slack grows, so it is constrained non-decreasing there and batch and
    context, whose effect on the step it carries, are left free (:func:`physical_monotone_constraints`)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.quantile_alpha is not None and self.monotone:
            raise ValueError(
                "FitConfig: LightGBM cannot combine a quantile objective with monotone "
                "constraints; set monotone=False or quantile_alpha=None"
            )
        if self.quantile_alpha is not None and not 0 < self.quantile_alpha < 1:
            raise ValueError(f"FitConfig.quantile_alpha must lie in (0, 1), got {self.quantile_alpha}")
        if self.unsafe_target is not None and not 0 < self.unsafe_target < 1:
            raise ValueError(f"FitConfig.unsafe_target must lie in (0, 1), got {self.unsafe_target}")
        if self.shift_allocation not in SHIFT_ALLOCATIONS:
            raise ValueError(
                f"FitConfig.shift_allocation must be one of {SHIFT_ALLOCATIONS}, "
                f"got {self.shift_allocation!r}"
            )
        if not self.shift_grid_step > 0:
            raise ValueError(f"FitConfig.shift_grid_step must be > 0, got {self.shift_grid_step}")
        if not self.min_lease_tokens >= 0:
            raise ValueError(f"FitConfig.min_lease_tokens must be >= 0, got {self.min_lease_tokens}")

    @classmethod
    def from_recorded(cls, recorded: dict[str, Any]) -> FitConfig:
        """The configuration an artifact's ``fit_config`` records. A field an older artifact lacks takes
        the value that applied before the field existed, not today's default."""
        known = {k: v for k, v in recorded.items() if k in cls.__dataclass_fields__}
        for name, before in _BEFORE_FIELD.items():
            known.setdefault(name, before)
        if isinstance(known.get("shift_batch_edges"), list):
            known["shift_batch_edges"] = tuple(known["shift_batch_edges"])
        return cls(**known)

    def lgb_params(self, monotone_constraints: tuple[int, ...]) -> dict[str, object]:
        params: dict[str, object] = {
            "objective": "quantile" if self.quantile_alpha is not None else "regression",
            "learning_rate": self.learning_rate,
            "num_leaves": self.num_leaves,
            "min_data_in_leaf": self.min_data_in_leaf,
            "seed": self.seed,
            "deterministic": True,
            "force_row_wise": True,
            "num_threads": 1,
            "verbose": -1,
        }
        if self.quantile_alpha is not None:
            params["alpha"] = self.quantile_alpha
        if any(monotone_constraints):
            params["monotone_constraints"] = list(monotone_constraints)
            params["monotone_constraints_method"] = "advanced"
        return params


_BEFORE_FIELD: dict[str, object] = {"shift_allocation": "per_bin", "decode_step_input": False}
"""What a fit did before these ``FitConfig`` fields were recorded (:meth:`FitConfig.from_recorded`)."""

MODEL_FEATURES: tuple[str, ...] = (*FEATURES, "context_tokens_sum")
"""What the trees see: ``FEATURES`` plus derived columns (:func:`model_inputs`). The decode step time
grows with the batch's total context, a product that axis-aligned splits approximate poorly. A fit
with ``FitConfig.decode_step_input`` adds :data:`DECODE_STEP_INPUT` (:class:`ModelInputs`)."""

DECODE_STEP_INPUT = "decode_step_slack_s"
"""The step budget left once the decode batch has run: ``T - t_decode`` seconds, ``t_decode`` from the
:class:`DecodeStepModel` fitted on the profiles' own decode-only steps."""


def model_inputs(X: np.ndarray) -> np.ndarray:
    """``(n, len(FEATURES))`` node states -> ``(n, len(MODEL_FEATURES))`` tree inputs."""
    X = np.asarray(X, dtype=float)
    if X.ndim != 2 or X.shape[1] != len(FEATURES):
        raise ValueError(
            f"expected an (n, {len(FEATURES)}) array in FEATURES order {FEATURES}, got {X.shape}"
        )
    return np.column_stack([X, X[:, 0] * X[:, 1]])


DECODE_STEP_KNOTS: tuple[float, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Decode batch sizes where :class:`DecodeStepModel` may place its knots (x1.5 and x1.33 steps); the
fit keeps those up to the first at or past the largest batch it sees, less any no batch measured
pins down, and extrapolates beyond the last."""


@dataclass(frozen=True, slots=True)
class DecodeStepModel:
    """The decode-only step time of a node state: ``h(batch) + s_per_context_token x context sum``,
    ``h`` piecewise linear in ``log(batch)`` between knots (linear in ``log(batch)`` past the last
    knot), non-decreasing.

    Fitted by least squares on the step-0 decode-only times the profiles measured (their median over
    repeats), so it needs nothing a profile lacks: measured on a GPU as well as simulated. Why it is
    worth its few parameters: the lease label is set by how much of the step budget the decode batch
    leaves (``T - t_decode``), and near the budget a 1 % error in ``t_decode`` moves the label by
    several percent. Trees approximate that crossing from batch and context sum only coarsely; this
    form (the weights and experts a batch reads grow with it, attention with the summed context)
    tracks the measured step within about 0.5 % (GLM-5 TP8 on H200, noise-free states).
    """

    batch_knots: tuple[float, ...]
    knot_times_s: tuple[float, ...]
    s_per_context_token: float

    def __post_init__(self) -> None:
        if len(self.batch_knots) < 2 or len(self.knot_times_s) != len(self.batch_knots):
            raise ValueError("DecodeStepModel needs at least two knots and one time per knot")
        if any(b <= a for a, b in zip(self.batch_knots, self.batch_knots[1:], strict=False)):
            raise ValueError(f"DecodeStepModel.batch_knots must increase, got {self.batch_knots}")
        if self.batch_knots[0] <= 0:
            raise ValueError("DecodeStepModel.batch_knots must be positive")
        values = (*self.knot_times_s, self.s_per_context_token)
        if not all(np.isfinite(v) for v in values):
            raise ValueError("DecodeStepModel: knot times and the per-token slope must be finite")

    @staticmethod
    def _segments(batch: np.ndarray, knots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per batch, its segment ``k`` (between knots ``k`` and ``k + 1``; the outermost segments
        extend past either end) and its weight ``w`` towards knot ``k + 1``, linear in log batch."""
        b = np.maximum(np.asarray(batch, dtype=float), knots[0])
        seg = np.clip(np.searchsorted(knots, b, side="right") - 1, 0, len(knots) - 2)
        return seg, np.log(b / knots[seg]) / np.log(knots[seg + 1] / knots[seg])

    @classmethod
    def fit(
        cls, batch: np.ndarray, context_tokens_sum: np.ndarray, decode_only_time_s: np.ndarray
    ) -> DecodeStepModel:
        batch = np.asarray(batch, dtype=float)
        top = float(batch.max())
        knots = [k for k in DECODE_STEP_KNOTS if k < top]
        knots.append(next((k for k in DECODE_STEP_KNOTS if k >= top), top))
        if len(knots) < 2:
            knots = [1.0, 2.0]
        while True:
            grid = np.asarray(knots, dtype=float)
            seg, w = cls._segments(batch, grid)
            design = np.zeros((len(batch), len(grid) + 1))
            rows = np.arange(len(batch))
            design[rows, seg] = 1.0 - w
            design[rows, seg + 1] += w
            # A knot no measured batch weighs on (none between its neighbours) has no value to fit.
            unsupported = [k for k in range(1, len(knots) - 1) if not design[:, k].any()]
            if not unsupported:
                break
            del knots[unsupported[0]]
        design[:, -1] = np.asarray(context_tokens_sum, dtype=float)
        coef = np.linalg.lstsq(design, np.asarray(decode_only_time_s, dtype=float), rcond=None)[0]
        # More running requests never make a step faster: a noisy knot that dips is raised.
        times = np.maximum.accumulate(coef[:-1])
        return cls(tuple(float(k) for k in grid), tuple(float(t) for t in times), float(coef[-1]))

    def time_s(self, batch: np.ndarray, context_tokens_sum: np.ndarray) -> np.ndarray:
        """The modelled decode-only step (seconds) per state; :meth:`time_one` for one state."""
        seg, w = self._segments(batch, np.asarray(self.batch_knots))
        t = np.asarray(self.knot_times_s)
        return t[seg] + w * (t[seg + 1] - t[seg]) + self.s_per_context_token * np.asarray(
            context_tokens_sum, dtype=float
        )

    def time_one(self, batch: float, context_tokens_sum: float) -> float:
        """:meth:`time_s` of one state without numpy (the predictor's hot path)."""
        knots, t = self.batch_knots, self.knot_times_s
        b = max(batch, knots[0])
        k = min(max(bisect_right(knots, b) - 1, 0), len(knots) - 2)
        w = math.log(b / knots[k]) / math.log(knots[k + 1] / knots[k])
        return t[k] + w * (t[k + 1] - t[k]) + self.s_per_context_token * context_tokens_sum

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_knots": list(self.batch_knots),
            "knot_times_s": list(self.knot_times_s),
            "s_per_context_token": self.s_per_context_token,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeStepModel:
        """Inverse of :meth:`to_dict`; raises ``KeyError`` / ``TypeError`` / ``ValueError``."""
        return cls(
            tuple(float(k) for k in d["batch_knots"]),
            tuple(float(t) for t in d["knot_times_s"]),
            float(d["s_per_context_token"]),
        )


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """The map from node states (``FEATURES``) to what the trees see: :data:`MODEL_FEATURES`, and with
    a :class:`DecodeStepModel` also :data:`DECODE_STEP_INPUT`, the label's step budget less the
    modelled decode-only step."""

    label: LeaseLabel
    decode_step: DecodeStepModel | None = None

    @classmethod
    def for_labels(cls, labels: pd.DataFrame, label: LeaseLabel, config: FitConfig) -> ModelInputs:
        """The inputs a fit with ``config`` uses on ``labels`` (one row per state, with the measured
        step-0 ``decode_only_time_s``)."""
        if not config.decode_step_input:
            return cls(label)
        batch = labels["decode_batch_size"].to_numpy(dtype=float)
        context_sum = batch * labels["context_tokens_mean"].to_numpy(dtype=float)
        step = DecodeStepModel.fit(batch, context_sum, labels["decode_only_time_s"].to_numpy(dtype=float))
        return cls(label, step)

    @property
    def names(self) -> tuple[str, ...]:
        return MODEL_FEATURES if self.decode_step is None else (*MODEL_FEATURES, DECODE_STEP_INPUT)

    def __call__(self, X: np.ndarray) -> np.ndarray:
        """``(n, len(FEATURES))`` node states -> ``(n, len(self.names))`` tree inputs."""
        Z = model_inputs(X)
        if self.decode_step is None:
            return Z
        t = self.decode_step.time_s(Z[:, 0], Z[:, len(FEATURES)])
        return np.column_stack([Z, self.label.step_budget_s(t) - t])

    def slack_function(self) -> Callable[[float, float], float]:
        """``(decode batch, context sum) -> slack`` for one state, its constants bound once (the
        predictor's hot path); the same arithmetic as :meth:`__call__` (``LeaseLabel.step_budget_s``)."""
        if self.decode_step is None:
            raise ValueError("ModelInputs.slack_function: these inputs have no decode-step model")
        time_one = self.decode_step.time_one
        ratio, floor_s = self.label.itl_target.budget_terms()
        cap_s = self.label.tpot_slo_ms / 1000.0

        def slack(decode_batch_size: float, context_tokens_sum: float) -> float:
            t = time_one(decode_batch_size, context_tokens_sum)
            return min(max(ratio * t, floor_s), cap_s) - t

        return slack


def kv_capacity_of(labels: pd.DataFrame) -> float:
    """The one ``kv_capacity_tokens`` of a label table (an error if its states disagree)."""
    capacity = labels["kv_capacity_tokens"].unique()
    if len(capacity) != 1:
        raise ValueError(f"labels: one kv_capacity_tokens per fit, found {sorted(capacity.tolist())}")
    return float(capacity[0])


def floored(prediction: np.ndarray, floor_tokens_per_s: float) -> np.ndarray:
    """``prediction`` with values below ``floor_tokens_per_s`` (and negatives) set to 0."""
    prediction = np.asarray(prediction, dtype=float)
    return np.where(prediction >= floor_tokens_per_s, np.maximum(prediction, 0.0), 0.0)


@dataclass(frozen=True, slots=True)
class LeaseCap:
    """What turns a learned ITL-part rate into the label's prediction: the lease floor, then the KV
    room spread over the horizon (exact, from the state: ``labels.kv_room_tokens``)."""

    label: LeaseLabel
    kv_capacity_tokens: float
    min_rate_tokens_per_s: float

    @classmethod
    def for_labels(cls, labels: pd.DataFrame, label: LeaseLabel, min_lease_tokens: float) -> LeaseCap:
        return cls(label, kv_capacity_of(labels), min_lease_tokens / label.horizon_s)

    def rate(self, X: np.ndarray) -> np.ndarray:
        """The KV cap in tokens/s per row of ``X`` (``FEATURES`` order); +inf without the cap."""
        X = np.asarray(X, dtype=float)
        return self.label.kv_cap_tokens_per_s(
            kv_room_tokens(X[:, 0], X[:, 3], X[:, 4], self.kv_capacity_tokens)
        )

    def apply(self, itl_rate: np.ndarray, X: np.ndarray) -> np.ndarray:
        return np.minimum(floored(itl_rate, self.min_rate_tokens_per_s), self.rate(X))

    def log_excess(
        self, raw_log: np.ndarray, X: np.ndarray, labels: pd.DataFrame, margin: float
    ) -> np.ndarray:
        """Per state, how far ``raw_log`` (log1p of the ITL-part rate) is above the unsafe line of the
        full prediction: unsafe iff ``excess > shift``; ``-inf`` where the KV cap alone keeps the
        prediction within ``(1 + margin)`` of the label."""
        y_itl = labels[ITL_LABEL].to_numpy(dtype=float)
        y = labels[LABEL].to_numpy(dtype=float)
        bound = np.log1p(np.maximum((1.0 + margin) * y_itl, self.min_rate_tokens_per_s))
        return np.where(self.rate(X) > (1.0 + margin) * y, raw_log - bound, -np.inf)


def physical_monotone_constraints(
    label: LeaseLabel, names: tuple[str, ...] = MODEL_FEATURES
) -> tuple[int, ...]:
    """-1 (non-increasing) / +1 (non-decreasing) / 0 (free) per tree input ``names``; see the module
    docstring. With :data:`DECODE_STEP_INPUT` among them the decode step's growth with batch and
    context is carried by that slack (non-decreasing under an absolute target; a ratio target's budget
    grows with the step, so free there), and batch and context are left free: constraining them too
    measured worse (docs/interference_model.md, "The decode step as an input")."""
    absolute = label.itl_target.kind == "absolute_ms"
    by_step = absolute and DECODE_STEP_INPUT not in names
    by_name = {
        "decode_batch_size": -1 if by_step else 0,
        "context_tokens_mean": -1 if by_step else 0,
        "context_tokens_std": 0,
        "remaining_output_tokens_mean": -1,
        "kv_occupancy": -1,
        # At a fixed mean, a longer longest output means the others leave sooner, and the label holds
        # the last request left: neither drain feature moves the label one way.
        "remaining_output_tokens_max": 0,
        "remaining_output_tokens_context_weighted": 0,
        "context_tokens_sum": -1 if by_step else 0,
        DECODE_STEP_INPUT: 1 if absolute else 0,
    }
    return tuple(by_name[f] for f in names)


def group_kfold(groups: np.ndarray, n_folds: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train_idx, test_idx) pairs; every group lands wholly in one test fold. Shuffled by ``seed``."""
    unique = np.unique(groups)
    if len(unique) < n_folds:
        raise ValueError(f"need at least {n_folds} state groups for {n_folds}-fold CV, have {len(unique)}")
    fold_of_group = np.random.default_rng(seed).permutation(len(unique)) % n_folds
    fold = fold_of_group[np.searchsorted(unique, groups)]
    return [(np.flatnonzero(fold != k), np.flatnonzero(fold == k)) for k in range(n_folds)]


def conformal_shift(excess: np.ndarray, unsafe_target: float) -> float:
    """Smallest ``s`` with share(excess > s) <= unsafe_target: the finite-sample corrected quantile of
    the per-state excess (see :meth:`LeaseCap.log_excess`; ``-inf`` entries are never unsafe)."""
    ordered = np.sort(np.asarray(excess, dtype=float))
    n = len(ordered)
    # Allowed unsafe count k: the shift must clear all but the k largest excesses.
    k = int(np.floor(unsafe_target * (n + 1))) - 1
    k = min(max(k, 0), n - 1)
    shift = float(ordered[n - 1 - k])
    return shift if np.isfinite(shift) else 0.0  # the cap alone keeps enough states safe: no shift


def conformal_log_shift(
    raw_log_pred: np.ndarray, y_true: np.ndarray, unsafe_target: float, unsafe_margin: float
) -> float:
    """Smallest ``s`` with share(expm1(raw - s) > (1 + margin) * y) <= unsafe_target, for an uncapped
    prediction in log1p space."""
    return conformal_shift(raw_log_pred - np.log1p((1.0 + unsafe_margin) * y_true), unsafe_target)


@dataclass(frozen=True, slots=True)
class ConformalShift:
    """Per-batch-bin log shifts: bin ``k`` holds batches in ``[edges[k-1], edges[k])``."""

    batch_edges: tuple[float, ...]
    log_shifts: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.log_shifts) != len(self.batch_edges) + 1:
            raise ValueError("ConformalShift needs exactly one more shift than batch edges")

    def for_batch(self, decode_batch_size: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(np.asarray(self.batch_edges, dtype=float), decode_batch_size, side="right")
        return np.asarray(self.log_shifts)[idx]


def mondrian_shift(
    excess: np.ndarray, batch: np.ndarray, config: FitConfig, mono_batch: int
) -> ConformalShift:
    """Conformal shift per batch bin from per-state excesses (see the module docstring). When safe
    throughput is constrained non-increasing in batch size, the shifts are made non-decreasing in
    batch so the shifted model keeps that property."""
    assert config.unsafe_target is not None
    glob = conformal_shift(excess, config.unsafe_target)
    edges, bins = _batch_bins(batch, config)
    shifts = np.full(len(edges) + 1, glob)
    for k in range(len(edges) + 1):
        m = bins == k
        if m.sum() >= config.min_states_per_shift_bin:
            shifts[k] = conformal_shift(excess[m], config.unsafe_target)
    return _bin_shifts(edges, shifts, mono_batch)


def _batch_bins(batch: np.ndarray, config: FitConfig) -> tuple[tuple[float, ...], np.ndarray]:
    """The shift's batch edges and each state's bin index (bin ``k``: ``[edges[k-1], edges[k])``)."""
    edges = tuple(float(e) for e in config.shift_batch_edges)
    return edges, np.searchsorted(np.asarray(edges), batch, side="right")


def _bin_shifts(edges: tuple[float, ...], shifts: np.ndarray, mono_batch: int) -> ConformalShift:
    """The per-bin shifts, made non-decreasing in batch when the model is constrained non-increasing
    there, so the shifted model keeps that property (raising a shift never adds an unsafe state)."""
    if mono_batch == -1:
        shifts = np.maximum.accumulate(shifts)
    return ConformalShift(edges, tuple(float(v) for v in shifts))


def pooled_shift(
    oof_raw: np.ndarray,
    states: np.ndarray,
    labels: pd.DataFrame,
    cap: LeaseCap,
    config: FitConfig,
    mono_batch: int,
) -> ConformalShift:
    """Per-batch-bin log shifts sharing one unsafe budget: the out-of-fold unsafe count may total at
    most ``floor(unsafe_target * (n + 1)) - 1`` (as :func:`conformal_shift` allows one bin), and within
    it the shifts minimise the summed absolute percentage error of the full prediction (floor and KV
    cap included). Solved by a Lagrangian: for a price ``lam`` per unsafe state each bin takes its own
    best grid shift, and ``lam`` is bisected to the cheapest price that keeps the total within budget
    (so the result is always feasible). A bin with fewer than ``min_states_per_shift_bin`` states keeps
    the global conformal shift, its unsafe states counted against the budget. Shifts are made
    monotone in batch as :func:`mondrian_shift`'s are."""
    assert config.unsafe_target is not None
    y = labels[LABEL].to_numpy(dtype=float)
    n = len(y)
    batch = states[:, 0]
    excess = cap.log_excess(oof_raw, states, labels, config.unsafe_margin)
    glob = conformal_shift(excess, config.unsafe_target)
    edges, bins = _batch_bins(batch, config)
    finite = excess[np.isfinite(excess)]
    top = max(float(finite.max()) if len(finite) else 0.0, glob) + config.shift_grid_step
    grid = np.arange(min(0.0, glob) - 0.25, top, config.shift_grid_step)
    pos = y > 0
    denom = np.where(pos, y, 1.0)
    n_bins = len(edges) + 1
    shifts = np.full(n_bins, glob)
    budget = max(int(np.floor(config.unsafe_target * (n + 1))) - 1, 0)
    dense: list[int] = []
    ape_sum = np.zeros((n_bins, len(grid)))
    unsafe = np.zeros((n_bins, len(grid)))
    for k in range(n_bins):
        m = bins == k
        if m.sum() < config.min_states_per_shift_bin:
            budget -= int((excess[m] > glob).sum())
            continue
        dense.append(k)
        for j, s in enumerate(grid):
            pred = cap.apply(np.expm1(oof_raw[m] - s), states[m])
            ape_sum[k, j] = float((np.abs(pred - y[m]) / denom[m])[pos[m]].sum())
            unsafe[k, j] = float((excess[m] > s).sum())
    if dense:
        rows = np.asarray(dense)

        def choose(lam: float) -> tuple[np.ndarray, float]:
            j = np.argmin(ape_sum[rows] + lam * unsafe[rows], axis=1)
            return j, float(unsafe[rows, j].sum())

        lo, hi = 0.0, float(n) + 1.0  # at hi one unsafe state outweighs every possible error
        if choose(hi)[1] > budget:
            shifts[rows] = grid[-1]  # budget already spent by sparse bins: the safest grid shift
        else:
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                if choose(mid)[1] > budget:
                    lo = mid
                else:
                    hi = mid
            shifts[rows] = grid[choose(hi)[0]]
    return _bin_shifts(edges, shifts, mono_batch)


@dataclass
class FitResult:
    """A fitted model: the final booster (all data), its conformal shift and the CV evidence."""

    booster: lgb.Booster
    shift: ConformalShift
    cap: LeaseCap
    monotone_constraints: tuple[int, ...]
    config: FitConfig
    inputs: ModelInputs
    """What the trees see, from a node state."""
    oof_prediction: np.ndarray
    """Out-of-fold predictions (tokens/s, shift applied) aligned with the training labels."""
    cv_metrics: dict[str, float] = field(default_factory=dict)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Safe prefill tokens/s for rows of ``X`` (columns in ``FEATURES`` order), via LightGBM."""
        Z = self.inputs(X)
        raw = np.asarray(self.booster.predict(Z, num_threads=1), dtype=float)
        return self.cap.apply(np.expm1(raw - self.shift.for_batch(Z[:, 0])), X)

    def feature_importance(self) -> dict[str, float]:
        """Total split gain per feature, normalised to sum to 1."""
        gain = self.booster.feature_importance(importance_type="gain")
        total = float(gain.sum()) or 1.0
        return {f: float(g) / total for f, g in zip(self.inputs.names, gain, strict=True)}


def _train(
    X: np.ndarray, z: np.ndarray, config: FitConfig, mono: tuple[int, ...], names: tuple[str, ...]
) -> lgb.Booster:
    data = lgb.Dataset(X, z, feature_name=list(names), free_raw_data=False)
    return lgb.train(config.lgb_params(mono), data, num_boost_round=config.num_boost_round)


def fit_interference_model(
    labels: pd.DataFrame, label: LeaseLabel, config: FitConfig = FitConfig()
) -> FitResult:
    """Fit on ``labels`` (from :func:`interference_model.labels.derive_labels` with ``label``), one
    row per state.

    Grouped K-fold CV by ``state_group`` gives out-of-fold predictions, which set the conformal shift
    and the reported CV metrics (MAPE, unsafe share); the returned booster is then refit on all rows.
    """
    for col in (*FEATURES, LABEL, ITL_LABEL, "state_group", "kv_capacity_tokens"):
        if col not in labels.columns:
            raise ValueError(f"labels: missing column {col!r}")
    cap = LeaseCap.for_labels(labels, label, config.min_lease_tokens)
    inputs = ModelInputs.for_labels(labels, label, config)
    names = inputs.names
    states = labels[list(FEATURES)].to_numpy(dtype=float)
    X = inputs(states)
    y = labels[LABEL].to_numpy(dtype=float)
    z = np.log1p(labels[ITL_LABEL].to_numpy(dtype=float))
    mono = physical_monotone_constraints(label, names) if config.monotone else (0,) * len(names)
    oof_raw = np.empty(len(y))
    for train_idx, test_idx in group_kfold(labels["state_group"].to_numpy(), config.n_folds, config.seed):
        oof_raw[test_idx] = _train(X[train_idx], z[train_idx], config, mono, names).predict(X[test_idx])
    shift = ConformalShift((), (0.0,))
    if config.unsafe_target is not None:
        if config.shift_allocation == "pooled":
            shift = pooled_shift(oof_raw, states, labels, cap, config, mono[0])
        else:
            excess = cap.log_excess(oof_raw, states, labels, config.unsafe_margin)
            shift = mondrian_shift(excess, X[:, 0], config, mono[0])
    oof = cap.apply(np.expm1(oof_raw - shift.for_batch(X[:, 0])), states)
    result = FitResult(
        booster=_train(X, z, config, mono, names),
        shift=shift,
        cap=cap,
        monotone_constraints=mono,
        config=config,
        inputs=inputs,
        oof_prediction=oof,
        cv_metrics=accuracy_metrics(y, oof, config.unsafe_margin),
    )
    return result
