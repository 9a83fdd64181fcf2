"""Names of the profile schema's columns, in canonical order (standard library only).

Kept apart from :mod:`interference_model.schema` (which needs numpy and pandas) so that measurement
scripts running where only torch is installed (``benchmarks/gpu/profile_torch.py``) write exactly
these columns. The meaning of each column and the validation rules live in ``schema``.
"""

from __future__ import annotations

PROFILE_SCHEMA_VERSION = 2

FEATURES: tuple[str, ...] = (
    "decode_batch_size",
    "context_tokens_mean",
    "context_tokens_std",
    "remaining_output_tokens_mean",
    "kv_occupancy",
)
"""Node-state features of the interference model, in this order (shared with ``policies``)."""

STEP_COLUMNS: tuple[str, ...] = (
    "decode_step",
    "step_batch_size",
    "step_context_tokens",
)
"""Where in the state's evolution a row was measured (added in schema version 2; optional on read)."""

PROFILE_COLUMNS: tuple[str, ...] = (
    "schema_version",
    "source",
    "hardware",
    "model",
    "tp",
    "state_id",
    "state_group",
    "repeat",
    *FEATURES,
    "kv_capacity_tokens",
    *STEP_COLUMNS,
    "chunk_tokens",
    "cached_prefix_tokens",
    "iteration_time_s",
    "decode_only_time_s",
)
"""Every column of a profile, in the canonical order used for hashing and writing."""
