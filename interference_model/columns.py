"""Names of the profile schema's columns, in canonical order (standard library only).

Kept apart from :mod:`interference_model.schema` (which needs numpy and pandas) so that measurement
scripts running where only torch is installed (``benchmarks/gpu/profile_torch.py``) write exactly
these columns. The meaning of each column and the validation rules live in ``schema``.
"""

from __future__ import annotations

from collections.abc import Iterable

PROFILE_SCHEMA_VERSION = 3

FEATURES: tuple[str, ...] = (
    "decode_batch_size",
    "context_tokens_mean",
    "context_tokens_std",
    "remaining_output_tokens_mean",
    "kv_occupancy",
    "remaining_output_tokens_max",
    "remaining_output_tokens_context_weighted",
)
"""Node-state features of the interference model, in this order (shared with ``policies``).

The last two (added in schema version 3) say how the batch drains inside a lease, which its mean
remaining output does not: ``remaining_output_tokens_max`` is the longest remaining output of the
running requests (the step at which the batch is gone), ``remaining_output_tokens_context_weighted``
is ``sum(context x remaining) / sum(context)`` (how long the KV-heavy requests, whose attention
dominates the decode step, stay). Both are optional on read (``DRAIN_FEATURES``)."""

DRAIN_FEATURES: tuple[str, ...] = FEATURES[5:]
"""Features a profile may omit; read as ``remaining_output_tokens_mean`` (every request ends with the
mean), which is exact for a batch whose requests share one remaining output (the live profiler's
states) and, under the lease label, the most conservative reading of a state: such a batch never
shrinks inside the lease (it leaves at once, and the label holds the last measured batch)."""

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


def drain_features(
    contexts_tokens: Iterable[float], remaining_output_tokens: Iterable[float]
) -> tuple[float, float]:
    """``DRAIN_FEATURES`` of a running batch from its requests' KV contexts and remaining outputs:
    ``(longest remaining output, sum(context x remaining) / sum(context))``; ``(0, 0)`` for an empty
    batch. Standard library only, so every builder of a node state (simulator, SGLang plugin, the
    profilers) computes them the same way."""
    longest = weighted = total = 0.0
    for context, remaining in zip(contexts_tokens, remaining_output_tokens, strict=True):
        longest = max(longest, float(remaining))
        weighted += float(context) * float(remaining)
        total += float(context)
    return longest, (weighted / total if total > 0 else longest)
