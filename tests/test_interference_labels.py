"""The lease label checked by hand on tiny, hand-built profiles."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from interference_model.labels import (
    ITL_LABEL,
    LABEL,
    ItlTarget,
    LeaseLabel,
    _non_decreasing,
    best_chunks,
    derive_labels,
    kv_room_tokens,
)
from interference_model.schema import PROFILE_SCHEMA_VERSION, STEP_COLUMNS, validate_profiles

Curve = list[tuple[int, list[float]]]


def checkpoint_rows(
    curve: Curve,
    t0: list[float],
    *,
    step: int = 0,
    batch: int = 4,
    step_batch: int | None = None,
    kv_occupancy: float = 0.0,
    remaining: float = 0.0,
    capacity: int = 1_000_000,
    state_id: int = 0,
) -> list[dict[str, object]]:
    """Rows of one checkpoint; ``curve`` is [(chunk, [time per repeat])], ``t0`` the decode-only time
    per repeat."""
    rows = []
    for chunk, times in curve:
        for rep, t in enumerate(times):
            rows.append(
                {
                    "schema_version": PROFILE_SCHEMA_VERSION,
                    "source": "sim",
                    "hardware": "H200",
                    "model": "m",
                    "tp": 1,
                    "state_id": state_id,
                    "state_group": state_id,
                    "repeat": rep,
                    "decode_batch_size": batch,
                    "context_tokens_mean": 1000.0,
                    "context_tokens_std": 0.0,
                    "remaining_output_tokens_mean": remaining,
                    "kv_occupancy": kv_occupancy,
                    "kv_capacity_tokens": capacity,
                    "decode_step": step,
                    "step_batch_size": batch if step_batch is None else step_batch,
                    "step_context_tokens": 1000.0 * (batch if step_batch is None else step_batch),
                    "chunk_tokens": chunk,
                    "cached_prefix_tokens": 0,
                    "iteration_time_s": t,
                    "decode_only_time_s": t0[rep],
                }
            )
    return rows


def one_state(curve: Curve, t0: list[float], **kwargs: object) -> pd.DataFrame:
    """A state measured at step 0 only, without step columns (as a version-1 profile)."""
    rows = checkpoint_rows(curve, t0, **kwargs)  # type: ignore[arg-type]
    return validate_profiles(pd.DataFrame(rows).drop(columns=list(STEP_COLUMNS)))


def frozen(spec: str = "1.5x", horizon_s: float = 8.0) -> LeaseLabel:
    return LeaseLabel.parse(spec, horizon_s=horizon_s)


def test_single_checkpoint_holds_the_instant_rate_over_the_horizon() -> None:
    # t0 = 10 ms; target 1.5x = 15 ms; t(100)=12 ms, t(200)=18 ms -> crossing at c = 150, t = 15 ms.
    df = one_state([(100, [0.012]), (200, [0.018])], [0.010])
    lab = derive_labels(df, frozen()).iloc[0]
    assert lab["safe_chunk_tokens"] == pytest.approx(150.0)
    assert lab[LABEL] == pytest.approx(150 / 0.015)
    assert lab["instant_safe_prefill_tokens_per_s"] == pytest.approx(150 / 0.015)
    assert lab["safe_prefill_tokens"] == pytest.approx(8.0 * 150 / 0.015)
    assert lab["horizon_steps"] == pytest.approx(8.0 / 0.015)
    assert (lab["limited_by"], lab["itl_target_s"], lab["checkpoints"]) == ("itl", pytest.approx(0.015), 1)


def test_the_last_iteration_counts_pro_rata() -> None:
    df = one_state([(100, [0.015]), (200, [0.030])], [0.010])
    lab = derive_labels(df, frozen(horizon_s=0.0225)).iloc[0]  # 1.5 iterations of 15 ms
    assert lab["safe_prefill_tokens"] == pytest.approx(150.0)
    assert lab["horizon_steps"] == pytest.approx(1.5)


def test_medians_over_repeats_resist_a_straggler() -> None:
    # Medians: t0 = 10 ms, t(100) = 12 ms, t(200) = 18 ms, despite one 3x straggler in each.
    df = one_state([(100, [0.012, 0.036, 0.012]), (200, [0.018, 0.018, 0.054])], [0.010, 0.030, 0.010])
    assert derive_labels(df, frozen())[LABEL].iloc[0] == pytest.approx(150 / 0.015)


def test_absolute_target_and_nothing_fits() -> None:
    df = one_state([(100, [0.012]), (200, [0.018])], [0.010])
    # 9 ms: even the decode-only step is over budget -> 0.
    lab = derive_labels(df, frozen("9ms")).iloc[0]
    assert lab[LABEL] == 0.0 and lab["limited_by"] == "none"
    # 11 ms: between (0, 10 ms) and (100, 12 ms) -> c = 50, t = 11 ms.
    assert derive_labels(df, frozen("11ms"))[LABEL].iloc[0] == pytest.approx(50 / 0.011)


def test_tpot_slo_caps_the_step_budget() -> None:
    # A busy node: t0 = 40 ms, so 1.5x would allow 60 ms steps; the 50 ms TPOT SLO caps it.
    df = one_state([(100, [0.050]), (200, [0.060])], [0.040])
    lab = derive_labels(df, frozen()).iloc[0]
    assert lab["itl_target_s"] == pytest.approx(0.050)
    assert lab[LABEL] == pytest.approx(100 / 0.050)
    loose = derive_labels(df, LeaseLabel.parse("1.5x", tpot_slo_ms=60.0)).iloc[0]
    assert loose[LABEL] == pytest.approx(200 / 0.060) and loose["limited_by"] == "sweep"


def test_whole_sweep_fits_is_flagged() -> None:
    df = one_state([(100, [0.012]), (200, [0.014])], [0.010])
    lab = derive_labels(df, frozen("2x")).iloc[0]
    assert lab["limited_by"] == "sweep" and lab[LABEL] == pytest.approx(200 / 0.014)


def test_kv_room_caps_the_whole_horizon() -> None:
    # Room = 1000 * (1 - 0.5) - 4 * 100 = 100 tokens for the whole 8 s lease.
    df = one_state(
        [(100, [0.012]), (200, [0.018])], [0.010], kv_occupancy=0.5, remaining=100.0, capacity=1000
    )
    capped = derive_labels(df, frozen()).iloc[0]
    assert capped["safe_prefill_tokens"] == pytest.approx(100.0) and capped["limited_by"] == "kv"
    assert capped[LABEL] == pytest.approx(100.0 / 8.0)
    assert capped["safe_chunk_tokens"] == pytest.approx(100.0)  # the first iteration is capped too
    free = derive_labels(df, LeaseLabel(ItlTarget.parse("1.5x"), kv_room=False)).iloc[0]
    assert free[LABEL] == pytest.approx(150 / 0.015)


def evolving_state(**kv: object) -> pd.DataFrame:
    """Step 0: t = (10, 15, 30) ms at c = (0, 100, 200). Step 2: a request has left: t = (5, 10, 15)."""
    rows = checkpoint_rows([(100, [0.015]), (200, [0.030])], [0.010], **kv)  # type: ignore[arg-type]
    rows += checkpoint_rows([(100, [0.010]), (200, [0.015])], [0.005], step=2, step_batch=3, **kv)  # type: ignore[arg-type]
    return validate_profiles(pd.DataFrame(rows))


def test_the_batch_evolves_between_and_after_checkpoints() -> None:
    # Budget 15 ms all along (1.5 x the start's 10 ms). Step 0: c = 100 at 15 ms. Step 1 (halfway:
    # t = 7.5, 12.5, 22.5 ms): crossing at 100 + 2.5 / 0.1 = 125 tokens. From step 2 on the last
    # checkpoint holds: c = 200 at 15 ms, the largest swept chunk. 60 ms = 4 iterations.
    lab = derive_labels(evolving_state(), frozen(horizon_s=0.060)).iloc[0]
    assert lab["safe_prefill_tokens"] == pytest.approx(100 + 125 + 2 * 200)
    assert lab[LABEL] == lab[ITL_LABEL] == pytest.approx(625 / 0.060)
    assert lab["horizon_steps"] == pytest.approx(4.0)
    assert lab["limited_by"] == "sweep" and lab["checkpoints"] == 2
    assert lab["instant_safe_prefill_tokens_per_s"] == pytest.approx(100 / 0.015)


def test_kv_freed_by_leaving_requests_is_not_lent() -> None:
    # Room = 10,000 * (1 - 0.9) - 4 * 175 = 300 tokens at the start. A request leaves at step 2, but
    # the promise does not count on it: 300 tokens, not the 625 the ITL part allows.
    lab = derive_labels(
        evolving_state(capacity=10_000, kv_occupancy=0.9, remaining=175.0), frozen(horizon_s=0.060)
    ).iloc[0]
    assert lab["kv_room_tokens"] == pytest.approx(300.0)
    assert lab["safe_prefill_tokens"] == pytest.approx(300.0) and lab["limited_by"] == "kv"
    assert lab[ITL_LABEL] == pytest.approx(625 / 0.060)
    assert lab["safe_chunk_tokens"] == pytest.approx(100.0)  # the first chunk fits in the room


def test_a_full_cache_lends_nothing() -> None:
    lab = derive_labels(evolving_state(capacity=10_000, kv_occupancy=0.95, remaining=125.0), frozen()).iloc[0]
    assert lab["kv_room_tokens"] == 0.0 and lab[LABEL] == 0.0 and lab["limited_by"] == "kv"
    assert lab["safe_chunk_tokens"] == 0.0


def test_kv_room_by_hand() -> None:
    room = kv_room_tokens(np.array([4, 4, 10]), np.array([100.0, 0.0, 20.0]), np.array([0.5, 0.2, 0.9]), 1000)
    np.testing.assert_allclose(room, [100.0, 800.0, 0.0])  # the last: 100 - 200 < 1 token -> none


def reference_itl_tokens(
    steps: list[int], curves: list[list[float]], chunks: list[float], label: LeaseLabel
) -> float:
    """A scalar, step-by-step reading of the ITL part's definition (independent of the vectorised code)."""
    budget = min(label.itl_target.target_s(np.array([curves[0][0]]))[0], label.tpot_slo_ms / 1000)
    grid = np.array([0.0, *chunks])
    fine = np.linspace(0.0, grid[-1], 40001)
    clock = tokens = 0.0
    k = 0
    while clock < label.horizon_s - 1e-15:
        j = max(i for i, s in enumerate(steps) if s <= k)
        if j + 1 < len(steps):
            w = (k - steps[j]) / (steps[j + 1] - steps[j])
            curve = (1 - w) * np.array(curves[j]) + w * np.array(curves[j + 1])
        else:
            curve = np.array(curves[j])
        t_fine = np.interp(fine, grid, curve)
        ok = (t_fine <= budget + 1e-15) & (fine > 0)
        if ok.any():
            i = int(np.argmax(np.where(ok, fine / t_fine, -1)))
            c, t = fine[i], t_fine[i]
        else:
            c, t = 0.0, curve[0]
        frac = min(1.0, (label.horizon_s - clock) / t)
        tokens += c * frac
        clock += t * frac
        k += 1
    return tokens


@pytest.mark.parametrize("occupancy", [0.0, 0.9985, 0.9995])
def test_vectorised_roll_matches_a_scalar_reading(occupancy: float) -> None:
    steps = [0, 3, 7]
    chunks = [64.0, 256.0, 1024.0]
    curves = [[0.010, 0.013, 0.020, 0.050], [0.008, 0.011, 0.017, 0.046], [0.004, 0.008, 0.012, 0.030]]
    rows = []
    for s, curve in zip(steps, curves, strict=True):
        points = [(int(c), [t]) for c, t in zip(chunks, curve[1:], strict=True)]
        rows += checkpoint_rows(points, [curve[0]], step=s, capacity=1_000_000, kv_occupancy=occupancy)
    label = frozen("1.5x|18ms", horizon_s=0.25)
    lab = derive_labels(validate_profiles(pd.DataFrame(rows)), label).iloc[0]
    want = reference_itl_tokens(steps, curves, chunks, label)
    assert lab[ITL_LABEL] * 0.25 == pytest.approx(want, rel=2e-3)
    assert lab["safe_prefill_tokens"] == pytest.approx(min(want, 1_000_000 * (1 - occupancy)), rel=2e-3)


def test_noisy_dip_is_smoothed_to_non_decreasing() -> None:
    # t(200) measured below t(100): isotonic fit pools them to 13 ms each.
    df = one_state([(100, [0.014]), (200, [0.012]), (400, [0.030])], [0.010])
    smooth = derive_labels(df, frozen()).iloc[0]
    # Pooled curve: (0,10) (100,13) (200,13) (400,30) ms. The 15 ms crossing is at c = 223.5 (14.9k
    # tokens/s), but c = 200 at 13 ms gives more (15.4k): the label is the max of c / t(c).
    assert smooth["safe_chunk_tokens"] == pytest.approx(200.0)
    assert smooth[LABEL] == pytest.approx(200 / 0.013)
    raw = derive_labels(df, frozen(), smooth=False).iloc[0]
    assert raw[LABEL] == pytest.approx(200 / 0.012)  # the dip itself, taken at face value


def test_isotonic_fit_by_hand() -> None:
    got = _non_decreasing(np.array([[10.0, 14.0, 12.0, 30.0], [5.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]]))
    np.testing.assert_allclose(got, [[10, 13, 13, 30], [2, 2, 2, 2], [1, 2, 3, 4]])


def test_best_chunk_respects_cap_and_budget() -> None:
    grid = np.array([0.0, 100.0, 200.0])
    times = np.array([[0.010, 0.012, 0.018]] * 3)
    c, t = best_chunks(grid, times, np.array([0.015, 0.015, 0.009]), np.array([np.inf, 40.0, np.inf]))
    np.testing.assert_allclose(c, [150.0, 40.0, 0.0])
    np.testing.assert_allclose(t, [0.015, 0.0108, 0.010])


def test_itl_target_parsing_and_errors() -> None:
    assert ItlTarget.parse("1.5x") == ItlTarget("ratio", 1.5)
    assert ItlTarget.parse(" 40ms ") == ItlTarget("absolute_ms", 40.0)
    assert str(ItlTarget("ratio", 1.5)) == "1.5x"
    for bad in ("fast", "1.5", "-2x"):
        with pytest.raises(ValueError, match="ITL target"):
            ItlTarget.parse(bad)
    with pytest.raises(ValueError, match=">= 1"):
        ItlTarget("ratio", 0.5)
    np.testing.assert_allclose(ItlTarget.parse("20ms").target_s(np.array([0.01, 0.05])), [0.02, 0.02])


def test_lease_label_round_trip_and_errors() -> None:
    label = LeaseLabel.parse("1.5x|25ms", horizon_s=4.0, tpot_slo_ms=40.0)
    assert LeaseLabel.from_dict(label.to_dict()) == label
    assert str(label) == "1.5x|25ms per step (<= 40 ms) over 4 s"
    np.testing.assert_allclose(label.step_budget_s(np.array([0.004, 0.02, 0.05])), [0.025, 0.03, 0.04])
    with pytest.raises(ValueError, match="horizon_s"):
        LeaseLabel.parse("1.5x", horizon_s=0.0)
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        LeaseLabel.parse("1.5x", tpot_slo_ms=-1.0)
    with pytest.raises(ValueError, match="lease_horizon"):
        LeaseLabel.from_dict({"kind": "instant"})


def test_missing_prefix_rows_and_bad_checkpoints_are_errors() -> None:
    df = one_state([(100, [0.012])], [0.010])
    with pytest.raises(ValueError, match="cached_prefix_tokens=512"):
        derive_labels(df, frozen(), cached_prefix_tokens=512)
    late = checkpoint_rows([(100, [0.012])], [0.010], step=5)
    with pytest.raises(ValueError, match="state_id 0 has no decode_step 0"):
        derive_labels(validate_profiles(pd.DataFrame(late)), frozen(), source="p.parquet")
    mixed = checkpoint_rows([(100, [0.012])], [0.010]) + checkpoint_rows([(200, [0.012])], [0.010], step=4)
    with pytest.raises(ValueError, match=r"p\.parquet: state_id 0 sweeps other chunks at decode_step 4"):
        derive_labels(validate_profiles(pd.DataFrame(mixed)), frozen(), source="p.parquet")


def test_ratio_floor_target_is_the_looser_of_both() -> None:
    t = ItlTarget.parse("1.5x|25ms")
    assert (t.kind, t.value, t.floor_ms, str(t)) == ("ratio_floor", 1.5, 25.0, "1.5x|25ms")
    assert t.target_s(np.array([0.004, 0.02, 0.05])).tolist() == pytest.approx([0.025, 0.03, 0.075])
    with pytest.raises(ValueError, match=r"1\.5x"):
        ItlTarget.parse("1.5x|25")
    with pytest.raises(ValueError, match="floor_ms"):
        ItlTarget("ratio_floor", 1.5, 0.0)
