"""``heuristic-datasheet``: Crossflow's heuristic with the datasheet estimate in place of the learned model.

The interference model has to earn its place against what a user has before profiling anything: the
datasheet roofline (``envs.profiler.datasheet_roofline``: every operator at ``max(flops / peak, bytes /
bandwidth)``, nothing calibrated). :class:`DatasheetSafeRate` answers the heuristic's one question,
``safe_prefill_tokens_per_s(state)``, by inverting those iteration times through the same lease label
the learned model was fitted on (``interference_model.baselines.InvertedTimeModel``: the swept chunks
timed at the checkpoints a state is assumed to pass through). Label, hardware, model, TP and KV
capacity come from the learned artifact's metadata, so the two variants differ only in where the safe
rate comes from; lease sizing, chunk budget, guard and path rule are the same code.

One inversion costs tens of milliseconds (a table through the label code), so it is done once per
batch size over a grid of contexts (``DatasheetSafeRate``); the rounding moves the answer far less
than the roofline's own error (about 5x optimistic against the calibrated cost model on gpt-oss-120b,
docs/leases.md).

Registered here (``envs`` may use the profiler's catalog; ``policies`` may not), imported by
``train.experiment`` so every simulation entry point knows the name.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from envs.profiler import DEFAULT_CHUNK_SIZES, datasheet_roofline
from interference_model.baselines import InvertedTimeModel
from interference_model.fit import LeaseCap
from interference_model.labels import LeaseLabel
from interference_model.schema import FEATURES
from policies.catalog import CROSSFLOW_SOURCE, PolicySpec, policy_spec, register_policy
from policies.context import PolicyContext
from policies.node_policies import NODE_POLICIES, HeuristicPolicy, make_heuristic, register_node_policy

CONTEXT_STEP_TOKENS = 1024
"""The mean context is rounded up to a multiple of this (the conservative side) before the table
lookup."""
MAX_CONTEXT_TOKENS = 262_144
"""The table covers mean contexts up to this; longer ones are read at it."""


UNBOUNDED_KV_TOKENS = 10**15
"""KV capacity the ITL-part inversion is run with, so that its own KV room never binds."""


class DatasheetSafeRate:
    """Safe prefill tokens/s from the datasheet roofline, through the lease label (module docstring).

    The ITL part of the label (what the roofline's iteration times allow within the ITL target) is
    inverted once per batch size over a grid of mean contexts, with the KV room out of the way; the KV
    cap is then applied per state exactly as the learned predictor applies it (``LeaseCap``). A state
    is read at its mean context rounded up to ``CONTEXT_STEP_TOKENS``; the inversion times every
    request at the mean context (``assumed_checkpoints`` at step 0), so the spread of contexts and the
    remaining output enter only through the KV cap.

    Args:
        gpu, model, tp: the served model (``envs.hardware`` / ``envs.models`` catalog names).
        label: the lease label the learned model was fitted on.
        kv_capacity_tokens: one decode node's KV capacity (the label's KV room).
        min_rate_tokens_per_s: the learned artifact's floor (rates below it read as 0).
        cached_prefix_tokens: prefix the profiled chunks attended over.
    """

    def __init__(
        self,
        gpu: str,
        model: str,
        tp: int,
        label: LeaseLabel,
        kv_capacity_tokens: int,
        *,
        min_rate_tokens_per_s: float = 0.0,
        cached_prefix_tokens: int = 0,
    ) -> None:
        self.name = f"datasheet_roofline({gpu}/{model}/tp{tp})"
        self._inverted = InvertedTimeModel(
            datasheet_roofline(gpu, model, tp),
            label,
            DEFAULT_CHUNK_SIZES,
            (0,),
            UNBOUNDED_KV_TOKENS,
            cached_prefix_tokens=cached_prefix_tokens,
            name="datasheet_roofline",
        )
        self._cap = LeaseCap(label, float(kv_capacity_tokens), float(min_rate_tokens_per_s))
        self._contexts = np.arange(0, MAX_CONTEXT_TOKENS + 1, CONTEXT_STEP_TOKENS, dtype=float)
        self._itl: dict[int, np.ndarray] = {}

    def itl_rate(self, decode_batch_size: int, context_tokens_mean: float) -> float:
        """The label's ITL part by the roofline (tokens/s), before the KV cap."""
        batch = max(1, int(decode_batch_size))  # an idle node is timed as one request (the label needs one)
        row = self._itl.get(batch)
        if row is None:
            n = len(self._contexts)
            X = np.zeros((n, len(FEATURES)))  # no spread, no remaining output, an empty cache
            X[:, 0], X[:, 1] = float(batch), self._contexts
            row = self._itl[batch] = np.asarray(self._inverted.predict(X), dtype=float)
        i = min(len(row) - 1, math.ceil(max(0.0, context_tokens_mean) / CONTEXT_STEP_TOKENS))
        return float(row[i])

    def safe_prefill_tokens_per_s(
        self,
        decode_batch_size: int,
        context_tokens_mean: float,
        context_tokens_std: float,
        remaining_output_tokens_mean: float,
        kv_occupancy: float,
        remaining_output_tokens_max: float | None = None,
        remaining_output_tokens_context_weighted: float | None = None,
    ) -> float:
        x = np.asarray(
            [
                [
                    decode_batch_size,
                    context_tokens_mean,
                    context_tokens_std,
                    remaining_output_tokens_mean,
                    kv_occupancy,
                ]
            ],
            dtype=float,
        )
        itl = np.asarray([self.itl_rate(decode_batch_size, context_tokens_mean)])
        return float(self._cap.apply(itl, x)[0])

    def __repr__(self) -> str:
        return f"DatasheetSafeRate({self.name})"


def datasheet_from_learned(learned: Any) -> DatasheetSafeRate:
    """The datasheet counterpart of a learned predictor (``SafeThroughputPredictor``): same hardware,
    model, TP, label and KV capacity, read from its artifact metadata."""
    meta = getattr(learned, "metadata", None) or {}
    missing = [k for k in ("hardware", "model", "tp", "label", "kv_capacity_tokens") if k not in meta]
    if missing:
        raise ValueError(
            f"heuristic-datasheet needs the learned artifact's metadata to match it; missing {missing}"
        )
    return DatasheetSafeRate(
        str(meta["hardware"]),
        str(meta["model"]),
        int(meta["tp"]),
        LeaseLabel.from_dict(meta["label"]),
        int(meta["kv_capacity_tokens"]),
        min_rate_tokens_per_s=float(meta.get("min_rate_tokens_per_s", 0.0)),
        cached_prefix_tokens=int(meta.get("cached_prefix_tokens", 0)),
    )


def _make(ctx: PolicyContext, **params: Any) -> HeuristicPolicy:
    learned = ctx.require_predictor("heuristic-datasheet")
    return make_heuristic(ctx, datasheet_from_learned(learned), **params)


if "heuristic-datasheet" not in NODE_POLICIES:
    register_node_policy(
        "heuristic-datasheet",
        _make,
        needs_predictor=True,
        summary="the heuristic with the datasheet roofline's safe rate instead of the learned model",
    )
    register_policy(
        PolicySpec(
            "heuristic-datasheet",
            "Crossflow's heuristic with the datasheet roofline estimate in place of the learned model",
            node="heuristic-datasheet",
            path="lease",
            grid=dict(policy_spec("heuristic").grid),
            source=CROSSFLOW_SOURCE + ", envs/datasheet.py",
        )
    )

__all__ = ["DatasheetSafeRate", "datasheet_from_learned"]
