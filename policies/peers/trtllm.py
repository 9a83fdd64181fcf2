"""TensorRT-LLM's conditional disaggregation: ``trtllm-local``.

Source: NVIDIA/TensorRT-LLM at commit 00bb903d, ``tensorrt_llm/serve/openai_disagg_service.py``,
``OpenAIDisaggregatedService._check_conditional_disagg`` (line 248; the predicate at lines 256-260);
``ConditionalDisaggConfig.max_local_prefill_length`` defaults to 0 in
``tensorrt_llm/llmapi/disagg_utils.py``. Rule re-expressed here, no code copied: the KV-cache-aware
generation router picks the generation (decode) server; the context (prefill) server is skipped, and
the generation server prefills the request itself, iff its cache matches part of the prompt and the
unmatched rest is at most ``max_local_prefill_length`` tokens. No match at all means the normal path.

Here: the decode pick is the gateway's, the match is that node's prefix cache (so with the cluster's
decode prefix cache off every request takes the normal path, as TensorRT-LLM would without block
reuse on its generation servers). Local prefill runs as chunked prefill mixed into the node's decode
iterations, ``local_chunk_tokens`` per iteration (tuned).
"""

from __future__ import annotations

from policies.catalog import PolicySpec, register_policy
from policies.context import CostEstimator, PolicyContext
from policies.path import PathQuery, PathReason, register_path_policy
from policies.peers.conditional import ConditionalLocal, check_non_negative

SOURCE = "NVIDIA/TensorRT-LLM@00bb903d tensorrt_llm/serve/openai_disagg_service.py:248-260"


class TrtllmConditionalDisagg(ConditionalLocal):
    """Local iff the decode pick caches part of the prompt and the rest is at most
    ``max_local_prefill_length`` tokens (see above)."""

    def __init__(
        self, cost: CostEstimator, *, max_local_prefill_length: int = 1024, local_chunk_tokens: int = 1024
    ) -> None:
        super().__init__(cost, local_chunk_tokens=local_chunk_tokens)
        check_non_negative("TrtllmConditionalDisagg", max_local_prefill_length=max_local_prefill_length)
        self.max_local_prefill_length = max_local_prefill_length

    def rule(self, q: PathQuery, node_id: int) -> tuple[bool, PathReason, str]:
        matched = q.input_tokens - q.decode_uncached_tokens(node_id)
        residual = q.input_tokens - matched
        if matched > 0 and residual <= self.max_local_prefill_length:
            return True, PathReason.RULE_LOCAL, f"match {matched}, residual {residual} on node {node_id}"
        return (
            False,
            PathReason.RULE_NORMAL,
            f"match {matched}, residual {residual} > {self.max_local_prefill_length}",
        )


def _make(ctx: PolicyContext, **params: int) -> TrtllmConditionalDisagg:
    return TrtllmConditionalDisagg(ctx.cost, **params)


register_path_policy("trtllm-local", _make, summary="TensorRT-LLM conditional disaggregation")
register_policy(
    PolicySpec(
        "trtllm-local",
        "TensorRT-LLM conditional disaggregation: local iff cached and the rest is short",
        path="trtllm-local",
        grid={
            "path.max_local_prefill_length": (256, 1024, 4096, 16384),
            "path.local_chunk_tokens": (512, 2048),
        },
        source=SOURCE,
    )
)

__all__ = ["TrtllmConditionalDisagg"]
