"""The timing estimates a scheduler makes, from the same cluster configuration the simulator runs.

``ClusterEstimator`` implements ``policies.scheduler.CostEstimator`` with the cluster's own chunk size,
KV-transfer bandwidth and latency, so the scheduler and the simulator never disagree about a fact
(earlier, the scheduler used the cost model's defaults while the simulator ran ``ClusterConfig``'s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from envs.cluster_config import ClusterConfig


class _Timing(Protocol):
    def prefill_time_s(self, new_tokens: int, cached_tokens: int = 0, chunk_tokens: int = 8192) -> float: ...

    def kv_transfer_time_s(
        self, tokens: int, bandwidth_bytes_per_s: float | None = None, latency_s: float = ...
    ) -> float: ...

    def iteration_time_s(
        self, prefill: Sequence[tuple[int, int]] = (), decode_batch: int = 0, decode_context_tokens: int = 0
    ) -> float: ...

    def iteration_times_s(
        self,
        prefill_tokens: np.ndarray,
        prefill_attention_pairs: np.ndarray,
        decode_batch: np.ndarray,
        decode_context_tokens: np.ndarray,
    ) -> np.ndarray: ...


class ClusterEstimator:
    """Prefill, queue and KV-transfer times on ``config``'s cluster, computed by ``cost_model``."""

    def __init__(self, config: ClusterConfig, cost_model: _Timing) -> None:
        self.config = config
        self.cost_model = cost_model

    def prefill_time_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """``new_tokens`` prefilled alone after ``cached_tokens`` of cached prefix, in the cluster's
        chunks."""
        return self.cost_model.prefill_time_s(new_tokens, cached_tokens, self.config.prefill_chunk_tokens)

    def queue_wait_s(self, queued_tokens: int) -> float:
        """Time a prefill worker needs for ``queued_tokens`` already queued ahead (no cache assumed)."""
        return self.prefill_time_s(queued_tokens) if queued_tokens > 0 else 0.0

    def prefill_iteration_time_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One prefill worker iteration computing ``chunks`` (``(tokens, tokens before them)`` of each
        prompt it packs), as the simulator times it."""
        return self.cost_model.iteration_time_s(chunks)

    def kv_transfer_time_s(self, tokens: int) -> float:
        """One transfer of ``tokens`` tokens' KV over an otherwise idle link."""
        return self.cost_model.kv_transfer_time_s(
            tokens,
            bandwidth_bytes_per_s=self.config.kv_transfer_bandwidth_bytes_per_s,
            latency_s=self.config.kv_transfer_latency_s,
        )

    def mixed_step_time_s(self, prefill_tokens: int, decode_batch: int, decode_context_tokens: int) -> float:
        """One decode iteration of ``decode_batch`` requests (``decode_context_tokens`` of KV in all)
        with a ``prefill_tokens`` chunk of a fresh prompt mixed in, as the simulator times it."""
        chunks = [(prefill_tokens, 0)] if prefill_tokens > 0 else []
        return self.cost_model.iteration_time_s(chunks, decode_batch, decode_context_tokens)

    def local_prefill_time_s(
        self,
        tokens: int,
        cached_tokens: int,
        chunk_tokens: int,
        decode_batch: int,
        decode_context_tokens: int,
    ) -> float:
        """``tokens`` of one prompt (after ``cached_tokens`` of cached prefix) prefilled on a decode
        node in chunks of ``chunk_tokens``, each mixed into an iteration of the node's decode batch:
        the sum of those iterations, each chunk's attention over the prefix before it included."""
        if tokens <= 0:
            return 0.0
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        starts = np.arange(0, tokens, chunk_tokens, dtype=np.float64)
        new = np.minimum(float(chunk_tokens), tokens - starts)
        pairs = new * (cached_tokens + starts) + new * (new + 1) * 0.5
        times = self.cost_model.iteration_times_s(
            new, pairs, np.asarray(decode_batch), np.asarray(decode_context_tokens)
        )
        return float(times.sum())


__all__ = ["ClusterEstimator"]
