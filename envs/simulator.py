"""Discrete-event, iteration-level simulator of a prefill/decode-disaggregated cluster.

What it models (SGLang's PD mode, one event per forward iteration):

* **Prefill workers**: FCFS queue, chunked prefill under a token budget per iteration, an LRU prefix
  cache per worker (hits reduce the tokens computed; at least one token is always computed), then a
  KV transfer of the whole input to the request's decode worker.
* **Decode workers**: continuous batching up to ``max_running_requests``; admission when free KV
  covers the context plus a reservation for part of the remaining output; retraction of the newest
  request when KV runs out (it re-prefills its context locally when re-admitted); a prefix cache of
  finished requests in otherwise free KV. The first output token is emitted at admission (the prefill
  worker computed it), the others one per iteration.
* **Borrowed prefill** (Crossflow): a request the scheduler sends to a decode node is prefilled
  there in chunks mixed into decode iterations, bounded by the node's lease, paused while decode
  waits for room (decode always wins), and sent back to the normal path if its reservation is
  revoked before it starts.

Hooks: every ``control_interval_s`` each decode node reports a ``NodeState`` to the scheduler
(``on_control_interval``), and every arriving request's prefill path is chosen by
``scheduler.choose_path``. Without a scheduler every request takes the normal path (static PD).

Identical decode iterations are simulated as one event of up to ``max_decode_jump_iters``
iterations: per-iteration time is linear in the summed context, so the jump's token times are exact,
and any event that reaches the node mid-jump cuts it at the next iteration boundary.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from envs.arrivals import curve_session_starts, poisson_session_starts
from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.metrics import SimResult, build_result
from envs.prefix_cache import PrefixCache, PrefixIndex
from envs.request import Trace
from envs.sim_state import (
    BORROWED,
    FALLBACK,
    Counters,
    DecodeCacheMatches,
    DecodeWorker,
    PrefillWorker,
    ReqState,
    iteration_boundary,
)
from policies.node_state import NodeState

# Event kinds, in tie-break priority order at equal times.
_EV_TRANSFER, _EV_PREFILL, _EV_DECODE, _EV_BORROW, _EV_RELEASE, _EV_TICK = range(6)


class SchedulerHooks(Protocol):
    """What the simulator needs from ``policies.ClusterScheduler``."""

    def on_control_interval(self, now_s: float, states: Sequence[NodeState]) -> Any: ...

    def choose_path(self, query: Any, now_s: float) -> Any: ...

    def on_task_arrival(self, reservation_id: int, state: NodeState, now_s: float) -> str: ...

    def on_task_started(self, reservation_id: int, now_s: float) -> bool: ...

    def on_fallback(self, reservation_id: int) -> Any: ...

    def on_prefill_done(self, reservation_id: int) -> Any: ...

    def on_request_finished(self, reservation_id: int) -> Any: ...


class Simulator:
    """One run of a trace through one cluster. Use :func:`simulate` unless you step it yourself."""

    def __init__(
        self,
        trace: Trace,
        config: ClusterConfig,
        *,
        scheduler: SchedulerHooks | None = None,
        cost_model: CostModel | None = None,
        load_factor: float = 1.0,
        session_rate_per_s: float | None = None,
        seed: int = 0,
        max_time_s: float = math.inf,
        session_rate_curve: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        if load_factor <= 0:
            raise ValueError(f"load_factor must be positive, got {load_factor}")
        self.trace = trace
        self.config = config
        self.scheduler = scheduler
        self.cm = cost_model or CostModel(config.gpu, config.model, config.tp)
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.max_time_s = max_time_s
        self.now_s = 0.0
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self.reqs = [ReqState(r) for r in trace.requests]
        self._children: dict[int, list[int]] = {}
        self.index = PrefixIndex(trace.requests, config.page_tokens)
        cap_pages = int(self.cm.kv_capacity_tokens * config.prefill_cache_fraction) // config.page_tokens
        self.prefill = [PrefillWorker(i, PrefixCache(self.index, cap_pages)) for i in range(config.n_prefill)]
        self.decode = [
            DecodeWorker(
                i,
                PrefixCache(self.index, 0) if config.decode_prefix_cache else None,
                self.cm.kv_capacity_tokens,
            )
            for i in range(config.n_decode)
        ]
        self._rr_prefill = 0
        self._rr_decode = 0
        self.finished = 0
        self.counters = Counters()
        self.itl_segments: list[tuple[float, float, int, int]] = []
        self.node_timeline: list[tuple[float, int, float, int, int]] = []
        self._tick_pending = False
        self._schedule_arrivals(load_factor, session_rate_per_s, session_rate_curve)

    # ---------------------------------------------------------------- events
    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, a, b))

    def _schedule_arrivals(
        self,
        load_factor: float,
        session_rate_per_s: float | None,
        curve: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        requests = self.trace.requests
        if not self.trace.closed_loop:
            for r in requests:
                self._push(r.arrival_s / load_factor, _EV_RELEASE, r.request_id, 0)
            return
        for r in requests:
            if r.depends_on >= 0:
                self._children.setdefault(r.depends_on, []).append(r.request_id)
        sessions = self.trace.session_ids
        if session_rate_per_s is None:
            raise ValueError("closed-loop trace needs session_rate_per_s (sessions started per second)")
        rate = session_rate_per_s * load_factor
        if curve is None:
            starts = poisson_session_starts(len(sessions), rate, self.rng)
        else:  # the curve's shape, rescaled so its time-weighted mean rate is ``rate``
            times, rates = (np.asarray(a, dtype=np.float64) for a in curve)
            widths = np.diff(times, append=times[-1] + (times[-1] - times[-2] if len(times) > 1 else 1.0))
            mean = float(np.sum(rates * widths) / np.sum(widths))
            if mean <= 0:
                raise ValueError("session_rate_curve has no positive rate")
            starts = curve_session_starts(len(sessions), times, rates * (rate / mean), self.rng)
        start_of = dict(zip(sessions, starts, strict=True))
        for r in requests:
            if r.depends_on < 0:
                self._push(start_of[r.session_id] + max(0.0, r.think_time_s), _EV_RELEASE, r.request_id, 0)

    def run(self, progress: Callable[[int], None] | None = None) -> SimResult:
        """Run to completion (or ``max_time_s``) and return the result."""
        self.step_until(math.inf, progress)
        return self.result()

    def step_until(self, t_end_s: float, progress: Callable[[int], None] | None = None) -> bool:
        """Process events up to ``t_end_s``; returns True while work remains."""
        events = self._events
        n = len(self.reqs)
        last_reported = self.finished
        while events and self.finished < n:
            t = events[0][0]
            if t > t_end_s or t > self.max_time_s:
                self.now_s = min(t_end_s, self.max_time_s)
                return True
            t, kind, _, a, b = heapq.heappop(events)
            self.now_s = t
            if kind == _EV_DECODE:
                self._on_decode_done(a, b)
            elif kind == _EV_PREFILL:
                self._on_prefill_done(a)
            elif kind == _EV_TRANSFER:
                self._on_transfer_done(a)
            elif kind == _EV_RELEASE:
                self._on_arrival(a)
            elif kind == _EV_BORROW:
                self._on_borrow_arrival(a)
            else:
                self._on_tick()
            if progress is not None and self.finished - last_reported >= 256:
                progress(self.finished - last_reported)
                last_reported = self.finished
        if progress is not None and self.finished > last_reported:
            progress(self.finished - last_reported)
        if math.isfinite(t_end_s):
            self.now_s = max(self.now_s, min(t_end_s, self.max_time_s))
        return bool(events) and self.finished < n

    @property
    def done(self) -> bool:
        return self.finished >= len(self.reqs) or not self._events

    # ---------------------------------------------------------------- arrival and routing
    def _on_arrival(self, rid: int) -> None:
        req = self.reqs[rid]
        req.arrival_s = self.now_s
        if req.input + req.output > self.cm.kv_capacity_tokens:
            self._reject(
                req,
                f"input + output = {req.input + req.output} tokens exceed a worker's KV capacity "
                f"({self.cm.kv_capacity_tokens} tokens)",
            )
            return
        if self.scheduler is not None:
            if not self._tick_pending:  # control ticks resume on the interval grid
                interval = self.config.control_interval_s
                self._tick_pending = True
                self._push(math.ceil(self.now_s / interval) * interval, _EV_TICK, 0, 0)
            decision = self._choose_path(req)
            if decision is not None:
                return
        self._route_normal(req)

    def _choose_path(self, req: ReqState) -> Any:
        """Ask the scheduler; on 'borrow' hand the task to the node and return the decision."""
        from policies.scheduler import PathQuery  # local: keeps envs importable without a scheduler

        assert self.scheduler is not None
        pw, cached = self._pick_prefill(req)
        uncached = req.input - cached
        decode_cached = DecodeCacheMatches(self.decode, req)
        query = PathQuery(
            request_id=req.rid,
            session_id=self.trace.requests[req.rid].session_id,
            input_tokens=req.input,
            expected_output_tokens=req.output,
            normal_uncached_tokens=uncached,
            normal_queue_wait_s=self._prefill_queue_wait_s(pw),
            normal_prefill_worker=pw.idx,
            decode_cached_tokens=decode_cached,
            prefill_cached_tokens=cached,
        )
        decision = self.scheduler.choose_path(query, self.now_s)
        if decision.path != "borrow":
            self._enqueue_prefill(req, pw, uncached)
            return decision
        req.path = BORROWED
        req.reservation = decision.reservation_id
        req.decode_worker = decision.node_id
        held = getattr(getattr(self.scheduler, "ledger", None), "held_by", None)
        req.pull = int(held(req.reservation).transfer_tokens) if held is not None else 0
        if req.pull > 0:  # the node first pulls the prefix cached on the prefill worker
            self._push(self.now_s + self._transfer_time_s(req.pull), _EV_BORROW, req.rid, 0)
        else:
            self._on_borrow_arrival(req.rid)
        return decision

    def _on_borrow_arrival(self, rid: int) -> None:
        """A borrowed task reaches its node, which re-checks its state before accepting it."""
        assert self.scheduler is not None
        req = self.reqs[rid]
        w = self.decode[req.decode_worker]
        verdict = self.scheduler.on_task_arrival(req.reservation, self._node_state(w), self.now_s)
        if verdict == "fallback":
            self._fallback(req)
        else:
            w.borrowed.append(req)
            self._kick_decode(w)

    def _transfer_time_s(self, tokens: int) -> float:
        return self.cm.kv_transfer_time_s(
            tokens,
            bandwidth_bytes_per_s=self.config.kv_transfer_bandwidth_bytes_per_s,
            latency_s=self.config.kv_transfer_latency_s,
        )

    def _prefill_queue_wait_s(self, pw: PrefillWorker) -> float:
        if pw.queued_tokens <= 0:
            return 0.0
        return self.cm.prefill_time_s(pw.queued_tokens, 0, self.config.prefill_chunk_tokens)

    def _pick_prefill(self, req: ReqState) -> tuple[PrefillWorker, int]:
        """The prefill worker for ``req`` and the input tokens it can take from that worker's cache
        (at most ``input - 1``: the last token is always computed)."""
        workers = self.prefill
        policy = self.config.prefill_routing
        if len(workers) == 1:
            chosen = workers[0]
        elif policy == "round_robin":
            self._rr_prefill = (self._rr_prefill + 1) % len(workers)
            chosen = workers[self._rr_prefill]
        elif policy == "least_load":
            chosen = min(workers, key=lambda w: (w.queued_tokens, w.idx))
        else:
            # cache-aware, as sglang-router does it: balance by request count when the pool is skewed
            # (more than 32 requests apart), otherwise go where the longest prefix is cached.
            counts = [len(w.queue) for w in workers]
            if max(counts) - min(counts) > 32:
                chosen = min(workers, key=lambda w: (len(w.queue), w.queued_tokens, w.idx))
            else:
                matches = [w.cache.match_tokens(req.rid) for w in workers]
                best = max(range(len(workers)), key=lambda i: (matches[i], -workers[i].queued_tokens, -i))
                return workers[best], min(matches[best], req.input - 1)
        return chosen, min(chosen.cache.match_tokens(req.rid), req.input - 1)

    def _pick_decode(self) -> DecodeWorker:
        workers = self.decode
        if self.config.decode_routing == "round_robin":
            self._rr_decode = (self._rr_decode + 1) % len(workers)
            return workers[self._rr_decode]
        return min(workers, key=lambda w: (len(w.running) + len(w.waiting), w.kv_used + w.kv_reserved, w.idx))

    def _route_normal(self, req: ReqState) -> None:
        pw, cached = self._pick_prefill(req)
        self._enqueue_prefill(req, pw, req.input - cached)

    def _enqueue_prefill(self, req: ReqState, pw: PrefillWorker, uncached_estimate: int) -> None:
        req.prefill_worker = pw.idx
        if req.decode_worker < 0 or req.path == FALLBACK:
            req.decode_worker = self._pick_decode().idx
        pw.queue.append(req)
        req.queued_estimate = uncached_estimate
        pw.queued_tokens += uncached_estimate
        if not pw.busy:
            self._start_prefill_iteration(pw)

    def _fallback(self, req: ReqState) -> None:
        """A borrowed request that will not start on its node goes back to the normal path."""
        if self.scheduler is not None and req.reservation >= 0:
            self.scheduler.on_fallback(req.reservation)
        self.counters.fallbacks += 1
        req.path = FALLBACK
        req.reservation = -1
        req.pull = 0
        req.decode_worker = -1
        self._route_normal(req)

    # ---------------------------------------------------------------- prefill workers
    def _start_prefill_iteration(self, pw: PrefillWorker) -> None:
        budget = self.config.prefill_chunk_tokens
        batch: list[tuple[ReqState, int]] = []
        chunks: list[tuple[int, int]] = []
        for req in pw.queue:
            if budget <= 0:
                break
            if not req.started:
                req.started = True
                req.cached = min(pw.cache.match_tokens(req.rid, touch=True), req.input - 1)
                req.done = req.cached
                # the cache may have changed since routing: queue load counts what is really left
                pw.queued_tokens += (req.input - req.cached) - req.queued_estimate
            take = min(req.input - req.done, budget)
            batch.append((req, take))
            chunks.append((take, req.done))
            budget -= take
        if not batch:
            pw.busy = False
            return
        pw.busy = True
        pw.batch = batch
        dt = self.cm.iteration_time_s(chunks)
        pw.busy_s += dt
        self._push(self.now_s + dt, _EV_PREFILL, pw.idx, 0)

    def _on_prefill_done(self, idx: int) -> None:
        pw = self.prefill[idx]
        for req, take in pw.batch:
            req.done += take
            self.counters.prefill_tokens += take
            pw.queued_tokens -= take
            if req.done >= req.input:
                pw.queue.remove(req)
                pw.cache.insert(req.rid)
                self._push(self.now_s + self._transfer_time_s(req.input), _EV_TRANSFER, req.rid, 0)
        pw.batch = []
        self._start_prefill_iteration(pw)

    def _on_transfer_done(self, rid: int) -> None:
        req = self.reqs[rid]
        w = self.decode[req.decode_worker]
        req.has_kv = False
        w.waiting.append(req)
        self._kick_decode(w)

    # ---------------------------------------------------------------- decode workers
    def _kick_decode(self, w: DecodeWorker) -> None:
        """Something arrived for ``w``: start an iteration, or cut a running jump short."""
        if not w.busy:
            self._start_decode_iteration(w)
            return
        if w.iter_k <= 1:
            return
        j = iteration_boundary(w.iter_t0_s, w.iter_dt_s, self.now_s - w.iter_start_s, w.iter_k)
        if j < w.iter_k:
            w.generation += 1
            w.iter_k = j
            end = w.iter_start_s + j * w.iter_t0_s + w.iter_dt_s * j * (j - 1) / 2
            self._push(end, _EV_DECODE, w.idx, w.generation)

    def _kv_free(self, w: DecodeWorker) -> int:
        return w.capacity_tokens - w.kv_used - w.kv_reserved

    def _make_room(self, w: DecodeWorker, tokens: int) -> bool:
        """Evict decode-side prefix cache if needed; True when ``tokens`` more KV fit."""
        free = self._kv_free(w)
        if w.cache is not None:
            cache_tokens = w.cache.used_pages * self.config.page_tokens
            if free - cache_tokens < tokens:
                w.cache.evict_to(max(0, (free - tokens) // self.config.page_tokens))
        return free >= tokens

    def _admit(self, w: DecodeWorker) -> None:
        cfg = self.config
        while w.waiting and len(w.running) < cfg.max_running_requests:
            req = w.waiting[0]
            remaining = req.output - max(req.generated, 1)
            reserve = math.ceil(cfg.decode_reserve_ratio * remaining)
            need = reserve + (0 if req.has_kv else req.input + req.generated)
            if not self._make_room(w, need):
                break
            w.waiting.popleft()
            if not req.has_kv:
                req.context = req.input + req.generated
                w.kv_used += req.context
                req.has_kv = True
            req.reserve_left = reserve
            w.kv_reserved += reserve
            w.running.append(req)
            if req.generated == 0:
                self._emit_first_token(req)
                if req.generated >= req.output:
                    self._finish(w, req)

    def _emit_first_token(self, req: ReqState) -> None:
        c = self.counters
        c.first_tokens += 1
        c.output_tokens += 1
        if self.now_s - req.arrival_s > self.config.slo_ttft_s:
            c.ttft_slo_misses += 1
        req.generated = 1
        req.first_token_s = self.now_s
        req.last_token_s = self.now_s

    def _retract(self, w: DecodeWorker) -> None:
        """KV ran out: the newest running request gives its KV back and waits to re-prefill."""
        req = max(w.running, key=lambda r: (r.arrival_s, r.rid))
        w.running.remove(req)
        w.kv_used -= req.context
        w.kv_reserved -= req.reserve_left
        req.reserve_left = 0
        req.context = 0
        req.has_kv = False
        req.needs_recompute = True
        req.retractions += 1
        w.waiting.appendleft(req)

    def _take_borrowed_chunks(self, w: DecodeWorker, decode_step_s: float) -> list[tuple[ReqState, int]]:
        """Chunks of borrowed prefill to mix into this iteration, within the lease's rate.

        Started tasks continue; a task not yet started re-checks the node with the scheduler first and
        waits while decode requests wait for room (decode always wins)."""
        if not w.borrowed or self.scheduler is None:
            return []
        budget = max(self.config.page_tokens, int(w.lease_prefill_tokens_per_s * max(decode_step_s, 0.01)))
        chunks: list[tuple[ReqState, int]] = []
        state: NodeState | None = None
        for req in list(w.borrowed):
            if budget <= 0:
                break
            if not req.started:
                if w.waiting or len(w.running) >= self.config.max_running_requests:
                    break
                state = state or self._node_state(w)
                verdict = self.scheduler.on_task_arrival(req.reservation, state, self.now_s)
                if verdict == "pause":
                    break
                if verdict == "fallback":
                    w.borrowed.remove(req)
                    self._fallback(req)
                    continue
                if not self._make_room(w, req.input):
                    break
                if not self.scheduler.on_task_started(req.reservation, self.now_s):
                    w.borrowed.remove(req)
                    self._fallback(req)
                    continue
                req.started = True
                local = w.cache.match_tokens(req.rid, touch=True) if w.cache else 0
                cached = min(local + req.pull, req.input - 1)
                req.cached = cached
                req.done = cached
                req.context = req.input
                req.has_kv = True
                w.kv_used += req.input
            take = min(req.input - req.done, budget)
            chunks.append((req, take))
            budget -= take
        return chunks

    def _start_decode_iteration(self, w: DecodeWorker) -> None:
        cfg = self.config
        self._admit(w)
        # Requests past their KV reservation grow by one token per iteration; retract until that fits.
        growing = sum(1 for r in w.running if r.reserve_left == 0 and not r.needs_recompute)
        while growing and not self._make_room(w, growing):
            self._retract(w)
            growing = sum(1 for r in w.running if r.reserve_left == 0 and not r.needs_recompute)
        prefill = [(req, req.context) for req in w.running if req.needs_recompute]
        batch = len(w.running) - len(prefill)
        ctx = sum(r.context for r in w.running if not r.needs_recompute)
        decode_step = self.cm.iteration_time_s((), batch, ctx) if batch else 0.0
        prefill.extend(self._take_borrowed_chunks(w, decode_step))
        if batch == 0 and not prefill:
            w.busy = False
            return
        k = 1
        if not prefill:
            k = min(cfg.max_decode_jump_iters, min(r.output - r.generated for r in w.running))
            if growing:
                k = max(1, min(k, self._kv_free(w) // growing))
                self._make_room(w, growing * k)
        chunks = [(take, 0 if req.needs_recompute else req.done) for req, take in prefill]
        t0 = self.cm.iteration_time_s(chunks, batch, ctx) if chunks else decode_step
        dt = 0.0
        if k > 1:
            dt = max(0.0, self.cm.iteration_time_s((), batch, ctx + batch) - decode_step)
        w.busy = True
        w.generation += 1
        w.iter_start_s = self.now_s
        w.iter_t0_s, w.iter_dt_s, w.iter_k = t0, dt, k
        w.iter_decode_only_s = decode_step
        w.iter_prefill = prefill
        self._push(self.now_s + k * t0 + dt * k * (k - 1) / 2, _EV_DECODE, w.idx, w.generation)

    def _on_decode_done(self, idx: int, generation: int) -> None:
        w = self.decode[idx]
        if generation != w.generation:
            return  # superseded by a cut jump
        k, t0, dt = w.iter_k, w.iter_t0_s, w.iter_dt_s
        elapsed = k * t0 + dt * k * (k - 1) / 2
        w.busy_s += elapsed
        w.step_time_sum_s += elapsed
        w.decode_only_sum_s += elapsed if not w.iter_prefill else k * w.iter_decode_only_s
        w.step_count += k
        recomputed = {id(r) for r, _ in w.iter_prefill if r.needs_recompute}
        decoding = [r for r in w.running if id(r) not in recomputed]
        if decoding:
            self.itl_segments.append((t0, dt, k, len(decoding)))
            c = self.counters
            c.output_tokens += k * len(decoding)
            slo = self.config.slo_itl_s
            if t0 + dt * (k - 1) > slo:  # iteration i takes t0 + i*dt: count those over the target
                fast = 0 if t0 > slo else min(k, int((slo - t0) / dt) + 1)
                slow = k - fast
                c.itl_slo_miss_tokens += slow * len(decoding)
        finished: list[ReqState] = []
        for req in decoding:
            before = req.reserve_left
            used = min(before, k)
            req.reserve_left = before - used
            w.kv_reserved -= used
            w.kv_used += k
            req.context += k
            req.generated += k
            req.last_token_s = self.now_s
            if req.generated >= req.output:
                finished.append(req)
        for req, take in w.iter_prefill:
            if req.needs_recompute:
                req.needs_recompute = False
                gap = self.now_s - req.last_token_s
                self.itl_segments.append((gap, 0.0, 1, 1))
                req.last_token_s = self.now_s
                continue
            req.done += take
            w.borrowed_tokens_total += take
            self.counters.prefill_tokens += take
            self.counters.borrowed_prefill_tokens += take
            if req.done >= req.input:
                self._borrowed_prefill_done(w, req)
        w.iter_prefill = []
        for req in finished:
            self._finish(w, req)
        self._start_decode_iteration(w)

    def _borrowed_prefill_done(self, w: DecodeWorker, req: ReqState) -> None:
        w.borrowed.remove(req)
        if self.scheduler is not None:
            self.scheduler.on_prefill_done(req.reservation)
        self._emit_first_token(req)
        if req.generated >= req.output:
            self._finish(w, req)
            return
        reserve = math.ceil(self.config.decode_reserve_ratio * (req.output - 1))
        req.reserve_left = reserve
        w.kv_reserved += reserve
        if len(w.running) < self.config.max_running_requests:
            w.running.append(req)
        else:
            w.kv_reserved -= reserve
            req.reserve_left = 0
            w.waiting.appendleft(req)

    def _reject(self, req: ReqState, reason: str) -> None:
        """Refuse a request with a reason (as the server would); its session carries on."""
        req.error = reason
        self.finished += 1
        self.counters.rejected += 1
        self._release_children(req)

    def _release_children(self, req: ReqState) -> None:
        for child in self._children.get(req.rid, ()):
            think = max(0.0, self.trace.requests[child].think_time_s)
            self._push(self.now_s + think, _EV_RELEASE, child, 0)

    def _finish(self, w: DecodeWorker, req: ReqState) -> None:
        req.finish_s = self.now_s
        if req in w.running:  # a borrowed one-token request finishes straight from its prefill
            w.running.remove(req)
        w.kv_used -= req.context
        w.kv_reserved -= req.reserve_left
        req.reserve_left = 0
        req.context = 0
        if w.cache is not None:
            w.cache.insert(req.rid)
            self._make_room(w, 0)
        if req.path == BORROWED and self.scheduler is not None:
            self.scheduler.on_request_finished(req.reservation)
        self.finished += 1
        self.counters.finished += 1
        self._release_children(req)

    # ---------------------------------------------------------------- control interval
    def _node_state(self, w: DecodeWorker) -> NodeState:
        running = [r for r in w.running if not r.needs_recompute]
        n = len(running)
        if n:
            ctx_sum = sum(r.context for r in running)
            ctx_mean = ctx_sum / n
            ctx_std = math.sqrt(
                max(0.0, sum(r.context * r.context for r in running) / n - ctx_mean * ctx_mean)
            )
            rem = sum(r.output - r.generated for r in running) / n
        else:
            ctx_mean = ctx_std = rem = 0.0
        decode_only = self.cm.iteration_time_s((), n, int(ctx_mean * n)) if n else 0.0
        recent = w.step_time_sum_s / w.step_count if w.step_count else 0.0
        recent_decode_only = w.decode_only_sum_s / w.step_count if w.step_count else 0.0
        return NodeState(
            node_id=w.idx,
            time_s=self.now_s,
            decode_batch_size=n,
            context_tokens_mean=ctx_mean,
            context_tokens_std=ctx_std,
            remaining_output_tokens_mean=float(rem),
            kv_capacity_tokens=w.capacity_tokens,
            kv_used_tokens=w.kv_used,
            kv_reserved_tokens=w.kv_reserved,
            queued_decode_requests=len(w.waiting),
            borrowed_tasks=len(w.borrowed),
            borrowed_prefill_tokens_queued=sum(r.input - r.done for r in w.borrowed),
            recent_step_time_s=recent,
            decode_only_step_time_s=decode_only,
            recent_decode_only_step_time_s=recent_decode_only,
            max_running_requests=self.config.max_running_requests,
        )

    def node_states(self) -> list[NodeState]:
        """Every decode node's state now (what the scheduler sees each control interval)."""
        return [self._node_state(w) for w in self.decode]

    def _on_tick(self) -> None:
        assert self.scheduler is not None
        revoked = set(self.scheduler.on_control_interval(self.now_s, self.node_states()) or ())
        ledger = getattr(self.scheduler, "ledger", None)
        for w in self.decode:
            lease = ledger.lease(w.idx) if ledger is not None else None
            if lease is not None and lease.expires_s > self.now_s and lease.ttl_s > 0:
                w.lease_prefill_tokens_per_s = lease.budgets.prefill_tokens / lease.ttl_s
            else:
                w.lease_prefill_tokens_per_s = 0.0
            if revoked:  # revoked before they started: back to the normal path now
                for req in [r for r in w.borrowed if not r.started and r.reservation in revoked]:
                    w.borrowed.remove(req)
                    self._fallback(req)
            self.node_timeline.append(
                (self.now_s, w.idx, w.lease_prefill_tokens_per_s, w.borrowed_tokens_total, len(w.running))
            )
            w.step_time_sum_s = 0.0
            w.decode_only_sum_s = 0.0
            w.step_count = 0
            if w.borrowed and not w.busy:
                self._start_decode_iteration(w)
        # An idle cluster needs no control ticks: the next arrival restarts them.
        idle = all(not w.busy and not w.borrowed and not w.waiting for w in self.decode) and all(
            not pw.busy for pw in self.prefill
        )
        if self.finished < len(self.reqs) and not idle:
            self._push(self.now_s + self.config.control_interval_s, _EV_TICK, 0, 0)
        else:
            self._tick_pending = False

    # ---------------------------------------------------------------- result
    def result(self) -> SimResult:
        return build_result(self)


def simulate(
    trace: Trace,
    config: ClusterConfig,
    *,
    scheduler: SchedulerHooks | None = None,
    load_factor: float = 1.0,
    session_rate_per_s: float | None = None,
    seed: int = 0,
    progress: bool = False,
    max_time_s: float = math.inf,
    cost_model: CostModel | None = None,
    session_rate_curve: tuple[np.ndarray, np.ndarray] | None = None,
) -> SimResult:
    """Replay ``trace`` through ``config`` and return per-request records and run metrics.

    Open-loop traces arrive at ``arrival_s / load_factor``; closed-loop (agent) traces start their
    sessions as a Poisson process of ``session_rate_per_s * load_factor`` (or, with
    ``session_rate_curve=(times_s, rates)``, a non-homogeneous one of that shape and mean) and
    release each request its think time after the request it depends on finished. Same seed, same
    result.
    """
    sim = Simulator(
        trace,
        config,
        scheduler=scheduler,
        cost_model=cost_model,
        load_factor=load_factor,
        session_rate_per_s=session_rate_per_s,
        seed=seed,
        max_time_s=max_time_s,
        session_rate_curve=session_rate_curve,
    )
    if not progress:
        return sim.run()
    from tqdm import tqdm

    with tqdm(total=len(trace.requests), unit="req", desc=f"simulate {config.shape}", leave=False) as bar:
        return sim.run(progress=bar.update)


__all__ = ["Counters", "SchedulerHooks", "Simulator", "simulate"]
