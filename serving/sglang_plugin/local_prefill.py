"""Decode-local prefill on an SGLang 0.5.23 decode worker: the state the hooks share, per scheduler.

One ``LocalPrefill`` lives on each scheduler process of a decode worker (``node_for``). The hooks in
``serving.sglang_plugin.hooks`` only translate SGLang calls into its methods; every decision is
``policies`` code shared with the simulator:

* **intake** (``intake``): a marked request is admitted against the node's own lease
  (``LocalPrefillAdmission.try_admit``: tasks, KV, compute) and joins the local queue, or is aborted
  with 503 before any token through SGLang's abort path;
* **batch selection** (``select``): a finished local prefill batch merges into the running batch; an
  EXTEND batch is built from the local queue by SGLang's own ``get_new_batch_prefill`` (the local queue
  presented as ``waiting_queue``, the chunk capped by the token bucket) instead of a decode step when
  the bucket has a useful chunk of credit, decode comes first (``borrowed_start_blocked``) and the KV
  fits (``prealloc_fits`` with every active request's reserved decode tokens), sized by the lease's
  per-iteration cap for the running batch (``ChunkLimits``); without ``--enable-mixed-chunk`` a local
  EXTEND step is always followed by a decode step of the running batch, so its tokens wait out at most
  one EXTEND step (the simulator's mixed iteration); queued requests whose reservation was revoked or
  expired are aborted with 503; otherwise SGLang's own decode step runs;
* **KV accounting** (``held_out_kv_tokens``): what PD pre-allocation must leave free for borrowed work
  (un-started reservations, the rest of an in-flight chunked prefill, reserved decode tokens of local
  requests between their EXTEND step and the merge);
* **lease and state**: ``install_lease`` (from ``/set_internal_state``), ``internal_state`` (into
  ``/server_info``: the ``NodeState`` for the lease agent), metrics.

Determinism across tensor-parallel ranks: every rank runs this code on the same requests in the same
order; the only clock decisions read is ``api.agree_min_ns`` (the minimum over the attention TP group
of each rank's monotonic clock), so all ranks build the same batches. Step timing for ``NodeState``
uses the local clock and never feeds a decision.

The attribute names read here are SGLang 0.5.23's; ``serving.sglang_plugin.contract`` lists them and
the tests check the list against the committed snapshot and against this file's source.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import numpy as np

from interference_model.columns import drain_features
from policies.admission import LocalPrefillAdmission, borrowed_start_blocked, prealloc_fits
from policies.chunk_limits import ChunkLimits
from policies.lease import LeaseBudgets
from policies.node_policies import DecodePressureRule
from policies.node_state import NodeState
from serving.sglang_plugin.config import PluginConfig
from serving.sglang_plugin.wire import INTERNAL_STATE_KEY, STARTED_BORROWED_KEY, unmark_routing_key

logger = logging.getLogger("crossflow.sglang_plugin")

NODE_ATTRIBUTE = "_crossflow_local_prefill"
"""Where a scheduler keeps its ``LocalPrefill``."""

UNAVAILABLE = HTTPStatus.SERVICE_UNAVAILABLE


@dataclass(frozen=True)
class SGLangApi:
    """The few SGLang functions the plugin calls (injected so the logic runs without SGLang)."""

    prepare_abort: Callable[..., None]
    """``sglang.srt.disaggregation.utils.prepare_abort(req, error_message, status_code=None)``."""
    finish_abort: Callable[..., Any]
    """``sglang.srt.managers.schedule_batch.FINISH_ABORT(message, status_code)``."""
    agree_min_ns: Callable[[Any, int], int]
    """``(scheduler, local monotonic ns) -> the minimum over the attention TP group``."""
    set_schedule_time_batch: Callable[[Any], None] = lambda batch: None
    """``sglang.srt.observability.req_time_stats.set_schedule_time_batch``."""
    monotonic_ns: Callable[[], int] = time.monotonic_ns


@dataclass
class _StepStats:
    """Iteration times over a trailing window (local clock, never decides), and token totals."""

    window_ns: int
    """The recent step times are over the iterations that ended in this last stretch of time
    (``PluginConfig.step_window_s``), whenever the lease agent reads them."""
    last_ns: int | None = None
    steps: deque[tuple[int, int, int]] = field(default_factory=deque)
    """``(end, time since the previous token step, own duration if a pure decode step else -1)`` in
    ns of each step in the window that emitted a token for the running batch (decode, or an EXTEND
    step mixed with it), oldest first; a step that emitted none (a local EXTEND step) counts in the
    next token step's time, as the ITL of that token does. Their sums:"""
    total_ns: int = 0
    pure_decode_ns: int = 0
    pure_decode_steps: int = 0
    decode_tokens: int = 0
    """Tokens the running batch received since the plugin started (``NodeState.decode_tokens_total``;
    never reset: the reader takes differences)."""
    mixed_decode_tokens: int = 0
    """Of those, tokens whose step had local prefill in it: a mixed step's, and a decode step's right
    after one or more local EXTEND steps (each of its tokens waited the EXTEND out)."""
    after_local_extend: bool = False
    carried_ns: int = 0
    """Time of the steps since the last token step that emitted no token."""

    def record(self, now_ns: int, kind: str | None, tokens: int = 0, *, local: bool = False) -> None:
        """The iteration that just ended ran ``kind`` (``_last_step_kind``) and gave the running batch
        ``tokens`` tokens; ``local``: it was the plugin's own EXTEND batch (borrowed prefill)."""
        self._drop_before(now_ns - self.window_ns)
        if self.last_ns is not None and kind is not None:
            step = now_ns - self.last_ns
            if kind in ("decode", "mixed"):
                pure = step if kind == "decode" else -1
                self.steps.append((now_ns, step + self.carried_ns, pure))
                self.total_ns += step + self.carried_ns
                self.carried_ns = 0
                if pure >= 0:
                    self.pure_decode_ns += pure
                    self.pure_decode_steps += 1
                self.decode_tokens += tokens
                if kind == "mixed" or self.after_local_extend:
                    self.mixed_decode_tokens += tokens
                self.after_local_extend = False
            else:
                self.carried_ns += step
            if kind == "extend" and local:
                self.after_local_extend = True
        self.last_ns = now_ns

    def recent(self, now_ns: int) -> tuple[float, float]:
        """``(mean time between tokens of the running batch, mean decode-only step)`` in seconds over
        the steps that ended in the last ``window_ns`` (0 when there was no such step)."""
        self._drop_before(now_ns - self.window_ns)
        steps = self.steps
        recent = self.total_ns * 1e-9 / len(steps) if steps else 0.0
        decode_only = self.pure_decode_ns * 1e-9 / self.pure_decode_steps if self.pure_decode_steps else 0.0
        return recent, decode_only

    def _drop_before(self, horizon_ns: int) -> None:
        steps = self.steps
        while steps and steps[0][0] <= horizon_ns:
            _, step, pure = steps.popleft()
            self.total_ns -= step
            if pure >= 0:
                self.pure_decode_ns -= pure
                self.pure_decode_steps -= 1


@dataclass
class _Started:
    req: Any
    reservation_id: int
    prefill_done: bool = False


@dataclass
class LocalPrefill:
    """Decode-local prefill on one SGLang decode scheduler (see the module docstring)."""

    scheduler: Any
    config: PluginConfig
    api: SGLangApi
    metrics: Any = None
    """A ``serving.sglang_plugin.metrics.PluginMetrics`` (or None: no metrics)."""
    admission: LocalPrefillAdmission = field(init=False)
    queue: list[Any] = field(default_factory=list)
    """Admitted borrowed requests that have not started, in arrival order."""
    reservations: dict[str, int] = field(default_factory=dict)
    """rid -> reservation of every queued request."""
    started: dict[str, _Started] = field(default_factory=dict)
    batch: Any = None
    """The EXTEND batch this plugin returned last, until it is merged."""
    disabled: str | None = None
    counters: dict[str, int] = field(default_factory=dict)
    _steps: _StepStats = field(init=False)
    largest_step_beside_decode_tokens: int = 0
    """The most prompt tokens one local EXTEND step computed while requests were decoding (what the
    lease's ``ChunkLimits`` bound; the GPU check reads it)."""

    def __post_init__(self) -> None:
        self.admission = LocalPrefillAdmission(node_id=self.config.node_id, burst_s=self.config.burst_s)
        self._steps = _StepStats(window_ns=int(self.config.step_window_s * 1e9))
        self.disabled = unsupported_reason(self.scheduler)
        if self.disabled:
            logger.warning("Crossflow decode-local prefill is off on this worker: %s", self.disabled)

    # ------------------------------------------------------------------ clock and bookkeeping
    def _now_s(self) -> float:
        return self.api.agree_min_ns(self.scheduler, self.api.monotonic_ns()) * 1e-9

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
        if self.metrics is not None:
            self.metrics.count(name, n)

    def _local_chunked(self) -> Any:
        """The scheduler's chunked request when it is a local prefill (else None)."""
        req = self.scheduler.chunked_req
        return req if req is not None and req.rid in self.started else None

    def _busy(self) -> bool:
        return bool(self.queue or self.started or self.batch is not None)

    def _abort(self, req: Any, message: str) -> None:
        """Finish ``req`` with 503 before any token, through SGLang's abort path (the router falls back)."""
        scheduler = self.scheduler
        self.api.prepare_abort(req, f"crossflow: {message}", status_code=UNAVAILABLE)
        scheduler._release_aborted_request(req)
        scheduler.output_streamer.stream_output([req], req.return_logprob)

    # ------------------------------------------------------------------ intake
    def intake(self, original: Callable[..., Any], req: Any, is_retracted: bool) -> Any:
        """``Scheduler._add_request_to_queue``: divert a marked request to the local queue or 503."""
        marked, routing_key = unmark_routing_key(req.routing_key)
        if not marked:
            return original(self.scheduler, req, is_retracted)
        req.routing_key = routing_key
        if is_retracted or req.finished() or not is_decode_worker(self.scheduler):
            # a re-queued or already-aborted request, or a worker that prefills anyway: SGLang's path
            return original(self.scheduler, req, is_retracted)
        if self.disabled:
            self._count("rejected_disabled")
            self._abort(req, f"decode-local prefill is off on this worker ({self.disabled})")
            return None
        now_s = self._now_s()
        outcome = self.admission.try_admit(
            len(req.origin_input_ids), req.sampling_params.max_new_tokens, now_s
        )
        if not outcome.admitted:
            self._count(f"rejected_{outcome.result.value}")
            self._abort(req, f"refused: {outcome.reason()}")
            return None
        assert outcome.reservation_id is not None
        self._count("admitted")
        self.queue.append(req)
        self.reservations[req.rid] = outcome.reservation_id
        req.time_stats.set_wait_queue_entry_time()
        return None

    # ------------------------------------------------------------------ the lease
    def install_lease(
        self,
        budgets: LeaseBudgets,
        ttl_s: float,
        *,
        chunk_limits: ChunkLimits | None = None,
        pressure_rule: DecodePressureRule | None = None,
    ) -> list[int]:
        """Install the node's lease (all zero revokes it), its per-iteration cap on borrowed prefill
        (``chunk_limits``) and its decode-pressure test (``pressure_rule``; a revocation keeps both as
        they were); queued requests that no longer fit are aborted with 503 now. Returns the revoked
        reservation ids."""
        now_s = self._now_s()
        if budgets.is_zero():
            revoked = self.admission.revoke(now_s)
        else:
            revoked = self.admission.install_lease(
                budgets, ttl_s, now_s, chunk_limits=chunk_limits, pressure_rule=pressure_rule
            )
        self._count("leases")  # the gauges follow at the next iteration
        self._drop_lapsed(now_s)
        return revoked

    def _drop_lapsed(self, now_s: float) -> None:
        """Abort (503) the queued requests whose reservation was revoked or expired: none has a token."""
        self.admission.expire(now_s)
        kept = []
        for req in self.queue:
            rid = self.reservations[req.rid]
            if self.admission.is_pending(rid, now_s):
                kept.append(req)
                continue
            status = self.admission.ledger.status(rid)
            del self.reservations[req.rid]
            self.admission.cancel(rid)
            self._count(f"lapsed_{status}")
            self._abort(req, f"the lease {status} the reservation before the request started")
        self.queue = kept

    # ------------------------------------------------------------------ batch selection
    def select(self, original: Callable[..., Any], running_batch: Any) -> Any:
        """``get_next_disagg_decode_batch_to_run``: a local EXTEND batch, or SGLang's decode step."""
        local_ns = self.api.monotonic_ns()
        kind = self._last_step_kind()
        batch = self.scheduler.last_batch
        tokens = 0
        if kind == "decode":
            tokens = len(batch.reqs)
        elif kind == "mixed":
            tokens = len(batch.decoding_reqs)
        local = batch is not None and batch is self.batch
        self._steps.record(local_ns, kind, tokens, local=local)
        decode_owed = kind == "extend" and local
        if self.metrics is not None:  # gauges, on one rank: the local clock is good enough
            self.metrics.update(self, local_ns * 1e-9, local_ns)
        if self.disabled or not self._busy():
            return original(self.scheduler, running_batch)
        plan = None
        if self.queue or self.batch is not None or self._local_chunked() is not None:
            plan, running_batch = self._decide(running_batch, decode_owed=decode_owed)
        else:
            self._release_finished()  # only started requests, decoding: nothing to decide
        return plan if plan is not None else self._sglang_decode_step(original, running_batch)

    def _decide(self, running_batch: Any, *, decode_owed: bool = False) -> tuple[Any, Any]:
        """``(plan, running batch)`` for this iteration when borrowed work is queued or in flight (see
        the module docstring); a None plan: SGLang's decode step, on the running batch returned (the
        last local EXTEND batch merged into it). ``decode_owed``: the last step was a local EXTEND that
        decoded nothing, so a running batch gets its decode step now (one EXTEND between two of its
        tokens at most: the simulator's mixed iteration)."""
        scheduler = self.scheduler
        now_s = self._now_s()
        self._drop_lapsed(now_s)
        self._abort_stalled_chunk(now_s)
        pending_abort = scheduler._pending_chunked_abort_req
        if pending_abort is not None and pending_abort is self._local_chunked():
            scheduler.process_pending_chunked_abort()  # as the normal loop does first, every step
        running_batch = self._merge_returned_batch(running_batch)
        self._release_finished()
        if decode_owed and running_batch.reqs:
            return None, running_batch
        chunk_tokens, candidates = self._plan(running_batch, now_s)
        if chunk_tokens > 0:
            return self._run_extend(running_batch, chunk_tokens, candidates, now_s), running_batch
        return None, running_batch

    def _last_step_kind(self) -> str | None:
        """What the iteration that just ended ran: ``decode``, ``mixed`` (an EXTEND batch that also
        decoded the running batch), ``extend``, or None (idle)."""
        batch = self.scheduler.last_batch
        if batch is None:
            return None
        if batch.forward_mode.is_decode():
            return "decode"
        if batch is self.batch and batch.decoding_reqs:
            return "mixed"
        return "extend"

    def _sglang_decode_step(self, original: Callable[..., Any], running_batch: Any) -> Any:
        """SGLang's own step (prebuilt merge, decode). A local chunked request is hidden meanwhile:
        SGLang asserts ``chunked_req is None`` when transferred requests join."""
        scheduler = self.scheduler
        chunked = scheduler.chunked_req
        scheduler.chunked_req = None
        try:
            return original(scheduler, running_batch)
        finally:
            scheduler.chunked_req = chunked

    def _merge_returned_batch(self, running_batch: Any) -> Any:
        """After the local EXTEND step ran: what the normal loop's ``get_next_batch_to_run`` does with
        its last prefill batch (pending chunked abort, stash the chunk, drop finished requests, merge)."""
        scheduler = self.scheduler
        batch = self.batch
        if batch is None or scheduler.last_batch is not batch:
            return running_batch
        self.batch = None
        chunked = self._local_chunked()
        for req in batch.reqs:
            entry = self.started.get(req.rid)
            if entry is not None and req is not chunked and not entry.prefill_done:
                entry.prefill_done = True
                self.admission.prefill_done(entry.reservation_id)
        exclude = []
        if chunked is not None:
            exclude.append(chunked)
            if chunked.extend_end > chunked.prefix_len:
                scheduler.stash_chunked_request(chunked)
        batch.filter_batch(reqs_to_exclude=exclude)
        if not batch.is_empty():
            if running_batch.is_empty():
                running_batch = batch
            else:
                running_batch.merge_batch(batch)
        return running_batch

    def _abort_stalled_chunk(self, now_s: float) -> None:
        """A started chunked prompt whose lease expired cannot be paid for: abort it with 503 through
        SGLang's chunked-abort path (it has no token yet, so the router falls back). A lease revoked to
        zero keeps it waiting until the lease's expiry, for a new lease."""
        scheduler = self.scheduler
        chunked = self._local_chunked()
        lease = self.admission.lease()
        if chunked is None or (lease is not None and lease.is_live(now_s)):
            return
        chunked.discard_output_reason = self.api.finish_abort(
            "crossflow: the lease expired before the local prefill finished", UNAVAILABLE
        )
        scheduler._pending_chunked_abort_req = chunked
        scheduler.process_pending_chunked_abort()
        self._count("lapsed_started")

    def _release_finished(self) -> None:
        """Return the budgets of local requests that left (finished or aborted)."""
        for rid in [rid for rid, entry in self.started.items() if entry.req.finished()]:
            entry = self.started.pop(rid)
            self.admission.finish(entry.reservation_id)
            self._count("finished")

    def _plan(self, running_batch: Any, now_s: float) -> tuple[int, list[Any]]:
        """``(tokens the local EXTEND step may compute, queued requests it may start)``; 0 tokens
        means SGLang's decode step runs instead."""
        scheduler = self.scheduler
        prealloc = scheduler.disagg_decode_prealloc_queue
        blocked = borrowed_start_blocked(
            waiting_to_join=len(scheduler.waiting_queue),
            waiting_for_kv=sum(1 for decode_req in prealloc.queue if decode_req.waiting_for_input),
            retracted=len(prealloc.retracted_queue),
            running=len(running_batch.reqs),
            max_running=scheduler.max_running_requests,
        )
        if scheduler.waiting_queue:
            # transferred requests join first, even before a started chunked prompt continues: SGLang
            # merges them only in its own step
            return 0, []
        candidates = [] if blocked else self._kv_fitting_candidates(now_s)
        if candidates and self.admission.start_paused(self.node_state()):
            candidates = []  # decode pressure: queued requests wait, as the simulator's node pauses them
        chunked = self._local_chunked()
        remaining = sum(len(req.origin_input_ids) for req in candidates)
        if chunked is not None:
            remaining += len(chunked.origin_input_ids) - chunked.extend_end
        if remaining <= 0:
            return 0, []
        max_chunk = scheduler.chunked_prefill_size or scheduler.max_prefill_tokens
        reqs = running_batch.reqs
        tokens = self.admission.chunk_tokens(
            remaining,
            max_chunk,
            scheduler.page_size,
            now_s,
            decode_batch=len(reqs),
            decode_context_tokens=sum(len(req.origin_input_ids) + len(req.output_ids) for req in reqs),
        )
        return tokens, candidates

    def _inflight(self) -> tuple[int, int]:
        """``(KV tokens still to come, requests)`` of local prefills that hold KV but are in no SGLang
        queue: the rest of a chunked prompt, and the local EXTEND batch before its merge."""
        tokens = 0
        requests: set[int] = set()
        if self.batch is not None:
            requests.update(id(req) for req in self.batch.reqs if not req.finished())
        chunked = self._local_chunked()
        if chunked is not None:
            tokens += len(chunked.origin_input_ids) - chunked.extend_end
            requests.add(id(chunked))
        return tokens, len(requests)

    def _kv_fitting_candidates(self, now_s: float) -> list[Any]:
        """The queue's head (FIFO, no overtaking) whose whole prompts fit under SGLang's pre-allocation
        rule beside every active request's reserved decode tokens and the other reservations' KV."""
        scheduler = self.scheduler
        prealloc = scheduler.disagg_decode_prealloc_queue
        allocator = prealloc.token_to_kv_pool_allocator
        free = allocator.available_size() + scheduler.tree_cache.evictable_size()
        inflight_tokens, inflight_requests = self._inflight()
        active = prealloc._active_req_count() + inflight_requests
        lease_kv = self.admission.unstarted_kv_tokens()
        out = []
        for req in self.queue:
            rid = self.reservations[req.rid]
            if not self.admission.is_pending(rid, now_s):
                break
            need = len(req.origin_input_ids)
            own = self.admission.ledger.held_by(rid).kv_tokens
            if not prealloc_fits(
                free_tokens=free,
                active_requests=active,
                need_tokens=need,
                reserved_decode_tokens=prealloc.num_reserved_decode_tokens,
                lease_reserved_kv_tokens=lease_kv - own + inflight_tokens,
            ):
                break
            out.append(req)
            free -= need
            active += 1
            lease_kv -= own
        return out

    def _run_extend(self, running_batch: Any, chunk_tokens: int, candidates: list[Any], now_s: float) -> Any:
        """Build the local EXTEND batch with SGLang's ``get_new_batch_prefill`` over ``candidates`` (and
        the local chunked request), at most ``chunk_tokens`` computed; None when SGLang built nothing.

        For the call, ``waiting_queue`` is the candidates, the prefill budgets are the chunk (plus one
        token per running request with ``--enable-mixed-chunk``: SGLang's adder takes those from both),
        and priority preemption is off (borrowed work never preempts a decode)."""
        scheduler = self.scheduler
        running_batch.filter_batch()
        running_batch.batch_is_full = False
        budget = chunk_tokens + (len(running_batch.reqs) if scheduler.is_mixed_chunk else 0)
        saved = (
            scheduler.waiting_queue,
            scheduler.chunked_prefill_size,
            scheduler.max_prefill_tokens,
            scheduler.enable_priority_preemption,
        )
        scheduler.waiting_queue = list(candidates)
        scheduler.chunked_prefill_size = budget
        scheduler.max_prefill_tokens = budget
        scheduler.enable_priority_preemption = False
        try:
            plan = scheduler.get_new_batch_prefill(running_batch)
            left = scheduler.waiting_queue
        finally:
            (
                scheduler.waiting_queue,
                scheduler.chunked_prefill_size,
                scheduler.max_prefill_tokens,
                scheduler.enable_priority_preemption,
            ) = saved
        batch = plan.batch_to_run
        left_ids = {id(req) for req in left}
        taken = [req for req in candidates if id(req) not in left_ids]
        if batch is None:
            assert not taken, "SGLang built no batch but took queued requests"
            return None
        for req in taken:
            rid = self.reservations.pop(req.rid)
            committed = self.admission.start(rid, now_s)  # pending at this same instant: it commits
            assert committed, f"reservation {rid} was pending but did not commit"
            self.started[req.rid] = _Started(req, rid)
            self._count("started")
        taken_ids = {id(req) for req in taken}
        self.queue = [req for req in self.queue if id(req) not in taken_ids]
        in_batch = {id(req) for req in batch.reqs}
        computed = sum(
            entry.req.extend_len
            for entry in self.started.values()
            if not entry.prefill_done and id(entry.req) in in_batch
        )
        spend = min(computed, self.admission.bucket.available_tokens(now_s))
        if computed > spend:
            logger.warning("local EXTEND computed %d tokens with %d of credit", computed, spend)
            self._count("overspent_tokens", computed - spend)
        self.admission.spend(spend, now_s)
        if running_batch.reqs:
            self.largest_step_beside_decode_tokens = max(self.largest_step_beside_decode_tokens, computed)
        self._count("local_prefill_tokens", computed)
        self._count("extend_batches")
        self.api.set_schedule_time_batch(batch)
        self.batch = batch
        return plan

    # ------------------------------------------------------------------ KV accounting
    def held_out_kv_tokens(self) -> int:
        """KV the decode pre-allocation budget must leave to borrowed work: un-started reservations'
        KV, the rest of an in-flight chunked prompt, and the reserved decode tokens of local requests
        that are in no SGLang queue (between their EXTEND step and the merge)."""
        if self.disabled or not self._busy():
            return 0
        inflight_tokens, inflight_requests = self._inflight()
        reserved = self.scheduler.disagg_decode_prealloc_queue.num_reserved_decode_tokens
        return self.admission.unstarted_kv_tokens() + inflight_tokens + reserved * inflight_requests

    # ------------------------------------------------------------------ client aborts
    def abort(self, original: Callable[..., Any], recv_req: Any) -> Any:
        """``Scheduler.abort_request``: SGLang aborts what it holds (a local chunked prefill included);
        queued local requests it cannot see are taken off the local queue here."""
        result = original(self.scheduler, recv_req)
        kept = []
        for req in self.queue:
            if recv_req.abort_all or req.rid.startswith(recv_req.rid):
                self.admission.cancel(self.reservations.pop(req.rid))
                self._count("aborted_queued")
                self._abort(req, "aborted before it started")
            else:
                kept.append(req)
        self.queue = kept
        return result

    # ------------------------------------------------------------------ state for the lease agent
    def node_state(self) -> NodeState:
        """The node's ``NodeState`` now (what ``/server_info`` carries for the lease agent); the step
        times cover the iterations since the previous call."""
        scheduler = self.scheduler
        prealloc = scheduler.disagg_decode_prealloc_queue
        allocator = prealloc.token_to_kv_pool_allocator
        reqs = scheduler.running_batch.reqs
        contexts = np.array([len(req.origin_input_ids) + len(req.output_ids) for req in reqs], dtype=float)
        remaining = np.array(
            [max(0, req.sampling_params.max_new_tokens - len(req.output_ids)) for req in reqs], dtype=float
        )
        capacity = int(scheduler.max_total_num_tokens)
        free = allocator.available_size() + scheduler.tree_cache.evictable_size()
        chunked = self._local_chunked()
        queued_tokens = sum(len(req.origin_input_ids) for req in self.queue)
        if chunked is not None:
            queued_tokens += len(chunked.origin_input_ids) - chunked.extend_end
        recent_s, decode_only_s = self._steps.recent(self.api.monotonic_ns())
        drain = drain_features(contexts.tolist(), remaining.tolist())
        return NodeState(
            node_id=self.config.node_id,
            time_s=self.api.monotonic_ns() * 1e-9,
            decode_batch_size=len(reqs),
            context_tokens_mean=float(contexts.mean()) if len(reqs) else 0.0,
            context_tokens_std=float(contexts.std()) if len(reqs) else 0.0,
            remaining_output_tokens_mean=float(remaining.mean()) if len(reqs) else 0.0,
            remaining_output_tokens_max=drain[0],
            remaining_output_tokens_context_weighted=drain[1],
            kv_capacity_tokens=capacity,
            kv_used_tokens=max(0, capacity - free),
            kv_reserved_tokens=prealloc.num_reserved_decode_tokens * prealloc._active_req_count(),
            queued_decode_requests=len(scheduler.waiting_queue)
            + len(prealloc.queue)
            + len(prealloc.retracted_queue),
            borrowed_tasks=len(self.queue) + (1 if chunked is not None else 0),
            borrowed_prefill_tokens_queued=queued_tokens,
            recent_step_time_s=recent_s,
            decode_only_step_time_s=decode_only_s,
            max_running_requests=int(scheduler.max_running_requests),
            recent_decode_only_step_time_s=decode_only_s,
            decode_tokens_total=self._steps.decode_tokens,
            mixed_decode_tokens_total=self._steps.mixed_decode_tokens,
        )

    def internal_state(self) -> dict[str, Any]:
        """What the plugin adds under ``crossflow`` to the scheduler's internal state."""
        lease = self.admission.lease()
        return {
            "node_state": self.node_state().to_dict(),
            "lease": None if lease is None else lease.to_dict(),
            "held": self.admission.held().to_dict(),
            "bucket_credit_tokens": self.admission.bucket.credit_tokens,
            "chunk_limited": self.admission.chunk_limits is not None,
            "largest_step_beside_decode_tokens": self.largest_step_beside_decode_tokens,
            "queued": len(self.queue),
            "started": len(self.started),
            STARTED_BORROWED_KEY: sorted(self.started),
            "disabled": self.disabled,
            "counters": dict(sorted(self.counters.items())),
        }


def is_decode_worker(scheduler: Any) -> bool:
    """The scheduler runs SGLang's PD decode mode (``--disaggregation-mode decode``)."""
    return scheduler.disaggregation_mode.name == "DECODE"


def unsupported_reason(scheduler: Any) -> str | None:
    """Why decode-local prefill cannot run on this scheduler (None: it can). Each is a configuration
    the plugin's hooks were not written for; its borrowed requests get 503 and the router falls back."""
    if not is_decode_worker(scheduler):
        return None
    if scheduler.enable_overlap:
        return "the overlap scheduler is on (start the worker with --disable-overlap-schedule)"
    if scheduler.disagg_decode_prealloc_queue.pp_size > 1:
        return "pipeline parallelism"
    if scheduler.require_mlp_sync:
        return "data-parallel attention"
    if not scheduler.spec_algorithm.is_none():
        return "speculative decoding"
    if scheduler.enable_hisparse:
        return "HiSparse"
    return None


def node_for(scheduler: Any, factory: Callable[[Any], LocalPrefill]) -> LocalPrefill:
    """The scheduler's ``LocalPrefill``, made on first use."""
    node = scheduler.__dict__.get(NODE_ATTRIBUTE)
    if node is None:
        node = factory(scheduler)
        setattr(scheduler, NODE_ATTRIBUTE, node)
    return node


__all__ = [
    "INTERNAL_STATE_KEY",
    "NODE_ATTRIBUTE",
    "LocalPrefill",
    "SGLangApi",
    "is_decode_worker",
    "node_for",
    "unsupported_reason",
]
