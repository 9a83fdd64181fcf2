"""A fast, dependency-light evaluator of the fitted trees for the scheduler's hot path.

LightGBM's own ``predict`` costs tens of microseconds per call on one thread (Python -> C), more
with its default thread pool. Here every tree is compiled into a lookup table over the grid its own
split thresholds cut the input space into. One global sorted threshold list per feature maps an
input to a global bin (``bisect``); per feature a precomputed ``(bins, trees)`` table turns that bin
into each tree's contribution to the flat index of its cell, so a prediction is one bisect per
model input, a few integer vector adds (the single call adds joint tables of feature pairs), one
gather and one sum, independent of tree depth. The result equals LightGBM's up to float summation
order.

Exactness rests on LightGBM's numerical decision ``x <= threshold`` -> left (thresholds are parsed
from the model text at full precision). Categorical splits, linear trees and zero-as-missing are
refused when compiling; inputs must be finite.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import Any

import numpy as np

from interference_model.fit import MODEL_FEATURES, ConformalShift, LeaseCap, model_inputs
from interference_model.schema import FEATURES


def _walk(tree: dict[str, Any], X: np.ndarray) -> np.ndarray:
    """Leaf values of ``tree`` (LightGBM ``dump_model`` structure) for the rows of ``X``."""
    out = np.empty(len(X))

    def visit(node: dict[str, Any], rows: np.ndarray) -> None:
        if "leaf_value" in node:
            out[rows] = node["leaf_value"]
            return
        go_left = X[rows, node["split_feature"]] <= node["threshold"]
        visit(node["left_child"], rows[go_left])
        visit(node["right_child"], rows[~go_left])

    visit(tree, np.arange(len(X)))
    return out


def _collect_splits(node: dict[str, Any], thresholds: list[set[float]]) -> None:
    if "leaf_value" in node:
        return
    if node.get("decision_type", "<=") != "<=" or node.get("missing_type", "None") == "Zero":
        raise ValueError(
            f"unsupported split {node.get('decision_type')}/{node.get('missing_type')}: "
            "only numerical '<=' splits without zero-as-missing can be compiled"
        )
    thresholds[node["split_feature"]].add(float(node["threshold"]))
    _collect_splits(node["left_child"], thresholds)
    _collect_splits(node["right_child"], thresholds)


class SafeThroughputPredictor:
    """Predicts safe prefill tokens/s of a decode node from its state (see ``FEATURES``).

    Built from a LightGBM model dump of the ITL part, its conformal shift and the :class:`LeaseCap`:
    the prediction is ``min(expm1(sum_of_trees - shift(batch)), KV room / horizon)`` tokens/s, the
    average over the label's horizon, with the learned part read as 0 below the cap's floor.
    ``metadata`` is the artifact's metadata (may be empty).
    """

    def __init__(
        self,
        model_dump: dict[str, Any],
        shift: ConformalShift,
        cap: LeaseCap,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        names = list(model_dump.get("feature_names", []))
        if names != list(MODEL_FEATURES):
            raise ValueError(f"model features {names} differ from this code's {list(MODEL_FEATURES)}")
        trees = [t["tree_structure"] for t in model_dump["tree_info"]]
        if not trees:
            raise ValueError("model has no trees")
        capacity = cap.kv_capacity_tokens
        if not (math.isfinite(capacity) and capacity > 0):
            raise ValueError(f"kv_capacity_tokens must be > 0, got {capacity!r}")
        self.shift, self.cap = shift, cap
        self._capacity, self._floor = float(capacity), float(cap.min_rate_tokens_per_s)
        self._horizon_s = cap.label.horizon_s if cap.label.kv_room else math.inf
        self._shift_edges = [float(e) for e in shift.batch_edges]
        self._shifts = [float(v) for v in shift.log_shifts]
        self.metadata: dict[str, Any] = dict(metadata or {})
        n_feat = len(MODEL_FEATURES)
        per_tree: list[list[set[float]]] = []
        for tree in trees:
            thresholds: list[set[float]] = [set() for _ in range(n_feat)]
            _collect_splits(tree, thresholds)
            per_tree.append(thresholds)
        self._global = [sorted(set().union(*(t[f] for t in per_tree))) for f in range(n_feat)]
        self._global_arr = [np.asarray(g, dtype=float) for g in self._global]
        # contrib[f][b, k]: tree k's flat-index contribution when feature f falls in global bin b.
        contrib = [np.zeros((len(g) + 1, len(trees)), dtype=np.int32) for g in self._global]
        tables: list[np.ndarray] = []
        offset = 0
        for k, (tree, thresholds) in enumerate(zip(trees, per_tree, strict=True)):
            local = [np.asarray(sorted(t), dtype=float) for t in thresholds]
            sizes = [len(t) + 1 for t in local]
            strides = np.cumprod([1, *sizes[:-1]])
            for f in range(n_feat):
                # Global bin b means x in (g[b-1], g[b]]; its local bin counts local thresholds < x.
                local_bin = np.searchsorted(local[f], self._global_arr[f], side="left")
                local_bin = np.r_[local_bin, len(local[f])]
                contrib[f][:, k] = local_bin * strides[f] + (offset if f == 0 else 0)
            # One representative point per local cell: its upper threshold, or +inf past the last one.
            axes = [np.r_[t, np.inf] for t in local]
            # Flat cell index = sum(local_bin[f] * strides[f]): feature 0 varies fastest (Fortran order).
            grid = np.column_stack([m.ravel(order="F") for m in np.meshgrid(*axes, indexing="ij")])
            tables.append(_walk(tree, grid))
            offset += int(np.prod(sizes))
        self._contrib = contrib
        self._table = np.concatenate(tables)
        self.n_trees = len(trees)
        if n_feat != 6:
            raise ValueError(f"the single-call path pairs 6 model inputs, the model has {n_feat}")
        # The single call adds three (bins_a x bins_b, trees) tables of feature pairs instead of six:
        # each numpy add costs about a microsecond at this size, the tables a few MB.
        self._pairs = [
            (contrib[a][:, None, :] + contrib[a + 1][None, :, :]).reshape(-1, len(trees)) for a in (0, 2, 4)
        ]
        self._pair_width = [len(contrib[a + 1]) for a in (0, 2, 4)]

    @property
    def table_entries(self) -> int:
        """Size of the compiled lookup table (memory: 8 bytes each)."""
        return len(self._table)

    def raw_predict(self, X: np.ndarray) -> np.ndarray:
        """Sum of tree outputs (LightGBM's ``raw_score``) for ``(n, len(FEATURES))`` node states."""
        Z = model_inputs(X)
        if not np.isfinite(Z).all():
            raise ValueError("node-state features must be finite")
        idx = self._contrib[0][np.searchsorted(self._global_arr[0], Z[:, 0], side="left")]
        for f in range(1, Z.shape[1]):
            idx = idx + self._contrib[f][np.searchsorted(self._global_arr[f], Z[:, f], side="left")]
        return self._table[idx].sum(axis=1)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Safe prefill tokens/s per row of ``X`` (columns in ``FEATURES`` order); vectorised."""
        shift = self.shift.for_batch(np.asarray(X, dtype=float)[:, 0])
        return self.cap.apply(np.expm1(self.raw_predict(X) - shift), np.asarray(X, dtype=float))

    def safe_prefill_tokens_per_s(
        self,
        decode_batch_size: float,
        context_tokens_mean: float,
        context_tokens_std: float,
        remaining_output_tokens_mean: float,
        kv_occupancy: float,
    ) -> float:
        """One node's safe prefill tokens/s over the label's horizon; the hot-path call (a few us)."""
        x = (
            decode_batch_size,
            context_tokens_mean,
            context_tokens_std,
            remaining_output_tokens_mean,
            kv_occupancy,
            decode_batch_size * context_tokens_mean,
        )
        try:
            finite = all(map(math.isfinite, x))
        except TypeError as exc:
            raise ValueError(f"node-state features must be numbers, got {x[:5]}") from exc
        if not finite:
            raise ValueError(f"node-state features must be finite, got {x[:5]}")
        g, (p0, p1, p2), (w0, w1, w2) = self._global, self._pairs, self._pair_width
        idx = (
            p0[bisect_left(g[0], x[0]) * w0 + bisect_left(g[1], x[1])]
            + p1[bisect_left(g[2], x[2]) * w1 + bisect_left(g[3], x[3])]
            + p2[bisect_left(g[4], x[4]) * w2 + bisect_left(g[5], x[5])]
        )
        shift = self._shifts[bisect_right(self._shift_edges, x[0])]
        value = math.expm1(float(self._table[idx].sum()) - shift)
        if value < self._floor or value <= 0.0:
            return 0.0
        # The KV cap, as labels.kv_room_tokens and LeaseLabel.kv_cap_tokens_per_s compute it.
        room = self._capacity * (1.0 - kv_occupancy) - decode_batch_size * remaining_output_tokens_mean
        return min(value, (room if room >= 1.0 else 0.0) / self._horizon_s)

    def __repr__(self) -> str:
        meta = self.metadata
        return (
            f"SafeThroughputPredictor({meta.get('hardware', '?')}/{meta.get('model', '?')}/"
            f"tp{meta.get('tp', '?')}, "
            f"itl_target={meta.get('itl_target', '?')}, trees={self.n_trees}, features={list(FEATURES)})"
        )
