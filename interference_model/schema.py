"""The profile schema: one row per measured iteration of a decode node with prefill mixed in.

A *profile* is a table of measurements. Each row says: a decode node in this state (batch, contexts,
remaining output, KV occupancy) on this hardware / model / TP ran one iteration with ``chunk_tokens``
new prefill tokens (on top of ``cached_prefix_tokens`` already-cached prefix) and it took
``iteration_time_s``; the same state with no prefill took ``decode_only_time_s`` (measured in the
same repeat). Rows of one state share ``state_id``; near-duplicate states (drawn from one scenario)
share ``state_group`` so cross-validation can keep them in one fold.

A state is measured at one or more *checkpoints* of its own evolution (``decode_step``: decode
iterations after the state was taken; 0 is the state itself). After ``k`` iterations every running
request has produced ``k`` more tokens, the ones whose remaining output ran out have left, and the
row records what is left: ``step_batch_size`` requests whose KV contexts sum to
``step_context_tokens``. The node-state features always describe step 0. The lease label
(``interference_model.labels``) rolls the state forward through these checkpoints.

Both the simulated profiler (``envs.profiler``), the torch profiler (``benchmarks/gpu``) and the live
profiler (``serving``) write this schema; :func:`validate_profiles` is the one gate every reader goes
through.

Version history:

* 1 -- first version: one measurement point per state.
* 2 -- checkpoint columns (``STEP_COLUMNS``). They are optional on read: a table without them (any
  version) is read as measured at step 0 only, with the step columns derived from the state.
* 3 -- how the batch drains (``DRAIN_FEATURES``: longest and context-weighted remaining output).
  Optional on read: a table without them (any version) reads both as the mean remaining output
  (``interference_model.columns.DRAIN_FEATURES`` says why that is exact or conservative).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from interference_model.columns import (
    DRAIN_FEATURES,
    FEATURES,
    PROFILE_COLUMNS,
    PROFILE_SCHEMA_VERSION,
    STEP_COLUMNS,
)

__all__ = [
    "DRAIN_FEATURES",
    "FEATURES",
    "PROFILE_COLUMNS",
    "PROFILE_SCHEMA_VERSION",
    "STEP_COLUMNS",
    "ProfileSchemaError",
    "profiles_sha256",
    "read_profiles",
    "validate_profiles",
    "write_profiles",
]

READABLE_VERSIONS: tuple[int, ...] = (1, 2, 3)

STRING_COLUMNS: tuple[str, ...] = ("source", "hardware", "model")
"""``source``: ``"sim"`` (simulated profiler), ``"torch"`` (torch layer stack), ``"sglang"`` (live worker)."""

INT_COLUMNS: dict[str, float] = {
    # column -> smallest allowed value
    "schema_version": 1,
    "tp": 1,
    "state_id": 0,
    "state_group": 0,
    "repeat": 0,
    "decode_batch_size": 0,
    "kv_capacity_tokens": 1,
    "decode_step": 0,
    "step_batch_size": 0,
    "chunk_tokens": 1,
    "cached_prefix_tokens": 0,
}

FLOAT_COLUMNS: dict[str, tuple[float, float]] = {
    # column -> inclusive [low, high]; times must also be > 0 (checked separately)
    "context_tokens_mean": (0.0, np.inf),
    "context_tokens_std": (0.0, np.inf),
    "remaining_output_tokens_mean": (0.0, np.inf),
    "kv_occupancy": (0.0, 1.0),
    "remaining_output_tokens_max": (0.0, np.inf),
    "remaining_output_tokens_context_weighted": (0.0, np.inf),
    "step_context_tokens": (0.0, np.inf),
    "iteration_time_s": (0.0, np.inf),
    "decode_only_time_s": (0.0, np.inf),
}

POSITIVE_COLUMNS: tuple[str, ...] = ("iteration_time_s", "decode_only_time_s")

STATE_COLUMNS: tuple[str, ...] = (
    "source",
    "hardware",
    "model",
    "tp",
    "state_group",
    *FEATURES,
    "kv_capacity_tokens",
)
"""Columns that must be constant within one ``state_id``."""

CHECKPOINT_COLUMNS: tuple[str, ...] = STEP_COLUMNS[1:]
"""Columns that must be constant within one (``state_id``, ``decode_step``)."""


def step_zero_columns(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """The step columns of a table measured at step 0 only, derived from its node-state columns:
    the whole batch and its summed context."""
    batch = pd.to_numeric(df["decode_batch_size"], errors="coerce").to_numpy(dtype=float)
    ctx = pd.to_numeric(df["context_tokens_mean"], errors="coerce").to_numpy(dtype=float)
    return {"decode_step": np.zeros(len(df)), "step_batch_size": batch, "step_context_tokens": batch * ctx}


class ProfileSchemaError(ValueError):
    """A profile table breaks the schema; the message names the source, column and row."""


def _fail(source: str, column: str, rows: np.ndarray, values: pd.Series | np.ndarray, why: str) -> None:
    first = int(rows[0])
    value = np.asarray(values)[first]
    raise ProfileSchemaError(
        f"{source}: column {column!r} row {first}: {why} (got {value!r}; {len(rows)} bad row(s) in all)"
    )


def _with_step_columns(df: pd.DataFrame, source: str) -> pd.DataFrame:
    """``df`` with every column present (step columns derived when all are absent), or an error."""
    present_steps = [c for c in STEP_COLUMNS if c in df.columns]
    if present_steps and len(present_steps) != len(STEP_COLUMNS):
        raise ProfileSchemaError(
            f"{source}: has step column(s) {present_steps} but not "
            f"{[c for c in STEP_COLUMNS if c not in df.columns]}; give all of {list(STEP_COLUMNS)} or none"
        )
    present_drain = [c for c in DRAIN_FEATURES if c in df.columns]
    if present_drain and len(present_drain) != len(DRAIN_FEATURES):
        raise ProfileSchemaError(
            f"{source}: has column(s) {present_drain} but not "
            f"{[c for c in DRAIN_FEATURES if c not in df.columns]}; "
            f"give all of {list(DRAIN_FEATURES)} or none"
        )
    optional = (*STEP_COLUMNS, *DRAIN_FEATURES)
    missing = [c for c in PROFILE_COLUMNS if c not in df.columns and c not in optional]
    if missing:
        raise ProfileSchemaError(
            f"{source}: missing column(s) {missing}; a profile needs {list(PROFILE_COLUMNS)}"
        )
    if len(df) == 0:
        raise ProfileSchemaError(f"{source}: no rows")
    if not present_drain:
        df = df.assign(**{c: df["remaining_output_tokens_mean"] for c in DRAIN_FEATURES})
    return df if present_steps else df.assign(**step_zero_columns(df))


def validate_profiles(df: pd.DataFrame, source: str = "<profiles>") -> pd.DataFrame:
    """Check ``df`` against the schema and return it with canonical column order and dtypes.

    Raises :class:`ProfileSchemaError` naming ``source``, the column and the first bad row (0-based
    position in ``df``). Extra columns are dropped. Never mutates ``df``.
    """
    df = _with_step_columns(df, source)
    out = pd.DataFrame(index=pd.RangeIndex(len(df)))
    for col in STRING_COLUMNS:
        values = df[col].to_numpy()
        bad = np.flatnonzero([not isinstance(v, str) or not v for v in values])
        if len(bad):
            _fail(source, col, bad, values, "must be a non-empty string")
        out[col] = values.astype(object)
    for col, low in INT_COLUMNS.items():
        raw = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
        bad = np.flatnonzero(~np.isfinite(raw) | (raw != np.round(raw)))
        if len(bad):
            _fail(source, col, bad, df[col].to_numpy(), "must be an integer")
        bad = np.flatnonzero(raw < low)
        if len(bad):
            _fail(source, col, bad, raw, f"must be >= {low}")
        out[col] = raw.astype(np.int64)
    bad = np.flatnonzero(~np.isin(out["schema_version"].to_numpy(), READABLE_VERSIONS))
    if len(bad):
        _fail(
            source,
            "schema_version",
            bad,
            out["schema_version"].to_numpy(),
            f"this reader understands versions {list(READABLE_VERSIONS)}",
        )
    out["schema_version"] = PROFILE_SCHEMA_VERSION  # read as the current version (see the module docstring)
    for col, (low, high) in FLOAT_COLUMNS.items():
        raw = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
        bad = np.flatnonzero(~np.isfinite(raw))
        if len(bad):
            _fail(source, col, bad, df[col].to_numpy(), "must be a finite number")
        bad = np.flatnonzero((raw < low) | (raw > high))
        if len(bad):
            _fail(source, col, bad, raw, f"must lie in [{low}, {high}]")
        if col in POSITIVE_COLUMNS:
            bad = np.flatnonzero(raw <= 0.0)
            if len(bad):
                _fail(source, col, bad, raw, "must be > 0 seconds")
        out[col] = raw
    mean = out["remaining_output_tokens_mean"].to_numpy()
    bad = np.flatnonzero(out["remaining_output_tokens_max"].to_numpy() < mean * (1.0 - 1e-9) - 1e-6)
    if len(bad):
        _fail(
            source,
            "remaining_output_tokens_max",
            bad,
            out["remaining_output_tokens_max"].to_numpy(),
            "must be >= remaining_output_tokens_mean (the longest remaining output)",
        )
    _check_state_consistency(out, source)
    return out[list(PROFILE_COLUMNS)]


def _first_disagreement(keys: np.ndarray, df: pd.DataFrame, columns: tuple[str, ...]) -> tuple[str, int, int]:
    """(column, row, key) of the first row whose ``columns`` differ from another row with equal key;
    ``("", -1, -1)`` when all agree. ``keys`` is one int64 per row."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    same = sorted_keys[1:] == sorted_keys[:-1]
    for col in columns:
        values = df[col].to_numpy()[order]
        bad = np.flatnonzero(same & (values[1:] != values[:-1]))
        if len(bad):
            return col, int(order[bad[0] + 1]), int(sorted_keys[bad[0]])
    return "", -1, -1


def _check_state_consistency(df: pd.DataFrame, source: str) -> None:
    """Every row of one ``state_id`` describes the same node state, and every row of one checkpoint
    (``state_id``, ``decode_step``) the same evolved batch."""
    ids = df["state_id"].to_numpy()
    col, row, key = _first_disagreement(ids, df, STATE_COLUMNS)
    if row >= 0:
        raise ProfileSchemaError(
            f"{source}: column {col!r} row {row}: differs from another row of state_id "
            f"{key} (a state's node-state columns must be constant)"
        )
    steps = df["decode_step"].to_numpy()
    pair = ids * (int(steps.max()) + 1) + steps
    col, row, _ = _first_disagreement(pair, df, CHECKPOINT_COLUMNS)
    if row >= 0:
        raise ProfileSchemaError(
            f"{source}: column {col!r} row {row}: differs from another row of state_id "
            f"{int(ids[row])} at decode_step {int(steps[row])} (a checkpoint's columns must be constant)"
        )


def profiles_sha256(df: pd.DataFrame) -> str:
    """SHA-256 of a validated profile's content in canonical column order.

    Independent of the Parquet writer and of row order, so the same measurements always hash the same.
    """
    canon = df[list(PROFILE_COLUMNS)].sort_values(
        ["state_id", "decode_step", "cached_prefix_tokens", "chunk_tokens", "repeat"], kind="stable"
    )
    digest = hashlib.sha256()
    for col in PROFILE_COLUMNS:
        values = canon[col].to_numpy()
        if values.dtype == object:
            digest.update("\x1f".join(values.tolist()).encode())
        else:
            digest.update(np.ascontiguousarray(values).tobytes())
    return digest.hexdigest()


def _is_csv(path: Path) -> bool:
    return path.suffix.lower() == ".csv"


def write_profiles(df: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Validate ``df`` and write it atomically (temp file in the same folder, then rename): CSV when
    ``path`` ends in ``.csv``, Parquet otherwise."""
    path = Path(path)
    clean = validate_profiles(df, source=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        if _is_csv(path):
            clean.to_csv(tmp, index=False)
        else:
            clean.to_parquet(tmp, engine="pyarrow", index=False)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a profile is a shareable data file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_profiles(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read a profile (Parquet, or CSV when the name ends in ``.csv``) and validate it; errors name
    ``path``. CSV rows are numbered like the validation messages: row 0 is the first data line."""
    path = Path(path)
    if not path.is_file():
        raise ProfileSchemaError(f"{path}: no such profile file")
    try:
        if _is_csv(path):
            df = pd.read_csv(path, dtype={c: str for c in STRING_COLUMNS})
        else:
            df = pd.read_parquet(path, engine="pyarrow")
    except Exception as exc:  # pyarrow / the CSV parser raise several types for a corrupt file
        kind = "CSV" if _is_csv(path) else "Parquet"
        raise ProfileSchemaError(f"{path}: not a readable {kind} file ({exc})") from exc
    return validate_profiles(df, source=str(path))
