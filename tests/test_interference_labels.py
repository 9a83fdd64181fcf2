"""Label derivation checked by hand on tiny tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from interference_model.labels import LABEL, ItlTarget, derive_labels
from interference_model.schema import PROFILE_SCHEMA_VERSION, validate_profiles


def one_state(
    curve: list[tuple[int, list[float]]],
    t0: list[float],
    *,
    batch: int = 4,
    kv_occupancy: float = 0.0,
    remaining: float = 0.0,
    capacity: int = 1_000_000,
) -> pd.DataFrame:
    """One state; ``curve`` is [(chunk, [time per repeat])], ``t0`` the decode-only time per repeat."""
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
                    "state_id": 0,
                    "state_group": 0,
                    "repeat": rep,
                    "decode_batch_size": batch,
                    "context_tokens_mean": 1000.0,
                    "context_tokens_std": 0.0,
                    "remaining_output_tokens_mean": remaining,
                    "kv_occupancy": kv_occupancy,
                    "kv_capacity_tokens": capacity,
                    "chunk_tokens": chunk,
                    "cached_prefix_tokens": 0,
                    "iteration_time_s": t,
                    "decode_only_time_s": t0[rep],
                }
            )
    return validate_profiles(pd.DataFrame(rows))


def test_ratio_target_interpolates_between_swept_chunks() -> None:
    # t0 = 10 ms; target 1.5x = 15 ms; t(100)=12 ms, t(200)=18 ms -> crossing at c = 150, t = 15 ms.
    df = one_state([(100, [0.012]), (200, [0.018])], [0.010])
    lab = derive_labels(df, ItlTarget("ratio", 1.5)).iloc[0]
    assert lab["safe_chunk_tokens"] == pytest.approx(150.0)
    assert lab[LABEL] == pytest.approx(150 / 0.015)
    assert lab["limited_by"] == "itl"
    assert lab["itl_target_s"] == pytest.approx(0.015)


def test_medians_over_repeats_resist_a_straggler() -> None:
    # Medians: t0 = 10 ms, t(100) = 12 ms, t(200) = 18 ms, despite one 3x straggler in each.
    df = one_state([(100, [0.012, 0.036, 0.012]), (200, [0.018, 0.018, 0.054])], [0.010, 0.030, 0.010])
    assert derive_labels(df, ItlTarget.parse("1.5x"))[LABEL].iloc[0] == pytest.approx(150 / 0.015)


def test_absolute_target_and_nothing_fits() -> None:
    df = one_state([(100, [0.012]), (200, [0.018])], [0.010])
    # 9 ms: even the decode-only step is over budget -> 0.
    lab = derive_labels(df, ItlTarget.parse("9ms")).iloc[0]
    assert lab[LABEL] == 0.0 and lab["limited_by"] == "none"
    # 11 ms: between (0, 10 ms) and (100, 12 ms) -> c = 50, t = 11 ms.
    assert derive_labels(df, ItlTarget.parse("11ms"))[LABEL].iloc[0] == pytest.approx(50 / 0.011)


def test_whole_sweep_fits_is_flagged() -> None:
    df = one_state([(100, [0.012]), (200, [0.014])], [0.010])
    lab = derive_labels(df, ItlTarget.parse("2x")).iloc[0]
    assert lab["limited_by"] == "sweep" and lab[LABEL] == pytest.approx(200 / 0.014)


def test_kv_headroom_caps_the_chunk() -> None:
    # Free KV = 1000 * (1 - 0.5) - 4 * 100 = 100 tokens; t(100) = 12 ms fits 15 ms.
    df = one_state(
        [(100, [0.012]), (200, [0.018])], [0.010], kv_occupancy=0.5, remaining=100.0, capacity=1000
    )
    capped = derive_labels(df, ItlTarget.parse("1.5x"), respect_kv_headroom=True).iloc[0]
    assert capped["safe_chunk_tokens"] == pytest.approx(100.0) and capped["limited_by"] == "kv"
    free = derive_labels(df, ItlTarget.parse("1.5x")).iloc[0]
    assert free["safe_chunk_tokens"] == pytest.approx(150.0)


def test_noisy_dip_is_smoothed_to_non_decreasing() -> None:
    # t(200) measured below t(100): isotonic fit pools them to 13 ms each.
    df = one_state([(100, [0.014]), (200, [0.012]), (400, [0.030])], [0.010])
    smooth = derive_labels(df, ItlTarget.parse("1.5x")).iloc[0]
    # Pooled curve: (0,10) (100,13) (200,13) (400,30) ms. The 15 ms crossing is at c = 223.5 (14.9k
    # tokens/s), but c = 200 at 13 ms gives more (15.4k): the label is the max of c / t(c).
    assert smooth["safe_chunk_tokens"] == pytest.approx(200.0)
    assert smooth[LABEL] == pytest.approx(200 / 0.013)
    raw = derive_labels(df, ItlTarget.parse("1.5x"), smooth=False).iloc[0]
    assert raw[LABEL] == pytest.approx(200 / 0.012)  # the dip itself, taken at face value


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


def test_missing_prefix_rows_is_an_error() -> None:
    df = one_state([(100, [0.012])], [0.010])
    with pytest.raises(ValueError, match="cached_prefix_tokens=512"):
        derive_labels(df, ItlTarget.parse("1.5x"), cached_prefix_tokens=512)


def test_ratio_floor_target_is_the_looser_of_both() -> None:
    t = ItlTarget.parse("1.5x|25ms")
    assert (t.kind, t.value, t.floor_ms, str(t)) == ("ratio_floor", 1.5, 25.0, "1.5x|25ms")
    assert t.target_s(np.array([0.004, 0.02, 0.05])).tolist() == pytest.approx([0.025, 0.03, 0.075])
    with pytest.raises(ValueError, match=r"1\.5x"):
        ItlTarget.parse("1.5x|25")
    with pytest.raises(ValueError, match="floor_ms"):
        ItlTarget("ratio_floor", 1.5, 0.0)
