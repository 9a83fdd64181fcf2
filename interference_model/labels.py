"""From raw profile rows to the label: the prefill a decode node can promise over a lease.

**The label** (``safe_prefill_tokens_per_s``) is a lease's promise: the prefill tokens a decode
node can absorb over the lease's horizon ``H`` (its TTL) while

* every iteration stays within the per-step budget ``T = min(ITL target, TPOT SLO)``, with the ITL
  target taken against the state's own decode-only step at the start (:class:`ItlTarget`), so the
  running decodes keep the TPOT SLO (mean inter-token time) whatever their history; and
* the KV stays within room: the lent prefill's own KV fits in what pinned KV and the running
  requests' final footprint (context + remaining output) leave free,

given how the batch evolves: each iteration adds one token to every running request, requests
leave when their remaining output runs out, and no new decode arrives inside the horizon (the lease
is revoked as soon as decode requests queue). It is reported as a rate, the tokens averaged over the
horizon (``tokens / H``), which is what the heuristic multiplies by its TTL.

It factors exactly into two parts, ``tokens = min(ITL tokens, KV room)``:

* the **ITL part** (``itl_safe_prefill_tokens_per_s``) is measured: the horizon played step by
  step on the profile (below); this is what the interference model learns;
* the **KV room** (``kv_room_tokens``, :func:`kv_room_tokens`) is known from the state itself:
  ``capacity x (1 - occupancy) - batch x mean remaining output``. The KV that leaving requests free
  inside the horizon is not lent: where the KV is full at the start, whether one of them happens to
  finish in time flips the promise between 0 and thousands of tokens/s, and a node cannot know it
  (a remaining output is a forecast), so a promise must not count on it. With that, the room is the
  same at every step and the cap applies to the total.

**The ITL part from a profile.** Each state is measured at checkpoints ``decode_step`` = 0, k1,
k2, ... of its evolution (``interference_model.schema``). At each checkpoint the iteration time
``t(c)`` of a prefill chunk ``c`` is the median over repeats at each swept chunk, made
non-decreasing in ``c`` (isotonic fit: more work never takes less time, and a noisy dip in a flat
stretch would otherwise move the crossing far), linearly interpolated between swept chunks with
``t(0)`` the decode-only time. Between checkpoints the curves are interpolated linearly in the step
index; past the last checkpoint the last one holds (a batch only shrinks, so that is conservative,
and the profilers stop when it is empty). The horizon is then played step by step: each iteration
takes the chunk with the highest rate ``c / t(c)`` among those with ``t(c) <= T``, the clock
advances by its ``t(c)`` (an iteration cut by the horizon counts pro rata), until ``H`` seconds
have passed.

Why the highest rate and not the largest chunk: over a fixed horizon the total is the time-average
of the per-step rate, and on the piecewise-linear curve the rate ``c / t(c)`` is monotone within
each segment, so its best feasible point is an end of a feasible interval (checked exhaustively).

A profile with a single checkpoint (step 0, e.g. schema version 1) gives the *frozen* label: the
state's instantaneous safe rate held over the horizon, capped by its KV room.

One profile serves many labels: derive again with another :class:`LeaseLabel`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

from interference_model.schema import FEATURES

LABEL = "safe_prefill_tokens_per_s"
ITL_LABEL = "itl_safe_prefill_tokens_per_s"
"""The ITL part of the label (no KV cap): what the interference model learns."""
DEFAULT_HORIZON_S = 8.0
"""The heuristic's lease TTL (``policies.node_policies.HeuristicPolicy.ttl_s``)."""
DEFAULT_TPOT_SLO_MS = 50.0
"""The per-request TPOT SLO of the evaluation (mean inter-token time <= 50 ms)."""


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

    def budget_terms(self) -> tuple[float, float]:
        """``(ratio, floor_s)``: every kind's budget is ``max(ratio x decode-only step, floor_s)`` (an
        absolute target has ratio 0, a plain ratio floor 0); the one formula :meth:`target_s` and a
        scalar hot path both use."""
        if self.kind == "ratio":
            return self.value, 0.0
        if self.kind == "absolute_ms":
            return 0.0, self.value / 1000.0
        return self.value, self.floor_ms / 1000.0

    def target_s(self, decode_only_time_s: np.ndarray) -> np.ndarray:
        """The per-state iteration-time budget in seconds."""
        ratio, floor_s = self.budget_terms()
        return np.maximum(ratio * np.asarray(decode_only_time_s, dtype=float), floor_s)


@dataclass(frozen=True, slots=True)
class LeaseLabel:
    """What a label promises: per-step ITL target, TPOT cap, horizon and KV room (module docstring)."""

    itl_target: ItlTarget
    horizon_s: float = DEFAULT_HORIZON_S
    """The lease's TTL: the label is the prefill over this many seconds, as tokens/s."""
    tpot_slo_ms: float = DEFAULT_TPOT_SLO_MS
    """No iteration may take longer, whatever the ITL target allows."""
    kv_room: bool = True
    """Cap the lent prefill by the KV room (:func:`kv_room_tokens`); ``False``: the ITL part only."""

    def __post_init__(self) -> None:
        if not (np.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ValueError(f"LeaseLabel.horizon_s must be > 0 seconds, got {self.horizon_s!r}")
        if not (np.isfinite(self.tpot_slo_ms) and self.tpot_slo_ms > 0):
            raise ValueError(f"LeaseLabel.tpot_slo_ms must be > 0, got {self.tpot_slo_ms!r}")

    @classmethod
    def parse(
        cls,
        itl_target: str,
        horizon_s: float = DEFAULT_HORIZON_S,
        tpot_slo_ms: float = DEFAULT_TPOT_SLO_MS,
        kv_room: bool = True,
    ) -> LeaseLabel:
        return cls(ItlTarget.parse(itl_target), float(horizon_s), float(tpot_slo_ms), kv_room)

    def kv_cap_tokens_per_s(self, kv_room: np.ndarray) -> np.ndarray:
        """The KV room spread over the horizon (tokens/s); +inf without the KV cap."""
        room = np.asarray(kv_room, dtype=float)
        return room / self.horizon_s if self.kv_room else np.full(room.shape, np.inf)

    def step_budget_s(self, decode_only_time_s: np.ndarray) -> np.ndarray:
        """Per-iteration time budget ``T`` from the start state's decode-only step (seconds)."""
        return np.minimum(self.itl_target.target_s(decode_only_time_s), self.tpot_slo_ms / 1000.0)

    def to_dict(self) -> dict[str, Any]:
        t = self.itl_target
        return {
            "kind": "lease_horizon",
            "itl_target": {"kind": t.kind, "value": t.value, "floor_ms": t.floor_ms, "spec": str(t)},
            "horizon_s": self.horizon_s,
            "tpot_slo_ms": self.tpot_slo_ms,
            "kv_room": self.kv_room,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LeaseLabel:
        """Inverse of :meth:`to_dict`; raises ``KeyError`` / ``ValueError`` on a malformed dict."""
        if d.get("kind") != "lease_horizon":
            raise ValueError(f"label kind {d.get('kind')!r} is not 'lease_horizon'")
        t = d["itl_target"]
        target = ItlTarget(t["kind"], float(t["value"]), float(t.get("floor_ms", 0.0)))
        return cls(target, float(d["horizon_s"]), float(d["tpot_slo_ms"]), bool(d["kv_room"]))

    def __str__(self) -> str:
        kv = "" if self.kv_room else ", no KV cap"
        return f"{self.itl_target} per step (<= {self.tpot_slo_ms:g} ms) over {self.horizon_s:g} s{kv}"


def kv_room_tokens(
    decode_batch_size: np.ndarray,
    remaining_output_tokens_mean: np.ndarray,
    kv_occupancy: np.ndarray,
    kv_capacity_tokens: np.ndarray | float,
) -> np.ndarray:
    """KV tokens a lease can lend: ``capacity x (1 - occupancy) - batch x mean remaining output``
    (what pinned KV and the running requests' final footprint leave free), 0 below one token."""
    room = np.asarray(kv_capacity_tokens, dtype=float) * (1.0 - np.asarray(kv_occupancy, dtype=float))
    room = room - np.asarray(decode_batch_size, dtype=float) * np.asarray(
        remaining_output_tokens_mean, dtype=float
    )
    return np.where(room >= 1.0, room, 0.0)


def _non_decreasing(values: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit of each row of ``values`` (equal weights), vectorised.

    Uses the min-max form of isotonic regression, ``fit[i] = max_{j<=i} min_{k>=i} mean(v[j..k])``,
    which for the short curves of a profile (a dozen points) is cheaper than looping a pool-adjacent-
    violators pass over tens of thousands of rows.
    """
    v = np.asarray(values, dtype=float)
    m = v.shape[-1]
    csum = np.concatenate([np.zeros((*v.shape[:-1], 1)), np.cumsum(v, axis=-1)], axis=-1)
    j = np.arange(m)[:, None]
    k = np.arange(m)[None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = (csum[..., None, 1:] - csum[..., :-1, None]) / (k - j + 1)  # [..., j, k]
    means = np.where(k >= j, means, np.inf)
    tail_min = np.minimum.accumulate(means[..., ::-1], axis=-1)[..., ::-1]  # [j, i] = min_{k>=i}
    tail_min = np.where(k >= j, tail_min, -np.inf)  # only j <= i counts
    return np.max(tail_min, axis=-2)


def best_chunks(
    chunks: np.ndarray, times: np.ndarray, budget_s: np.ndarray, cap_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the chunk with the highest rate ``c / t(c)`` with ``t(c) <= budget`` and ``c <= cap``.

    ``chunks`` (m,) ascending with ``chunks[0] == 0``; ``times`` (n, m) the iteration time at each
    chunk (column 0: decode-only), linearly interpolated in between; ``budget_s`` and ``cap_tokens``
    (n,). Returns (chunk, its iteration time); (0, decode-only time) where no positive chunk fits.
    Within a segment both constraints are linear in c, so the feasible set is an interval and c / t(c)
    is monotone on it: checking the interval's ends is exact.
    """
    chunks = np.asarray(chunks, dtype=float)
    times = np.asarray(times, dtype=float)
    c0, c1 = chunks[None, :-1], chunks[None, 1:]
    t0, t1 = times[:, :-1], times[:, 1:]
    slope = (t1 - t0) / (c1 - c0)
    budget = np.asarray(budget_s, dtype=float)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        crossing = c0 + (budget - t0) / slope
        lo = np.broadcast_to(c0, slope.shape)
        hi = np.minimum(c1, np.asarray(cap_tokens, dtype=float)[:, None])
        hi = np.where(slope > 0, np.minimum(hi, crossing), hi)
        lo = np.where(slope < 0, np.maximum(lo, crossing), lo)
        lo = np.where((slope <= 0) & (t0 > budget) & (t1 > budget), np.inf, lo)
        ok = lo <= hi
        ends = np.concatenate([lo, hi], axis=1)
        seg = np.tile(np.arange(slope.shape[1]), 2)
        t_ends = t0[:, seg] + slope[:, seg] * (ends - chunks[seg])
        rate = np.where(np.concatenate([ok, ok], axis=1) & (ends > 0), ends / t_ends, -1.0)
    pick = np.argmax(rate, axis=1)
    rows = np.arange(len(times))
    found = rate[rows, pick] > 0
    return (
        np.where(found, ends[rows, pick], 0.0),
        np.where(found, t_ends[rows, pick], times[:, 0]),
    )


@dataclass
class _Roll:
    """Result of playing one group of states over the horizon (ITL part, no KV cap)."""

    tokens: np.ndarray
    steps: np.ndarray
    sweep_bound: np.ndarray


def roll_horizon(
    steps: np.ndarray, chunks: np.ndarray, times: np.ndarray, budget_s: np.ndarray, horizon_s: float
) -> _Roll:
    """Play ``n`` states over the horizon (module docstring): ``steps`` (J,) checkpoint steps,
    ascending from 0; ``chunks`` (m,) from 0; ``times`` (n, J, m) smoothed iteration times;
    ``budget_s`` (n,) the per-step budget."""
    n = len(budget_s)
    tokens, clock, count = np.zeros(n), np.zeros(n), np.zeros(n)
    sweep_bound = np.zeros(n, dtype=bool)
    top = float(chunks[-1])
    unbounded = np.full(n, np.inf)
    for k in range(int(steps[-1])):
        live = clock < horizon_s
        if not live.any():
            break
        j = int(np.searchsorted(steps, k, side="right")) - 1
        w = (k - steps[j]) / (steps[j + 1] - steps[j])
        c, t = best_chunks(chunks, (1.0 - w) * times[:, j] + w * times[:, j + 1], budget_s, unbounded)
        frac = np.where(live, np.minimum(1.0, (horizon_s - clock) / t), 0.0)
        tokens += c * frac
        clock += t * frac
        count += frac
        sweep_bound |= live & (c >= top) & (t <= budget_s)
    # Past the last checkpoint the batch holds still: the rest of the horizon in closed form.
    left_s = np.maximum(horizon_s - clock, 0.0)
    c, t = best_chunks(chunks, times[:, -1], budget_s, unbounded)
    tokens += c * left_s / t
    count += left_s / t
    sweep_bound |= (left_s > 0) & (c >= top) & (t <= budget_s)
    return _Roll(tokens, count, sweep_bound)


def _curves(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
    """Per-checkpoint decode-only median and the median curve per chunk."""
    checkpoints = rows.groupby(["state_id", "decode_step"], sort=True).agg(
        decode_only_time_s=("decode_only_time_s", "median")
    )
    curve = rows.groupby(["state_id", "decode_step", "chunk_tokens"], sort=True)["iteration_time_s"].median()
    return checkpoints, curve


def _signatures(curve: pd.Series, source: str) -> pd.Series:
    """Per state: (checkpoint steps, chunk sizes); every checkpoint of a state must sweep the same
    chunks, and step 0 must be measured."""
    idx = curve.index.to_frame(index=False)
    per_checkpoint = idx.groupby(["state_id", "decode_step"], sort=True)["chunk_tokens"].agg(tuple)
    frame = per_checkpoint.reset_index()
    first = frame.groupby("state_id", sort=True)["chunk_tokens"].transform("first")
    bad = frame[frame["chunk_tokens"] != first]
    if len(bad):
        row = bad.iloc[0]
        raise ValueError(
            f"{source}: state_id {int(row['state_id'])} sweeps other chunks at decode_step "
            f"{int(row['decode_step'])} than at its first checkpoint; every checkpoint must sweep the same"
        )
    steps = frame.groupby("state_id", sort=True)["decode_step"].agg(tuple)
    no_zero = steps[[s[0] != 0 for s in steps]]
    if len(no_zero):
        raise ValueError(
            f"{source}: state_id {int(no_zero.index[0])} has no decode_step 0 (the state itself) "
            f"but {list(no_zero.iloc[0])}"
        )
    chunks = frame.groupby("state_id", sort=True)["chunk_tokens"].first()
    return pd.Series(list(zip(steps, chunks, strict=True)), index=steps.index)


def derive_labels(
    profiles: pd.DataFrame,
    label: LeaseLabel,
    *,
    cached_prefix_tokens: int = 0,
    smooth: bool = True,
    source: str = "<profiles>",
) -> pd.DataFrame:
    """One row per ``state_id``: the node state (features, ``kv_capacity_tokens``), the step-0
    ``decode_only_time_s`` (median), the step budget ``itl_target_s``, ``horizon_s``,
    ``checkpoints`` (measured steps), ``horizon_steps`` (iterations the ITL part's horizon held),
    ``itl_safe_prefill_tokens_per_s`` (the ITL part), ``kv_room_tokens``, the label
    (``safe_prefill_tokens`` over the horizon and ``safe_prefill_tokens_per_s``),
    ``safe_chunk_tokens`` (the first iteration's chunk), ``instant_safe_prefill_tokens_per_s`` (the
    best rate of the first iteration without KV cap: a label of the instantaneous step) and
    ``limited_by``: ``"kv"`` (the KV room bounds the label), ``"none"`` (nothing fits the step
    budget; the label is 0), ``"sweep"`` (the largest swept chunk fitted at some step, so the label
    is a lower bound) or ``"itl"``.

    Only rows with ``cached_prefix_tokens`` equal to the argument are used (the label is for prefill
    work with that much cached prefix). ``profiles`` must be validated (see ``validate_profiles``);
    ``source`` names it in errors.
    """
    rows = profiles[profiles["cached_prefix_tokens"] == cached_prefix_tokens]
    if rows.empty:
        have = sorted(profiles["cached_prefix_tokens"].unique().tolist())
        raise ValueError(
            f"{source}: no profile rows with cached_prefix_tokens={cached_prefix_tokens}; have {have}"
        )
    state_cols = ("source", "hardware", "model", "tp", "state_group", *FEATURES, "kv_capacity_tokens")
    states = rows.groupby("state_id", sort=True).agg({c: "first" for c in state_cols})
    checkpoints, curve = _curves(rows)
    signature = _signatures(curve, source)
    n = len(states)
    t_start = checkpoints.xs(0, level="decode_step")["decode_only_time_s"].to_numpy()
    budget = label.step_budget_s(t_start)
    room = kv_room_tokens(
        states["decode_batch_size"].to_numpy(),
        states["remaining_output_tokens_mean"].to_numpy(),
        states["kv_occupancy"].to_numpy(),
        states["kv_capacity_tokens"].to_numpy(),
    )
    cap = room if label.kv_room else np.full(n, np.inf)
    itl_tokens, steps_held, sweep = np.zeros(n), np.zeros(n), np.zeros(n, dtype=bool)
    first_c, instant, n_checkpoints = np.zeros(n), np.zeros(n), np.zeros(n, dtype=np.int64)
    position = pd.Series(np.arange(n), index=states.index)
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for sid, sig in signature.items():
        groups.setdefault(sig, []).append(int(sid))
    for (steps, chunks), members in groups.items():
        ids = np.asarray(members)
        at = position[ids].to_numpy()
        n_g, n_j, n_c = len(ids), len(steps), len(chunks)
        sel_curve = curve.loc[ids].to_numpy().reshape(n_g, n_j, n_c)
        t_decode = checkpoints.loc[ids]["decode_only_time_s"].to_numpy().reshape(n_g, n_j, 1)
        times = np.concatenate([t_decode, sel_curve], axis=2)
        if smooth:
            times = _non_decreasing(times)
        grid = np.r_[0.0, np.asarray(chunks, dtype=float)]
        roll = roll_horizon(np.asarray(steps, dtype=float), grid, times, budget[at], label.horizon_s)
        itl_tokens[at], steps_held[at], sweep[at] = roll.tokens, roll.steps, roll.sweep_bound
        first_c[at], _ = best_chunks(grid, times[:, 0], budget[at], cap[at])
        ci, ti = best_chunks(grid, times[:, 0], budget[at], np.full(n_g, np.inf))
        instant[at] = np.where(ci > 0, ci / ti, 0.0)
        n_checkpoints[at] = n_j
    tokens = np.minimum(itl_tokens, cap)
    result = states.reset_index()
    result["decode_only_time_s"] = t_start
    result["itl_target_s"] = budget
    result["horizon_s"] = label.horizon_s
    result["checkpoints"] = n_checkpoints
    result["horizon_steps"] = steps_held
    result[ITL_LABEL] = itl_tokens / label.horizon_s
    result["kv_room_tokens"] = room
    result["safe_chunk_tokens"] = first_c
    result["instant_safe_prefill_tokens_per_s"] = instant
    result["safe_prefill_tokens"] = tokens
    result[LABEL] = tokens / label.horizon_s
    result["limited_by"] = np.select(
        [cap < itl_tokens, itl_tokens <= 0, sweep], ["kv", "none", "sweep"], default="itl"
    )
    return result


def concat_labels(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Label tables of separately drawn profiles (:func:`derive_labels` of each) as one: each table's
    ``state_id`` and ``state_group`` are offset past the previous tables', so no two profiles share a
    state or a cross-validation group (two profiles drawn with different seeds number theirs alike)."""
    if not tables:
        raise ValueError("concat_labels: no label tables")
    shifted, next_id, next_group = [], 0, 0
    for table in tables:
        shifted.append(
            table.assign(state_id=table["state_id"] + next_id, state_group=table["state_group"] + next_group)
        )
        next_id += int(table["state_id"].max()) + 1
        next_group += int(table["state_group"].max()) + 1
    return pd.concat(shifted, ignore_index=True)
