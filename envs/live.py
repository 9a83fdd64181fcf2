"""A live emulated PD cluster: one :class:`~envs.simulator.Simulator` advanced in scaled wall time.

Requests are not read from a trace: they arrive while it runs (``submit``, ``submit_borrowed``),
already placed on a prefill and a decode worker by a router outside it, and what the simulator
produces is handed back as it happens (first token, every later token, the prefill worker's end of
its KV transfer, the finish, a refusal). Nothing about batching, caching, admission or decoding is
implemented here: the simulator's own workers and cost model do it, exactly as for a trace.

* **Clock.** Emulated time is ``(wall - start) / time_scale``: an iteration the cost model times at
  ``t`` seconds takes ``t x time_scale`` wall seconds. The driver (``run``) processes every event when
  its wall time comes and sleeps until the next one; a request submitted in between is injected at the
  current emulated instant. With a scheduler its control ticks start with the cluster (a node-side
  policy publishes its leases before the first request, as a running node's would). Decode
  iterations are simulated one event each (``max_decode_jump_iters=1``, which gives bit-identical
  results to any jump cap), so every token is delivered at its own iteration's end.
* **Lag.** Each worker records, at every iteration end, how late the driver processed it
  (wall time now minus the iteration's scheduled wall time), and a 50 ms ticker records how late the
  event loop wakes (HTTP handling and arrivals share that loop). A lag beyond ``LAG_LIMIT_SHARE`` of a
  run's wall duration means the host could not keep the emulation's schedule, so its figures are not
  trustworthy (``lag_check``); a larger ``time_scale`` fixes it.
* **Prefix identity.** A live request has token ids, not a trace parent. ``PrefixResolver`` hashes
  them in chained pages of ``page_tokens`` and names the most recent earlier request that holds the
  longest matched run as its ``parent_id`` (the trace loaders' rule for block hashes), so the
  simulator's prefix caches see the sharing.

All methods run on the event loop that runs ``run()`` (one thread).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.request import Request, Trace
from envs.sim_state import FALLBACK, DecodeWorker, PrefillWorker, ReqState, StepWindow
from envs.simulator import SchedulerHooks, Simulator
from envs.trace_formats import _prefix_fields, _PrefixIndex
from policies.chunk_limits import ChunkLimits
from policies.lease import LeaseBudgets
from policies.node_policies import DecodePressureRule
from policies.node_state import NodeState

LAG_LIMIT_SHARE = 0.05
"""A run whose largest lag exceeds this share of its wall duration fails its lag check."""

_LAG_BUCKETS_KEPT = 86_400
"""Per-second lag buckets kept per worker (one day), for lag reports over a window."""


class PrefixResolver:
    """Token ids -> ``(parent_id, shared_prefix_tokens)`` against every request seen so far.

    Pages of ``page_tokens`` ids are hashed in a chain (a page's hash covers its whole prefix), so
    the longest run of leading pages already seen is found by binary search, and the most recent
    request that held its last page shares all of it (``envs.trace_formats``' rule for block ids). A
    trailing partial page is hashed too, so identical prompts share their whole length.
    """

    def __init__(self, page_tokens: int) -> None:
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        self.page_tokens = page_tokens
        self._index = _PrefixIndex()
        self._inputs: list[int] = []

    def page_hashes(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        ids = np.asarray(token_ids, dtype=np.int64)
        hashes: list[int] = []
        digest = b""
        for start in range(0, len(ids), self.page_tokens):
            digest = hashlib.blake2b(
                digest + ids[start : start + self.page_tokens].tobytes(), digest_size=8
            ).digest()
            hashes.append(int.from_bytes(digest, "little"))
        return hashes

    def resolve(self, page_hashes: Sequence[int], input_tokens: int) -> tuple[int, int]:
        """``(parent_id, shared_prefix_tokens)`` of the next request; ``(-1, 0)`` when it shares nothing."""
        return _prefix_fields(self._index, page_hashes, input_tokens, self._inputs, self.page_tokens)

    def add(self, page_hashes: Sequence[int], request_id: int, input_tokens: int) -> None:
        """Record request ``request_id`` (ids consecutive from 0)."""
        if request_id != len(self._inputs):
            raise ValueError(f"request_id must be {len(self._inputs)} (the next id), got {request_id}")
        self._index.add(page_hashes, request_id)
        self._inputs.append(input_tokens)


@dataclass
class LagStats:
    """How late one worker's iterations were processed, in wall seconds."""

    count: int = 0
    sum_s: float = 0.0
    max_s: float = 0.0
    first_unix_s: float | None = None
    last_unix_s: float | None = None
    _by_second: OrderedDict[int, tuple[float, float, int]] = field(default_factory=OrderedDict, repr=False)
    """Unix second -> (max, sum, count) of the lags recorded in it (the last day)."""

    def record(self, lag_s: float, unix_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self.count += 1
        self.sum_s += lag_s
        self.max_s = max(self.max_s, lag_s)
        if self.first_unix_s is None:
            self.first_unix_s = unix_s
        self.last_unix_s = unix_s
        second = int(unix_s)
        hi, total, n = self._by_second.get(second, (0.0, 0.0, 0))
        self._by_second[second] = (max(hi, lag_s), total + lag_s, n + 1)
        if len(self._by_second) > _LAG_BUCKETS_KEPT:
            self._by_second.popitem(last=False)

    def report(self, since_unix_s: float | None = None) -> dict[str, Any]:
        """``max_s``, ``mean_s`` and ``iterations`` since the start, or over the whole seconds from
        ``since_unix_s`` on (the second that holds it included: never less than the truth)."""
        if since_unix_s is None:
            hi, total, n = self.max_s, self.sum_s, self.count
        else:
            hi, total, n = 0.0, 0.0, 0
            first = int(since_unix_s)
            for second, (b_hi, b_sum, b_n) in reversed(self._by_second.items()):
                if second < first:
                    break
                hi, total, n = max(hi, b_hi), total + b_sum, n + b_n
        return {
            "max_s": hi,
            "mean_s": total / n if n else 0.0,
            "iterations": n,
            "first_unix_s": self.first_unix_s,
            "last_unix_s": self.last_unix_s,
        }


def lag_check(lag_max_s: float, duration_s: float, who: str = "the emulation") -> str | None:
    """None when a run of ``duration_s`` wall seconds kept its schedule; else the reason it did not
    (``who`` lagged ``lag_max_s`` behind it)."""
    if duration_s > 0 and lag_max_s > LAG_LIMIT_SHARE * duration_s:
        return (
            f"{who} lagged {lag_max_s:.3f} s behind its schedule, more than "
            f"{LAG_LIMIT_SHARE:.0%} of the {duration_s:.2f} s run: its timings are not trustworthy "
            f"(use a larger --time-scale)"
        )
    return None


class LiveRequest:
    """One request in the live cluster, as its HTTP handlers see it (read after ``await changed()``)."""

    def __init__(self, rid: int, request: Request, prefill_worker: int, decode_worker: int) -> None:
        self.rid = rid
        self.request = request
        self.prefill_worker = prefill_worker
        """-1 on the borrowed path."""
        self.decode_worker = decode_worker
        self.generated = 0
        """Tokens produced so far (what the client may be sent)."""
        self.finished = False
        self.error: tuple[int, str] | None = None
        """``(HTTP status, message)`` when the request was refused or failed."""
        self.cached_tokens = 0
        """Leading input tokens its prefill took from a prefix cache."""
        self.kv_landed = asyncio.Event()
        """Set when its KV reached the decode worker (the prefill worker's leg may answer)."""
        self._changed = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.finished or self.error is not None

    def notify(self) -> None:
        self._changed.set()

    async def changed(self) -> None:
        """Wait until new tokens, the finish or an error arrived since the last call."""
        await self._changed.wait()
        self._changed.clear()


def local_prefill_demand(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> LeaseBudgets:
    """What a borrowed prefill of this size holds on its node's lease while it runs: its uncached
    prefill, its KV (input and expected output), its expected decode work and one task slot (the
    budgets ``ClusterScheduler`` reserves for a borrow without a pulled prefix)."""
    return LeaseBudgets(
        prefill_tokens=max(1, input_tokens - cached_tokens),
        kv_tokens=input_tokens + output_tokens,
        transfer_tokens=0,
        decode_tokens=output_tokens,
        tasks=1,
    )


class LiveCluster:
    """The emulated cluster's one simulator, driven in scaled wall time (see the module docstring).

    Args:
        config: the cluster (``max_decode_jump_iters`` is set to 1; routing fields are unused: requests
            arrive placed).
        cost_model: iteration timing (default: ``config``'s GPU, model and TP).
        scheduler: the decode nodes' lease scheduler (``policies.ClusterScheduler``); without one no
            node lends, and a borrowed request is refused.
        time_scale: wall seconds per emulated second.
        stream_interval: deliver tokens every this many (SGLang ``--stream-interval``); the first and
            the last are always delivered.
    """

    def __init__(
        self,
        config: ClusterConfig,
        *,
        cost_model: CostModel | None = None,
        scheduler: SchedulerHooks | None = None,
        time_scale: float = 1.0,
        stream_interval: int = 1,
        seed: int = 0,
    ) -> None:
        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise ValueError(f"time_scale must be positive and finite, got {time_scale}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.config = config.with_(max_decode_jump_iters=1)
        self.sim = Simulator(
            Trace("live", [], source="requests received over HTTP"),
            self.config,
            scheduler=scheduler,
            cost_model=cost_model,
            seed=seed,
        )
        self.sim.listener = self
        self.sim.open_ended = True
        for w in self.sim.decode:
            w.step_log = StepWindow(self.config.control_interval_s)
        self.sim.refuse_fallbacks = True
        self.cm = self.sim.cm
        self.time_scale = time_scale
        self.stream_interval = stream_interval
        self.prefixes = PrefixResolver(self.config.page_tokens)
        self.prefill_lag = [LagStats() for _ in range(self.config.n_prefill)]
        self.decode_lag = [LagStats() for _ in range(self.config.n_decode)]
        self.loop_lag = LagStats()
        """The event loop's own delay (a 50 ms ticker), which every worker's HTTP side shares."""
        self._live: dict[int, LiveRequest] = {}
        self._prefill_tokens = [0] * self.config.n_prefill
        self._generated = [0] * self.config.n_decode
        self._t0: float | None = None
        self._wake: asyncio.Event | None = None

    # ---------------------------------------------------------------- clock
    @property
    def started(self) -> bool:
        return self._t0 is not None

    def now_s(self) -> float:
        """Emulated seconds since the cluster started."""
        if self._t0 is None:
            return 0.0
        return (time.perf_counter() - self._t0) / self.time_scale

    def _advance(self) -> None:
        """Process every event due by now; the simulator's clock is then now."""
        if self._t0 is not None:
            self.sim.step_until(self.now_s())

    async def run(self) -> None:
        """Drive the simulator until cancelled (start it as a task on the serving event loop)."""
        self._t0 = time.perf_counter()
        self._wake = asyncio.Event()
        self.sim.start_control_ticks()  # a node-side policy publishes its leases before any request
        watcher = asyncio.create_task(self._watch_loop())
        try:
            await self._drive()
        finally:
            watcher.cancel()

    async def _watch_loop(self, period_s: float = 0.05) -> None:
        """Record how late the event loop wakes a ticker: a loop busy elsewhere (or a stalled host)
        also delays the HTTP side, requests' arrivals included, even while no iteration is due."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(period_s)
            self.loop_lag.record(time.perf_counter() - start - period_s, time.time())

    async def _drive(self) -> None:
        assert self._wake is not None and self._t0 is not None
        while True:
            self._advance()
            t_next = self.sim.next_event_time_s()
            if math.isinf(t_next):
                await self._wake.wait()
            else:
                delay = self._t0 + t_next * self.time_scale - time.perf_counter()
                if delay <= 0:
                    await asyncio.sleep(0)  # let handlers run, then catch up
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
                except TimeoutError:
                    pass
            self._wake.clear()

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ---------------------------------------------------------------- intake
    def context_error(self, input_tokens: int, output_tokens: int) -> str | None:
        """SGLang's refusal for a request that does not fit the model's context (its messages), or a
        worker's KV (the simulator's rule); None when it fits."""
        window = self.config.context_window_tokens
        if input_tokens >= window:
            return (
                f"The input ({input_tokens} tokens) is longer than the model's context length "
                f"({window} tokens)."
            )
        if input_tokens + output_tokens > window:
            return (
                f"Requested token count exceeds the model's maximum context length of {window} tokens. "
                f"You requested a total of {input_tokens + output_tokens} tokens: {input_tokens} tokens "
                f"from the input messages and {output_tokens} tokens for the completion. Please reduce the "
                f"number of tokens in the input messages or the completion to fit within the limit."
            )
        return self.sim.refusal_reason(input_tokens, output_tokens)

    def submit(
        self,
        token_ids: Sequence[int] | np.ndarray,
        output_tokens: int,
        *,
        prefill_worker: int,
        decode_worker: int,
        session_id: int = -1,
    ) -> LiveRequest:
        """A request placed on ``prefill_worker`` and ``decode_worker`` (both legs of a PD dispatch
        arrived) enters now. Check ``context_error`` first."""
        return self._enter(token_ids, output_tokens, session_id, decode_worker, prefill_worker=prefill_worker)

    def reserve_borrowed(self, decode_worker: int, input_tokens: int, output_tokens: int) -> int | None:
        """Reserve room for a local (borrowed) prefill on ``decode_worker``'s current lease; the
        reservation id, or None when there is no lease or it cannot hold the request."""
        ledger = getattr(self.sim.scheduler, "ledger", None)
        if ledger is None:
            return None
        self._advance()
        reservation = ledger.reserve(
            decode_worker, local_prefill_demand(input_tokens, output_tokens), self.sim.now_s
        )
        return None if reservation is None else int(reservation.reservation_id)

    def takes_wire_leases(self) -> bool:
        """Whether the decode nodes' leases are installed from outside (``install_lease``) rather than
        published by an in-process scheduler's node policy."""
        return callable(getattr(self.sim.scheduler, "install_lease", None))

    def install_lease(
        self,
        decode_worker: int,
        budgets: LeaseBudgets,
        ttl_s: float,
        *,
        chunk_limits: ChunkLimits | None = None,
        pressure_rule: DecodePressureRule | None = None,
    ) -> list[int]:
        """Install a lease sent to ``decode_worker`` over the wire (its ``/set_internal_state``), with
        its per-iteration cap on borrowed prefill (``chunk_limits``) and the test that holds un-started
        borrowed requests back (``pressure_rule``), on a scheduler that takes them
        (``serving.node_leases.WireLeases``); the node's token bucket follows at once. Returns the
        reservations it revoked: those queued here fall back now, as the plugin aborts them with 503
        when it installs the lease. ``ValueError`` when the nodes' leases come from an in-process node
        policy."""
        if not self.takes_wire_leases():
            raise ValueError("this cluster's decode nodes take their leases from an in-process scheduler")
        self._advance()
        now = self.sim.now_s
        scheduler: Any = self.sim.scheduler
        revoked: list[int] = scheduler.install_lease(
            decode_worker, budgets, ttl_s, now, chunk_limits=chunk_limits, pressure_rule=pressure_rule
        )
        rate, expires_s = scheduler.lease_rate(decode_worker)
        w = self.sim.decode[decode_worker]
        w.bucket.set_lease(now, rate, expires_s)
        if revoked:  # the plugin aborts queued requests a revocation leaves unpaid now (503), not later
            self.sim.fall_back_revoked(w, set(revoked))
        self._kick()
        return revoked

    def submit_borrowed(
        self,
        token_ids: Sequence[int] | np.ndarray,
        output_tokens: int,
        *,
        decode_worker: int,
        reservation_id: int,
        session_id: int = -1,
    ) -> LiveRequest:
        """A request prefilled on ``decode_worker`` itself under ``reservation_id`` enters now (the
        simulator's borrowed path: paid from the node's lease token bucket, decode first)."""
        return self._enter(token_ids, output_tokens, session_id, decode_worker, reservation_id=reservation_id)

    def _enter(
        self,
        token_ids: Sequence[int] | np.ndarray,
        output_tokens: int,
        session_id: int,
        decode_worker: int,
        *,
        prefill_worker: int | None = None,
        reservation_id: int | None = None,
    ) -> LiveRequest:
        if self._t0 is None:
            raise RuntimeError("the live cluster is not running (start run() first)")
        if len(token_ids) < 1 or output_tokens < 1:
            raise ValueError("a request needs at least one input token and one output token")
        self._advance()
        rid = len(self.sim.reqs)
        hashes = self.prefixes.page_hashes(token_ids)
        parent, shared = self.prefixes.resolve(hashes, len(token_ids))
        request = Request(rid, session_id, 0, self.now_s(), len(token_ids), output_tokens, parent, shared)
        live = LiveRequest(rid, request, -1 if prefill_worker is None else prefill_worker, decode_worker)
        # registered first: a borrowed request whose reservation lapsed since it was made is refused
        # inside ``inject`` (``on_reject``), and that refusal must reach this request's handler
        self._live[rid] = live
        try:
            self.sim.inject(
                request,
                decode_worker=decode_worker,
                prefill_worker=prefill_worker,
                reservation_id=reservation_id,
            )
        except BaseException:
            self._live.pop(rid, None)
            raise
        self.prefixes.add(hashes, rid, len(token_ids))
        self._kick()
        return live

    # ---------------------------------------------------------------- the simulator's listener
    def _lag(self, stats: LagStats) -> None:
        if self._t0 is None:
            return
        stats.record(time.perf_counter() - (self._t0 + self.sim.now_s * self.time_scale), time.time())

    def _deliver(self, live: LiveRequest, generated: int) -> None:
        if generated <= live.generated:
            return
        live.generated = generated
        if generated == 1 or generated % self.stream_interval == 0 or generated >= live.request.output_tokens:
            live.notify()

    def on_first_token(self, req: ReqState) -> None:
        live = self._live.get(req.rid)
        if live is not None:
            live.cached_tokens = req.cached
            self._deliver(live, req.generated)

    def on_decode_iteration(self, w: DecodeWorker) -> None:
        self._lag(self.decode_lag[w.idx])
        live = self._live
        produced = 0
        for req in w.running:
            if req.needs_recompute:
                continue
            produced += 1
            found = live.get(req.rid)
            if found is not None:
                self._deliver(found, req.generated)
        self._generated[w.idx] += produced

    def on_prefill_iteration(self, pw: PrefillWorker) -> None:
        self._lag(self.prefill_lag[pw.idx])
        self._prefill_tokens[pw.idx] += sum(take for _, take in pw.batch)

    def on_kv_landed(self, req: ReqState) -> None:
        live = self._live.get(req.rid)
        if live is not None:
            live.cached_tokens = req.cached
            live.kv_landed.set()

    def on_finish(self, req: ReqState) -> None:
        live = self._live.pop(req.rid, None)
        if live is not None:
            live.generated = req.generated
            live.finished = True
            live.kv_landed.set()
            live.notify()

    def on_reject(self, req: ReqState) -> None:
        live = self._live.pop(req.rid, None)
        if live is not None:
            live.error = (503 if req.path == FALLBACK else 400, req.error)
            live.kv_landed.set()
            live.notify()

    # ---------------------------------------------------------------- what the workers report
    def in_flight(self) -> int:
        """Requests submitted and not yet finished or refused."""
        return len(self._live)

    def lag_report(self, role: str, idx: int, since_unix_s: float | None = None) -> dict[str, Any]:
        """One worker's lag since the start, or from ``since_unix_s`` on: ``max_s`` is the larger of
        its iterations' lag (``iteration_max_s``, ``mean_s`` and ``iterations`` describe those) and
        the event loop's (``loop_max_s``); ``duration_s`` is the wall time the window covers, and
        ``check`` is None or why that run did not keep its schedule."""
        stats = (self.prefill_lag if role == "prefill" else self.decode_lag)[idx]
        report = stats.report(since_unix_s)
        loop = self.loop_lag.report(since_unix_s)
        report["iteration_max_s"] = report["max_s"]
        report["loop_max_s"] = loop["max_s"]
        report["max_s"] = max(report["max_s"], loop["max_s"])
        firsts = [t for t in (report["first_unix_s"], loop["first_unix_s"]) if t is not None]
        ends = [t for t in (report["last_unix_s"], loop["last_unix_s"]) if t is not None]
        start = since_unix_s if since_unix_s is not None else min(firsts, default=None)
        report["duration_s"] = max(0.0, max(ends) - start) if start is not None and ends else 0.0
        report["check"] = lag_check(report["max_s"], report["duration_s"])
        return report

    def load(self, role: str, idx: int) -> WorkerLoad:
        """What worker ``idx`` of ``role`` (``"prefill"`` or ``"decode"``) holds now, in the terms of
        SGLang's load snapshot (``/v1/loads``): a prefill worker's requests wait for their decode
        worker's pre-allocation (bootstrap), for the prefill, or for their KV transfer (in flight); a
        decode worker's wait for KV room (pre-allocation), for their KV (transfer), for a running slot
        (waiting) or to resume after a retraction."""
        self._advance()
        if role == "prefill":
            pw = self.sim.prefill[idx]
            in_batch = {id(r) for r, _ in pw.batch}
            queued = [r for r in pw.queue if id(r) not in in_batch]
            waiting = [r for r in queued if r.bootstrapped]
            bootstrap = [r for r in queued if not r.bootstrapped]
            inflight = sum(
                1 for live in self._live.values() if live.prefill_worker == idx and self._transferring(live)
            )
            return WorkerLoad(
                role="prefill",
                running=len(pw.batch),
                waiting=len(waiting),
                bootstrap=len(bootstrap),
                inflight=inflight,
                used_tokens=sum(r.done for r in pw.queue if r.started),
                pending_tokens=sum(r.input for r in queued),
                uncached_waiting_tokens=pw.queued_tokens,
                capacity_tokens=self.cm.kv_capacity_tokens,
                busy_s=pw.busy_s,
                prefill_tokens_total=self._prefill_tokens[idx],
            )
        if role != "decode":
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        w = self.sim.decode[idx]  # one event per iteration: its state is current
        transfer = [
            self.sim.reqs[live.rid]
            for live in self._live.values()
            if live.decode_worker == idx
            and live.prefill_worker >= 0
            and not live.kv_landed.is_set()
            and self.sim.reqs[live.rid].bootstrapped
        ]
        return WorkerLoad(
            role="decode",
            running=len(w.running),
            waiting=len(w.waiting),
            prealloc=len(w.prealloc),
            transfer=len(transfer),
            retracted=len(w.retracted),
            borrowed=len(w.borrowed),
            used_tokens=w.kv_used,
            pending_tokens=sum(r.input for r in w.prealloc) + w.retracted_tokens,
            awaiting_kv_tokens=sum(r.input for r in w.prealloc) + sum(r.input for r in transfer),
            capacity_tokens=w.capacity_tokens,
            busy_s=w.busy_ns * 1e-9,
            prefill_tokens_total=w.borrowed_tokens_total,
            generated_tokens_total=self._generated[idx],
            context_tokens=sum(r.context for r in w.running if not r.needs_recompute),
        )

    def node_state(self, idx: int) -> NodeState:
        """Decode worker ``idx``'s ``NodeState`` now: what the SGLang plugin reports in
        ``/server_info`` on a real worker. Its recent step times are over the iterations that ended
        in the control interval ending now (``StepWindow``, as the plugin's trailing window), as a
        simulator tick reads them over the interval ending at the tick; so a router whose control
        grid runs at another phase than this cluster's own ticks reads what its simulator would."""
        self._advance()
        sim = self.sim
        w = sim.decode[idx]
        state = sim._node_state(w)  # applies the iterations finished by now first
        assert w.step_log is not None
        recent_s, decode_only_s = w.step_log.read(sim.now_s)
        return replace(state, recent_step_time_s=recent_s, recent_decode_only_step_time_s=decode_only_s)

    def prefill_started(self, live: LiveRequest) -> bool:
        """Whether ``live``'s prefill has begun (a borrowed one: the node started it and committed its
        reservation, ``on_task_started``)."""
        return bool(self.sim.reqs[live.rid].started)

    def _transferring(self, live: LiveRequest) -> bool:
        req = self.sim.reqs[live.rid]
        return req.started and req.done >= req.input and not live.kv_landed.is_set()

    def flush_cache(self, role: str, idx: int) -> bool:
        """Empty worker ``idx``'s prefix cache (SGLang ``/flush_cache``); False (nothing done) while it
        holds requests."""
        self._advance()
        if role == "prefill":
            pw = self.sim.prefill[idx]
            if pw.queue or pw.batch:
                return False
            cache = pw.cache
        else:
            w = self.sim.decode[idx]
            if w.running or w.waiting or w.prealloc or w.retracted or w.borrowed:
                return False
            if w.cache is None:
                return True
            cache = w.cache
        capacity = cache.capacity_pages
        cache.evict_to(0)
        cache.capacity_pages = capacity
        return True


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's queues and KV now (see ``LiveCluster.load``); counts of requests unless named."""

    role: str
    running: int
    """In the iteration in flight (prefill) or the running batch (decode)."""
    waiting: int
    """SGLang's waiting queue: ready to run, not running."""
    used_tokens: int
    """KV allocated to requests."""
    capacity_tokens: int
    busy_s: float
    """Emulated seconds spent iterating."""
    prefill_tokens_total: int
    """Prompt tokens computed here so far (a decode worker: borrowed prefill)."""
    bootstrap: int = 0
    """Prefill: waiting for the decode worker's pre-allocation."""
    inflight: int = 0
    """Prefill: computed, KV transfer not finished."""
    prealloc: int = 0
    """Decode: waiting for KV room."""
    transfer: int = 0
    """Decode: KV allocated, transfer not finished."""
    retracted: int = 0
    borrowed: int = 0
    """Decode: borrowed prefills queued or running."""
    pending_tokens: int = 0
    """Tokens of queued requests that hold no KV here yet."""
    awaiting_kv_tokens: int = 0
    """Decode: input tokens whose KV has not arrived."""
    uncached_waiting_tokens: int = 0
    generated_tokens_total: int = 0
    context_tokens: int = 0
    """Decode: KV context the running batch reads."""

    @property
    def waiting_requests(self) -> int:
        """SGLang's ``num_waiting_reqs``: every queue but the running one and the prefill's in-flight
        transfers."""
        return self.waiting + self.bootstrap + self.prealloc + self.transfer + self.retracted

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.capacity_tokens if self.capacity_tokens else 0.0


__all__ = [
    "LAG_LIMIT_SHARE",
    "LagStats",
    "LiveCluster",
    "LiveRequest",
    "PrefixResolver",
    "WorkerLoad",
    "lag_check",
    "local_prefill_demand",
]
