"""The profile schema: one row per measured iteration of a decode node with prefill mixed in.

A *profile* is a table of measurements. Each row says: a decode node in this state (batch, contexts,
remaining output, KV occupancy) on this hardware / model / TP ran one iteration with ``chunk_tokens``
new prefill tokens (on top of ``cached_prefix_tokens`` already-cached prefix) and it took
``iteration_time_s``; the same state with no prefill took ``decode_only_time_s`` (measured in the
same repeat). Rows of one state share ``state_id``; near-duplicate states (drawn from one scenario)
share ``state_group`` so cross-validation can keep them in one fold.

Both the simulated profiler (``envs.profiler``) and the real profiler (``serving``) write this
schema; :func:`validate_profiles` is the one gate every reader goes through.

Version history:

* 1 -- first version.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

PROFILE_SCHEMA_VERSION = 1

FEATURES: tuple[str, ...] = (
    "decode_batch_size",
    "context_tokens_mean",
    "context_tokens_std",
    "remaining_output_tokens_mean",
    "kv_occupancy",
)
"""Node-state features of the interference model, in this order (shared with ``policies``)."""

STRING_COLUMNS: tuple[str, ...] = ("source", "hardware", "model")
"""``source`` is ``"sim"`` for the simulated profiler, ``"sglang"`` for a live worker."""

INT_COLUMNS: dict[str, float] = {
    # column -> smallest allowed value
    "schema_version": PROFILE_SCHEMA_VERSION,
    "tp": 1,
    "state_id": 0,
    "state_group": 0,
    "repeat": 0,
    "decode_batch_size": 0,
    "kv_capacity_tokens": 1,
    "chunk_tokens": 1,
    "cached_prefix_tokens": 0,
}

FLOAT_COLUMNS: dict[str, tuple[float, float]] = {
    # column -> inclusive [low, high]; times must also be > 0 (checked separately)
    "context_tokens_mean": (0.0, np.inf),
    "context_tokens_std": (0.0, np.inf),
    "remaining_output_tokens_mean": (0.0, np.inf),
    "kv_occupancy": (0.0, 1.0),
    "iteration_time_s": (0.0, np.inf),
    "decode_only_time_s": (0.0, np.inf),
}

POSITIVE_COLUMNS: tuple[str, ...] = ("iteration_time_s", "decode_only_time_s")

PROFILE_COLUMNS: tuple[str, ...] = (
    "schema_version",
    *STRING_COLUMNS,
    "tp",
    "state_id",
    "state_group",
    "repeat",
    *FEATURES,
    "kv_capacity_tokens",
    "chunk_tokens",
    "cached_prefix_tokens",
    "iteration_time_s",
    "decode_only_time_s",
)
"""Every column a profile must have, in the canonical order used for hashing and writing."""

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


class ProfileSchemaError(ValueError):
    """A profile table breaks the schema; the message names the source, column and row."""


def _fail(source: str, column: str, rows: np.ndarray, values: pd.Series | np.ndarray, why: str) -> None:
    first = int(rows[0])
    value = np.asarray(values)[first]
    raise ProfileSchemaError(
        f"{source}: column {column!r} row {first}: {why} (got {value!r}; {len(rows)} bad row(s) in all)"
    )


def validate_profiles(df: pd.DataFrame, source: str = "<profiles>") -> pd.DataFrame:
    """Check ``df`` against the schema and return it with canonical column order and dtypes.

    Raises :class:`ProfileSchemaError` naming ``source``, the column and the first bad row (0-based
    position in ``df``). Extra columns are dropped. Never mutates ``df``.
    """
    missing = [c for c in PROFILE_COLUMNS if c not in df.columns]
    if missing:
        raise ProfileSchemaError(
            f"{source}: missing column(s) {missing}; a profile needs {list(PROFILE_COLUMNS)}"
        )
    if len(df) == 0:
        raise ProfileSchemaError(f"{source}: no rows")
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
    bad = np.flatnonzero(out["schema_version"].to_numpy() != PROFILE_SCHEMA_VERSION)
    if len(bad):
        _fail(
            source,
            "schema_version",
            bad,
            out["schema_version"].to_numpy(),
            f"this reader understands version {PROFILE_SCHEMA_VERSION} only",
        )
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
    _check_state_consistency(out, source)
    return out[list(PROFILE_COLUMNS)]


def _check_state_consistency(df: pd.DataFrame, source: str) -> None:
    """Every row of one ``state_id`` must describe the same node state."""
    ids = df["state_id"].to_numpy()
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    same_state = sorted_ids[1:] == sorted_ids[:-1]
    for col in STATE_COLUMNS:
        values = df[col].to_numpy()[order]
        bad = np.flatnonzero(same_state & (values[1:] != values[:-1]))
        if len(bad):
            row = int(order[bad[0] + 1])
            raise ProfileSchemaError(
                f"{source}: column {col!r} row {row}: differs from another row of state_id "
                f"{int(sorted_ids[bad[0]])} (a state's node-state columns must be constant)"
            )


def profiles_sha256(df: pd.DataFrame) -> str:
    """SHA-256 of a validated profile's content in canonical column order.

    Independent of the Parquet writer and of row order, so the same measurements always hash the same.
    """
    canon = df[list(PROFILE_COLUMNS)].sort_values(
        ["state_id", "cached_prefix_tokens", "chunk_tokens", "repeat"], kind="stable"
    )
    digest = hashlib.sha256()
    for col in PROFILE_COLUMNS:
        values = canon[col].to_numpy()
        if values.dtype == object:
            digest.update("\x1f".join(values.tolist()).encode())
        else:
            digest.update(np.ascontiguousarray(values).tobytes())
    return digest.hexdigest()


def write_profiles(df: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Validate ``df`` and write it as Parquet, atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    clean = validate_profiles(df, source=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        clean.to_parquet(tmp, engine="pyarrow", index=False)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a profile is a shareable data file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_profiles(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read a Parquet profile and validate it; errors name ``path``."""
    path = Path(path)
    if not path.is_file():
        raise ProfileSchemaError(f"{path}: no such profile file")
    try:
        df = pd.read_parquet(path, engine="pyarrow")
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise ProfileSchemaError(f"{path}: not a readable Parquet file ({exc})") from exc
    return validate_profiles(df, source=str(path))
