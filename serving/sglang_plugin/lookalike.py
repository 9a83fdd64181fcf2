"""A look-alike of SGLang 0.5.23's PD decode scheduler, built to the snapshot's names, for running the
plugin's hooks without a GPU.

It is not SGLang: it keeps only what the hooks touch and the accounting their effects are judged by
(KV tokens allocated per request, retractions, tokens emitted, aborts streamed), with the same class,
method, parameter and attribute names the committed snapshot records for 0.5.23 (the tests run the
plugin's real hooks on it through :class:`HookRegistry`, which wraps as SGLang's registry does). What
it models, in SGLang's terms:

* decode-mode intake: ``_add_request_to_queue`` hands every request to the pre-allocation queue;
* ``process_decode_queue``: retracted requests resume first (budget with ``count_retracted=False``),
  then requests pre-allocate KV for their prompt in FIFO order while ``_allocatable_token_budgets``
  (free KV minus ``num_reserved_decode_tokens`` per active request and what retracted requests need)
  allows, and their KV "arrives" ``transfer_steps`` iterations later into ``waiting_queue`` with the
  first token the prefill worker sampled;
* ``get_next_disagg_decode_batch_to_run``: transferred requests join the running batch (asserting
  ``chunked_req is None`` as 0.5.23 does), then the decode step takes one KV token per running request
  and retracts the newest request while that does not fit;
* ``get_new_batch_prefill``: SGLang's prefill adder reduced to its budgets: the chunked request first,
  then ``waiting_queue`` in order, at most ``chunked_prefill_size`` tokens, while KV is free and the
  running batch has room; a prompt cut by the budget becomes ``chunked_req``; with ``is_mixed_chunk``
  the running batch decodes in the same EXTEND batch. It keeps nothing back for the running decodes'
  growth (SGLang's adder keeps an estimate), so only the plugin's own rules protect them here;
* results: an EXTEND batch gives each request whose prompt completed its first token; a DECODE batch
  one token per request; a request finishes at ``max_new_tokens`` and frees its KV.

:class:`Cluster` drives it like ``event_loop_normal_disagg_decode`` and keeps the clock.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

# ---------------------------------------------------------------- small SGLang types


class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND


class SpeculativeAlgorithm(enum.Enum):
    NONE = "none"
    EAGLE = "eagle"

    def is_none(self) -> bool:
        return self is SpeculativeAlgorithm.NONE


class FINISH_ABORT:  # SGLang's name
    def __init__(self, message: str | None = None, status_code: int | None = None, err_type: Any = None):
        self.message = message or "Aborted"
        self.status_code = status_code
        self.err_type = err_type

    def to_json(self) -> dict[str, Any]:
        return {"type": "abort", "message": self.message, "status_code": self.status_code}


class FINISH_LENGTH:  # SGLang's name
    def __init__(self, length: int) -> None:
        self.length = length

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


def prepare_abort(req: Req, error_message: str, status_code: int | None = None) -> None:
    """``sglang.srt.disaggregation.utils.prepare_abort``."""
    req.finished_reason = FINISH_ABORT(error_message, status_code)


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    ignore_eos: bool = True


class SchedulerReqTimeStats:
    def __init__(self) -> None:
        self.wait_queue_entries = 0

    def set_wait_queue_entry_time(self, ts: float | None = None) -> None:
        self.wait_queue_entries += 1


class Req:
    """The parts of ``sglang.srt.managers.schedule_batch.Req`` the plugin and this look-alike use."""

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        routing_key: str | None = None,
        return_logprob: bool = False,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.routing_key = routing_key
        self.return_logprob = return_logprob
        self.finished_reason: Any = None
        self.to_finish: Any = None
        self.discard_output_reason: Any = None
        self.prefix_len = 0
        self.extend_end: int | None = None
        self.time_stats = SchedulerReqTimeStats()
        self.kv_tokens = 0
        """KV tokens this request holds (look-alike bookkeeping)."""
        self.is_retracted = False
        self.retractions = 0

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def extend_len(self) -> int:
        assert self.extend_end is not None
        return self.extend_end - self.prefix_len


@dataclass
class ScheduleBatch:
    reqs: list[Req] = field(default_factory=list)
    forward_mode: ForwardMode = ForwardMode.DECODE
    batch_is_full: bool = False
    decoding_reqs: list[Req] | None = None

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    def filter_batch(
        self, reqs_to_exclude: Req | list[Req] | None = None, keep_indices: list[int] | None = None
    ) -> None:
        if isinstance(reqs_to_exclude, Req):
            reqs_to_exclude = [reqs_to_exclude]
        excluded = {id(r) for r in reqs_to_exclude or []}
        if keep_indices is None:
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished() and id(r) not in excluded]
        self.reqs = [self.reqs[i] for i in keep_indices]

    def merge_batch(self, other: ScheduleBatch) -> None:
        self.reqs.extend(other.reqs)


@dataclass
class NextBatchPlan:
    batch_to_run: ScheduleBatch | None
    running_batch: ScheduleBatch


class BaseTokenToKVPoolAllocator:
    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0

    def available_size(self) -> int:
        return self.size - self.used

    def alloc(self, req: Req, tokens: int) -> None:
        assert tokens <= self.available_size(), f"KV overcommitted: {tokens} > {self.available_size()}"
        self.used += tokens
        req.kv_tokens += tokens

    def free(self, req: Req) -> None:
        self.used -= req.kv_tokens
        req.kv_tokens = 0


class BasePrefixCache:
    def evictable_size(self) -> int:
        return 0


class SchedulerOutputStreamer:
    def __init__(self) -> None:
        self.finished: dict[str, dict[str, Any]] = {}
        """rid -> the finish reason streamed, as JSON."""

    def stream_output(self, reqs: list[Req], return_logprob: bool, skip_req: Req | None = None) -> None:
        for req in reqs:
            if req.finished():
                self.finished[req.rid] = req.finished_reason.to_json()


@dataclass
class SchedulerMetricsReporter:
    current_scheduler_metrics_enabled: bool = False


@dataclass
class DecodeRequest:
    req: Req
    waiting_for_input: bool = True
    arrives_at_step: int = -1


@dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False


@dataclass
class SetInternalStateReq:
    server_args: dict[str, int | float]


@dataclass
class SetInternalStateReqOutput:
    updated: bool


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateReqOutput:
    internal_state: dict[str, Any]


@dataclass
class GenerateReqInput:
    input_ids: list[int] | None = None
    routing_key: str | None = None


class Request:
    """A Starlette request as the tokenizer manager sees it (its body already read)."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    async def body(self) -> bytes:
        return self._body


class TokenizerManager:
    def __init__(self) -> None:
        self.seen: list[GenerateReqInput] = []

    async def generate_request(
        self, obj: GenerateReqInput, request: Request | None = None
    ) -> AsyncIterator[Any]:
        self.seen.append(obj)
        yield {"routing_key": obj.routing_key}


# ---------------------------------------------------------------- the decode scheduler


class DecodePreallocQueue:
    def __init__(self, scheduler: Scheduler, allocator: BaseTokenToKVPoolAllocator, reserved: int) -> None:
        self.scheduler = scheduler
        self.token_to_kv_pool_allocator = allocator
        self.num_reserved_decode_tokens = reserved
        self.queue: list[DecodeRequest] = []
        self.retracted_queue: list[Req] = []
        self.transfer: list[DecodeRequest] = []
        self.pp_size = 1

    def add(self, req: Req, is_retracted: bool = False, is_rebootstrap: bool = False) -> None:
        if is_retracted:
            self.retracted_queue.append(req)
        else:
            self.queue.append(DecodeRequest(req))

    def _active_req_count(self, extra_reserved_reqs: int = 0) -> int:
        s = self.scheduler
        return len(s.running_batch.reqs) + len(self.transfer) + len(s.waiting_queue) + extra_reserved_reqs

    def _allocatable_token_budgets(
        self,
        retractable_tokens: int | None = None,
        count_retracted: bool = True,
        extra_reserved_reqs: int = 0,
        reserved_tokens: int | None = None,
        hicache_reserved_tokens: int = 0,
    ) -> int:
        return self._budget(count_retracted, extra_reserved_reqs, reserved_tokens) - hicache_reserved_tokens

    def _swa_tail_allocatable_token_budget(
        self,
        retractable_tokens: int | None = None,
        retractable_swa_tokens: int | None = None,
        count_retracted: bool = True,
        n_active: int | None = None,
        reserved_tokens: int | None = None,
        extra_reserved_reqs: int = 0,
    ) -> int:
        # computed on its own as 0.5.23's is (not through the hooked full-attention budget)
        return self._budget(count_retracted, extra_reserved_reqs, reserved_tokens)

    def _budget(self, count_retracted: bool, extra_reserved_reqs: int, reserved_tokens: int | None) -> int:
        """Free KV less ``num_reserved_decode_tokens`` per active request and, unless resuming, what
        the retracted requests need (one pool: the look-alike has no sliding window)."""
        if reserved_tokens is None:
            reserved_tokens = self.num_reserved_decode_tokens * self._active_req_count(extra_reserved_reqs)
        budget = self.token_to_kv_pool_allocator.available_size() - reserved_tokens
        if count_retracted:
            budget -= sum(self._resume_tokens(r) for r in self.retracted_queue)
        return budget

    def _resume_tokens(self, req: Req) -> int:
        return len(req.origin_input_ids) + len(req.output_ids) + self.num_reserved_decode_tokens

    def resume_retracted_reqs(self) -> list[Req]:
        resumed = []
        while self.retracted_queue:
            req = self.retracted_queue[0]
            if self._allocatable_token_budgets(count_retracted=False) < self._resume_tokens(req):
                break
            self.retracted_queue.pop(0)
            self.token_to_kv_pool_allocator.alloc(req, len(req.origin_input_ids) + len(req.output_ids))
            req.is_retracted = False
            resumed.append(req)
        return resumed

    def pop_preallocated(self, step: int, transfer_steps: int) -> None:
        while self.queue:
            decode_req = self.queue[0]
            need = len(decode_req.req.origin_input_ids)
            if self._allocatable_token_budgets() < need + self.num_reserved_decode_tokens:
                break
            self.queue.pop(0)
            self.token_to_kv_pool_allocator.alloc(decode_req.req, need)
            decode_req.waiting_for_input = False
            decode_req.arrives_at_step = step + transfer_steps
            self.transfer.append(decode_req)

    def pop_transferred(self, step: int) -> list[Req]:
        arrived = [d for d in self.transfer if d.arrives_at_step <= step]
        self.transfer = [d for d in self.transfer if d.arrives_at_step > step]
        for d in arrived:
            d.req.output_ids.append(7)  # the first token, sampled by the prefill worker
        return [d.req for d in arrived]


class Scheduler:
    """The decode scheduler's state and the methods the plugin hooks or calls (0.5.23 names)."""

    def __init__(
        self,
        *,
        kv_tokens: int,
        reserved_decode_tokens: int = 64,
        max_running_requests: int = 8,
        chunked_prefill_size: int = 1024,
        page_size: int = 16,
        is_mixed_chunk: bool = False,
        enable_overlap: bool = False,
    ) -> None:
        self.disaggregation_mode = DisaggregationMode.DECODE
        self.enable_overlap = enable_overlap
        self.require_mlp_sync = False
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.enable_hisparse = False
        self.attn_tp_cpu_group = None
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max(chunked_prefill_size, 16384)
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.max_total_num_tokens = kv_tokens
        self.is_mixed_chunk = is_mixed_chunk
        self.enable_priority_preemption = False
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch()
        self.last_batch: ScheduleBatch | None = None
        self.chunked_req: Req | None = None
        self._pending_chunked_abort_req: Req | None = None
        self.tree_cache = BasePrefixCache()
        self.output_streamer = SchedulerOutputStreamer()
        self.metrics_reporter = SchedulerMetricsReporter()
        self.allocator = BaseTokenToKVPoolAllocator(kv_tokens)
        self.disagg_decode_prealloc_queue = DecodePreallocQueue(self, self.allocator, reserved_decode_tokens)
        self.retracted = 0
        self.stashed = 0
        self.released: list[str] = []

    # ---- intake
    def _add_request_to_queue(self, req: Req, is_retracted: bool = False) -> None:
        self.disagg_decode_prealloc_queue.add(req, is_retracted=is_retracted)

    def _release_aborted_request(self, req: Req) -> None:
        self.released.append(req.rid)

    # ---- batch selection (SchedulerDisaggregationDecodeMixin)
    def get_next_disagg_decode_batch_to_run(self, running_batch: ScheduleBatch) -> NextBatchPlan:
        room = self.max_running_requests - running_batch.batch_size()
        joining, self.waiting_queue = self.waiting_queue[:room], self.waiting_queue[room:]
        if joining:
            assert self.chunked_req is None  # decode.py:3246-3248 in 0.5.23
            running_batch.merge_batch(ScheduleBatch(list(joining)))
        running_batch.filter_batch()
        if running_batch.is_empty():
            return NextBatchPlan(None, running_batch)
        while len(running_batch.reqs) > self.allocator.available_size():
            self._retract(running_batch)
        batch = running_batch if running_batch.reqs else None
        if batch is not None:
            batch.forward_mode = ForwardMode.DECODE
            for req in batch.reqs:
                self.allocator.alloc(req, 1)
        return NextBatchPlan(batch, running_batch)

    def _retract(self, running_batch: ScheduleBatch) -> None:
        req = running_batch.reqs.pop()  # the newest
        self.allocator.free(req)
        req.is_retracted = True
        req.retractions += 1
        self.retracted += 1
        self._add_request_to_queue(req, is_retracted=True)

    # ---- SGLang's prefill machinery
    def get_new_batch_prefill(self, running_batch: ScheduleBatch) -> NextBatchPlan:
        assert not self.enable_priority_preemption, "the look-alike does not preempt"
        budget = min(self.chunked_prefill_size or self.max_prefill_tokens, self.max_prefill_tokens)
        if self.is_mixed_chunk:
            budget -= running_batch.batch_size()  # the mixed decode tokens (PrefillAdder's rem_*)
        can_run: list[Req] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            end = self._add_chunk(req, budget)
            if end is not None:  # else it waits, still the chunked request
                self.chunked_req = req if end < len(req.origin_input_ids) else None
                can_run.append(req)
                budget -= req.extend_len
        elif not self.waiting_queue:
            return NextBatchPlan(None, running_batch)
        for req in list(self.waiting_queue):
            if self.chunked_req is not None or budget <= 0:
                break
            if running_batch.batch_size() + len(can_run) >= self.max_running_requests:
                running_batch.batch_is_full = True
                break
            end = self._add_chunk(req, budget)
            if end is None:
                break
            if end < len(req.origin_input_ids):
                self.chunked_req = req
            can_run.append(req)
            budget -= req.extend_len
        if not can_run:
            return NextBatchPlan(None, running_batch)
        self.waiting_queue = [r for r in self.waiting_queue if r not in can_run]
        batch = ScheduleBatch(can_run, ForwardMode.EXTEND)
        if self.is_mixed_chunk and not running_batch.is_empty():
            for req in running_batch.reqs:
                self.allocator.alloc(req, 1)
            batch.decoding_reqs = list(running_batch.reqs)
            batch.reqs = [*batch.reqs, *running_batch.reqs]
            running_batch = ScheduleBatch(batch_is_full=running_batch.batch_is_full)
        return NextBatchPlan(batch, running_batch)

    def _add_chunk(self, req: Req, budget: int) -> int | None:
        """Schedule the next part of ``req``'s prompt: at most ``budget`` tokens and what KV is free
        (page-aligned when cut), nothing reserved for the running decodes (a weaker rule than
        SGLang's adder, which keeps an estimate of their growth). Returns where the part ends, or None
        when nothing fits."""
        remaining = len(req.origin_input_ids) - req.prefix_len
        limit = min(budget, self.allocator.available_size())
        take = remaining if remaining <= limit else limit // self.page_size * self.page_size
        if take <= 0:
            return None
        req.extend_end = req.prefix_len + take
        self.allocator.alloc(req, take)
        return req.extend_end

    def stash_chunked_request(self, req: Req) -> None:
        assert req.extend_end is not None
        req.prefix_len = req.extend_end
        self.stashed += 1

    def process_pending_chunked_abort(self) -> None:
        req = self._pending_chunked_abort_req
        if req is None or req is not self.chunked_req:
            self._pending_chunked_abort_req = None
            return
        reason = req.discard_output_reason or FINISH_ABORT("Aborted")
        prepare_abort(req, reason.message, reason.status_code)
        self.allocator.free(req)
        self.chunked_req = None
        self._pending_chunked_abort_req = None
        self.output_streamer.stream_output([req], req.return_logprob)

    # ---- control requests
    def abort_request(self, recv_req: AbortReq) -> None:
        if self.chunked_req is not None and (
            recv_req.abort_all or self.chunked_req.rid.startswith(recv_req.rid)
        ):
            self._pending_chunked_abort_req = self.chunked_req
        for req in self.running_batch.reqs:
            if recv_req.abort_all or req.rid.startswith(recv_req.rid):
                req.to_finish = FINISH_ABORT()

    def is_fully_idle(self, for_health_check: bool = False, ignore_waiting: bool = False) -> bool:
        prealloc = self.disagg_decode_prealloc_queue
        return (
            self.running_batch.is_empty()
            and self.chunked_req is None
            and not self.waiting_queue
            and not prealloc.queue
            and not prealloc.transfer
            and not prealloc.retracted_queue
        )

    def set_internal_state(self, recv_req: SetInternalStateReq) -> SetInternalStateReqOutput:
        return SetInternalStateReqOutput(updated=False)  # 0.5.23 refuses keys it does not know

    def get_internal_state(self, recv_req: GetInternalStateReq) -> GetInternalStateReqOutput:
        return GetInternalStateReqOutput(internal_state={"max_running_requests": self.max_running_requests})


# ---------------------------------------------------------------- the hook registry


class HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


class HookRegistry:
    """Collects ``register`` calls and, inside ``installed()``, patches the look-alike classes with
    them, wrapping as SGLang 0.5.23's ``_wrap_fn`` does (AROUND: ``hook(original, *args, **kwargs)``;
    AFTER: ``hook(result, *args, **kwargs)``, a ``None`` answer keeping the result); the classes are
    restored on leaving."""

    TARGET_CLASSES: ClassVar[dict[str, type]] = {
        "sglang.srt.managers.scheduler.Scheduler": Scheduler,
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin": Scheduler,
        "sglang.srt.disaggregation.decode.DecodePreallocQueue": DecodePreallocQueue,
        "sglang.srt.managers.tokenizer_manager.TokenizerManager": TokenizerManager,
    }

    def __init__(self) -> None:
        self.hooks: list[tuple[str, Callable[..., Any], HookType]] = []

    def register(self, target: str, hook: Callable[..., Any], hook_type: HookType = HookType.AFTER) -> None:
        self.hooks.append((target, hook, hook_type))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved: list[tuple[type, str, Any]] = []
        try:
            for target, hook, hook_type in self.hooks:
                owner, _, name = target.rpartition(".")
                cls = self.TARGET_CLASSES[owner]
                saved.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, _wrap(getattr(cls, name), hook, hook_type))
            yield
        finally:
            for cls, name, original in reversed(saved):
                setattr(cls, name, original)


def _wrap(original: Callable[..., Any], hook: Callable[..., Any], hook_type: HookType) -> Callable[..., Any]:
    if hook_type is HookType.AROUND:

        def around(*args: Any, **kwargs: Any) -> Any:
            return hook(original, *args, **kwargs)

        return around
    if hook_type is HookType.AFTER:

        def after(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            modified = hook(result, *args, **kwargs)
            return modified if modified is not None else result

        return after
    raise ValueError(f"the look-alike registry does not apply {hook_type}")


# ---------------------------------------------------------------- the event loop


@dataclass
class Cluster:
    """One decode worker's scheduler driven like ``event_loop_normal_disagg_decode``, with a clock:
    an iteration takes ``decode_step_s`` plus ``prefill_token_s`` per prompt token it computes."""

    scheduler: Scheduler
    decode_step_s: float = 0.02
    prefill_token_s: float = 0.0001
    transfer_steps: int = 2
    now_s: float = 0.0
    step_count: int = 0
    extend_tokens: list[int] = field(default_factory=list)
    """Prompt tokens computed by each EXTEND iteration."""

    def monotonic_ns(self) -> int:
        return round(self.now_s * 1e9)

    def step(self) -> ScheduleBatch | None:
        s = self.scheduler
        prealloc = s.disagg_decode_prealloc_queue
        s.waiting_queue.extend(prealloc.resume_retracted_reqs())
        if not prealloc.retracted_queue:
            prealloc.pop_preallocated(self.step_count, self.transfer_steps)
            s.waiting_queue.extend(prealloc.pop_transferred(self.step_count))
        plan = s.get_next_disagg_decode_batch_to_run(running_batch=s.running_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        duration = self.decode_step_s
        if batch is not None:
            duration += self._process(batch) * self.prefill_token_s
        s.last_batch = batch
        self.now_s += duration
        self.step_count += 1
        return batch

    def _process(self, batch: ScheduleBatch) -> int:
        """``process_batch_result``: tokens out, finishes; returns the prompt tokens computed."""
        s = self.scheduler
        computed = 0
        decoding = {id(r) for r in batch.decoding_reqs or []}
        for req in batch.reqs:
            if req.finished():
                continue
            if batch.forward_mode.is_extend() and id(req) not in decoding:
                computed += req.extend_len
                if req is s.chunked_req:
                    continue  # a middle chunk samples nothing
            if req.to_finish is not None:
                req.finished_reason, req.to_finish = req.to_finish, None
            else:
                req.output_ids.append(7)
                if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                    req.finished_reason = FINISH_LENGTH(len(req.output_ids))
            if req.finished():
                s.allocator.free(req)
                s.output_streamer.stream_output([req], req.return_logprob)
        if batch.forward_mode.is_extend():
            self.extend_tokens.append(computed)
        return computed

    def run(self, steps: int, arrivals: Iterable[tuple[int, Req]] = ()) -> None:
        """``steps`` iterations; ``arrivals`` are (step, request) handed to ``_add_request_to_queue``."""
        pending = sorted(arrivals, key=lambda a: a[0])
        for _ in range(steps):
            while pending and pending[0][0] <= self.step_count:
                self.scheduler._add_request_to_queue(pending.pop(0)[1])
            self.step()


__all__ = [
    "AbortReq",
    "Cluster",
    "GenerateReqInput",
    "GetInternalStateReq",
    "HookRegistry",
    "HookType",
    "Req",
    "Request",
    "SamplingParams",
    "Scheduler",
    "SetInternalStateReq",
    "SetInternalStateReqOutput",
    "TokenizerManager",
    "prepare_abort",
]
