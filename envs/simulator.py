"""Discrete-event, iteration-level simulator of a prefill/decode-disaggregated cluster.

What it models (SGLang 0.5.23's PD mode behind smg 1.13.0, one event per forward iteration):

* **Routing** (``policies.routing``, the same rules the HTTP router runs): the gateway dispatches
  each request to a prefill worker P and a decode worker D at arrival (dual dispatch); by default
  both pools use smg's ``cache_aware`` over the gateway's approximate prefix tree and its in-flight
  request counts (a request counts on P until P answers after its KV transfer, and on D until it
  finishes).
* **Decode pre-allocation**: D takes KV for the request's input (less what its radix cache already
  holds, when the decode prefix cache is on) once that fits beside ``num_reserved_decode_tokens`` for
  each of its active requests, the KV lease reservations hold, and what retracted requests need
  (``policies.admission.prealloc_fits``). Until then P holds the request: it runs FCFS among the
  requests whose D pre-allocated.
* **Prefill workers**: chunked prefill under a token budget per iteration and an LRU prefix cache per
  worker (hits reduce the tokens computed; at least one token is always computed). Each chunk's KV is
  sent as soon as the chunk is computed, over P's link and D's link (one NIC per worker; transfers
  through a worker queue behind each other), so the transfer overlaps the rest of the prefill.
* **Decode workers**: continuous batching up to ``max_running_requests``; a request whose KV arrived
  joins the batch and emits its first token (P computed it); running requests grow one token per
  iteration and the newest is retracted when KV runs out (it re-prefills its context locally when
  re-admitted); a prefix cache of finished requests in otherwise free KV when the cluster enables it.
* **Borrowed prefill** (Crossflow): a request the scheduler sends to a decode node is prefilled there
  in chunks mixed into decode iterations. The tokens each iteration may take come from the node's
  ``LeaseTokenBucket``, which its live lease feeds (zero lease, zero borrowed work). A task not yet
  started waits while decode waits for room (decode always wins), re-checks with the scheduler, and
  falls back to the normal path if its reservation is revoked before it starts.
* **Local prefill without a lease** (the peers' conditional disaggregation): a request a path policy
  sends to a decode node as ``local`` prefills there in chunks of at most the policy's
  ``local_chunk_tokens(node)`` per decode iteration. No reservation, no token bucket: only the
  policy's own rule bounds what goes there. It starts, like a borrowed task, once no decode request
  waits for the node and its KV fits. A policy may also move a request still waiting on a prefill
  worker to ``local`` (``reconsider_path``, each control interval).
* **Context windows**: requests beyond the model's window are compacted (``envs.context``) or
  rejected at arrival, per ``ClusterConfig.context_policy``.

Hooks: every ``control_interval_s`` each decode node reports a ``NodeState`` to the scheduler
(``on_control_interval``), and every arriving request's path is chosen by ``scheduler.choose_path``.
Without a scheduler every request takes the normal path (static PD).

Identical decode iterations are simulated as one event of up to ``max_decode_jump_iters``
iterations: per-iteration time is linear in the summed context, so the jump's token times are exact,
and any event that reaches the node mid-jump cuts it at the next iteration boundary.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from envs.arrivals import curve_session_starts, poisson_session_starts
from envs.cluster_config import ClusterConfig
from envs.context import fit_context_window
from envs.cost_model import CostModel
from envs.estimator import ClusterEstimator
from envs.itl import to_ns
from envs.metrics import SimResult, build_result
from envs.prefix_cache import PrefixCache, PrefixIndex, match_in_pool, pool_caches
from envs.request import Request, Trace
from envs.sim_state import (
    BORROWED,
    FALLBACK,
    LOCAL,
    SHED_ERROR_PREFIX,
    Counters,
    DecodeCacheMatches,
    DecodeWorker,
    PrefillWorker,
    ReqState,
    RouterKvLoad,
)
from interference_model.columns import drain_features
from policies.admission import (
    LeaseTokenBucket,
    borrowed_chunk_tokens,
    borrowed_start_blocked,
    min_borrowed_chunk_tokens,
    prealloc_fits,
)
from policies.chunk_limits import capped_chunk_tokens
from policies.node_state import NodeState
from policies.routing import OverloadProtection, RoutingPolicy, WorkerPool, make_routing_policy

# Event kinds, in tie-break priority order at equal times.
_EV_TRANSFER, _EV_PREFILL, _EV_DECODE, _EV_BORROW, _EV_WAKE, _EV_RELEASE, _EV_TICK = range(7)

ROUTER_CHARS_PER_TOKEN = 4
"""smg's HTTP tree counts characters; its ``max_tree_size`` is converted to tokens at this ratio."""


class SchedulerHooks(Protocol):
    """What the simulator needs from ``policies.ClusterScheduler``. A scheduler may also offer
    ``replay_control_interval(now_s) -> bool`` (``ClusterScheduler`` does): the simulator then asks it
    to repeat an interval whose node states are unchanged apart from the clock (``Simulator._on_tick``),
    and ``accepts_unchanged_states() -> bool``: True when neither it nor its policies read a state's
    ``time_s``, so an idle node whose state is unchanged is handed its last ``NodeState`` object again
    (``Simulator._tick_states``)."""

    def on_control_interval(self, now_s: float, states: Sequence[NodeState]) -> Any: ...

    def choose_path(self, query: Any, now_s: float) -> Any: ...

    def on_task_arrival(self, reservation_id: int, state: NodeState, now_s: float) -> str: ...

    def on_task_started(self, reservation_id: int, now_s: float) -> bool: ...

    def on_fallback(self, reservation_id: int) -> Any: ...

    def on_prefill_done(self, reservation_id: int) -> Any: ...

    def on_request_finished(self, reservation_id: int) -> Any: ...

    def lease_rate(self, node_id: int) -> tuple[float, float]: ...

    def unstarted_kv_tokens(self, node_id: int, exclude: int | None = None) -> int: ...

    def pull_tokens(self, reservation_id: int) -> int: ...

    def granted_prefill_tokens(self, node_id: int, now_s: float) -> float: ...

    def local_chunk_tokens(self, node_id: int) -> int: ...

    def borrowed_chunk_tokens(
        self, node_id: int, decode_batch: int, decode_context_tokens: int
    ) -> int | None: ...

    @property
    def uses_gateway_decode_pick(self) -> bool: ...

    @property
    def reconsiders_waiting(self) -> bool: ...

    def reconsider_path(self, query: Any, now_s: float) -> Any: ...


class SimListener(Protocol):
    """Told what the simulation produces, as it happens (``envs.live`` streams it to HTTP clients).

    Called with the simulation clock at the moment of the event; a listener only reads the state it is
    given and never calls back into the simulator."""

    def on_first_token(self, req: ReqState) -> None:
        """``req`` produced its first token (KV arrived and it joined a decode batch, or its borrowed
        prefill finished)."""

    def on_decode_iteration(self, w: DecodeWorker) -> None:
        """``w`` finished an iteration: every request in ``w.running`` that is not recomputing gained a
        token (called before the requests that just finished are removed)."""

    def on_prefill_iteration(self, pw: PrefillWorker) -> None:
        """``pw`` finished a prefill iteration (its chunks are in ``pw.batch``)."""

    def on_kv_landed(self, req: ReqState) -> None:
        """``req``'s KV finished its transfer to its decode worker: the prefill worker is done with it."""

    def on_finish(self, req: ReqState) -> None:
        """``req`` produced its last token."""

    def on_reject(self, req: ReqState) -> None:
        """``req`` was refused (``req.error`` says why; ``req.path == FALLBACK`` when a borrowed request
        could not start and ``refuse_fallbacks`` is set)."""


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
        if not (load_factor > 0 and math.isfinite(load_factor)):
            raise ValueError(f"load_factor must be positive and finite, got {load_factor}")
        self.trace, self.context_fit = fit_context_window(
            trace, config.context_window_tokens, config.context_policy
        )
        self.config = config
        self.scheduler = scheduler
        self.cm = cost_model or CostModel(config.gpu, config.model, config.tp)
        self.estimator = ClusterEstimator(config, self.cm)
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._route_rng = np.random.default_rng([abs(seed), 0x5EED])
        self.max_time_s = max_time_s
        self.now_s = 0.0
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self.reqs = [ReqState(r) for r in self.trace.requests]
        self._session = [r.session_id for r in self.trace.requests]
        self._children: dict[int, list[int]] = {}
        self._reject_over_window = config.context_policy == "reject"
        page = config.page_tokens
        self.index = PrefixIndex(self.trace.requests, page)
        cap_pages = int(self.cm.kv_capacity_tokens * config.prefill_cache_fraction) // page
        self.prefill = [PrefillWorker(i, PrefixCache(self.index, cap_pages)) for i in range(config.n_prefill)]
        self.decode = [
            DecodeWorker(
                i,
                PrefixCache(self.index, 0) if config.decode_prefix_cache else None,
                self.cm.kv_capacity_tokens,
                LeaseTokenBucket(burst_s=config.control_interval_s),
            )
            for i in range(config.n_decode)
        ]
        self._kv_bytes_per_token = float(self.cm.kv_transfer_bytes_per_token)
        # The gateway's view: in-flight counts, routing rules and approximate prefix trees per pool.
        race = config.router_same_instant_race
        self.prefill_pool = WorkerPool(config.n_prefill, same_instant_race=race)
        self.decode_pool = WorkerPool(config.n_decode, same_instant_race=race)
        self._prefill_router = make_routing_policy(config.prefill_routing)
        self._decode_router = make_routing_policy(config.decode_routing)
        tree_pages = (2**26) // ROUTER_CHARS_PER_TOKEN // page
        self._prefill_tree = pool_caches(self.index, config.n_prefill, tree_pages // config.n_prefill)
        self._decode_tree = pool_caches(self.index, config.n_decode, tree_pages // config.n_decode)
        self._overload = OverloadProtection() if config.router_overload_protection else None
        self._next_load_poll_s = 0.0
        self.finished = 0
        self.counters = Counters()
        self.tick_node_states: list[NodeState] = []
        """The decode nodes' states the scheduler was handed at the last control interval (after a
        replayed interval, those of the interval before: equal apart from ``time_s``; an idle node's
        state unchanged since an earlier interval is that interval's object, ``_tick_states``)."""
        self._replay_interval: Callable[[float], bool] | None = getattr(
            scheduler, "replay_control_interval", None
        )
        """The scheduler's ``replay_control_interval``, if it has one (``_on_tick``)."""
        self._accepts_unchanged: Callable[[], bool] | None = getattr(
            scheduler, "accepts_unchanged_states", None
        )
        """The scheduler's ``accepts_unchanged_states``, if it has one (``_tick_states``)."""
        self._states_unchanged = False
        """No decode node's state can have changed, apart from its clock, since the last control
        interval: set at the end of an interval that leaves every node idle and free of borrowed and
        local work, with no iteration run in the interval before it; cleared by every event but a
        prefill iteration that completes no prompt (only a completion changes what a decode node
        reports: the KV pre-allocated for requests still prefilling)."""
        self.ticks = 0
        self.last_tick_s: float | None = None
        """When the last control interval ran (``None`` before the first)."""
        self.ticks_replayed = 0
        """Control intervals run, and those of them the scheduler replayed."""
        self.rejected_context = 0
        self._decode_terms: dict[int, tuple[float, float]] = {}
        self._chunk_times: dict[int, float] = {}
        """Cached prefix -> the time of a prefill iteration of one chunk of ``prefill_chunk_tokens``
        after it (``_start_prefill_iteration``): the cost model is a pure function, and a long
        prompt's full chunks start at cached prefixes that recur from request to request."""
        self._event_kind = _EV_RELEASE
        self.node_timeline: list[tuple[float, int, float, int, int]] = []
        self._tick_pending = False
        self._kv_load = RouterKvLoad(self.decode, self._sync)
        self._kv_load_s = -math.inf
        self.listener: SimListener | None = None
        """Told about tokens, transfers and finishes as they happen (``envs.live``); None for a trace."""
        self.open_ended = False
        """Requests may still be injected (``inject``): events are processed even when every request so
        far has finished."""
        self.refuse_fallbacks = False
        """A borrowed request that cannot start on its node is refused (the client's router sends it
        again on the normal path, as with SGLang's ``do_local_prefill``) instead of re-dispatched here."""
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

    def run_checked(self, stop: Callable[[float], bool], every_s: float) -> SimResult | None:
        """``run``, asking ``stop(t)`` at each multiple ``t`` of ``every_s`` simulated seconds that has an
        event after it (every event up to ``t`` processed, none after it, the clock left where the
        last event put it): None as soon as ``stop`` answers True, else ``run``'s result, identical to
        it (the checks change no state)."""
        if not every_s > 0:
            raise ValueError(f"run_checked: every_s must be > 0, got {every_s}")
        check_s = every_s
        while not self.done:
            nxt = self.next_event_time_s()
            if nxt > self.max_time_s:
                break
            if nxt > check_s:
                if stop(check_s):
                    return None
                check_s = (math.floor(nxt / every_s) + 1) * every_s
                continue
            self.step_until(check_s, advance_clock=False)
        return self.run()

    def step_until(
        self, t_end_s: float, progress: Callable[[int], None] | None = None, *, advance_clock: bool = True
    ) -> bool:
        """Process events up to ``t_end_s``; returns True while work remains. The clock then reads
        ``t_end_s`` (at most ``max_time_s``), or with ``advance_clock=False`` the last event's time."""
        events = self._events
        n = len(self.reqs)
        last_reported = self.finished
        while events and (self.finished < n or self.open_ended):
            t = events[0][0]
            if t > t_end_s or t > self.max_time_s:
                if advance_clock:
                    self.now_s = min(t_end_s, self.max_time_s)
                return True
            t, kind, _, a, b = heapq.heappop(events)
            self.now_s = t
            self._event_kind = kind
            if kind == _EV_PREFILL:
                self._on_prefill_done(a)
            elif kind == _EV_TICK:
                self._on_tick()
            else:
                self._states_unchanged = False
                if kind == _EV_DECODE:
                    self._on_decode_done(a, b)
                elif kind == _EV_TRANSFER:
                    self._on_transfer_done(a)
                elif kind == _EV_RELEASE:
                    self._on_arrival(a)
                elif kind == _EV_BORROW:
                    self._on_borrow_arrival(a)
                else:
                    self._on_wake(a)
            if progress is not None and self.finished - last_reported >= 256:
                progress(self.finished - last_reported)
                last_reported = self.finished
        if progress is not None and self.finished > last_reported:
            progress(self.finished - last_reported)
        if math.isfinite(t_end_s) and advance_clock:
            self.now_s = max(self.now_s, min(t_end_s, self.max_time_s))
        return bool(events) and self.finished < n

    @property
    def done(self) -> bool:
        return self.finished >= len(self.reqs) or not self._events

    def next_event_time_s(self) -> float:
        """When the next pending event happens (``inf`` when none is pending)."""
        return self._events[0][0] if self._events else math.inf

    def inject(
        self,
        request: Request,
        *,
        decode_worker: int,
        prefill_worker: int | None = None,
        reservation_id: int | None = None,
    ) -> ReqState:
        """Add a request that arrives now, already placed by a router outside the simulator.

        Normal path (``prefill_worker`` given): dual dispatch to that prefill worker and
        ``decode_worker``, exactly as a routed trace request. Borrowed path (``reservation_id`` given,
        needs a scheduler): prefilled on ``decode_worker`` under that reservation. ``request.request_id``
        must be the next id (``len(self.reqs)``); its prefix identity refers to earlier requests. The
        caller checks that the request fits the model and the KV (``refusal_reason``)."""
        rid = len(self.reqs)
        if request.request_id != rid:
            raise ValueError(f"injected request_id must be {rid} (the next id), got {request.request_id}")
        if (prefill_worker is None) == (reservation_id is None):
            raise ValueError("give exactly one of prefill_worker (normal path) or reservation_id (borrowed)")
        if not 0 <= decode_worker < len(self.decode):
            raise ValueError(f"decode_worker {decode_worker} out of range (0..{len(self.decode) - 1})")
        if prefill_worker is not None and not 0 <= prefill_worker < len(self.prefill):
            raise ValueError(f"prefill_worker {prefill_worker} out of range (0..{len(self.prefill) - 1})")
        if reservation_id is not None and self.scheduler is None:
            raise ValueError("a borrowed request needs a simulator with a scheduler")
        self.index.add(request)
        self.trace.requests.append(request)
        self.reqs.append(ReqState(request))
        self._session.append(request.session_id)
        req = self.reqs[rid]
        req.arrival_s = self.now_s
        self._event_kind = _EV_RELEASE  # handled as a trace arrival at this instant would be
        self._states_unchanged = False
        if self.scheduler is not None:
            self._start_ticks()
        if prefill_worker is not None:
            self._dispatch_normal(req, prefill_worker, decode_worker)
        else:
            assert reservation_id is not None
            self._dispatch_borrowed(req, decode_worker, reservation_id, -1)
        return req

    def refusal_reason(self, input_tokens: int, output_tokens: int) -> str | None:
        """Why a request of this size is refused at arrival (it cannot fit a decode worker's KV), or
        None when it fits."""
        need = max(1, input_tokens) + max(1, output_tokens) + self.config.num_reserved_decode_tokens
        if need > self.cm.kv_capacity_tokens:
            return (
                f"input + output + reserved decode tokens = {need} exceed a worker's KV capacity "
                f"({self.cm.kv_capacity_tokens} tokens)"
            )
        return None

    # ---------------------------------------------------------------- arrival and routing
    def _on_arrival(self, rid: int) -> None:
        req = self.reqs[rid]
        req.arrival_s = self.now_s
        if self._reject_over_window and rid in self.context_fit.over_window:
            self.rejected_context += 1
            self._reject(
                req,
                f"input + output = {req.input + req.output} tokens exceed the model's context window "
                f"({self.context_fit.window_tokens} tokens)",
            )
            return
        reason = self.refusal_reason(req.input, req.output)
        if reason is not None:
            self._reject(req, reason)
            return
        if self.scheduler is not None:
            self._start_ticks()
            self._choose_path(req)
            return
        pidx, _ = self._pick_prefill(req)
        self._dispatch_normal(req, pidx)

    def start_control_ticks(self) -> None:
        """Start the control ticks now, on the interval grid, rather than at the first arrival (a
        control plane that runs before any request: the leases are out when the first one comes).
        They stop again while the cluster is idle, as always; nothing happens without a scheduler."""
        if self.scheduler is not None:
            self._start_ticks()

    def _start_ticks(self) -> None:
        """Control ticks resume on the interval grid (an idle cluster stops them)."""
        if not self._tick_pending:
            interval = self.config.control_interval_s
            self._tick_pending = True
            self._push(math.ceil(self.now_s / interval) * interval, _EV_TICK, 0, 0)

    def _choose_path(self, req: ReqState) -> None:
        """Ask the scheduler which path ``req`` takes and dispatch it there."""
        assert self.scheduler is not None
        pidx, cached = self._pick_prefill(req)
        # The gateway's decode pick is made first only for path policies that read it (it draws from the
        # routing RNG on ties, so making it for every request would change every other policy's runs).
        didx = self._pick_decode(req) if self.scheduler.uses_gateway_decode_pick else None
        queued = self.prefill[pidx].queued_tokens
        query = self._path_query(req, pidx, didx, cached, queued)
        decision = self.scheduler.choose_path(query, self.now_s)
        if decision.path == "shed":  # admission control: an SLO miss, not a rejection
            self._reject(req, f"{SHED_ERROR_PREFIX}{decision.reason}", shed=True)
            return
        if decision.path == "local":
            self._dispatch_local(req, decision.node_id)
            return
        if decision.path != "borrow":
            self._dispatch_normal(req, pidx, didx)
            return
        self._dispatch_borrowed(req, decision.node_id, decision.reservation_id, pidx)

    def _dispatch_borrowed(self, req: ReqState, node_id: int, reservation_id: int, pidx: int) -> None:
        """``req`` is prefilled on decode node ``node_id`` under ``reservation_id`` (``pidx``: the normal
        path's prefill worker, whose cached prefix the node may pull; -1 for none)."""
        assert self.scheduler is not None
        req.path = BORROWED
        req.reservation = reservation_id
        req.decode_worker = node_id
        req.prefill_worker = pidx
        self.decode_pool.dispatched(node_id, self.now_s)
        self._decode_tree[node_id].insert(req.rid)
        req.pull = self.scheduler.pull_tokens(req.reservation)
        if req.pull > 0 and pidx < 0:
            raise ValueError(f"reservation {reservation_id} pulls a prefix but no prefill worker was given")
        w = self.decode[req.decode_worker]
        if req.pull > 0:  # the node first pulls the prefix cached on the prefill worker
            done_s = self._link_transfer(self.prefill[pidx], w, req.pull)
            self._push(done_s, _EV_BORROW, req.rid, 0)
        else:
            self._on_borrow_arrival(req.rid)

    def _path_query(
        self, req: ReqState, pidx: int, didx: int | None, prefill_cached: int, queued_tokens: int
    ) -> Any:
        """What the path policy is told about ``req`` routed to prefill worker ``pidx`` (holding
        ``prefill_cached`` of its tokens, ``queued_tokens`` queued ahead) and decode worker ``didx``."""
        from policies.path import PathQuery  # local: keeps envs importable without a scheduler

        decode_cached: Mapping[int, int] = {}
        if self.config.decode_prefix_cache:
            for w in self.decode:  # the caches as of now (a decode jump evicts as it goes)
                self._sync(w)
            decode_cached = DecodeCacheMatches(self.decode, req)
        if self._kv_load_s != self.now_s:  # one router-side load snapshot per instant (RouterKvLoad)
            self._kv_load, self._kv_load_s = RouterKvLoad(self.decode, self._sync), self.now_s
        return PathQuery(
            request_id=req.rid,
            session_id=self._session[req.rid],
            input_tokens=req.input,
            expected_output_tokens=req.output,
            normal_uncached_tokens=req.input - prefill_cached,
            normal_queue_wait_s=self.estimator.queue_wait_s(queued_tokens),
            normal_prefill_worker=pidx,
            decode_cached_tokens=decode_cached,
            prefill_cached_tokens=prefill_cached,
            normal_decode_worker=didx,
            normal_queued_tokens=queued_tokens,
            decode_kv_load_tokens=self._kv_load,
            decode_kv_capacity_tokens=self.cm.kv_capacity_tokens,
        )

    def _dispatch_local(self, req: ReqState, node: int) -> None:
        """A ``local`` decision: ``req`` prefills on decode node ``node`` without a lease."""
        req.path = LOCAL
        req.decode_worker = node
        self.decode_pool.dispatched(node, self.now_s)
        self._decode_tree[node].insert(req.rid)
        w = self.decode[node]
        w.local.append(req)
        self._kick_decode(w)

    def _reconsider_waiting(self) -> None:
        """Offer each request still waiting on a prefill worker (queue order, with the uncomputed work
        queued ahead of it) to the path policy; a ``local`` answer moves it to that decode node."""
        assert self.scheduler is not None
        for pw in self.prefill:
            ahead = sum(r.input - r.done for r in pw.queue if r.started)
            for req in [r for r in pw.queue if not r.started]:
                cached = req.input - req.queued_estimate
                query = self._path_query(req, pw.idx, req.decode_worker, cached, ahead)
                decision = self.scheduler.reconsider_path(query, self.now_s)
                if decision is not None and decision.path == "local":
                    self._withdraw_normal(req)
                    self._dispatch_local(req, decision.node_id)
                else:
                    ahead += req.queued_estimate

    def _withdraw_normal(self, req: ReqState) -> None:
        """Take a request whose prefill has not started back from its prefill and decode workers."""
        pw, w = self.prefill[req.prefill_worker], self.decode[req.decode_worker]
        pw.queue.remove(req)
        pw.queued_tokens -= req.queued_estimate
        self.prefill_pool.finished(pw.idx)
        self.decode_pool.finished(w.idx)
        if req.bootstrapped:  # its KV was pre-allocated on the decode worker: give it back
            self._give_back_kv(w, req)
            req.d_cached = 0
            req.bootstrapped = False
        else:
            w.prealloc.remove(req)
        req.prefill_worker = req.decode_worker = -1
        self._try_prealloc(w)

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

    def _poll_loads(self) -> None:
        """The gateway's load poll: refresh both pools' overload flags once per monitor interval (at
        the first routing decision of the interval, from the workers' state at that moment)."""
        if self._overload is None or self.now_s < self._next_load_poll_s:
            return
        rule = self._overload
        interval = rule.load_monitor_interval_s
        self._next_load_poll_s = (math.floor(self.now_s / interval) + 1) * interval
        prefill_flags = []
        for pw in self.prefill:
            waiting = held = 0
            for r in pw.queue:
                if r.started:
                    held += r.done
                else:
                    waiting += 1
            prefill_flags.append(rule.is_overloaded(waiting, held / self.cm.kv_capacity_tokens))
        decode_flags = []
        for w in self.decode:
            self._sync(w)
            decode_flags.append(
                rule.is_overloaded(
                    len(w.prealloc) + len(w.waiting) + len(w.retracted), w.kv_used / w.capacity_tokens
                )
            )
        self.prefill_pool.set_overloaded(prefill_flags)
        self.decode_pool.set_overloaded(decode_flags)

    def _pick_prefill(self, req: ReqState) -> tuple[int, int]:
        """The prefill worker the gateway picks for ``req`` and the input tokens its approximate tree
        says that worker holds (at most ``input - 1``: the last token is always computed)."""
        self._poll_loads()
        tree, pool = self._prefill_tree, self.prefill_pool
        pool.at(self.now_s)
        matches = self._pool_matches(tree, pool, self._prefill_router, req)
        idx = self._prefill_router.choose(
            pool, req.input, matches, self._route_rng, lambda i: tree[i].used_pages * self.config.page_tokens
        )
        cached = matches[idx] if idx in matches else tree[idx].match_tokens(req.rid)
        return idx, min(cached, req.input - 1)

    @staticmethod
    def _pool_matches(
        tree: list[PrefixCache], pool: WorkerPool, router: RoutingPolicy, req: ReqState
    ) -> Mapping[int, int]:
        """What the gateway's tree says the pool holds of ``req``'s prefix, as far as ``router`` needs:
        the longest matches among the candidates (cache-aware), every worker's (the legacy rule,
        which ignores overload), or nothing."""
        if not router.uses_prefix_match:
            return {}
        if router.name == "sglang_router_cache_aware":
            return {i: m for i, c in enumerate(tree) if (m := c.match_tokens(req.rid))}
        return match_in_pool(tree, req.rid, pool.is_candidate, all_eligible=pool.all_candidates)

    def _pick_decode(self, req: ReqState) -> int:
        tree = self._decode_tree
        router = self._decode_router
        self.decode_pool.at(self.now_s)
        matches = self._pool_matches(tree, self.decode_pool, router, req)
        return router.choose(
            self.decode_pool,
            req.input,
            matches,
            self._route_rng,
            lambda i: tree[i].used_pages * self.config.page_tokens,
        )

    def _dispatch_normal(self, req: ReqState, pidx: int, didx: int | None = None) -> None:
        """Dual dispatch: the request joins P's queue and D's pre-allocation queue at once (``didx``:
        the decode worker when the gateway's pick was made already or a router outside the simulator
        chose it)."""
        didx = self._pick_decode(req) if didx is None else didx
        self.prefill_pool.dispatched(pidx, self.now_s)
        self.decode_pool.dispatched(didx, self.now_s)
        self._prefill_tree[pidx].insert(req.rid)
        self._decode_tree[didx].insert(req.rid)
        pw, w = self.prefill[pidx], self.decode[didx]
        req.prefill_worker, req.decode_worker = pidx, didx
        req.queued_estimate = req.input - min(pw.cache.match_tokens(req.rid), req.input - 1)
        pw.queued_tokens += req.queued_estimate
        pw.queue.append(req)
        w.prealloc.append(req)
        self._try_prealloc(w)

    def _fallback(self, req: ReqState) -> None:
        """A borrowed request that will not start on its node goes back to the normal path."""
        if self.scheduler is not None and req.reservation >= 0:
            self.scheduler.on_fallback(req.reservation)
        self.counters.fallbacks += 1
        self.decode_pool.finished(req.decode_worker)
        self._cut_jump(self.decode[req.decode_worker])  # its lease KV is free: admissions re-check
        req.path = FALLBACK
        req.reservation = -1
        req.pull = 0
        req.decode_worker = -1
        if self.refuse_fallbacks:
            self._reject(req, "the node's lease cannot take this borrowed prefill now (revoked or paused)")
            return
        pidx, _ = self._pick_prefill(req)
        self._dispatch_normal(req, pidx)

    def _link_transfer(self, src: PrefillWorker, dst: DecodeWorker, tokens: int) -> float:
        """Queue a KV transfer of ``tokens`` tokens on both workers' links; returns when it lands."""
        latency = self.config.kv_transfer_latency_s
        if tokens <= 0:
            return self.now_s + latency
        start = max(self.now_s, src.link_free_s, dst.link_free_s)
        end = start + tokens * self._kv_bytes_per_token / self.config.kv_transfer_bandwidth_bytes_per_s
        src.link_free_s = dst.link_free_s = end
        return end + latency

    # ---------------------------------------------------------------- decode pre-allocation
    def _lease_reserved_kv(self, w: DecodeWorker, exclude: int | None = None) -> int:
        if self.scheduler is None:
            return 0
        return self.scheduler.unstarted_kv_tokens(w.idx, exclude)

    def _kv_fits(self, w: DecodeWorker, need: int, exclude_reservation: int | None = None) -> bool:
        """``need`` more KV may be allocated on ``w`` under SGLang's pre-allocation rule (evicting
        decode prefix cache if it must)."""
        ok = prealloc_fits(
            free_tokens=w.capacity_tokens - w.kv_used,
            active_requests=w.n_active,
            need_tokens=need,
            reserved_decode_tokens=self.config.num_reserved_decode_tokens,
            lease_reserved_kv_tokens=self._lease_reserved_kv(w, exclude_reservation),
            retracted_tokens=w.retracted_tokens,
        )
        if ok:
            self._make_room(w, need)
        return ok

    def _try_prealloc(self, w: DecodeWorker) -> None:
        """Pre-allocate KV for the requests queued on ``w`` (FIFO) and release them to their prefill."""
        if w.prealloc:
            self._sync(w)
        allocated = False
        while w.prealloc:
            req = w.prealloc[0]
            d_cached = min(w.cache.match_tokens(req.rid, touch=True), req.input - 1) if w.cache else 0
            need = req.input - d_cached
            if not self._kv_fits(w, need):
                break
            w.prealloc.popleft()
            allocated = True
            req.d_cached = d_cached
            req.kv_held = need
            req.context = req.input
            w.kv_used += need
            w.n_active += 1
            req.bootstrapped = True
            pw = self.prefill[req.prefill_worker]
            if not pw.busy:
                self._start_prefill_iteration(pw)
        if allocated:  # less KV for the jump in flight: its next iteration re-checks the room
            self._cut_jump(w)

    # ---------------------------------------------------------------- prefill workers
    def _start_prefill_iteration(self, pw: PrefillWorker) -> None:
        budget = self.config.prefill_chunk_tokens
        queue = pw.queue
        if queue:
            head = queue[0]
            if head.started and head.input - head.done >= budget:
                # A started request at the head with a budget or more left fills this iteration
                # alone (what the loop below finds; most iterations of a long prompt are these).
                pw.busy = True
                pw.batch = [(head, budget)]
                dt = self._chunk_times.get(head.done)
                if dt is None:
                    if len(self._chunk_times) >= 1 << 16:  # a bound on memory
                        self._chunk_times.clear()
                    dt = self._chunk_times[head.done] = self.cm.iteration_time_s(((budget, head.done),))
                pw.busy_s += dt
                self._push(self.now_s + dt, _EV_PREFILL, pw.idx, 0)
                return
        batch: list[tuple[ReqState, int]] = []
        chunks: list[tuple[int, int]] = []
        for req in pw.queue:
            if budget <= 0:
                break
            if not req.bootstrapped:
                continue
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
        if self.listener is not None:
            self.listener.on_prefill_iteration(pw)
        counters = self.counters
        for req, take in pw.batch:
            done = req.done = req.done + take
            counters.prefill_tokens += take
            pw.queued_tokens -= take
            # this chunk's KV (and, with the first chunk, the cached prefix) goes to D now
            lo = max(req.sent_upto, req.d_cached)
            landed_s = self._link_transfer(pw, self.decode[req.decode_worker], done - lo if done > lo else 0)
            req.sent_upto = done
            if done >= req.input:
                self._states_unchanged = False
                pw.queue.remove(req)
                pw.cache.insert(req.rid)
                self._push(landed_s, _EV_TRANSFER, req.rid, 0)
        pw.batch = []
        self._start_prefill_iteration(pw)

    def _on_transfer_done(self, rid: int) -> None:
        req = self.reqs[rid]
        self.prefill_pool.finished(req.prefill_worker)
        w = self.decode[req.decode_worker]
        req.has_kv = True
        if self.listener is not None:
            self.listener.on_kv_landed(req)
        w.waiting.append(req)
        self._kick_decode(w)

    # ---------------------------------------------------------------- decode workers
    def _kick_decode(self, w: DecodeWorker) -> None:
        """Something arrived for ``w``: start an iteration, or cut a running jump short."""
        if not w.busy:
            self._start_decode_iteration(w)
        else:
            self._cut_jump(w)

    def _boundary(self, ends: list[float] | np.ndarray) -> int:
        """Iterations of ``ends`` finished by now, as single-iteration events would have it: an
        iteration ending exactly now counts as finished when the event in hand sorts after decode
        events at equal times (arrivals, ticks), and as still running when it sorts before (transfers,
        prefill iterations) or is another worker's decode event."""
        side: Literal["left", "right"] = "right" if self._event_kind > _EV_DECODE else "left"
        if isinstance(ends, np.ndarray):
            return int(ends.searchsorted(self.now_s, side=side))
        return (bisect.bisect_right if side == "right" else bisect.bisect_left)(ends, self.now_s)

    def _cut_jump(self, w: DecodeWorker) -> None:
        """End ``w``'s jump at the iteration in flight, so the next iteration sees what just changed."""
        k = len(w.iter_ends_s)
        if not w.busy or k - w.iter_applied <= 1:
            return
        j = min(k, self._boundary(w.iter_ends_s) + 1)
        if j < k:
            w.generation += 1
            w.iter_times_s = w.iter_times_s[:j]
            w.iter_ends_s = w.iter_ends_s[:j]
            self._push(float(w.iter_ends_s[j - 1]), _EV_DECODE, w.idx, w.generation)

    def _sync(self, w: DecodeWorker) -> None:
        """Apply the iterations of ``w``'s jump that have finished by now (before anything reads the
        worker's state), leaving the one in flight; a no-op outside a jump."""
        k = len(w.iter_ends_s)
        if w.busy and k - w.iter_applied > 1:
            self._apply_decode(w, min(k - 1, self._boundary(w.iter_ends_s)))

    def _apply_decode(self, w: DecodeWorker, upto: int) -> None:
        """Apply decode-only iterations ``[iter_applied, upto)`` of the jump: tokens, KV growth, time
        accounting, and the prefix-cache evictions each iteration's start made room with."""
        start = w.iter_applied
        if upto <= start:
            return
        n = len(w.running)
        if w.cache is not None and upto > start + 1:  # evictions up to the last one's start
            self._advance_decode(w, start, upto - 1, n)
            self._make_room(w, n)
            start = upto - 1
        self._advance_decode(w, start, upto, n)

    def _advance_decode(self, w: DecodeWorker, start: int, upto: int, n: int) -> None:
        m = upto - start
        if m <= 0:
            return
        times = w.iter_times_s[start:upto]
        if m == 1 or not isinstance(times, np.ndarray) or not self._account_jump(w, start, upto, n):
            self._account(w, times, times, n)
        log = w.step_log
        if log is not None:
            for t, end_s in zip(times, w.iter_ends_s[start:upto], strict=True):
                ns = to_ns(float(t))
                log.add(float(end_s), ns, ns)
        if w.iter_credit_wait:  # each iteration's end starts the next: single iterations check credit there
            for end_s in w.iter_ends_s[start:upto]:
                w.bucket.advance(float(end_s))
        last_s = float(w.iter_ends_s[upto - 1])
        for req in w.running:
            req.kv_held += m
            req.context += m
            req.generated += m
            req.last_token_s = last_s
        w.kv_used += n * m
        self.counters.output_tokens += n * m
        w.iter_applied = upto

    def _account_jump(self, w: DecodeWorker, start: int, upto: int, n: int) -> bool:
        """``_account(w, times, times, n)`` for iterations ``[start, upto)`` (at least two) of ``w``'s
        jump. A jump applied in pieces (every control interval reads the node) makes its nanosecond
        counts and their running sums once (``DecodeWorker.iter_ns``) and costs one subtraction a
        piece; one applied whole needs no running sums. The same integers: the rounding is
        elementwise and integer sums are exact, and in times that never decrease the iterations over
        the SLO are those from one index on. False (nothing done) for a jump whose times decrease
        somewhere."""
        pre = w.iter_ns
        arr = w.iter_times_s
        assert isinstance(arr, np.ndarray)  # a jump's times are an array (``_start_decode_iteration``)
        if pre is None:
            if not w.iter_ascending and not bool((arr[1:] >= arr[:-1]).all()):
                return False
            ns = np.rint(arr * 1e9).astype(np.int64)
            over_from = int(arr.searchsorted(self.config.slo_tpot_s, "right"))
            if start == 0 and upto == len(arr):  # the whole jump at once
                self._add_jump_piece(w, arr, ns, int(ns.sum()), over_from, n)
                return True
            sums = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(ns)))
            pre = w.iter_ns = (ns, sums, over_from)
        ns, sums, over_from = pre
        total = int(sums[upto] - sums[start])
        self._add_jump_piece(w, arr[start:upto], ns[start:upto], total, over_from - start, n)
        return True

    def _add_jump_piece(
        self, w: DecodeWorker, times: np.ndarray, ns: np.ndarray, total: int, over_from: int, n: int
    ) -> None:
        """Account ascending iterations ``times`` of a jump (``ns``: in integer nanoseconds, summing to
        ``total``; those from index ``over_from`` on are over the TPOT SLO), each of ``n`` tokens."""
        m = len(ns)
        w.busy_ns += total
        w.step_time_ns += total
        w.decode_only_ns += total
        if n:
            w.itl.add_many(times, n, ascending=True, ns=ns, ns_sum=total)
            over = m - max(0, over_from)
            if over > 0:
                self.counters.itl_slo_miss_tokens += over * n
        w.step_count += m
        w.decode_tokens_total += n * m
        w.iterations += m

    def _account(
        self, w: DecodeWorker, times: list[float] | np.ndarray, decode_only: list[float] | np.ndarray, n: int
    ) -> None:
        """Add iterations to ``w``'s busy time, interval sums and ITL histogram, in integer
        nanoseconds, so one jump and the same iterations one by one add up identically."""
        slo = self.config.slo_tpot_s
        if len(times) == 1:
            t, ns = float(times[0]), to_ns(float(times[0]))
            w.busy_ns += ns
            w.step_time_ns += ns
            w.decode_only_ns += to_ns(float(decode_only[0]))
            if n:
                w.itl.add(t, n)
                if t > slo:
                    self.counters.itl_slo_miss_tokens += n
        else:
            arr = np.asarray(times, dtype=np.float64)
            ns_arr = np.rint(arr * 1e9).astype(np.int64)
            total = int(ns_arr.sum())
            w.busy_ns += total
            w.step_time_ns += total
            w.decode_only_ns += (
                total
                if decode_only is times
                else int(np.rint(np.asarray(decode_only, dtype=np.float64) * 1e9).astype(np.int64).sum())
            )
            if n:  # a jump: its iteration times never decrease
                w.itl.add_many(arr, n, ascending=True, ns=ns_arr)
                self.counters.itl_slo_miss_tokens += (len(arr) - int(arr.searchsorted(slo, "right"))) * n
        w.step_count += len(times)
        w.decode_tokens_total += n * len(times)
        w.iterations += len(times)

    def _on_wake(self, idx: int) -> None:
        w = self.decode[idx]
        w.wake_pending = False
        if not w.busy:
            self._start_decode_iteration(w)

    def _make_room(self, w: DecodeWorker, tokens: int) -> bool:
        """Evict decode-side prefix cache if needed; True when ``tokens`` more KV fit."""
        free = w.capacity_tokens - w.kv_used
        if w.cache is not None:
            page = self.config.page_tokens
            if free - w.cache.used_pages * page < tokens:
                w.cache.evict_to(max(0, (free - tokens) // page))
        return free >= tokens

    def _admit(self, w: DecodeWorker) -> None:
        """Fill free running slots: retracted requests first (once their KV fits again, as SGLang
        resumes them), then requests whose KV is here."""
        cap = self.config.max_running_requests
        while w.retracted and len(w.running) < cap:
            req = w.retracted[0]
            need = req.input + req.generated
            w.retracted_tokens -= need
            if not self._kv_fits(w, need):
                w.retracted_tokens += need
                break
            w.retracted.popleft()
            req.context = need
            req.kv_held = need
            w.kv_used += need
            w.n_active += 1
            req.has_kv = True
            w.running.append(req)
        while w.waiting and len(w.running) < cap:
            req = w.waiting.popleft()
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
        if self.listener is not None:
            self.listener.on_first_token(req)

    def _retract(self, w: DecodeWorker) -> None:
        """KV ran out: the newest running request gives its KV back and waits to re-prefill."""
        req = max(w.running, key=lambda r: (r.arrival_s, r.rid))
        w.running.remove(req)
        self._give_back_kv(w, req)
        req.has_kv = False
        req.needs_recompute = True
        req.retractions += 1
        w.retracted_tokens += req.input + req.generated
        w.retracted.append(req)

    def _take_borrowed_chunks(self, w: DecodeWorker, batch: int, ctx: int) -> list[tuple[ReqState, int]]:
        """Chunks of borrowed prefill to mix into this iteration (beside ``batch`` decoding requests with
        ``ctx`` tokens of context), paid from the node's token bucket, at most the node policy's chunk
        for that batch.

        Started tasks continue; a task not yet started re-checks the node with the scheduler first and
        waits while decode requests wait for room (decode always wins). With too little credit for a
        useful chunk it takes none (``_start_decode_iteration`` then waits for the credit)."""
        if not w.borrowed or self.scheduler is None:
            return []
        cfg = self.config
        limit = self.scheduler.borrowed_chunk_tokens(w.idx, batch, ctx)
        max_chunk = cfg.prefill_chunk_tokens
        # the policy's chunk within its ITL budget; started work still progresses
        max_chunk = capped_chunk_tokens(limit, max_chunk, self._min_chunk_tokens(w))
        budget = borrowed_chunk_tokens(
            min(w.bucket.available_tokens(self.now_s), max_chunk),
            self._borrowed_remaining(w),
            self._min_chunk_tokens(w),
        )
        if budget <= 0:
            return []
        chunks: list[tuple[ReqState, int]] = []
        state: NodeState | None = None
        for req in list(w.borrowed):
            if budget <= 0:
                break
            if not req.started:
                blocked = borrowed_start_blocked(
                    waiting_to_join=len(w.waiting),
                    waiting_for_kv=len(w.prealloc),
                    retracted=len(w.retracted),
                    running=len(w.running),
                    max_running=cfg.max_running_requests,
                )
                if blocked is not None:
                    break
                state = state or self._node_state(w)
                verdict = self.scheduler.on_task_arrival(req.reservation, state, self.now_s)
                if verdict == "pause":
                    break
                if verdict == "fallback":
                    w.borrowed.remove(req)
                    self._fallback(req)
                    continue
                local = min(w.cache.match_tokens(req.rid, touch=True), req.input - 1) if w.cache else 0
                if not self._kv_fits(w, req.input - local, exclude_reservation=req.reservation):
                    break
                if not self.scheduler.on_task_started(req.reservation, self.now_s):
                    w.borrowed.remove(req)
                    self._fallback(req)
                    continue
                self._start_on_node(w, req, local, min(local + req.pull, req.input - 1))
                state = None
            take = min(req.input - req.done, budget)
            chunks.append((req, take))
            budget -= take
        spent = sum(take for _, take in chunks)
        if spent:
            w.bucket.spend(spent, self.now_s)
        return chunks

    def _take_local_chunks(self, w: DecodeWorker) -> list[tuple[ReqState, int]]:
        """Chunks of unleased (``local``) prefill to mix into this iteration: FCFS up to the path
        policy's chunk size, nothing paid from the token bucket. A request not yet started waits, as a
        borrowed one does, while decode requests wait for the node, or until its KV fits."""
        if not w.local or self.scheduler is None:
            return []
        budget = self.scheduler.local_chunk_tokens(w.idx)
        chunks: list[tuple[ReqState, int]] = []
        for req in w.local:
            if budget <= 0:
                break
            if not req.started:
                full = len(w.running) >= self.config.max_running_requests
                if w.waiting or w.prealloc or w.retracted or full:
                    break
                local = min(w.cache.match_tokens(req.rid, touch=True), req.input - 1) if w.cache else 0
                if not self._kv_fits(w, req.input - local):
                    break
                self._start_on_node(w, req, local, local)
            take = min(req.input - req.done, budget)
            chunks.append((req, take))
            budget -= take
        return chunks

    @staticmethod
    def _start_on_node(w: DecodeWorker, req: ReqState, local_cached: int, cached: int) -> None:
        """``req`` starts prefilling on decode node ``w``: it allocates KV for what the node does not
        cache (``local_cached``) and computes from ``cached`` (its cache hit plus any pulled prefix)."""
        req.started = True
        req.cached = cached
        req.done = cached
        req.context = req.input
        req.kv_held = req.input - local_cached
        w.kv_used += req.kv_held
        w.n_active += 1
        req.has_kv = True

    @staticmethod
    def _drop_started_borrowed(w: DecodeWorker, req: ReqState) -> None:
        """Undo ``_start_on_node`` for a borrowed prefill aborted before its first token (its node's
        lease ran out under it: ``serving.node_leases.WireLeases``): its KV goes back to the node."""
        Simulator._give_back_kv(w, req)
        req.done = req.cached = 0
        req.started = req.has_kv = False

    @staticmethod
    def _give_back_kv(w: DecodeWorker, req: ReqState) -> None:
        """``req`` no longer holds KV on decode worker ``w`` (nor counts as active there)."""
        w.kv_used -= req.kv_held
        w.n_active -= 1
        req.kv_held = 0
        req.context = 0

    @staticmethod
    def _borrowed_remaining(w: DecodeWorker) -> int:
        """Borrowed prefill tokens still to compute on ``w`` (a pulled prefix is not computed)."""
        return sum(r.input - r.done if r.started else r.input - min(r.pull, r.input - 1) for r in w.borrowed)

    def _min_chunk_tokens(self, w: DecodeWorker) -> int:
        return min_borrowed_chunk_tokens(w.bucket, self.config.page_tokens)

    def _wake_when_credit(self, w: DecodeWorker) -> None:
        """An idle node with borrowed work but too little credit starts again once it has a chunk's
        (with enough credit it is waiting for something else, and that event restarts it)."""
        if w.wake_pending or not w.borrowed:
            return
        tokens = min(self._borrowed_remaining(w), self._min_chunk_tokens(w))
        wait_s = w.bucket.seconds_until(tokens, self.now_s)
        if 0.0 < wait_s < math.inf:
            w.wake_pending = True
            self._push(max(self.now_s + wait_s, math.nextafter(self.now_s, math.inf)), _EV_WAKE, w.idx, 0)

    def _decode_linear(self, batch: int) -> tuple[float, float]:
        """``(fixed_s, per_context_token_s)`` of a decode-only iteration of ``batch`` requests: its time
        is ``fixed_s + context_tokens * per_context_token_s`` (the cost model is linear in context)."""
        terms = self._decode_terms.get(batch)
        if terms is None:
            fixed = self.cm.iteration_time_s((), batch, 0)
            per_ctx = self.cm.iteration_time_s((), batch, 1_000_000) - fixed
            terms = self._decode_terms[batch] = (fixed, per_ctx / 1_000_000)
        return terms

    def _start_decode_iteration(self, w: DecodeWorker) -> None:
        cfg = self.config
        if w.waiting or w.retracted:
            self._admit(w)
        running = w.running
        while True:
            # Every decoding request grows by one token per iteration (those recomputing their
            # context prefill it first); retract until that fits.
            batch = ctx = 0
            prefill: list[tuple[ReqState, int]] = []
            for r in running:
                if r.needs_recompute:
                    prefill.append((r, r.context))
                else:
                    batch += 1
                    ctx += r.context
            if not batch or self._make_room(w, batch):
                break
            self._retract(w)
        growing = batch
        fixed_s, per_ctx_s = self._decode_linear(batch) if batch else (0.0, 0.0)
        decode_step = fixed_s + ctx * per_ctx_s if batch else 0.0
        if w.borrowed:
            prefill.extend(self._take_borrowed_chunks(w, batch, ctx))
        if w.local:
            prefill.extend(self._take_local_chunks(w))
        if batch == 0 and not prefill:
            w.busy = False
            self._wake_when_credit(w)
            return
        k = 1
        # Borrowed work that waits only for credit (nothing else about the node changes until an event
        # cuts the jump) lets decode iterations run as a jump up to the first start with enough credit.
        lending = bool(w.borrowed) and w.bucket.rate_tokens_per_s > 0
        credit_wait = not prefill and lending and self._credit_short(w)
        if not prefill and (credit_wait or not lending):
            k = min(cfg.max_decode_jump_iters, min([r.output - r.generated for r in running]))
            k = max(1, min(k, (w.capacity_tokens - w.kv_used) // growing))
        times: list[float] | np.ndarray
        ends: list[float] | np.ndarray
        ascending = False
        if prefill:
            chunks = [(take, 0 if req.needs_recompute else req.done) for req, take in prefill]
            t = self.cm.iteration_time_s(chunks, batch, ctx)
            times, ends = [t], [self.now_s + t]
        elif k == 1:
            times, ends = [decode_step], [self.now_s + decode_step]
        else:  # k identical iterations: exactly the times and clock that k single events would give
            # each iteration's context: exact integers in floats (ctx + i * batch), then its time
            times = np.arange(ctx, ctx + k * batch, batch, dtype=np.float64)
            times *= per_ctx_s
            times += fixed_s
            ends = np.add.accumulate(np.concatenate(([self.now_s], times)))[1:]
            ascending = per_ctx_s >= 0  # rounding is monotone: exact integers times a factor >= 0
            if credit_wait:
                j = self._credit_iterations(w, ends)
                times, ends = times[:j], ends[:j]
        w.busy = True
        w.generation += 1
        w.iter_times_s, w.iter_ends_s, w.iter_applied = times, ends, 0
        w.iter_ns = None
        w.iter_ascending = ascending
        w.iter_decode_only_s = decode_step
        w.iter_prefill = prefill
        w.iter_credit_wait = credit_wait
        self._push(float(ends[-1]), _EV_DECODE, w.idx, w.generation)

    def _credit_need(self, w: DecodeWorker) -> int:
        """Credit the node's borrowed work needs before an iteration takes a chunk of it (see
        ``policies.admission.borrowed_chunk_tokens``)."""
        return min(self._min_chunk_tokens(w), self._borrowed_remaining(w))

    def _credit_short(self, w: DecodeWorker) -> bool:
        """Whether borrowed work on ``w`` took no chunk now only for lack of credit."""
        need = self._credit_need(w)
        available = min(w.bucket.available_tokens(self.now_s), self.config.prefill_chunk_tokens)
        return 0 < need and available < need

    def _credit_iterations(self, w: DecodeWorker, ends: np.ndarray) -> int:
        """Iterations of a credit-waiting jump with ``ends``: up to (including) the one at whose end the
        bucket, advanced at every iteration end as single iterations advance it, first holds a chunk."""
        bucket = copy.copy(w.bucket)
        need, chunk = self._credit_need(w), self.config.prefill_chunk_tokens
        for i in range(len(ends) - 1):
            if min(bucket.available_tokens(float(ends[i])), chunk) >= need:
                return i + 1
        return len(ends)

    def _on_decode_done(self, idx: int, generation: int) -> None:
        w = self.decode[idx]
        if generation != w.generation:
            return  # superseded by a cut jump
        if w.iter_prefill:
            self._on_mixed_done(w)
        else:
            self._apply_decode(w, len(w.iter_ends_s))
        if self.listener is not None:
            self.listener.on_decode_iteration(w)
        finished = [r for r in w.running if not r.needs_recompute and r.generated >= r.output]
        for req in finished:
            self._finish(w, req)
        if w.prealloc:
            self._try_prealloc(w)
        self._start_decode_iteration(w)

    def _on_mixed_done(self, w: DecodeWorker) -> None:
        """One iteration that mixed prefill (recomputed contexts, borrowed chunks) into decode."""
        recomputed = {id(r) for r, _ in w.iter_prefill if r.needs_recompute}
        decoding = [r for r in w.running if id(r) not in recomputed]
        self._account(w, w.iter_times_s, [w.iter_decode_only_s], len(decoding))
        if w.step_log is not None:
            w.step_log.add(self.now_s, to_ns(float(w.iter_times_s[0])), to_ns(float(w.iter_decode_only_s)))
        if len(recomputed) < len(w.iter_prefill):  # borrowed or local prefill, not only re-prefill
            w.mixed_decode_tokens_total += len(decoding)
        for req in decoding:
            w.kv_used += 1
            req.kv_held += 1
            req.context += 1
            req.generated += 1
            req.last_token_s = self.now_s
        self.counters.output_tokens += len(decoding)
        for req, take in w.iter_prefill:
            if req.needs_recompute:
                req.needs_recompute = False
                w.itl.add(self.now_s - req.last_token_s, 1)
                req.last_token_s = self.now_s
                continue
            req.done += take
            self.counters.prefill_tokens += take
            if req.path == LOCAL:
                self.counters.local_prefill_tokens += take
            else:
                w.borrowed_tokens_total += take
                self.counters.borrowed_prefill_tokens += take
            if req.done >= req.input:
                self._borrowed_prefill_done(w, req)
        w.iter_prefill = []

    def _borrowed_prefill_done(self, w: DecodeWorker, req: ReqState) -> None:
        """A borrowed or local prefill on ``w`` finished: first token, then it decodes here."""
        if req.path == LOCAL:
            w.local.remove(req)
        else:
            w.borrowed.remove(req)
            if self.scheduler is not None:
                self.scheduler.on_prefill_done(req.reservation)
        self._emit_first_token(req)
        if req.generated >= req.output:
            self._finish(w, req)
            return
        if len(w.running) < self.config.max_running_requests:
            w.running.append(req)
        else:
            w.waiting.appendleft(req)

    def _reject(self, req: ReqState, reason: str, *, shed: bool = False) -> None:
        """Refuse a request with a reason (as the server would); its session carries on. ``shed``: by
        admission control (counted in ``Counters.shed``, an SLO miss, not a rejection)."""
        req.error = reason
        self.finished += 1
        if shed:
            self.counters.shed += 1
        else:
            self.counters.rejected += 1
        if self.listener is not None:
            self.listener.on_reject(req)
        self._release_children(req)

    def _release_children(self, req: ReqState) -> None:
        for child in self._children.get(req.rid, ()):
            think = max(0.0, self.trace.requests[child].think_time_s)
            self._push(self.now_s + think, _EV_RELEASE, child, 0)

    def _finish(self, w: DecodeWorker, req: ReqState) -> None:
        req.finish_s = self.now_s
        if req in w.running:  # a borrowed one-token request finishes straight from its prefill
            w.running.remove(req)
        self._give_back_kv(w, req)
        if w.cache is not None:
            w.cache.insert(req.rid)
            self._make_room(w, 0)
        if req.path == BORROWED and self.scheduler is not None:
            self.scheduler.on_request_finished(req.reservation)
        self.decode_pool.finished(w.idx)
        self.finished += 1
        self.counters.finished += 1
        if self.listener is not None:
            self.listener.on_finish(req)
        self._release_children(req)
        if w.prealloc:
            self._try_prealloc(w)

    # ---------------------------------------------------------------- control interval
    def _prealloc_waiting(self) -> dict[int, tuple[int, int]]:
        """Per decode worker: KV pre-allocated there for requests still on a prefill worker's queue
        (not decoding yet), and those requests' output tokens."""
        out: dict[int, tuple[int, int]] = {}
        for pw in self.prefill:
            for r in pw.queue:
                if r.bootstrapped:
                    kv, output = out.get(r.decode_worker, (0, 0))
                    out[r.decode_worker] = (kv + r.kv_held, output + r.output)
        return out

    def _node_state(self, w: DecodeWorker, waiting: dict[int, tuple[int, int]] | None = None) -> NodeState:
        """``w``'s state now (``waiting``: ``_prealloc_waiting()`` when the caller has it for every node)."""
        self._sync(w)
        if waiting is None:
            waiting = self._prealloc_waiting()
        waiting_kv, waiting_output = waiting.get(w.idx, (0, 0))
        contexts = [r.context for r in w.running if not r.needs_recompute]
        n = len(contexts)
        if n:
            remaining = [r.output - r.generated for r in w.running if not r.needs_recompute]
            ctx_mean = sum(contexts) / n
            ctx_std = math.sqrt(max(0.0, sum(c * c for c in contexts) / n - ctx_mean * ctx_mean))
            rem = sum(remaining) / n
            rem_max, rem_weighted = drain_features(contexts, remaining)
            decode_only = self.cm.iteration_time_s((), n, int(ctx_mean * n))
        else:
            ctx_mean = ctx_std = rem = rem_max = rem_weighted = decode_only = 0.0
        steps = w.step_count
        borrowed, local = w.borrowed, w.local
        return NodeState(
            node_id=w.idx,
            time_s=self.now_s,
            decode_batch_size=n,
            context_tokens_mean=ctx_mean,
            context_tokens_std=ctx_std,
            remaining_output_tokens_mean=float(rem),
            kv_capacity_tokens=w.capacity_tokens,
            kv_used_tokens=w.kv_used,
            kv_reserved_tokens=self.config.num_reserved_decode_tokens * w.n_active,
            queued_decode_requests=len(w.waiting) + len(w.prealloc) + len(w.retracted),
            borrowed_tasks=len(borrowed),
            borrowed_prefill_tokens_queued=sum(r.input - r.done for r in borrowed) if borrowed else 0,
            local_tasks=len(local),
            local_prefill_tokens_queued=sum(r.input - r.done for r in local) if local else 0,
            recent_step_time_s=w.step_time_ns * 1e-9 / steps if steps else 0.0,
            decode_only_step_time_s=decode_only,
            recent_decode_only_step_time_s=w.decode_only_ns * 1e-9 / steps if steps else 0.0,
            decode_tokens_total=w.decode_tokens_total,
            mixed_decode_tokens_total=w.mixed_decode_tokens_total,
            max_running_requests=self.config.max_running_requests,
            kv_prealloc_waiting_tokens=waiting_kv,
            prealloc_waiting_output_tokens=waiting_output,
            remaining_output_tokens_max=rem_max,
            remaining_output_tokens_context_weighted=rem_weighted,
        )

    def node_states(self) -> list[NodeState]:
        """Every decode node's state now (what the scheduler sees each control interval)."""
        waiting = self._prealloc_waiting()
        return [self._node_state(w, waiting) for w in self.decode]

    def _tick_states(self) -> list[NodeState]:
        """``node_states()`` for a control interval. For a scheduler that ``accepts_unchanged_states``,
        an idle node (no running request, no iteration in flight, no borrowed or local work) whose
        state would be built from the same numbers as at an earlier interval (KV, queues, the
        interval's step counters, token totals, pre-allocated KV waiting) is handed that interval's
        ``NodeState`` object again: equal apart from its ``time_s``, which the scheduler never reads."""
        accepts = self._accepts_unchanged
        if accepts is None or not accepts():
            return self.node_states()
        waiting = self._prealloc_waiting()
        states = []
        for w in self.decode:
            if w.running or w.busy or w.borrowed or w.local:
                w.tick_state = None
                states.append(self._node_state(w, waiting))
                continue
            kv, output = waiting.get(w.idx, (0, 0))
            key = (
                w.kv_used,
                w.n_active,
                len(w.waiting),
                len(w.prealloc),
                len(w.retracted),
                w.step_count,
                w.step_time_ns,
                w.decode_only_ns,
                w.decode_tokens_total,
                w.mixed_decode_tokens_total,
                kv,
                output,
                w.capacity_tokens,
            )
            last = w.tick_state
            if last is not None and last[0] == key:
                states.append(last[1])
                continue
            state = self._node_state(w, waiting)
            w.tick_state = (key, state)
            states.append(state)
        return states

    def fall_back_revoked(self, w: DecodeWorker, revoked: Collection[int]) -> None:
        """Send ``w``'s borrowed requests whose reservation is in ``revoked`` back to the normal path
        now, but for those in the iteration in flight (it finishes first); a node-side scheduler may
        revoke started ones."""
        running = {r.rid for r, _ in w.iter_prefill}
        for req in [r for r in w.borrowed if r.reservation in revoked and r.rid not in running]:
            w.borrowed.remove(req)
            if req.started:
                self._drop_started_borrowed(w, req)
            self._fallback(req)

    def _on_tick(self) -> None:
        """A control interval: the scheduler sees every node's state and republishes the leases.

        When no node's state can have changed since the last interval apart from its clock
        (``_states_unchanged``), a scheduler with ``replay_control_interval`` repeats that interval
        without the states being built or any policy asked (it says whether it can); what follows
        here, the token buckets, the node timeline and the idle check, runs either way."""
        assert self.scheduler is not None
        self.ticks += 1
        self.last_tick_s = self.now_s
        replay = self._replay_interval
        if self._states_unchanged and replay is not None and replay(self.now_s):
            self.ticks_replayed += 1
            revoked: set[int] = set()
        else:
            self.tick_node_states = self._tick_states()
            revoked = set(self.scheduler.on_control_interval(self.now_s, self.tick_node_states) or ())
        ran = False
        now_s, lease_rate, timeline = self.now_s, self.scheduler.lease_rate, self.node_timeline
        for w in self.decode:
            rate, expires_s = lease_rate(w.idx)
            w.bucket.set_lease(now_s, rate, expires_s)
            if revoked:
                self.fall_back_revoked(w, revoked)
            timeline.append((now_s, w.idx, rate, w.borrowed_tokens_total, len(w.running)))
            ran = ran or w.step_count > 0
            w.step_time_ns = 0
            w.decode_only_ns = 0
            w.step_count = 0
            if (w.borrowed and rate > 0) or w.local:
                self._kick_decode(w)
        reconsiders = self.scheduler.reconsiders_waiting
        if reconsiders:
            self._reconsider_waiting()
        # The next interval sees these states again (its recent step times are zero as these were).
        self._states_unchanged = (
            not ran
            and not revoked
            and not reconsiders
            and self.listener is None
            and all(not w.busy and not w.borrowed and not w.local for w in self.decode)
        )
        # An idle cluster needs no control ticks: the next arrival restarts them.
        idle = all(
            not w.busy and not w.borrowed and not w.local and not w.waiting and not w.retracted
            for w in self.decode
        ) and all(not pw.busy for pw in self.prefill)
        if self.finished < len(self.reqs) and not idle:
            self._push(self.now_s + self.config.control_interval_s, _EV_TICK, 0, 0)
        else:
            self._tick_pending = False

    # ---------------------------------------------------------------- result
    def granted_prefill_tokens(self) -> list[float]:
        """Prefill tokens each decode node's leases granted so far (0 without a scheduler)."""
        if self.scheduler is None:
            return [0.0] * len(self.decode)
        return [self.scheduler.granted_prefill_tokens(w.idx, self.now_s) for w in self.decode]

    def result(self) -> SimResult:
        self._event_kind = _EV_TICK  # iterations ending at the stop time count as done
        for w in self.decode:
            self._sync(w)
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


__all__ = ["Counters", "SchedulerHooks", "SimListener", "Simulator", "simulate"]
