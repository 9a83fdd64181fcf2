"""From raw profile rows to the label: safe prefill tokens per second of each node state.

For a target inter-token latency (ITL) ``T`` -- absolute, or a ratio to the state's decode-only step
time -- the *safe prefill throughput* of a state is the largest ``c / t(c)`` over prefill chunk sizes
``c`` whose iteration time ``t(c) <= T``. ``t`` is the median over repeats at each swept chunk size,
made non-decreasing in ``c`` (isotonic fit: more work never takes less time, and a noisy dip in a flat
stretch of the curve would otherwise move the crossing far), linearly interpolated between swept
sizes, with ``t(0)`` the decode-only time. Optionally the chunk
must also fit in the node's KV headroom: ``c <= kv_capacity * (1 - kv_occupancy) - batch *
remaining_output_mean`` (the running requests' remaining output is reserved). That headroom term is
why remaining output and KV occupancy matter: the iteration time itself does not depend on them.

One profile serves many targets: derive labels again with another :class:`ItlTarget`.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

from interference_model.schema import FEATURES

LABEL = "safe_prefill_tokens_per_s"


@dataclass(frozen=True, slots=True)
class ItlTarget:
    """An ITL target for the decode batch while prefill is mixed in.

    * ``ratio``: ``value`` x the decode-only step time (``"1.5x"``);
    * ``absolute_ms``: ``value`` milliseconds (``"40ms"``);
    * ``ratio_floor``: the looser of ``value`` x the decode-only step and ``floor_ms``
      (``"1.5x|25ms"``): a busy node keeps its step within the ratio, while a nearly idle node, whose
      decode step is a few milliseconds, may still lend up to an absolute per-token budget.
    """

    kind: Literal["ratio", "absolute_ms", "ratio_floor"]
    value: float
    floor_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("ratio", "absolute_ms", "ratio_floor"):
            raise ValueError(
                f"ItlTarget.kind must be 'ratio', 'absolute_ms' or 'ratio_floor', got {self.kind!r}"
            )
        ratio = self.kind in ("ratio", "ratio_floor")
        if not np.isfinite(self.value) or self.value <= 0 or (ratio and self.value < 1.0):
            raise ValueError(f"ItlTarget.value must be > 0 (and >= 1 for a ratio), got {self.value!r}")
        if self.kind == "ratio_floor" and not (np.isfinite(self.floor_ms) and self.floor_ms > 0):
            raise ValueError(f"ItlTarget.floor_ms must be > 0 for 'ratio_floor', got {self.floor_ms!r}")

    @classmethod
    def parse(cls, spec: str) -> ItlTarget:
        """``"1.5x"`` -> ratio 1.5; ``"40ms"`` -> 40 ms absolute; ``"1.5x|25ms"`` -> the looser of both."""
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*x\s*\|\s*([0-9]*\.?[0-9]+)\s*ms\s*", spec)
        if m:
            return cls("ratio_floor", float(m.group(1)), float(m.group(2)))
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(x|ms)\s*", spec)
        if not m:
            raise ValueError(
                f"ITL target {spec!r}: write a ratio like '1.5x', an absolute like '40ms', "
                "or the looser of both like '1.5x|25ms'"
            )
        return cls("ratio" if m.group(2) == "x" else "absolute_ms", float(m.group(1)))

    def __str__(self) -> str:
        if self.kind == "ratio_floor":
            return f"{self.value:g}x|{self.floor_ms:g}ms"
        return f"{self.value:g}x" if self.kind == "ratio" else f"{self.value:g}ms"

    def target_s(self, decode_only_time_s: np.ndarray) -> np.ndarray:
        """The per-state iteration-time budget in seconds."""
        t0 = np.asarray(decode_only_time_s, dtype=float)
        if self.kind == "ratio":
            return self.value * t0
        if self.kind == "absolute_ms":
            return np.full_like(t0, self.value / 1000.0)
        return np.maximum(self.value * t0, self.floor_ms / 1000.0)


def _non_decreasing(values: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit (pool adjacent violators) of a short sequence."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values.tolist():
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return np.repeat([b[0] for b in blocks], [int(b[1]) for b in blocks])


def _best_chunk(
    chunks: np.ndarray, times: np.ndarray, target_s: float, cap_tokens: float
) -> tuple[float, float]:
    """Max of c / t(c) over the feasible part of the piecewise-linear curve; returns (chunk, time).

    ``chunks[0] == 0`` (the decode-only point). Within a segment both constraints are linear in c, so
    the feasible set is an interval and c / t(c) is monotone on it: checking its ends is enough.
    """
    c0, c1, t0, t1 = chunks[:-1], chunks[1:], times[:-1], times[1:]
    slope = (t1 - t0) / (c1 - c0)
    lo, hi = c0.copy(), np.minimum(c1, cap_tokens)
    rising = slope > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        crossing = c0 + (target_s - t0) / slope
    hi = np.where(rising, np.minimum(hi, crossing), hi)
    lo = np.where(slope < 0, np.maximum(lo, crossing), lo)
    lo = np.where((slope == 0) & (t0 > target_s), np.inf, lo)
    ok = lo <= hi
    if not ok.any():
        return 0.0, float(times[0])
    ends = np.concatenate([lo[ok], hi[ok]])
    seg = np.concatenate([np.flatnonzero(ok), np.flatnonzero(ok)])
    t_ends = t0[seg] + slope[seg] * (ends - c0[seg])
    thr = np.where(ends > 0, ends / t_ends, 0.0)
    k = int(np.argmax(thr))
    return float(ends[k]), float(t_ends[k])


def derive_labels(
    profiles: pd.DataFrame,
    itl_target: ItlTarget,
    *,
    cached_prefix_tokens: int = 0,
    respect_kv_headroom: bool = False,
    smooth: bool = True,
) -> pd.DataFrame:
    """One row per ``state_id``: the node state, ``decode_only_time_s`` (median), ``itl_target_s``,
    ``safe_chunk_tokens``, ``safe_prefill_tokens_per_s`` and ``limited_by`` (``"itl"``, ``"kv"``,
    ``"sweep"`` -- the largest swept chunk still fits, so the label is a lower bound -- or ``"none"``
    when nothing fits and the label is 0).

    Only rows with ``cached_prefix_tokens`` equal to the argument are used (the label is for prefill
    work with that much cached prefix). ``profiles`` must be validated (see ``validate_profiles``).
    """
    rows = profiles[profiles["cached_prefix_tokens"] == cached_prefix_tokens]
    if rows.empty:
        have = sorted(profiles["cached_prefix_tokens"].unique().tolist())
        raise ValueError(f"no profile rows with cached_prefix_tokens={cached_prefix_tokens}; have {have}")
    curve = rows.groupby(["state_id", "chunk_tokens"], sort=True)["iteration_time_s"].median()
    states = rows.groupby("state_id", sort=True).agg(
        {
            **{
                c: "first"
                for c in ("source", "hardware", "model", "tp", "state_group", *FEATURES, "kv_capacity_tokens")
            },
            "decode_only_time_s": "median",
        }
    )
    target_s = itl_target.target_s(states["decode_only_time_s"].to_numpy())
    if respect_kv_headroom:
        cap = (
            states["kv_capacity_tokens"] * (1.0 - states["kv_occupancy"])
            - states["decode_batch_size"] * states["remaining_output_tokens_mean"]
        ).to_numpy()
        cap = np.maximum(cap, 0.0)
    else:
        cap = np.full(len(states), np.inf)
    state_of_point = curve.index.get_level_values(0).to_numpy()
    chunk_of_point = curve.index.get_level_values(1).to_numpy().astype(float)
    bounds = np.flatnonzero(np.r_[True, state_of_point[1:] != state_of_point[:-1], True])
    t_points = curve.to_numpy()
    best_c = np.zeros(len(states))
    best_t = np.zeros(len(states))
    limited = np.empty(len(states), dtype=object)
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        chunks = np.r_[0.0, chunk_of_point[a:b]]
        times = np.r_[states["decode_only_time_s"].iat[i], t_points[a:b]]
        if smooth:
            times = _non_decreasing(times)
        c, t = _best_chunk(chunks, times, float(target_s[i]), float(cap[i]))
        best_c[i], best_t[i] = c, t
        if c <= 0:
            limited[i] = "none"
        elif c >= cap[i] - 1e-9:
            limited[i] = "kv"
        elif c >= chunks[-1] and times[-1] <= target_s[i]:
            limited[i] = "sweep"
        else:
            limited[i] = "itl"
    out = states.reset_index()
    out["itl_target_s"] = target_s
    out["safe_chunk_tokens"] = best_c
    out[LABEL] = np.where(best_c > 0, best_c / np.where(best_t > 0, best_t, 1.0), 0.0)
    out["limited_by"] = limited
    return out
