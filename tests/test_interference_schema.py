"""Profile schema: validation errors name the column and row; Parquet round trip; stable hash."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from interference_model.schema import (
    PROFILE_COLUMNS,
    PROFILE_SCHEMA_VERSION,
    ProfileSchemaError,
    profiles_sha256,
    read_profiles,
    validate_profiles,
    write_profiles,
)


def tiny_profile() -> pd.DataFrame:
    """Two states x two chunks x one repeat."""
    rows = []
    for sid, (batch, ctx) in enumerate([(4, 1000.0), (8, 2000.0)]):
        for chunk, t in [(256, 0.012), (1024, 0.020)]:
            rows.append(
                {
                    "schema_version": PROFILE_SCHEMA_VERSION,
                    "source": "sim",
                    "hardware": "H200",
                    "model": "gpt-oss-120b",
                    "tp": 1,
                    "state_id": sid,
                    "state_group": sid,
                    "repeat": 0,
                    "decode_batch_size": batch,
                    "context_tokens_mean": ctx,
                    "context_tokens_std": 10.0,
                    "remaining_output_tokens_mean": 100.0,
                    "kv_occupancy": 0.1,
                    "kv_capacity_tokens": 100_000,
                    "chunk_tokens": chunk,
                    "cached_prefix_tokens": 0,
                    "iteration_time_s": t * (1 + sid),
                    "decode_only_time_s": 0.010 * (1 + sid),
                }
            )
    return pd.DataFrame(rows)


def test_valid_profile_passes_with_canonical_columns() -> None:
    out = validate_profiles(tiny_profile().assign(extra=1))
    assert tuple(out.columns) == PROFILE_COLUMNS
    assert out["chunk_tokens"].dtype == np.int64


@pytest.mark.parametrize(
    ("column", "row", "value", "words"),
    [
        ("kv_occupancy", 2, 1.5, "must lie in"),
        ("iteration_time_s", 3, 0.0, "> 0 seconds"),
        ("iteration_time_s", 1, float("nan"), "finite"),
        ("chunk_tokens", 0, 12.5, "integer"),
        ("decode_batch_size", 1, -1, ">= 0"),
        ("schema_version", 0, 99, "version"),
        ("hardware", 3, "", "non-empty string"),
    ],
)
def test_bad_value_names_column_and_row(column: str, row: int, value: object, words: str) -> None:
    df = tiny_profile()
    df[column] = df[column].astype(object)
    df.at[row, column] = value
    with pytest.raises(ProfileSchemaError, match=rf"prof\.parquet: column '{column}' row {row}: .*{words}"):
        validate_profiles(df, source="prof.parquet")


def test_missing_column_and_empty_table() -> None:
    with pytest.raises(ProfileSchemaError, match=r"missing column.*kv_occupancy"):
        validate_profiles(tiny_profile().drop(columns="kv_occupancy"))
    with pytest.raises(ProfileSchemaError, match="no rows"):
        validate_profiles(tiny_profile().iloc[:0])


def test_state_columns_must_agree_within_a_state() -> None:
    df = tiny_profile()
    df.loc[1, "decode_batch_size"] = 5  # row 1 belongs to state 0 like row 0
    with pytest.raises(ProfileSchemaError, match=r"'decode_batch_size' row 1: differs .* state_id 0"):
        validate_profiles(df)


def test_parquet_round_trip_and_hash(tmp_path: Path) -> None:
    df = validate_profiles(tiny_profile())
    path = write_profiles(df, tmp_path / "sub" / "p.parquet")
    back = read_profiles(path)
    pd.testing.assert_frame_equal(back, df)
    assert profiles_sha256(back) == profiles_sha256(df.iloc[::-1].reset_index(drop=True))
    changed = df.copy()
    changed.loc[0, "iteration_time_s"] += 1e-9
    assert profiles_sha256(changed) != profiles_sha256(df)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["p.parquet"]  # no temp file left


def test_unreadable_or_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ProfileSchemaError, match=r"bad.parquet: not a readable Parquet"):
        read_profiles(bad)
    with pytest.raises(ProfileSchemaError, match="no such profile file"):
        read_profiles(tmp_path / "nope.parquet")


def test_write_refuses_invalid_table_and_leaves_nothing(tmp_path: Path) -> None:
    df = tiny_profile()
    df.loc[0, "kv_occupancy"] = 2.0
    with pytest.raises(ProfileSchemaError):
        write_profiles(df, tmp_path / "p.parquet")
    assert list(tmp_path.iterdir()) == []


def test_a_table_without_step_columns_reads_as_step_zero() -> None:
    df = tiny_profile().assign(schema_version=1)  # a version-1 table: no step columns
    out = validate_profiles(df)
    assert (out["schema_version"] == PROFILE_SCHEMA_VERSION).all() and (out["decode_step"] == 0).all()
    np.testing.assert_array_equal(out["step_batch_size"], out["decode_batch_size"])
    np.testing.assert_allclose(
        out["step_context_tokens"], out["decode_batch_size"] * out["context_tokens_mean"]
    )


def test_step_columns_are_all_or_none_and_constant_per_checkpoint() -> None:
    df = validate_profiles(tiny_profile())
    with pytest.raises(ProfileSchemaError, match=r"has step column\(s\) \['decode_step'\] but not"):
        validate_profiles(df.drop(columns=["step_batch_size", "step_context_tokens"]))
    bad = df.copy()
    bad.loc[1, "step_batch_size"] = 3  # row 1 is the same checkpoint of state 0 as row 0
    with pytest.raises(ProfileSchemaError, match=r"'step_batch_size' row 1: .* state_id 0 at decode_step 0"):
        validate_profiles(bad)
    later = df.copy()
    later.loc[1, ["decode_step", "step_batch_size"]] = [40, 3]  # another checkpoint may differ
    assert len(validate_profiles(later)) == len(df)


def test_csv_round_trip(tmp_path: Path) -> None:
    df = validate_profiles(tiny_profile())
    back = read_profiles(write_profiles(df, tmp_path / "p.csv"))
    pd.testing.assert_frame_equal(back, df)
    assert profiles_sha256(back) == profiles_sha256(df)
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ProfileSchemaError, match=r"bad.csv: missing column"):
        read_profiles(tmp_path / "bad.csv")


def test_drain_columns_are_optional_and_checked() -> None:
    # Without them (a version-2 table, the live profiler's) both read as the mean remaining output.
    out = validate_profiles(tiny_profile().assign(schema_version=2))
    np.testing.assert_array_equal(out["remaining_output_tokens_max"], out["remaining_output_tokens_mean"])
    np.testing.assert_array_equal(
        out["remaining_output_tokens_context_weighted"], out["remaining_output_tokens_mean"]
    )
    with pytest.raises(ProfileSchemaError, match="give all of"):
        validate_profiles(tiny_profile().assign(remaining_output_tokens_max=150.0))
    given = tiny_profile().assign(
        remaining_output_tokens_max=150.0, remaining_output_tokens_context_weighted=90.0
    )
    assert (validate_profiles(given)["remaining_output_tokens_max"] == 150.0).all()
    short = given.assign(remaining_output_tokens_max=[150.0, 150.0, 99.0, 99.0])
    with pytest.raises(ProfileSchemaError, match=r"'remaining_output_tokens_max' row 2: must be >= rem"):
        validate_profiles(short)
