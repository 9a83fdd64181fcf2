"""What the plugin relies on in SGLang 0.5.23, beyond the hook points: the attributes and methods its
glue reads, writes or calls on SGLang objects.

The glue (``local_prefill.py``, ``hooks.py``) names every SGLang object by its role (``scheduler``,
``req``, ``batch``, ...; :data:`ROLES`), so an :mod:`ast` scan of the glue finds every SGLang name it
touches (:func:`glue_uses`). The tests check both directions: everything the glue touches is listed in
:data:`RELIED`, and the committed snapshot shows each listed name defined in the 0.5.23 source (a
method, a class-level field, or a ``self.<name>`` assignment in the class or one of its bases).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

CLASSES: dict[str, str] = {
    "Scheduler": "sglang/srt/managers/scheduler.py",
    "DecodePreallocQueue": "sglang/srt/disaggregation/decode.py",
    "DecodeRequest": "sglang/srt/disaggregation/decode.py",
    "Req": "sglang/srt/managers/schedule_batch.py",
    "ScheduleBatch": "sglang/srt/managers/schedule_batch.py",
    "NextBatchPlan": "sglang/srt/managers/schedule_batch.py",
    "ForwardMode": "sglang/srt/model_executor/forward_batch_info.py",
    "SamplingParams": "sglang/srt/sampling/sampling_params.py",
    "SchedulerReqTimeStats": "sglang/srt/observability/req_time_stats.py",
    "BasePrefixCache": "sglang/srt/mem_cache/base_prefix_cache.py",
    "BaseTokenToKVPoolAllocator": "sglang/srt/mem_cache/allocator/base.py",
    "SchedulerOutputStreamer": "sglang/srt/managers/scheduler_components/output_streamer.py",
    "SchedulerMetricsReporter": "sglang/srt/managers/scheduler_components/metrics_reporter.py",
    "SpeculativeAlgorithm": "sglang/srt/speculative/spec_info.py",
    "GenerateReqInput": "sglang/srt/managers/io_struct.py",
    "AbortReq": "sglang/srt/managers/io_struct.py",
    "SetInternalStateReq": "sglang/srt/managers/io_struct.py",
    "GetInternalStateReqOutput": "sglang/srt/managers/io_struct.py",
}
"""SGLang class -> the file that defines it (its bases are found through that file's imports)."""

ROLES: dict[str, str] = {
    "scheduler": "Scheduler",
    "self.scheduler": "Scheduler",
    "prealloc": "DecodePreallocQueue",
    "scheduler.disagg_decode_prealloc_queue": "DecodePreallocQueue",
    "self.scheduler.disagg_decode_prealloc_queue": "DecodePreallocQueue",
    "decode_req": "DecodeRequest",
    "req": "Req",
    "chunked": "Req",
    "entry.req": "Req",
    "batch": "ScheduleBatch",
    "running_batch": "ScheduleBatch",
    "self.batch": "ScheduleBatch",
    "scheduler.running_batch": "ScheduleBatch",
    "scheduler.last_batch": "ScheduleBatch",
    "plan": "NextBatchPlan",
    "batch.forward_mode": "ForwardMode",
    "req.sampling_params": "SamplingParams",
    "req.time_stats": "SchedulerReqTimeStats",
    "scheduler.tree_cache": "BasePrefixCache",
    "allocator": "BaseTokenToKVPoolAllocator",
    "scheduler.output_streamer": "SchedulerOutputStreamer",
    "scheduler.metrics_reporter": "SchedulerMetricsReporter",
    "scheduler.spec_algorithm": "SpeculativeAlgorithm",
    "obj": "GenerateReqInput",
    "recv_req": "AbortReq|SetInternalStateReq",
    "state_output": "GetInternalStateReqOutput",
}
"""How the glue names SGLang objects: a variable (or attribute chain) -> its class (``A|B``: either)."""

RELIED: dict[str, tuple[str, ...]] = {
    "Scheduler": (
        "_pending_chunked_abort_req",
        "_release_aborted_request",
        "attn_tp_cpu_group",
        "chunked_prefill_size",
        "chunked_req",
        "disagg_decode_prealloc_queue",
        "disaggregation_mode",
        "enable_hisparse",
        "enable_overlap",
        "enable_priority_preemption",
        "get_new_batch_prefill",
        "is_mixed_chunk",
        "last_batch",
        "max_prefill_tokens",
        "max_running_requests",
        "max_total_num_tokens",
        "metrics_reporter",
        "output_streamer",
        "page_size",
        "process_pending_chunked_abort",
        "require_mlp_sync",
        "running_batch",
        "spec_algorithm",
        "stash_chunked_request",
        "tree_cache",
        "waiting_queue",
    ),
    "DecodePreallocQueue": (
        "_active_req_count",
        "num_reserved_decode_tokens",
        "pp_size",
        "queue",
        "retracted_queue",
        "scheduler",
        "token_to_kv_pool_allocator",
    ),
    "DecodeRequest": ("waiting_for_input",),
    "Req": (
        "discard_output_reason",
        "extend_end",
        "extend_len",
        "finished",
        "origin_input_ids",
        "output_ids",
        "prefix_len",
        "return_logprob",
        "rid",
        "routing_key",
        "sampling_params",
        "time_stats",
    ),
    "ScheduleBatch": (
        "batch_is_full",
        "decoding_reqs",
        "filter_batch",
        "forward_mode",
        "is_empty",
        "merge_batch",
        "reqs",
    ),
    "NextBatchPlan": ("batch_to_run",),
    "ForwardMode": ("is_decode",),
    "SamplingParams": ("max_new_tokens",),
    "SchedulerReqTimeStats": ("set_wait_queue_entry_time",),
    "BasePrefixCache": ("evictable_size",),
    "BaseTokenToKVPoolAllocator": ("available_size",),
    "SchedulerOutputStreamer": ("stream_output",),
    "SchedulerMetricsReporter": ("current_scheduler_metrics_enabled",),
    "SpeculativeAlgorithm": ("is_none",),
    "GenerateReqInput": ("routing_key",),
    "AbortReq": ("abort_all", "rid"),
    "SetInternalStateReq": ("server_args",),
    "GetInternalStateReqOutput": ("internal_state",),
}
"""SGLang class -> the names the glue uses on its instances."""

PYTHON_ATTRIBUTES: frozenset[str] = frozenset({"name", "__dict__"})
"""Attributes Python itself defines that the glue reads on an SGLang value (an enum's ``name``, an
object's ``__dict__``)."""

GLUE_FILES: tuple[str, ...] = ("local_prefill.py", "hooks.py")


def _chain(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *parts[::-1]]
    return None


def glue_uses(sources: Iterable[str]) -> set[tuple[str, str]]:
    """``(role class, name)`` for every attribute the given glue sources read, write or call on an
    SGLang object named by one of :data:`ROLES` (``scheduler.tree_cache.evictable_size`` is both
    ``Scheduler.tree_cache`` and ``BasePrefixCache.evictable_size``)."""
    uses: set[tuple[str, str]] = set()
    for source in sources:
        tree = ast.parse(source)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or isinstance(parents.get(node), ast.Attribute):
                continue  # whole chains only
            chain = _chain(node)
            if chain is None:
                continue
            for i in range(1, len(chain)):
                role = ROLES.get(".".join(chain[:i]))
                if role is not None and chain[i] not in PYTHON_ATTRIBUTES:
                    uses.add((role, chain[i]))
    return uses


def glue_sources() -> list[str]:
    here = Path(__file__).parent
    return [(here / name).read_text("utf-8") for name in GLUE_FILES]


def missing_from_contract(uses: set[tuple[str, str]]) -> list[str]:
    """Uses the contract does not list (``Class.name``); a role naming two classes is satisfied when
    either lists the name."""
    out = []
    for role_class, name in sorted(uses):
        if not any(name in RELIED.get(c, ()) for c in role_class.split("|")):
            out.append(f"{role_class}.{name}")
    return out


__all__ = ["CLASSES", "GLUE_FILES", "RELIED", "ROLES", "glue_sources", "glue_uses", "missing_from_contract"]
