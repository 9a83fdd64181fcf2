"""What a decode node reports each control interval.

Both the simulator (``envs``) and the SGLang side (``serving``) produce ``NodeState``; every node
policy and the cluster scheduler consume it. Keep it plain numbers so it serialises to JSON as is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class NodeState:
    """A decode node's live state at ``time_s``."""

    node_id: int
    time_s: float
    decode_batch_size: int
    """Requests in the running decode batch."""
    context_tokens_mean: float
    """Mean KV context (input + generated so far) of the running requests."""
    context_tokens_std: float
    """Spread of those contexts (population standard deviation)."""
    remaining_output_tokens_mean: float
    """Mean output tokens the running requests still have to generate (expected)."""
    kv_capacity_tokens: int
    kv_used_tokens: int
    """KV tokens held now by running (and borrowed) requests."""
    kv_reserved_tokens: int
    """KV tokens promised to running requests' remaining output (admission reservation)."""
    queued_decode_requests: int
    """Requests waiting for admission to the decode batch."""
    borrowed_tasks: int
    """Borrowed prefill tasks queued or running on this node."""
    borrowed_prefill_tokens_queued: int
    """Uncomputed prefill tokens of those tasks."""
    recent_step_time_s: float
    """Mean iteration time over the last control interval (0 when idle)."""
    decode_only_step_time_s: float
    """Iteration time the current decode batch would take with no prefill mixed in."""
    max_running_requests: int
    recent_decode_only_step_time_s: float = 0.0
    """What the iterations of the last control interval would have taken on average without prefill
    mixed in (0 when unknown). ``recent_step_time_s / recent_decode_only_step_time_s`` is the node's
    ITL inflation from borrowed work, free of batch-size changes."""
    local_tasks: int = 0
    """Requests queued or prefilling here without a lease (a path policy's ``local`` decisions)."""
    local_prefill_tokens_queued: int = 0
    """Uncomputed prefill tokens of those requests."""
    kv_prealloc_waiting_tokens: int = 0
    """Of ``kv_used_tokens``, the KV pre-allocated here (SGLang's decode pre-allocation) for requests
    whose prefill on a prefill worker has not finished: held, but not decoding and not growing until
    their KV has arrived (0 when the reporter does not know)."""
    prealloc_waiting_output_tokens: int = 0
    """Expected output tokens of those requests: the KV they will grow by once they decode."""
    decode_tokens_total: int = 0
    """Decode tokens the node's iterations produced since it started (0 when unknown). A running
    total, so that whoever reads states at any cadence (the router, from agents' reports) gets the
    tokens between two reads exactly, as their difference."""
    mixed_decode_tokens_total: int = 0
    """Of ``decode_tokens_total``, those produced by iterations that mixed in borrowed or local
    (unleased) prefill: every such token waits out the whole mixed iteration, so their share over a
    window is the share of the node's tokens that lending put in the ITL tail (a re-prefill after a
    retraction, which plain PD runs too, does not count)."""
    remaining_output_tokens_max: float | None = None
    """Longest remaining output (expected) of the running requests: when the batch is gone. ``None``
    when the reporter does not know; read as ``remaining_output_tokens_mean`` (every request ends
    together), which the interference model answers less accurately: every reporter here fills it."""
    remaining_output_tokens_context_weighted: float | None = None
    """``sum(context x remaining output) / sum(context)`` over the running requests: how long the
    KV-heavy requests stay (``interference_model.columns.drain_features``). ``None``: unknown, read as
    ``remaining_output_tokens_mean``."""

    @property
    def kv_decoding_occupancy(self) -> float:
        """KV occupancy without the pre-allocated KV of requests still waiting for their prefill."""
        if not self.kv_capacity_tokens:
            return 1.0
        return (self.kv_used_tokens - self.kv_prealloc_waiting_tokens) / self.kv_capacity_tokens

    @property
    def kv_occupancy(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 1.0

    @property
    def kv_free_tokens(self) -> int:
        return max(0, self.kv_capacity_tokens - self.kv_used_tokens - self.kv_reserved_tokens)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)
