"""The cluster scheduler: publishes leases each control interval and asks its path policy for each
request's path.

One object, used unchanged by the simulator and the HTTP router. Leases come from the node policies;
the path (normal, borrow on a lease, or local without one) from the path policy (``policies.path``;
Crossflow's is ``policies.lease_path.LeasePath``). Its life cycle per borrowed request::

    choose_path ─(borrow: reservation made)─► on_task_arrival ─"run"─► on_task_started (commit)
                                               │  "pause": retry later     ─► on_prefill_done
                                               └─ "fallback": normal path     (frees prefill, transfer,
                                                  (call on_fallback)           task budgets)
                                                                             ─► on_request_finished
                                                                                (frees KV, decode work)

KV and decode-work budgets stay held until the request finishes because the borrowed request keeps
decoding on the lending node; compute, transfer and the task slot are spent once its prefill is done.

Decode priority: on every control interval a node whose policy proposes zero gets its lease revoked
to zero at once; its un-started reservations are revoked (returned to the caller, which falls back),
committed ones keep running. Between intervals, ``on_task_arrival`` re-checks the node and pauses a
not-yet-started borrowed prefill under decode pressure.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import fields
from operator import attrgetter
from typing import Any, Literal

from policies.chunk_limits import ChunkLimits
from policies.context import CostEstimator
from policies.lease import LeaseBudgets
from policies.ledger import LeaseLedger
from policies.node_policies import DecodePressureRule, NodePolicy
from policies.node_state import NodeState
from policies.path import PathDecision, PathPolicy, PathQuery, observes_only_states
from policies.slo import DEFAULT_CONTROL_INTERVAL_S

_STATE_KEY = attrgetter(*(f.name for f in fields(NodeState) if f.name != "time_s"))
"""A node state's fields apart from its clock, as a tuple (what a node policy may read)."""


def _by_node_id(states: Sequence[NodeState]) -> Sequence[NodeState]:
    """``states`` in node-id order (as given when they already are: every reporter lists them so)."""
    ids = [s.node_id for s in states]
    if all(a < b for a, b in itertools.pairwise(ids)):
        return states
    return sorted(states, key=lambda s: s.node_id)


def _has_pressure_rule(policy: NodePolicy) -> bool:
    """Whether ``policy`` says why decode needs the node (``decode_pressure``); without one a zero
    proposal is the pressure (``ClusterScheduler._decode_pressure``)."""
    return getattr(policy, "decode_pressure", None) is not None


ArrivalVerdict = Literal["run", "pause", "fallback"]
CHUNK_CONTEXT_BUCKET_TOKENS = 1024
"""Borrowed chunks are sized for the decode batch's mean context rounded up to a multiple of this."""


class ClusterScheduler:
    """Lease publication and per-request path choice (see the module docstring).

    Args:
        policy: one node policy for every node, or ``{node_id: policy}``.
        ledger: the lease ledger (shared with whoever commits/releases).
        cost: prefill and KV-transfer timing (the cost model).
        path: the path policy (``policies.path``); default Crossflow's ``LeasePath`` with
            ``congestion_wait_s`` and ``borrow_margin`` (pass those only without ``path``).
        control_interval_s: how often ``on_control_interval`` is called; every policy's ``ttl_s`` must
            be at least this, or leases would lapse between intervals.
        congestion_wait_s, borrow_margin: the default path policy's (``policies.lease_path``).
        itl_guard: the ITL guard. ``"slo"`` (default): each node against its policy's absolute ITL
            budget (``itl_budget_s``, a share of the TPOT SLO, ``policies.slo``): while the node's
            recent mean step exceeds the budget its new leases' prefill budget is halved each
            interval, below it the node's scale recovers by 0.1 per interval (a node whose policy has
            no budget is not guarded). A number ``>= 1``: the older relative guard, a cap on the
            decode pool's ITL inflation ``sum(batch x recent step) / sum(batch x decode-only step)``
            (smoothed over intervals) acting on every lease at once the same way. ``None``: off.
        max_records: decision/event records kept (oldest dropped first).
    """

    def __init__(
        self,
        policy: NodePolicy | Mapping[int, NodePolicy],
        ledger: LeaseLedger,
        cost: CostEstimator,
        *,
        path: PathPolicy | None = None,
        control_interval_s: float = DEFAULT_CONTROL_INTERVAL_S,
        congestion_wait_s: float | None = None,
        borrow_margin: float | None = None,
        itl_guard: float | Literal["slo"] | None = "slo",
        max_records: int = 10_000,
    ) -> None:
        if not control_interval_s > 0:
            raise ValueError(f"control_interval_s must be > 0, got {control_interval_s!r}")
        if path is None:
            from policies.lease_path import DEFAULT_BORROW_MARGIN, DEFAULT_CONGESTION_WAIT_S, LeasePath

            path = LeasePath(
                cost,
                congestion_wait_s=DEFAULT_CONGESTION_WAIT_S
                if congestion_wait_s is None
                else congestion_wait_s,
                borrow_margin=DEFAULT_BORROW_MARGIN if borrow_margin is None else borrow_margin,
            )
        elif congestion_wait_s is not None or borrow_margin is not None:
            raise ValueError("congestion_wait_s and borrow_margin belong to the path policy; pass them to it")
        if (
            itl_guard is not None
            and itl_guard != "slo"
            and not (isinstance(itl_guard, int | float) and itl_guard >= 1.0)
        ):
            raise ValueError(
                f"itl_guard must be 'slo', a ratio of step times >= 1, or None, got {itl_guard!r}"
            )
        policies = policy.values() if isinstance(policy, Mapping) else [policy]
        for p in policies:
            if p.ttl_s < control_interval_s:
                raise ValueError(
                    f"policy {type(p).__name__} ttl_s={p.ttl_s} is shorter than control_interval_s="
                    f"{control_interval_s}; leases would lapse between intervals"
                )
        self._policy = policy
        self._policy_by_node: Mapping[int, NodePolicy] = policy if isinstance(policy, Mapping) else {}
        self._single_policy: NodePolicy | None = None if isinstance(policy, Mapping) else policy
        """The policy of every node, or None with per-node policies (told apart once, not per call)."""
        self.ledger = ledger
        self.cost = cost
        self.control_interval_s = control_interval_s
        self.path = path
        """The path policy every ``choose_path`` asks."""
        self.itl_guard = itl_guard
        self.lend_scale = 1.0
        """Share of each policy's prefill headroom currently lent (the relative ITL guard's control
        variable)."""
        self.node_scale: dict[int, float] = {}
        """Per node, the share of its prefill headroom currently lent (the SLO guard's control
        variable; 1 when absent)."""
        self._chunk_tokens: dict[tuple[int, int, int], int | None] = {}
        self._chunk_limits: dict[tuple[int, int, int], ChunkLimits | None] = {}
        """``(node, batch, context bucket) -> chunk``: the node policies' borrowed chunk sizes asked so
        far (a pure function of those, so remembered)."""
        self.itl_inflation = 1.0
        """Smoothed ITL inflation of the decode pool (see ``itl_guard``)."""
        self.records: deque[dict[str, Any]] = deque(maxlen=max_records)
        """Decision and lease events as plain dicts (``kind`` says which), for debugging and reports."""
        self._lock = threading.RLock()
        self._lending: dict[int, bool] = {}
        self._proposals: dict[
            int, tuple[NodePolicy, tuple[Any, ...], LeaseBudgets, str | None, NodeState]
        ] = {}
        """node id -> (policy, state without its clock, proposal, decode pressure, the state object last
        seen with them) of the node's last ``propose``."""
        self._arrived: set[int] = set()
        """Un-started reservations whose task has reached its node (so ``NodeState`` counts them)."""
        self._replay: list[tuple[int, NodePolicy, LeaseBudgets | None]] | None = None
        """What the last control interval did to each node's lease, in node order (``(node, its
        policy, budgets published)``; budgets ``None``: revoked to zero), when repeating that interval
        with the same states is exact (``replay_control_interval``); ``None`` when it is not."""

    def policy_for(self, node_id: int) -> NodePolicy:
        if self._single_policy is not None:
            return self._single_policy
        try:
            return self._policy_by_node[node_id]
        except KeyError:
            raise KeyError(f"no node policy configured for node {node_id}") from None

    # ---- control loop -------------------------------------------------------------------------------
    def on_control_interval(self, now_s: float, states: Sequence[NodeState]) -> list[int]:
        """Ask each node's policy and publish (or revoke) its lease. Returns revoked reservation ids.

        Under decode pressure the lease goes to zero now and un-started reservations are revoked.
        Otherwise the published lease is the policy's new headroom plus what the borrowed work that
        ``state`` already reflects still holds (committed reservations, and un-started ones that have
        arrived at the node), so that work is neither counted twice nor revoked for lack of room.
        Reservations still in flight to the node are carried over only if they fit the headroom.
        The path policy's ``plan`` may scale each node's new prefill headroom down first (a path
        policy that sizes leases with its path choice). A path policy that never borrows
        (``uses_leases`` False) gets no leases published at all: nothing could spend them. Either way
        the path policy then observes ``states``.
        """
        with self._lock:
            replayable = observes_only_states(self.path)
            if not self.path.uses_leases:
                self.path.observe(now_s, states)
                self._replay = [] if replayable else None
                return []
            ledger = self.ledger
            revoked = ledger.expire(now_s)
            # started work on a lease that ran out (decode pressure outlasted its TTL) falls back, as
            # the node plugin aborts it: it would otherwise hold its KV while waiting for credit, and
            # a node whose admissions wait on that KV stays under pressure for good
            lapsed = ledger.lapsed(now_s)
            revoked += lapsed
            replayable = self._update_itl_guard(states) and replayable
            replay: list[tuple[int, NodePolicy, LeaseBudgets | None]] = []
            shares = self.path.plan(now_s, states) or {}
            reserved = ledger.has_reservations()  # False: no node has any (nor gets one below)
            lend_scale, node_scale = self.lend_scale, self.node_scale
            for state in _by_node_id(states):
                node_id = state.node_id
                policy = self.policy_for(node_id)
                headroom, pressure = self._propose(policy, state)
                scale = lend_scale * node_scale.get(node_id, 1.0)
                scale *= shares.get(node_id, 1.0)
                if scale < 1.0 and not headroom.is_zero():
                    headroom = LeaseBudgets(
                        int(headroom.prefill_tokens * scale),
                        headroom.kv_tokens,
                        headroom.transfer_tokens,
                        headroom.decode_tokens,
                        headroom.tasks,
                    )
                if pressure is None and headroom.is_zero() and not _has_pressure_rule(policy):
                    pressure = "policy proposes no lease"
                if pressure is not None:
                    node_revoked = ledger.revoke(node_id, now_s)
                    lease_budgets = LeaseBudgets.zero()
                    replay.append((node_id, policy, None))
                elif not reserved or not ledger.has_active(node_id):
                    # nothing held or pending: the headroom is the lease
                    lease_budgets = headroom
                    ledger.publish(node_id, lease_budgets, now_s, policy.ttl_s)
                    node_revoked = []
                    replay.append((node_id, policy, lease_budgets))
                else:
                    replayable = False
                    pending = ledger.pending_ids(node_id)
                    reflected = ledger.held(node_id, committed=True) + LeaseBudgets.total(
                        ledger.held_by(rid) for rid in pending if rid in self._arrived
                    )
                    if lapsed:  # what falls back now holds nothing in the new lease
                        reflected = reflected.saturating_sub(
                            LeaseBudgets.total(
                                ledger.held_by(rid) for rid in lapsed if ledger.get(rid).node_id == node_id
                            )
                        )
                    lease_budgets = headroom + reflected
                    ledger.publish(node_id, lease_budgets, now_s, policy.ttl_s)
                    node_revoked = sorted(set(pending) - set(ledger.pending_ids(node_id)))
                if node_revoked:
                    revoked.extend(node_revoked)
                # Record lease transitions (lending <-> decode pressure, or revocations), not every refresh.
                lending = pressure is None and not lease_budgets.is_zero()
                if node_revoked or self._lending.get(node_id) != lending:
                    self._lending[node_id] = lending
                    self.records.append(
                        {
                            "kind": "lease",
                            "time_s": now_s,
                            "node_id": node_id,
                            **{f"lease_{k}": v for k, v in lease_budgets.to_dict().items()},
                            "decode_pressure": pressure,
                            "revoked": node_revoked,
                        }
                    )
            if self._arrived:
                self._arrived.intersection_update(self.ledger.active_ids())
            self.path.observe(now_s, states)
            self._replay = replay if replayable and not revoked else None
            return sorted(revoked)

    def replay_control_interval(self, now_s: float) -> bool:
        """Repeat the last control interval at ``now_s`` without asking any policy, for a caller whose
        node states are those it handed then apart from their clock; ``False`` (nothing done) when a
        repeat would not be exact, and the caller then calls ``on_control_interval``.

        A repeat is exact when the last interval found the scheduler at a fixed point: the ITL guard
        unchanged by it, a path policy that only stores the states (``policies.path.observes_only_
        states``), nothing revoked, and no reservation held or pending on any node (nor made since).
        Node policies are pure functions of the state apart from its clock, so every node gets the same
        lease again: the same ledger calls in the same order, so a new epoch and the granted-token sums
        exactly as ``on_control_interval`` would make them. No lease transition is recorded (none
        happens) and nothing is revoked. The path policy keeps the states it was last handed; one whose
        ``observe`` is ``observe_replayable`` observes them again at ``now_s``.
        """
        with self._lock:
            replay = self._replay
            if (
                replay is None
                or self._arrived
                or self.ledger.has_reservations()
                or not observes_only_states(self.path)
                or any(self.policy_for(node_id) is not policy for node_id, policy, _ in replay)
            ):
                return False
            ledger = self.ledger
            for node_id, policy, budgets in replay:
                if budgets is None:
                    ledger.revoke(node_id, now_s)
                else:
                    ledger.publish(node_id, budgets, now_s, policy.ttl_s)
            if type(self.path).observe is not PathPolicy.observe:  # an observe_replayable override
                self.path.observe(now_s, list(self.path.states.values()))
            return True

    def accepts_unchanged_states(self) -> bool:
        """Whether a reporter may hand a node's last ``NodeState`` object again, its ``time_s`` stale,
        while nothing else in it has changed: node policies never read ``time_s`` (``NodePolicy``), nor
        does a path policy that ``observes_only_states``. ``_propose`` then knows the state by identity."""
        return observes_only_states(self.path)

    def _propose(self, policy: NodePolicy, state: NodeState) -> tuple[LeaseBudgets, str | None]:
        """``(policy.propose(state), policy.decode_pressure(state))`` (the pressure ``None`` for a policy
        without ``decode_pressure``), reused while the node's state apart from the clock is unchanged.

        Node policies are pure functions of the state and never read ``time_s`` (``NodePolicy``), so an
        idle node (most ticks of a closed-loop trace: four in five on the agent sessions) costs no
        predictor call. The memo holds one entry per node and is keyed by the policy object too.
        """
        memo = self._proposals.get(state.node_id)
        if memo is not None and memo[0] is policy and memo[4] is state:
            return memo[2], memo[3]
        key = _STATE_KEY(state)
        if memo is not None and memo[0] is policy and memo[1] == key:
            self._proposals[state.node_id] = (policy, key, memo[2], memo[3], state)
            return memo[2], memo[3]
        both = getattr(policy, "propose_with_pressure", None)
        pressure: str | None
        if both is not None:
            headroom, pressure = both(state)
        else:
            headroom = policy.propose(state)
            pressure_fn = getattr(policy, "decode_pressure", None)
            pressure = pressure_fn(state) if pressure_fn is not None else None
        self._proposals[state.node_id] = (policy, key, headroom, pressure, state)
        return headroom, pressure

    @staticmethod
    def _decode_pressure(
        policy: NodePolicy, state: NodeState, proposal: LeaseBudgets | None = None
    ) -> str | None:
        """The policy's ``decode_pressure`` reason if it has one; otherwise a zero proposal is pressure."""
        pressure_fn = getattr(policy, "decode_pressure", None)
        if pressure_fn is not None:
            reason: str | None = pressure_fn(state)
            return reason
        if proposal is None:
            proposal = policy.propose(state)
        return "policy proposes no lease" if proposal.is_zero() else None

    def _update_itl_guard(self, states: Sequence[NodeState]) -> bool:
        """One interval of the ITL guard; True when it left the guard's scales as they were (so the
        same states again would leave them so too)."""
        if self.itl_guard is None:
            return True
        if self.itl_guard == "slo":
            unchanged = True
            for s in states:
                budget_s = getattr(self.policy_for(s.node_id), "itl_budget_s", None)
                if budget_s is None:
                    continue
                scale = self.node_scale.get(s.node_id, 1.0)
                over = s.recent_step_time_s > budget_s
                new_scale = scale * 0.5 if over else min(1.0, scale + 0.1)
                self.node_scale[s.node_id] = new_scale
                unchanged = unchanged and new_scale == scale
            return unchanged
        mixed = decode_only = 0.0
        for s in states:
            # the same iterations without prefill when the node reports it, else the current batch's step
            baseline = s.recent_decode_only_step_time_s or s.decode_only_step_time_s
            if s.decode_batch_size and s.recent_step_time_s > 0 and baseline > 0:
                mixed += s.decode_batch_size * s.recent_step_time_s
                decode_only += s.decode_batch_size * baseline
        if decode_only <= 0:
            return True
        before = (self.itl_inflation, self.lend_scale)
        self.itl_inflation = 0.7 * self.itl_inflation + 0.3 * (mixed / decode_only)
        if self.itl_inflation > self.itl_guard:
            self.lend_scale *= 0.5
        else:
            self.lend_scale = min(1.0, self.lend_scale + 0.1)
        return (self.itl_inflation, self.lend_scale) == before

    # ---- path choice --------------------------------------------------------------------------------
    def choose_path(self, q: PathQuery, now_s: float) -> PathDecision:
        """The path policy's choice for ``q``; a borrow decision carries a reservation already made."""
        with self._lock:
            decision = self.path.choose(q, now_s, self.ledger)
            self._record_decision("decision", q, decision, now_s)
            return decision

    @property
    def uses_gateway_decode_pick(self) -> bool:
        """Whether the path policy reads the gateway's decode pick (``PathQuery.normal_decode_worker``)."""
        return self.path.uses_gateway_decode_pick

    @property
    def reconsiders_waiting(self) -> bool:
        """Whether requests waiting on a prefill worker should be offered to ``reconsider_path``."""
        return self.path.reconsiders_waiting

    def reconsider_path(self, q: PathQuery, now_s: float) -> PathDecision | None:
        """For a request still queued on its prefill worker: a ``local`` decision to move it, or ``None``."""
        with self._lock:
            decision = self.path.reconsider(q, now_s)
            if decision is not None:
                self._record_decision("reconsider", q, decision, now_s)
            return decision

    def borrowed_chunk_tokens(
        self, node_id: int, decode_batch: int, decode_context_tokens: int
    ) -> int | None:
        """Borrowed prefill tokens the next iteration of ``node_id`` may take beside its running batch of
        ``decode_batch`` requests (``decode_context_tokens`` of KV in all), as its node policy sizes them
        within its ITL budget; ``None``: the policy sets no limit. The context is rounded up to
        ``CHUNK_CONTEXT_BUCKET_TOKENS`` per request (the conservative side) and answers are remembered."""
        policy = self.policy_for(node_id)
        chunk_fn = getattr(policy, "borrowed_chunk_tokens", None)
        if chunk_fn is None:
            return None
        per_request = CHUNK_CONTEXT_BUCKET_TOKENS * decode_batch
        bucket = -(-decode_context_tokens // per_request) if per_request else 0
        key = (node_id, decode_batch, bucket)
        with self._lock:
            if key not in self._chunk_tokens:
                self._chunk_tokens[key] = chunk_fn(decode_batch, bucket * per_request)
            return self._chunk_tokens[key]

    def chunk_limits(self, node_id: int, max_batch: int, max_context_tokens: int) -> ChunkLimits | None:
        """The node policy's per-iteration cap tabulated for a node that holds no policy (an SGLang
        worker running the plugin gets it with its lease): ``ChunkLimits.build`` over decode batches up
        to ``max_batch`` and context up to ``max_context_tokens`` (the node's ``max_running_requests``
        and ``kv_capacity_tokens``); ``None`` when the policy sets no limit. Built once per node and
        range."""
        policy = self.policy_for(node_id)
        chunk_fn = getattr(policy, "borrowed_chunk_tokens", None)
        if chunk_fn is None:
            return None
        key = (node_id, max(1, max_batch), max(0, max_context_tokens))
        with self._lock:
            if key not in self._chunk_limits:
                self._chunk_limits[key] = ChunkLimits.build(chunk_fn, key[1], key[2])
            return self._chunk_limits[key]

    def pressure_rule(self, node_id: int) -> DecodePressureRule | None:
        """The node policy's decode-pressure test as data, for a node that holds no policy (it pauses
        a borrowed request that arrives under pressure, as ``on_task_arrival`` does here); ``None``
        when the policy has no such rule (then a zero proposal is its pressure, which reaches the
        node as a revocation)."""
        rule_fn = getattr(self.policy_for(node_id), "pressure_rule", None)
        return rule_fn() if callable(rule_fn) else None

    def local_chunk_tokens(self, node_id: int) -> int:
        """Prefill tokens of unleased (``local``) requests one iteration of ``node_id`` may mix in."""
        return self.path.local_chunk_tokens(node_id)

    def _record_decision(self, kind: str, q: PathQuery, decision: PathDecision, now_s: float) -> None:
        self.records.append(
            {
                "kind": kind,
                "time_s": now_s,
                "request_id": q.request_id,
                "session_id": q.session_id,
                "path": decision.path,
                "node_id": decision.node_id,
                "reservation_id": decision.reservation_id,
                "est_normal_s": decision.est_normal_s,
                "est_borrow_s": decision.est_borrow_s,
                "input_tokens": q.input_tokens,
                "normal_uncached_tokens": q.normal_uncached_tokens,
                "normal_queue_wait_s": q.normal_queue_wait_s,
                "code": decision.code.value,
                "reason": decision.reason,
            }
        )

    # ---- what a lending node reads ------------------------------------------------------------------
    def lease_rate(self, node_id: int) -> tuple[float, float]:
        """``(prefill tokens per second, expiry)`` of the node's current lease; ``(0, 0)`` without one.

        The node's token bucket earns credit at this rate until the expiry (``policies.admission``).
        """
        with self._lock:
            lease = self.ledger.lease(node_id)
            if lease is None:
                return 0.0, 0.0
            return lease.budgets.prefill_tokens / lease.ttl_s, lease.expires_s

    def unstarted_kv_tokens(self, node_id: int, exclude: int | None = None) -> int:
        """KV tokens that reservations not yet started on ``node_id`` hold (optionally but one): the
        node keeps that room out of its pre-allocation budget so PD admissions cannot take it."""
        with self._lock:
            held = self.ledger.held(node_id, committed=False).kv_tokens
            if exclude is not None and self.ledger.status(exclude) == "reserved":
                held -= self.ledger.held_by(exclude).kv_tokens
            return held

    def pull_tokens(self, reservation_id: int) -> int:
        """Prefix tokens the borrowed task pulls from a prefill worker's cache before it computes."""
        with self._lock:
            return self.ledger.held_by(reservation_id).transfer_tokens

    def granted_prefill_tokens(self, node_id: int, now_s: float) -> float:
        """Prefill tokens the node's leases granted up to ``now_s`` (the ledger's record)."""
        return self.ledger.granted_prefill_tokens(node_id, now_s)

    # ---- borrowed task life cycle ---------------------------------------------------------------------
    def on_task_arrival(self, reservation_id: int, state: NodeState, now_s: float) -> ArrivalVerdict:
        """The lending node re-checks before starting a borrowed prefill.

        ``fallback``: the reservation was revoked or its lease expired; run the request on the normal
        path (call ``on_fallback``). ``pause``: decode pressure now; keep the task queued and ask again
        (by the next control interval the lease is revoked and the answer becomes ``fallback``).
        ``run``: start it (then ``on_task_started``).
        """
        with self._lock:
            if not self.ledger.is_spendable(reservation_id, now_s):
                verdict: ArrivalVerdict = "fallback"
                reason = f"reservation {self.ledger.status(reservation_id)}"
            else:
                pressure = self._decode_pressure(self.policy_for(state.node_id), state)
                verdict = "pause" if pressure else "run"
                reason = pressure or "node still has headroom"
                self._arrived.add(reservation_id)
            self.records.append(
                {
                    "kind": "arrival",
                    "time_s": now_s,
                    "reservation_id": reservation_id,
                    "node_id": state.node_id,
                    "verdict": verdict,
                    "reason": reason,
                }
            )
            return verdict

    def on_task_started(self, reservation_id: int, now_s: float) -> bool:
        """Commit the reservation; ``False`` means it can no longer run here (fall back)."""
        return self.ledger.commit(reservation_id, now_s)

    def on_task_reported_started(self, reservation_id: int, now_s: float) -> bool:
        """The node reports the task's prefill begun, which it may have done before a revocation here
        reached it (a router learns of starts from the node's reports, a little late): commit it, or
        re-open it as committed if this ledger revoked it (``LeaseLedger.reinstate``), so the leases
        that follow count the work the node goes on running, as the simulator, which revokes a started
        task only once its lease has expired (``LeaseLedger.lapsed``), does. ``False``: it expired (the
        node aborts it on its own); ``KeyError`` for one already released, as ``LeaseLedger.commit``."""
        with self._lock:
            if self.ledger.commit(reservation_id, now_s):
                return True
            if self.ledger.reinstate(reservation_id):
                self.records.append({"kind": "reinstated", "time_s": now_s, "reservation_id": reservation_id})
                return True
            return False

    def on_prefill_done(self, reservation_id: int) -> None:
        """Return the compute, transfer and task budgets; KV and decode work stay held."""
        held = self.ledger.held_by(reservation_id)
        self.ledger.release(
            reservation_id,
            LeaseBudgets(
                prefill_tokens=held.prefill_tokens, transfer_tokens=held.transfer_tokens, tasks=held.tasks
            ),
        )

    def on_request_finished(self, reservation_id: int) -> None:
        """Return everything the reservation still holds."""
        self.ledger.release(reservation_id)

    def on_fallback(self, reservation_id: int) -> None:
        """The request left the borrow path before starting; free its reservation if still active."""
        self._arrived.discard(reservation_id)
        if self.ledger.status(reservation_id) in ("reserved", "committed"):
            self.ledger.release(reservation_id)
