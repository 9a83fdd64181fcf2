"""The shape every conditional-disaggregation peer shares: a rule on the gateway's decode pick.

The router first picks the decode worker the request would decode on (the gateway's choice, as
Dynamo's ``PrefillRouter`` peeks its decode router and TensorRT-LLM's disaggregated server asks its
generation router); the rule then says whether that worker prefills the request itself (``local``,
no lease) or the normal path runs. Local prefill mixes at most ``local_chunk_tokens`` prefill tokens
into each of that worker's decode iterations.
"""

from __future__ import annotations

from abc import abstractmethod

from policies.context import CostEstimator
from policies.ledger import LeaseLedger
from policies.path import PathDecision, PathPolicy, PathQuery, PathReason, normal_path_estimate_s


class ConditionalLocal(PathPolicy):
    """Local on the gateway's decode pick when ``rule`` says so, else normal (see the module docstring).

    Args:
        cost: timing, for the decision records' estimate of the normal path.
        local_chunk_tokens: prefill tokens of local requests one decode iteration mixes in (> 0).
    """

    uses_gateway_decode_pick = True

    def __init__(self, cost: CostEstimator, *, local_chunk_tokens: int) -> None:
        super().__init__()
        if local_chunk_tokens < 1:
            raise ValueError(
                f"{type(self).__name__}.local_chunk_tokens must be >= 1, got {local_chunk_tokens}"
            )
        self.cost = cost
        self.chunk_tokens = local_chunk_tokens

    @abstractmethod
    def rule(self, q: PathQuery, node_id: int) -> tuple[bool, PathReason, str]:
        """``(local?, reason code, detail)`` for ``q`` on decode node ``node_id``."""

    def choose(self, q: PathQuery, now_s: float, ledger: LeaseLedger) -> PathDecision:
        est_normal_s = normal_path_estimate_s(self.cost, q)
        node = q.normal_decode_worker
        if node is None:
            raise ValueError(
                f"{type(self).__name__} needs the gateway's decode pick (PathQuery.normal_decode_worker)"
            )
        local, code, detail = self.rule(q, node)
        if local:
            return PathDecision("local", node, None, est_normal_s, None, detail, code)
        return PathDecision("normal", None, None, est_normal_s, None, detail, code)

    def local_chunk_tokens(self, node_id: int) -> int:
        return self.chunk_tokens


def check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{owner}.{name} must be >= 0, got {value!r}")


__all__ = ["ConditionalLocal", "check_non_negative"]
