"""Load-aware prefill deflection: ``deflect``, a **reconstruction** of arXiv 2607.02043.

Source: S. Bharadwaj, R. St. Amant, V. Rühle, A. Parayil, S. Arun, "Towards Load-Aware Prefill
Deflection for Disaggregated LLM Serving", arXiv:2607.02043 (2026), from its abstract: for each queued
request, estimate the TTFT it would see on the prefill node; on every decode node, find the largest
chunk schedule that keeps in-flight decodes within their time-between-tokens SLO; deflect when the
decode path is faster, running the prefill as chunked-prefill steps interleaved with the node's decode
batch (no KV transfer). No code was published with it that we know of; this is our reading of the
rule, not the authors' implementation.

Rule here, per decode node each control interval (from its ``NodeState``): the largest chunk ``c``
(at most ``max_chunk_tokens``, in steps of 64 tokens) whose mixed iteration with the node's running
batch takes at most ``itl_slack x`` the TPOT SLO (the cost estimator's ``mixed_step_time_s``); the
node then prefills local work at ``c`` tokens per such iteration. A request's local TTFT on that node
is its uncached tokens plus the node's queued local prefill (as last reported, plus what this policy
sent there since), at that rate. It is deflected to the fastest node iff that beats the normal path's
estimate (queue wait + prefill + KV transfer) by ``margin``, and the node's KV can hold it. Requests
still waiting on a prefill worker are re-evaluated every control interval. No lease, no learned model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.catalog import PolicySpec, register_policy
from policies.context import ClusterView, CostEstimator, PolicyContext
from policies.ledger import LeaseLedger
from policies.node_policies import largest_chunk_within
from policies.node_state import NodeState
from policies.path import (
    PathDecision,
    PathPolicy,
    PathQuery,
    PathReason,
    normal_path_estimate_s,
    register_path_policy,
)

SOURCE = "arXiv:2607.02043 (reconstructed from the abstract; no public code)"


class Deflect(PathPolicy):
    """Deflect a request's prefill to the decode node where it finishes soonest within the ITL SLO.

    Args:
        cost: timing; ``mixed_step_time_s`` sizes the chunk each node can take.
        cluster: the TPOT SLO the chunk must keep.
        itl_slack: share of the TPOT SLO a mixed iteration may take (0, 1].
        max_chunk_tokens: largest chunk mixed into one iteration.
        margin: deflect only if ``local <= normal x (1 - margin)``.
    """

    reconsiders_waiting = True
    observe_replayable = True  # its observe reads the states but never their time_s

    def __init__(
        self,
        cost: CostEstimator,
        cluster: ClusterView,
        *,
        itl_slack: float = 1.0,
        max_chunk_tokens: int = 8192,
        margin: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0 < itl_slack <= 1 or max_chunk_tokens < 1 or not 0 <= margin < 1:
            raise ValueError("Deflect: need 0 < itl_slack <= 1, max_chunk_tokens >= 1 and 0 <= margin < 1")
        self.cost = cost
        self.step_target_s = itl_slack * cluster.slo_tpot_s
        self.max_chunk_tokens = max_chunk_tokens
        self.margin = margin
        self._chunk: dict[int, int] = {}
        self._step_s: dict[int, float] = {}
        self._sent_tokens: dict[int, int] = {}
        """Local prefill tokens sent to each node since its last state report."""
        self._nodes: list[tuple[int, NodeState]] = []
        """``states`` in node order (as of the last ``observe``)."""
        self._chunks: dict[tuple[int, int, float, int], tuple[int, float]] = {}
        """(decode batch, its context tokens, step target, chunk cap) -> ``largest_chunk``."""

    def largest_chunk(self, state: NodeState) -> tuple[int, float]:
        """``(chunk tokens, mixed iteration time)`` of the largest chunk within the step target (kept
        per batch and context: an idle node asks the same at every interval)."""
        batch = state.decode_batch_size
        key = (batch, int(state.context_tokens_mean * batch), self.step_target_s, self.max_chunk_tokens)
        found = self._chunks.get(key)
        if found is None:
            if len(self._chunks) >= 1 << 14:  # a bound on memory
                self._chunks.clear()
            found = self._chunks[key] = largest_chunk_within(self.cost, *key)
        return found

    def observe(self, now_s: float, states: Sequence[NodeState]) -> None:
        super().observe(now_s, states)
        self._nodes = sorted(self.states.items())
        for s in states:
            self._chunk[s.node_id], self._step_s[s.node_id] = self.largest_chunk(s)
            self._sent_tokens[s.node_id] = 0

    def local_chunk_tokens(self, node_id: int) -> int:
        return self._chunk.get(node_id, 0)

    def best_local(self, q: PathQuery, threshold_s: float = math.inf) -> tuple[int, float, int] | None:
        """``(node, estimated local TTFT, tokens it computes)`` of the fastest node whose estimate is
        under ``threshold_s``, or ``None``. A node's estimate is its queued local tokens at its chunk
        rate, plus this prompt's chunks, each timed with its attention over the prefix before it."""
        candidates = []
        for node, state in self._nodes:
            chunk = self._chunk.get(node, 0)
            if chunk <= 0:
                continue
            need = q.decode_uncached_tokens(node)
            load = q.decode_kv_load_tokens.get(node, state.kv_used_tokens)
            if load + need + q.expected_output_tokens > state.kv_capacity_tokens:
                continue  # the node cannot hold it: it would only wait there
            step_s = self._step_s[node]
            queue_s = (state.local_prefill_tokens_queued + self._sent_tokens.get(node, 0)) / chunk * step_s
            lower_s = queue_s + (need // chunk) * step_s  # full chunks at the first chunk's cost
            candidates.append((lower_s, node, queue_s, need, state))
        best: tuple[int, float, int] | None = None
        for lower_s, node, queue_s, need, state in sorted(candidates, key=lambda c: (c[0], c[1])):
            if lower_s >= min(threshold_s, best[1] if best else math.inf):
                break  # neither this node nor any later one can do better
            context = int(state.context_tokens_mean * state.decode_batch_size)
            est_s = queue_s + self.cost.local_prefill_time_s(
                need, q.input_tokens - need, self._chunk[node], state.decode_batch_size, context
            )
            if est_s < threshold_s and (best is None or est_s < best[1]):
                best = (node, est_s, need)
        return best

    def _local(self, q: PathQuery, est_normal_s: float) -> tuple[int, float, int] | None:
        """``best_local`` under the margin: the node to deflect ``q`` to, or ``None``."""
        return self.best_local(q, threshold_s=math.nextafter(est_normal_s * (1.0 - self.margin), math.inf))

    def _deflect(self, est_normal_s: float, best: tuple[int, float, int]) -> PathDecision:
        """Send the prompt to ``best``'s node: its queue there grows by the tokens it computes."""
        node, est_s, need = best
        self._sent_tokens[node] = self._sent_tokens.get(node, 0) + need
        detail = (
            f"local {est_s:.3f} s on node {node} (chunk {self._chunk[node]}) vs normal {est_normal_s:.3f} s"
        )
        return PathDecision("local", node, None, est_normal_s, est_s, detail, PathReason.LOCAL_FASTER)

    def choose(self, q: PathQuery, now_s: float, ledger: LeaseLedger) -> PathDecision:
        est_normal_s = normal_path_estimate_s(self.cost, q)
        if not self.states:
            return PathDecision(
                "normal", None, None, est_normal_s, None, "no decode node state yet", PathReason.NO_NODE_STATE
            )
        best = self._local(q, est_normal_s)
        if best is None:
            detail = f"no decode node beats normal {est_normal_s:.3f} s by the margin within the ITL target"
            return PathDecision("normal", None, None, est_normal_s, None, detail, PathReason.LOCAL_NOT_FASTER)
        return self._deflect(est_normal_s, best)

    def reconsider(self, q: PathQuery, now_s: float) -> PathDecision | None:
        # ``choose``'s rule, building a decision only for a deflection (the usual answer is to stay)
        if not self.states:
            return None
        est_normal_s = normal_path_estimate_s(self.cost, q)
        best = self._local(q, est_normal_s)
        return None if best is None else self._deflect(est_normal_s, best)


def _make(ctx: PolicyContext, **params: float) -> Deflect:
    return Deflect(ctx.cost, ctx.cluster, **params)  # type: ignore[arg-type]


register_path_policy("deflect", _make, summary="load-aware prefill deflection (reconstructed)")
register_policy(
    PolicySpec(
        "deflect",
        "load-aware prefill deflection (arXiv 2607.02043, reconstructed): local when faster, within ITL",
        path="deflect",
        grid={
            "path.itl_slack": (0.5, 1.0),
            "path.max_chunk_tokens": (2048, 8192),
            "path.margin": (0.0, 0.2),
        },
        source=SOURCE,
    )
)

__all__ = ["Deflect"]
