"""The plugin's hooks on SGLang 0.5.23, installed through its ``HookRegistry``.

``load()`` is the entry point (``[project.entry-points."sglang.srt.plugins"] crossflow``); SGLang calls
it once in every process that runs ``load_plugins()`` (the HTTP server with the tokenizer, each
scheduler, the detokenizer), then applies the registered hooks. ``register`` takes the registry and
its ``HookType`` as arguments so the tests install the same hooks on look-alike classes.

Each hook only translates its SGLang call into ``LocalPrefill`` (``local_prefill.py``) or ``wire``:

* ``TokenizerManager.generate_request`` (AROUND): a body with ``do_local_prefill: true`` marks
  ``obj.routing_key``;
* ``Scheduler._add_request_to_queue`` (AROUND): a marked request joins the local queue or gets 503
  (``LocalPrefill.intake``);
* ``SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run`` (AROUND): a local
  EXTEND batch, or SGLang's decode step (``LocalPrefill.select``);
* ``DecodePreallocQueue._allocatable_token_budgets`` and ``_swa_tail_allocatable_token_budget``
  (AFTER): SGLang's budget minus the KV held out for borrowed work;
* ``Scheduler.abort_request`` (AROUND): also aborts queued local requests;
* ``Scheduler.is_fully_idle`` (AFTER): not idle while borrowed requests are queued;
* ``Scheduler.set_internal_state`` (AROUND): a ``crossflow_lease_*`` update installs the lease;
* ``Scheduler.get_internal_state`` (AFTER): adds ``crossflow`` (``NodeState``, lease, queue).

The KV hooks leave ``count_retracted=False`` calls alone: that is ``resume_retracted_reqs``, and a
retracted decode resumes before any borrowed work.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.sglang_plugin.config import PluginConfig
from serving.sglang_plugin.local_prefill import (
    NODE_ATTRIBUTE,
    LocalPrefill,
    SGLangApi,
    is_decode_worker,
    node_for,
)
from serving.sglang_plugin.wire import (
    INTERNAL_STATE_KEY,
    is_lease_update,
    mark_routing_key,
    parse_lease_update,
    requests_local_prefill,
)

logger = logging.getLogger("crossflow.sglang_plugin")

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_DECODE = "sglang.srt.disaggregation.decode"
_TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"


# ---------------------------------------------------------------- tokenizer side
async def carry_marker(
    original: Callable[..., AsyncIterator[Any]], tokenizer_manager: Any, obj: Any, request: Any = None
) -> AsyncIterator[Any]:
    """AROUND ``TokenizerManager.generate_request(self, obj, request=None)``: put the body's
    ``do_local_prefill`` on ``obj.routing_key`` (the raw body is Starlette's cached copy)."""
    if request is not None and requests_local_prefill(await request.body()):
        obj.routing_key = mark_routing_key(obj.routing_key)
    async for out in original(tokenizer_manager, obj, request):
        yield out


# ---------------------------------------------------------------- scheduler side
def intake(original: Callable[..., Any], scheduler: Any, req: Any, is_retracted: bool = False) -> Any:
    """AROUND ``Scheduler._add_request_to_queue(self, req, is_retracted=False)``."""
    return _node(scheduler).intake(original, req, is_retracted)


def select_batch(original: Callable[..., Any], scheduler: Any, running_batch: Any) -> Any:
    """AROUND ``get_next_disagg_decode_batch_to_run(self, running_batch)``."""
    return _node(scheduler).select(original, running_batch)


def kv_budget(
    result: int,
    prealloc: Any,
    retractable_tokens: int | None = None,
    count_retracted: bool = True,
    extra_reserved_reqs: int = 0,
    reserved_tokens: int | None = None,
    hicache_reserved_tokens: int = 0,
) -> int:
    """AFTER ``DecodePreallocQueue._allocatable_token_budgets``: SGLang's budget minus the KV held out
    for borrowed work (not when resuming retracted requests)."""
    return _held_out(result, prealloc, count_retracted)


def swa_kv_budget(
    result: int,
    prealloc: Any,
    retractable_tokens: int | None = None,
    retractable_swa_tokens: int | None = None,
    count_retracted: bool = True,
    n_active: int | None = None,
    reserved_tokens: int | None = None,
    extra_reserved_reqs: int = 0,
) -> int:
    """AFTER ``DecodePreallocQueue._swa_tail_allocatable_token_budget``: the same subtraction for the
    sliding-window pool (conservative: a borrowed prompt's sliding-window KV is at most its length)."""
    return _held_out(result, prealloc, count_retracted)


def _held_out(result: int, prealloc: Any, count_retracted: bool) -> int:
    node = prealloc.scheduler.__dict__.get(NODE_ATTRIBUTE)  # none yet: nothing borrowed
    if not count_retracted or node is None:
        return result
    return result - node.held_out_kv_tokens()


def abort_request(original: Callable[..., Any], scheduler: Any, recv_req: Any) -> Any:
    """AROUND ``Scheduler.abort_request(self, recv_req)``."""
    return _node(scheduler).abort(original, recv_req)


def fully_idle(
    result: bool, scheduler: Any, for_health_check: bool = False, ignore_waiting: bool = False
) -> bool:
    """AFTER ``Scheduler.is_fully_idle``: queued borrowed requests are work (no idle sleep, no cache
    flush under them); the health check keeps SGLang's answer (it rides on running requests)."""
    if not result or for_health_check:
        return result
    node = scheduler.__dict__.get(NODE_ATTRIBUTE)
    return not (node is not None and node.queue)


def set_internal_state(original: Callable[..., Any], scheduler: Any, recv_req: Any) -> Any:
    """AROUND ``Scheduler.set_internal_state(self, recv_req)``: a lease update installs the lease."""
    if not is_lease_update(recv_req.server_args):
        return original(scheduler, recv_req)
    if not is_decode_worker(scheduler):
        logger.warning("crossflow lease update ignored: this worker is not in decode mode")
        return api_output(False)
    try:
        update = parse_lease_update(recv_req.server_args)
    except ValueError as exc:
        logger.warning("crossflow lease update refused: %s", exc)
        return api_output(False)
    _node(scheduler).install_lease(
        update.budgets, update.ttl_s, chunk_limits=update.chunk_limits, pressure_rule=update.pressure_rule
    )
    return api_output(True)


def get_internal_state(state_output: Any, scheduler: Any, recv_req: Any) -> Any:
    """AFTER ``Scheduler.get_internal_state(self, recv_req)``: add the plugin's state."""
    if is_decode_worker(scheduler):
        state_output.internal_state[INTERNAL_STATE_KEY] = _node(scheduler).internal_state()
    return state_output


HOOKS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    (f"{_TOKENIZER}.generate_request", "AROUND", carry_marker),
    (f"{_SCHEDULER}._add_request_to_queue", "AROUND", intake),
    (
        f"{_DECODE}.SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run",
        "AROUND",
        select_batch,
    ),
    (f"{_DECODE}.DecodePreallocQueue._allocatable_token_budgets", "AFTER", kv_budget),
    (f"{_DECODE}.DecodePreallocQueue._swa_tail_allocatable_token_budget", "AFTER", swa_kv_budget),
    (f"{_SCHEDULER}.abort_request", "AROUND", abort_request),
    (f"{_SCHEDULER}.is_fully_idle", "AFTER", fully_idle),
    (f"{_SCHEDULER}.set_internal_state", "AROUND", set_internal_state),
    (f"{_SCHEDULER}.get_internal_state", "AFTER", get_internal_state),
)
"""(target, hook type, hook) of every hook the plugin installs."""


def register(registry: Any, hook_type: Any) -> None:
    """Register every hook of :data:`HOOKS` with ``registry`` (SGLang's ``HookRegistry``), its type
    looked up by name in ``hook_type`` (SGLang's ``HookType`` enum)."""
    for target, kind, hook in HOOKS:
        registry.register(target, hook, hook_type[kind])


def load() -> None:
    """The ``sglang.srt.plugins`` entry point: register the hooks with SGLang's registry."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    PluginConfig.from_env(os.environ)  # a bad setting fails here, in every process, naming it
    register(HookRegistry, HookType)


# ---------------------------------------------------------------- SGLang's side of LocalPrefill
_API: SGLangApi | None = None
_CONFIG: PluginConfig | None = None
_OUTPUT: Callable[[bool], Any] | None = None


def configure(api: SGLangApi, config: PluginConfig, output: Callable[[bool], Any]) -> None:
    """Use ``api``, ``config`` and the ``SetInternalStateReqOutput`` maker ``output`` for the nodes
    made from now on (the tests' look-alikes; in SGLang they are built on first use)."""
    global _API, _CONFIG, _OUTPUT
    _API, _CONFIG, _OUTPUT = api, config, output


def _api() -> SGLangApi:
    if _API is None:
        configure(_sglang_api(), PluginConfig.from_env(os.environ), _sglang_output())
    assert _API is not None
    return _API


def api_output(updated: bool) -> Any:
    _api()
    assert _OUTPUT is not None
    return _OUTPUT(updated)


def _node(scheduler: Any) -> LocalPrefill:
    return node_for(scheduler, _make_node)


def _make_node(scheduler: Any) -> LocalPrefill:
    api = _api()
    assert _CONFIG is not None
    metrics = None
    if _CONFIG.metrics and scheduler.metrics_reporter.current_scheduler_metrics_enabled:
        from serving.sglang_plugin.metrics import PluginMetrics

        metrics = PluginMetrics.create(_CONFIG.node_id)
    return LocalPrefill(scheduler, _CONFIG, api, metrics)


def _sglang_api() -> SGLangApi:  # pragma: no cover - runs inside SGLang only
    import torch
    import torch.distributed as dist
    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.observability.req_time_stats import set_schedule_time_batch

    def agree_min_ns(scheduler: Any, local_ns: int) -> int:
        group = scheduler.attn_tp_cpu_group
        if dist.get_world_size(group) == 1:
            return local_ns
        value = torch.tensor([local_ns], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        return int(value.item())

    return SGLangApi(
        prepare_abort=prepare_abort,
        finish_abort=FINISH_ABORT,
        agree_min_ns=agree_min_ns,
        set_schedule_time_batch=set_schedule_time_batch,
        monotonic_ns=time.monotonic_ns,
    )


def _sglang_output() -> Callable[[bool], Any]:  # pragma: no cover - runs inside SGLang only
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    return lambda updated: SetInternalStateReqOutput(updated=updated)


__all__ = ["HOOKS", "configure", "load", "register"]
