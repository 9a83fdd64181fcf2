"""Small purpose-built stand-ins for tests (a linear cost model, hand-made traces)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.request import Request, Trace


@dataclass
class LinearCostModel:
    """Iteration time = base + per prefill token + per decode request + per context token.

    Linear in every input, so hand computations in tests are exact.
    """

    base_s: float = 0.01
    per_prefill_token_s: float = 1e-5
    per_decode_request_s: float = 1e-4
    per_context_token_s: float = 0.0
    kv_capacity_tokens: int = 1_000_000
    kv_bytes_per_token: int = 1000
    kv_transfer_bytes_per_token: float = 0.0
    """Bytes one token's KV puts on a transfer link (0: a transfer takes only the link latency)."""
    transfer_s: float = 0.005
    """What ``kv_transfer_time_s`` answers (the scheduler's estimate; the simulator times transfers on
    its links from ``kv_transfer_bytes_per_token`` and the cluster's latency)."""

    def iteration_time_s(
        self, prefill: Sequence[tuple[int, int]] = (), decode_batch: int = 0, decode_context_tokens: int = 0
    ) -> float:
        new = sum(n for n, _ in prefill)
        if new == 0 and decode_batch == 0:
            return 0.0
        return (
            self.base_s
            + self.per_prefill_token_s * new
            + self.per_decode_request_s * decode_batch
            + self.per_context_token_s * decode_context_tokens
        )

    def iteration_times_s(
        self,
        prefill_tokens: np.ndarray,
        prefill_attention_pairs: np.ndarray,
        decode_batch: np.ndarray | int,
        decode_context_tokens: np.ndarray | int,
    ) -> np.ndarray:
        """Vectorised ``iteration_time_s`` (attention pairs cost nothing in this model)."""
        new, _, batch, ctx = np.broadcast_arrays(
            np.asarray(prefill_tokens, dtype=np.float64),
            np.asarray(prefill_attention_pairs, dtype=np.float64),
            np.asarray(decode_batch, dtype=np.float64),
            np.asarray(decode_context_tokens, dtype=np.float64),
        )
        total = (
            self.base_s
            + self.per_prefill_token_s * new
            + self.per_decode_request_s * batch
            + self.per_context_token_s * ctx
        )
        return np.where((new > 0) | (batch > 0), total, 0.0)

    def decode_step_time_s(self, batch: int, context_tokens: int) -> float:
        return self.iteration_time_s((), batch, context_tokens)

    def prefill_time_s(self, new_tokens: int, cached_tokens: int = 0, chunk_tokens: int = 8192) -> float:
        chunks = -(-new_tokens // chunk_tokens)
        return chunks * self.base_s + self.per_prefill_token_s * new_tokens

    def kv_transfer_time_s(
        self, tokens: int, bandwidth_bytes_per_s: float | None = None, latency_s: float | None = None
    ) -> float:
        return self.transfer_s


class ConstantPredictor:
    """An interference model that says the same safe prefill rate for every node state."""

    def __init__(self, tokens_per_s: float) -> None:
        self.tokens_per_s = tokens_per_s

    def safe_prefill_tokens_per_s(
        self,
        decode_batch_size: int,
        context_tokens_mean: float,
        context_tokens_std: float,
        remaining_output_tokens_mean: float,
        kv_occupancy: float,
        remaining_output_tokens_max: float | None = None,
        remaining_output_tokens_context_weighted: float | None = None,
    ) -> float:
        return self.tokens_per_s


def open_trace(rows: Sequence[tuple[float, int, int]], name: str = "tiny") -> Trace:
    """Open-loop trace from (arrival_s, input_tokens, output_tokens) rows, no prefix sharing."""
    reqs = [
        Request(request_id=i, session_id=-1, turn=0, arrival_s=t, input_tokens=n_in, output_tokens=n_out)
        for i, (t, n_in, n_out) in enumerate(rows)
    ]
    return Trace(name=name, requests=reqs)


def session_trace(
    n_sessions: int,
    turns: int,
    first_input: int = 2048,
    grow: int = 1024,
    output: int = 64,
    think_s: float = 1.0,
) -> Trace:
    """Closed-loop agent-like sessions: each turn extends the previous turn's input by ``grow``."""
    reqs: list[Request] = []
    for s in range(n_sessions):
        prev = -1
        for t in range(turns):
            rid = len(reqs)
            n_in = first_input + t * grow
            reqs.append(
                Request(
                    request_id=rid,
                    session_id=s,
                    turn=t,
                    arrival_s=0.0,
                    input_tokens=n_in,
                    output_tokens=output + 7 * t,
                    parent_id=prev,
                    shared_prefix_tokens=(n_in - grow) if prev >= 0 else 0,
                    depends_on=prev,
                    think_time_s=think_s,
                )
            )
            prev = rid
    return Trace(name="sessions", requests=reqs, closed_loop=True)


def assert_pool_matches_agree(matches: Any, walked: dict[int, int]) -> None:
    """``match_in_pool``'s answer agrees with each worker's own ``match_tokens`` (``walked``): a uniform
    answer is every worker's match; otherwise it names exactly the workers holding the longest match
    (none when nothing matches), each with its own match."""
    from policies.routing import UniformMatches

    best = max(walked.values())
    if isinstance(matches, UniformMatches):
        assert all(v == matches.tokens for v in walked.values())
        return
    assert {i for i, v in walked.items() if v == best and v > 0} == {
        i for i, v in matches.items() if v == best
    }
    assert all(walked[i] == v for i, v in matches.items())
