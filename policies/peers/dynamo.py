"""NVIDIA Dynamo's conditional disaggregation: ``dynamo-isl``, ``dynamo-load``, ``dynamo-isl-or-load``.

Source: ai-dynamo/dynamo at commit 2a6da14c (2026-08-21); rules re-expressed here, no code copied.

* ``isl_bounding`` (Dynamo's default policy), ``lib/kv-router/src/conditional_disagg.rs`` lines
  155-166: with ``eff_isl`` = prompt tokens minus the decode worker's cached prefix, prefill locally
  iff ``eff_isl < eff_isl_threshold`` and ``eff_isl / prompt < eff_isl_ratio_threshold`` (defaults
  2048 and 0.7, lines 16 and 20).
* ``prefill_load``, same file lines 204-209: locally iff the prefill worker the router would pick is
  busy, ``active_prefill_tokens > prefill_busy_threshold x max_num_batched_tokens``
  (``lib/kv-router/src/scheduling/types.rs`` lines 163-165). Here: the uncomputed tokens queued on the
  gateway's prefill pick against the cluster's ``prefill_chunk_tokens``.
* ``isl_or_load``, same file lines 256-259: either.
* The decode-busy guard, ``lib/llm/src/kv_router/prefill_router/conditional_bypass.rs`` lines 55-61
  and 242-261: a local verdict is vetoed when the decode worker's projected KV (its router-side
  active blocks plus this request's) exceeds ``decode_busy_threshold`` of its capacity, or when the
  capacity is unknown (``types.rs`` lines 167-174). It is **advisory**: the comment at lines 242-248
  says so; it books nothing, and concurrent decisions race the same threshold. Here the router-side
  load is one snapshot per simulated instant (``PathQuery.decode_kv_load_tokens``), so requests
  arriving together all pass a guard that only the first of them should have. Leases close that gap.

The decode worker is the gateway's pick; the local prefill runs as chunked prefill mixed into its
decode iterations, ``local_chunk_tokens`` per iteration (Dynamo leaves that to the engine's
``max_num_batched_tokens``; here it is tuned).
"""

from __future__ import annotations

from typing import Any, Literal

from policies.catalog import PolicySpec, register_policy
from policies.context import CostEstimator, PolicyContext
from policies.path import PathQuery, PathReason, register_path_policy
from policies.peers.conditional import ConditionalLocal, check_non_negative

DynamoKind = Literal["isl_bounding", "prefill_load", "isl_or_load"]

SOURCE = (
    "ai-dynamo/dynamo@2a6da14c lib/kv-router/src/conditional_disagg.rs:155-166,204-209,256-259; "
    "decode-busy guard lib/llm/src/kv_router/prefill_router/conditional_bypass.rs:55-61,242-261"
)
DEFAULT_EFF_ISL_THRESHOLD = 2048
DEFAULT_EFF_ISL_RATIO_THRESHOLD = 0.7
DEFAULT_DECODE_BUSY_THRESHOLD = 0.9
"""Unset (guard off) in Dynamo; 0.9 is the value its own configuration test uses."""
DEFAULT_PREFILL_BUSY_THRESHOLD = 4.0
"""Unset in Dynamo (it falls back to ``router_queue_threshold``, itself unset by default)."""
DEFAULT_LOCAL_CHUNK_TOKENS = 1024


class DynamoConditionalDisagg(ConditionalLocal):
    """One of Dynamo's three conditional-disaggregation policies plus its decode-busy guard.

    Args:
        kind: ``isl_bounding``, ``prefill_load`` or ``isl_or_load``.
        eff_isl_threshold, eff_isl_ratio_threshold: the ISL rule's bounds (strict).
        prefill_busy_threshold: the load rule's busy line, in units of ``prefill_chunk_tokens``.
        decode_busy_threshold: the guard's share of the decode worker's KV capacity (``None``: off).
        prefill_chunk_tokens: the prefill workers' per-iteration token budget (the cluster's).
        local_chunk_tokens: see ``ConditionalLocal``.
    """

    def __init__(
        self,
        cost: CostEstimator,
        *,
        kind: DynamoKind,
        prefill_chunk_tokens: int,
        eff_isl_threshold: int = DEFAULT_EFF_ISL_THRESHOLD,
        eff_isl_ratio_threshold: float = DEFAULT_EFF_ISL_RATIO_THRESHOLD,
        prefill_busy_threshold: float = DEFAULT_PREFILL_BUSY_THRESHOLD,
        decode_busy_threshold: float | None = DEFAULT_DECODE_BUSY_THRESHOLD,
        local_chunk_tokens: int = DEFAULT_LOCAL_CHUNK_TOKENS,
    ) -> None:
        super().__init__(cost, local_chunk_tokens=local_chunk_tokens)
        if kind not in ("isl_bounding", "prefill_load", "isl_or_load"):
            raise ValueError(
                f"DynamoConditionalDisagg.kind: isl_bounding, prefill_load or isl_or_load, not {kind!r}"
            )
        check_non_negative(
            "DynamoConditionalDisagg",
            eff_isl_threshold=eff_isl_threshold,
            prefill_busy_threshold=prefill_busy_threshold,
            decode_busy_threshold=decode_busy_threshold or 0.0,
        )
        ratio = eff_isl_ratio_threshold
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(
                f"DynamoConditionalDisagg.eff_isl_ratio_threshold must be in [0, 1], got {ratio!r}"
            )
        self.kind = kind
        self.eff_isl_threshold = eff_isl_threshold
        self.eff_isl_ratio_threshold = eff_isl_ratio_threshold
        self.prefill_busy_tokens = prefill_busy_threshold * prefill_chunk_tokens
        self.decode_busy_threshold = decode_busy_threshold

    def _isl_local(self, q: PathQuery, node_id: int) -> bool:
        eff_isl = q.decode_uncached_tokens(node_id)
        return (
            eff_isl < self.eff_isl_threshold
            and eff_isl / max(q.input_tokens, 1) < self.eff_isl_ratio_threshold
        )

    def _load_local(self, q: PathQuery) -> bool:
        return q.normal_queued_tokens > self.prefill_busy_tokens

    def rule(self, q: PathQuery, node_id: int) -> tuple[bool, PathReason, str]:
        isl = self.kind != "prefill_load" and self._isl_local(q, node_id)
        load = self.kind != "isl_bounding" and self._load_local(q)
        eff_isl = q.decode_uncached_tokens(node_id)
        facts = f"eff_isl {eff_isl}/{q.input_tokens}, prefill queued {q.normal_queued_tokens}"
        if not (isl or load):
            return False, PathReason.RULE_NORMAL, f"{self.kind}: normal ({facts})"
        if self.decode_busy_threshold is not None:
            load_tokens = q.decode_kv_load_tokens.get(node_id)
            if load_tokens is None or q.decode_kv_capacity_tokens <= 0:
                return False, PathReason.DECODE_UNKNOWN, f"{self.kind}: decode load of node {node_id} unknown"
            projected = load_tokens + eff_isl
            if projected > self.decode_busy_threshold * q.decode_kv_capacity_tokens:
                detail = (
                    f"{self.kind}: node {node_id} projected KV {projected} > {self.decode_busy_threshold} x "
                    f"{q.decode_kv_capacity_tokens}"
                )
                return False, PathReason.DECODE_BUSY, detail
        which = "isl" if isl else "load"
        return True, PathReason.RULE_LOCAL, f"{self.kind}: local on node {node_id} by {which} ({facts})"


def _register(name: str, kind: DynamoKind, summary: str, grid: dict[str, tuple[Any, ...]]) -> None:
    def make(ctx: PolicyContext, **params: Any) -> DynamoConditionalDisagg:
        chunk = ctx.cluster.prefill_chunk_tokens
        return DynamoConditionalDisagg(ctx.cost, kind=kind, prefill_chunk_tokens=chunk, **params)

    register_path_policy(name, make, summary=summary)
    register_policy(
        PolicySpec(name, summary + " (decode-busy guard on)", path=name, grid=grid, source=SOURCE)
    )


_register(
    "dynamo-isl",
    "isl_bounding",
    "Dynamo isl_bounding: local iff the uncached prompt is short in tokens and in share",
    {
        "path.eff_isl_threshold": (2048, 8192),
        "path.decode_busy_threshold": (0.5, 0.9),
        "path.local_chunk_tokens": (512, 2048),
    },
)
_register(
    "dynamo-load",
    "prefill_load",
    "Dynamo prefill_load: local iff the chosen prefill worker is over its busy line",
    {
        "path.prefill_busy_threshold": (4.0, 16.0),
        "path.decode_busy_threshold": (0.5, 0.9),
        "path.local_chunk_tokens": (512, 2048),
    },
)
_register(
    "dynamo-isl-or-load",
    "isl_or_load",
    "Dynamo isl_or_load: local iff either rule says so",
    {
        "path.eff_isl_threshold": (2048, 8192),
        "path.prefill_busy_threshold": (4.0, 16.0),
        "path.local_chunk_tokens": (512, 2048),
    },
)

__all__ = ["DynamoConditionalDisagg"]
