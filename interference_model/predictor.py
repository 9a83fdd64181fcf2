"""The fitted model as the scheduler's hot path calls it: one node state in, safe prefill tokens/s out.

LightGBM's Python ``predict`` costs tens of microseconds per call on one thread (argument checks, a
numpy copy, a thread pool). The single call here goes through LightGBM's own C single-row fast path
(``LGBM_BoosterPredictForMatSingleRowFast``): a prediction configuration made once (raw score, one
thread, one float64 column per tree input), a preallocated ctypes row buffer the inputs are
written into, and one C call that walks the trees. The answer is LightGBM's own, bit for bit; the
trees' nodes are a few hundred KB, so the walk stays in cache however many inputs the model has.

An earlier version compiled every tree into a lookup table over the cells its thresholds cut the
input space into. With the drain features (eight model inputs) those tables grew to about 80 MB per
artifact, and a call cycling over different states spent its time in cache misses (about 20 us on
the development machine, against 6-9 us for the fast path).

``predict`` (many rows) uses LightGBM's ``predict`` with ``num_threads=1``. Where the C entry point
cannot be reached (a LightGBM build without it), the single call falls back to ``predict`` of one row
and ``fast_path`` says so.
"""

from __future__ import annotations

import ctypes
import math
import threading
from bisect import bisect_right
from typing import Any

import lightgbm as lgb
import numpy as np

from interference_model.fit import ConformalShift, LeaseCap, ModelInputs
from interference_model.schema import FEATURES

_PREDICT_RAW_SCORE = 1  # C_API_PREDICT_RAW_SCORE
_DTYPE_FLOAT64 = 1  # C_API_DTYPE_FLOAT64


class _SingleRow:
    """LightGBM's single-row fast path for one booster (raw score, one thread).

    The call goes through this object's own handle on LightGBM's shared library, without ctypes
    ``argtypes`` (every argument is already a ctypes object: converting them costs about 2 us a
    call), so LightGBM's own function objects are left as they are."""

    def __init__(self, booster: lgb.Booster, n_inputs: int) -> None:
        self._booster = booster  # the configuration points into it: keep it alive as long as this
        lib = ctypes.CDLL(lgb.basic._LIB._name)
        self._free = lib.LGBM_FastConfigFree
        self._error = lib.LGBM_GetLastError
        self._error.restype = ctypes.c_char_p
        self.config = ctypes.c_void_p()
        rc = lib.LGBM_BoosterPredictForMatSingleRowFastInit(
            booster._handle,
            ctypes.c_int(_PREDICT_RAW_SCORE),
            ctypes.c_int(0),
            ctypes.c_int(-1),
            ctypes.c_int(_DTYPE_FLOAT64),
            ctypes.c_int32(n_inputs),
            ctypes.c_char_p(b"num_threads=1"),
            ctypes.byref(self.config),
        )
        if rc != 0:
            raise RuntimeError(self._error().decode())
        self.call = lib.LGBM_BoosterPredictForMatSingleRowFast
        self.call.restype = ctypes.c_int
        self.row = (ctypes.c_double * n_inputs)()
        self.row_ptr = ctypes.c_void_p(ctypes.addressof(self.row))
        self.out = (ctypes.c_double * 1)()
        self._out_len = ctypes.c_int64()
        self.out_len_ref = ctypes.byref(self._out_len)

    def fail(self) -> RuntimeError:
        return RuntimeError(f"LightGBM single-row prediction failed: {self._error().decode()}")

    def __del__(self) -> None:
        config = getattr(self, "config", None)
        if config is not None and config.value:
            self._free(config)


class SafeThroughputPredictor:
    """Predicts safe prefill tokens/s of a decode node from its state (see ``FEATURES``).

    Built from the LightGBM model of the ITL part (a ``Booster`` or its model text), its conformal
    shift and the :class:`LeaseCap`: the prediction is ``min(expm1(sum_of_trees - shift(batch)),
    KV room / horizon)`` tokens/s, the average over the label's horizon, with the learned part read
    as 0 below the cap's floor. ``inputs`` maps a node state to the trees' inputs (default: the
    plain ``MODEL_FEATURES``). ``metadata`` is the artifact's metadata (may be empty). The single
    call is serialised by a lock (the fast path reuses one buffer); pickling keeps the model text.
    """

    def __init__(
        self,
        model: lgb.Booster | str,
        shift: ConformalShift,
        cap: LeaseCap,
        metadata: dict[str, Any] | None = None,
        inputs: ModelInputs | None = None,
    ) -> None:
        booster = lgb.Booster(model_str=model) if isinstance(model, str) else model
        inputs = inputs if inputs is not None else ModelInputs(cap.label)
        names = list(booster.feature_name())
        if names != list(inputs.names):
            raise ValueError(f"model features {names} differ from the inputs' {list(inputs.names)}")
        if booster.num_trees() == 0:
            raise ValueError("model has no trees")
        capacity = cap.kv_capacity_tokens
        if not (math.isfinite(capacity) and capacity > 0):
            raise ValueError(f"kv_capacity_tokens must be > 0, got {capacity!r}")
        self._booster = booster
        self.shift, self.cap, self.inputs = shift, cap, inputs
        self._slack = inputs.slack_function() if inputs.decode_step is not None else None
        self._capacity, self._floor = float(capacity), float(cap.min_rate_tokens_per_s)
        self._horizon_s = cap.label.horizon_s if cap.label.kv_room else math.inf
        self._shift_edges = [float(e) for e in shift.batch_edges]
        self._shifts = [float(v) for v in shift.log_shifts]
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.n_trees = booster.num_trees()
        self._lock = threading.Lock()
        self._single: _SingleRow | None
        try:
            self._single = _SingleRow(booster, len(inputs.names))
        except (AttributeError, RuntimeError):
            self._single = None

    @property
    def fast_path(self) -> bool:
        """Whether the single call uses LightGBM's C single-row fast path (else ``predict``)."""
        return self._single is not None

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            SafeThroughputPredictor,
            (self._booster.model_to_string(), self.shift, self.cap, self.metadata, self.inputs),
        )

    def raw_predict(self, X: np.ndarray) -> np.ndarray:
        """Sum of tree outputs (LightGBM's ``raw_score``) for ``(n, len(FEATURES))`` node states."""
        Z = self.inputs(X)
        if not np.isfinite(Z).all():
            raise ValueError("node-state features must be finite")
        return np.asarray(self._booster.predict(Z, raw_score=True, num_threads=1), dtype=float)

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
        remaining_output_tokens_max: float | None = None,
        remaining_output_tokens_context_weighted: float | None = None,
    ) -> float:
        """One node's safe prefill tokens/s over the label's horizon; the hot-path call (a few us).

        The drain features default to the mean remaining output (``columns.DRAIN_FEATURES``: a batch
        whose requests all end together); the answer is then less accurate and not always lower (on
        held-out simulated states, up to 2.8% of them more than 5% above the label), so pass them."""
        rem = remaining_output_tokens_mean
        longest, weighted = remaining_output_tokens_max, remaining_output_tokens_context_weighted
        context_sum = decode_batch_size * context_tokens_mean
        x: tuple[float, ...] = (
            decode_batch_size,
            context_tokens_mean,
            context_tokens_std,
            rem,
            kv_occupancy,
            rem if longest is None else longest,
            rem if weighted is None else weighted,
            context_sum,
        )
        try:
            finite = all(map(math.isfinite, x))
        except TypeError as exc:
            raise ValueError(f"node-state features must be numbers, got {x[:-1]}") from exc
        if not finite:
            raise ValueError(f"node-state features must be finite, got {x[:-1]}")
        if self._slack is not None:
            x = (*x, self._slack(decode_batch_size, context_sum))
        single = self._single
        if single is None:
            raw = float(self._booster.predict(np.asarray([x]), raw_score=True, num_threads=1)[0])
        else:
            with self._lock:
                single.row[:] = x  # type: ignore[call-overload]  # ctypes takes any sequence
                if single.call(single.config, single.row_ptr, single.out_len_ref, single.out):
                    raise single.fail()
                raw = single.out[0]
        value = math.expm1(raw - self._shifts[bisect_right(self._shift_edges, x[0])])
        if value < self._floor or value <= 0.0:
            return 0.0
        # The KV cap, as labels.kv_room_tokens and LeaseLabel.kv_cap_tokens_per_s compute it.
        room = self._capacity * (1.0 - kv_occupancy) - decode_batch_size * rem
        return min(value, (room if room >= 1.0 else 0.0) / self._horizon_s)

    def __repr__(self) -> str:
        meta = self.metadata
        return (
            f"SafeThroughputPredictor({meta.get('hardware', '?')}/{meta.get('model', '?')}/"
            f"tp{meta.get('tp', '?')}, "
            f"itl_target={meta.get('itl_target', '?')}, trees={self.n_trees}, features={list(FEATURES)})"
        )
