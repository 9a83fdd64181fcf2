"""llm-d's prefix-based PD decider: ``llmd-prefix``.

Source: llm-d/llm-d-inference-scheduler at commit 520af478 (2026-05-17),
``pkg/epp/framework/plugins/scheduling/profilehandler/disagg/prefix_based_pd_decider.go`` lines
99-149 (``disaggregate``); rule re-expressed here, no code copied. After the decode profile has picked
the decode endpoint, the request is disaggregated (runs a prefill profile) iff its non-cached tokens on
that endpoint, prompt tokens minus the endpoint's prefix-cache match, are at least ``nonCachedTokens``;
otherwise the decode endpoint prefills it itself. ``nonCachedTokens = 0`` disables disaggregation.

Here: the decode endpoint is the gateway's decode pick and the match is that node's real prefix cache
(zero with the cluster's decode prefix cache off, as in SGLang's default; llm-d reads an approximate,
router-side index instead). ``non_cached_tokens = 0`` sends everything on the normal path: this
cluster is disaggregated, so "no decider" means static PD. Local prefill runs as chunked prefill mixed
into the node's decode iterations, ``local_chunk_tokens`` per iteration (tuned).
"""

from __future__ import annotations

from policies.catalog import PolicySpec, register_policy
from policies.context import CostEstimator, PolicyContext
from policies.path import PathQuery, PathReason, register_path_policy
from policies.peers.conditional import ConditionalLocal, check_non_negative

SOURCE = (
    "llm-d/llm-d-inference-scheduler@520af478 pkg/epp/framework/plugins/scheduling/profilehandler/"
    "disagg/prefix_based_pd_decider.go:99-149"
)


class LlmdPrefixDecider(ConditionalLocal):
    """Local iff the uncached prompt on the decode pick is under ``non_cached_tokens`` (see above)."""

    def __init__(
        self, cost: CostEstimator, *, non_cached_tokens: int = 1024, local_chunk_tokens: int = 1024
    ) -> None:
        super().__init__(cost, local_chunk_tokens=local_chunk_tokens)
        check_non_negative("LlmdPrefixDecider", non_cached_tokens=non_cached_tokens)
        self.non_cached_tokens = non_cached_tokens

    def rule(self, q: PathQuery, node_id: int) -> tuple[bool, PathReason, str]:
        uncached = q.decode_uncached_tokens(node_id)
        if self.non_cached_tokens > 0 and uncached < self.non_cached_tokens:
            return (
                True,
                PathReason.RULE_LOCAL,
                f"non-cached {uncached} < {self.non_cached_tokens} on node {node_id}",
            )
        return False, PathReason.RULE_NORMAL, f"non-cached {uncached} >= {self.non_cached_tokens}"


def _make(ctx: PolicyContext, **params: int) -> LlmdPrefixDecider:
    return LlmdPrefixDecider(ctx.cost, **params)


register_path_policy("llmd-prefix", _make, summary="llm-d prefix-based PD decider")
register_policy(
    PolicySpec(
        "llmd-prefix",
        "llm-d prefix-based PD decider: local iff the non-cached prompt is under a threshold",
        path="llmd-prefix",
        grid={"path.non_cached_tokens": (256, 1024, 4096, 16384), "path.local_chunk_tokens": (512, 2048)},
        source=SOURCE,
    )
)

__all__ = ["LlmdPrefixDecider"]
