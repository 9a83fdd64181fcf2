"""The cluster scheduler: path choice, decode priority, pause/fallback, and no double spending."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import pytest

from policies.lease import LeaseBudgets
from policies.ledger import LeaseLedger
from policies.node_policies import HeuristicPolicy, StaticPolicy, UtilisationPolicy
from policies.node_state import NodeState
from policies.scheduler import ClusterScheduler, PathQuery
from tests.fakes import ConstantPredictor


class FakeCost:
    """Prefill at 20k uncached tokens/s (cached tokens are free); KV moves at 1M tokens/s."""

    def prefill_time_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return new_tokens / 20_000

    def kv_transfer_time_s(self, tokens: int) -> float:
        return tokens / 1_000_000


def calm(node_id: int, **overrides: float) -> NodeState:
    base = NodeState(
        node_id=node_id,
        time_s=0.0,
        decode_batch_size=4,
        context_tokens_mean=2000.0,
        context_tokens_std=0.0,
        remaining_output_tokens_mean=100.0,
        kv_capacity_tokens=200_000,
        kv_used_tokens=8_000,
        kv_reserved_tokens=400,
        queued_decode_requests=0,
        borrowed_tasks=0,
        borrowed_prefill_tokens_queued=0,
        recent_step_time_s=0.02,
        decode_only_step_time_s=0.02,
        max_running_requests=32,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def make_scheduler(
    safe_tokens_per_s: float = 20_000.0, max_tasks: int = 4, **kwargs: Any
) -> ClusterScheduler:
    # margin 1.0, TTL 1 s: each node lends exactly safe_tokens_per_s prefill tokens per lease.
    policy = HeuristicPolicy(ConstantPredictor(safe_tokens_per_s), ttl_s=1.0, margin=1.0, max_tasks=max_tasks)
    return ClusterScheduler(policy, LeaseLedger(), FakeCost(), control_interval_s=0.5, **kwargs)


def query(request_id: int = 0, *, wait_s: float = 2.0, input_tokens: int = 10_000, **kw: object) -> PathQuery:
    fields: dict[str, object] = dict(
        request_id=request_id,
        session_id=7,
        input_tokens=input_tokens,
        expected_output_tokens=500,
        normal_uncached_tokens=input_tokens,
        normal_queue_wait_s=wait_s,
        normal_prefill_worker=0,
    )
    fields.update(kw)
    return PathQuery(**fields)  # type: ignore[arg-type]


def test_normal_when_prefill_pool_not_congested() -> None:
    sched = make_scheduler()
    sched.on_control_interval(0.0, [calm(0), calm(1)])
    d = sched.choose_path(query(wait_s=0.1, decode_cached_tokens={0: 9_000}), 0.0)
    assert d.path == "normal" and d.reservation_id is None and "not congested" in d.reason
    assert d.est_normal_s == pytest.approx(0.1 + 0.5 + 0.01)
    assert sched.ledger.held(0).is_zero()


def test_borrow_on_the_node_holding_the_session_prefix() -> None:
    sched = make_scheduler()
    sched.on_control_interval(0.0, [calm(0), calm(1)])
    d = sched.choose_path(query(decode_cached_tokens={1: 8_000}), 0.0)
    # Normal: 2 + 10_000/20_000 + 0.01 = 2.51 s. Node 1 computes only 2_000 tokens: 0.1 s, transfers nothing.
    assert d.path == "borrow" and d.node_id == 1 and d.reservation_id is not None
    assert d.est_normal_s == pytest.approx(2.51) and d.est_borrow_s == pytest.approx(0.1)
    assert sched.ledger.held_by(d.reservation_id) == LeaseBudgets(2_000, 10_500, 0, 500, 1)
    record = sched.records[-1]
    assert record["kind"] == "decision" and record["path"] == "borrow" and "node 1" in record["reason"]


@pytest.mark.parametrize(
    ("pulls", "est_s", "held_prefill", "held_transfer"),
    [(True, 0.059, 1_000, 9_000), (False, 0.5, 10_000, 0)],
    ids=["pull", "served-without-pulls"],
)
def test_borrow_pulls_a_prefix_cached_on_the_prefill_worker_when_faster_and_allowed(
    pulls: bool, est_s: float, held_prefill: int, held_transfer: int
) -> None:
    """Pulling 9 000 cached tokens (0.009 s) and computing 1 000 (0.05 s) beats computing all 10 000
    locally (0.5 s). The served path has no protocol for a pull (``without_prefix_pulls``, which
    the router applies: ``tests/test_router.py``), so there the borrow reserves and costs all
    10 000 tokens of prefill and no transfer, as the node itself reserves them."""
    from policies.lease_path import without_prefix_pulls

    sched = make_scheduler() if pulls else without_prefix_pulls(make_scheduler())
    sched.on_control_interval(0.0, [calm(0)])
    d = sched.choose_path(query(prefill_cached_tokens=9_000, normal_uncached_tokens=1_000, wait_s=5.0), 0.0)
    assert d.path == "borrow" and d.est_borrow_s == pytest.approx(est_s)
    assert d.reservation_id is not None
    held = sched.ledger.held_by(d.reservation_id)
    assert (held.prefill_tokens, held.transfer_tokens) == (held_prefill, held_transfer)
    assert without_prefix_pulls(None) is None


def test_normal_when_borrow_does_not_beat_it_by_the_margin() -> None:
    sched = make_scheduler(safe_tokens_per_s=12_000.0, borrow_margin=0.1)
    sched.on_control_interval(0.0, [calm(0)])
    # Normal 0.25 + 0.5 + 0.01 = 0.76 s; borrow 10_000 / 12_000 = 0.833 s.
    d = sched.choose_path(query(wait_s=0.25), 0.0)
    assert d.path == "normal" and d.est_borrow_s == pytest.approx(10_000 / 12_000)
    assert "does not beat" in d.reason and sched.ledger.active_ids() == []


def test_two_requests_never_double_spend_one_task_slot() -> None:
    sched = make_scheduler(max_tasks=1)
    sched.on_control_interval(0.0, [calm(0)])
    first = sched.choose_path(query(0), 0.0)
    second = sched.choose_path(query(1), 0.0)
    assert first.path == "borrow" and second.path == "normal"
    assert "no lease can hold it" in second.reason


def test_concurrent_choose_path_never_overspends() -> None:
    sched = make_scheduler(max_tasks=3)
    sched.on_control_interval(0.0, [calm(0), calm(1)])
    decisions = []
    barrier = threading.Barrier(16)

    def worker(i: int) -> None:
        barrier.wait()
        decisions.append(sched.choose_path(query(i, input_tokens=1_000), 0.0))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    borrowed = [d for d in decisions if d.path == "borrow"]
    assert len(borrowed) == 6  # 3 task slots on each of 2 nodes
    assert len({d.reservation_id for d in borrowed}) == 6
    for node in (0, 1):
        assert sched.ledger.held(node).fits_within(sched.ledger.lease(node).budgets)  # type: ignore[union-attr]


def test_decode_priority_lease_to_zero_within_one_interval() -> None:
    sched = make_scheduler()
    sched.on_control_interval(0.0, [calm(0)])
    started = sched.choose_path(query(0, input_tokens=2_000), 0.0)
    waiting = sched.choose_path(query(1, input_tokens=2_000), 0.1)
    assert started.reservation_id is not None and waiting.reservation_id is not None
    assert sched.on_task_arrival(started.reservation_id, calm(0), 0.1) == "run"
    assert sched.on_task_started(started.reservation_id, 0.1)

    revoked = sched.on_control_interval(0.5, [calm(0, queued_decode_requests=2)])
    assert revoked == [waiting.reservation_id]
    assert sched.ledger.available(0, 0.5).is_zero()
    assert sched.ledger.lease(0).budgets.is_zero()  # type: ignore[union-attr]
    assert sched.ledger.status(started.reservation_id) == "committed"  # started work is never dropped
    assert sched.on_task_arrival(waiting.reservation_id, calm(0), 0.6) == "fallback"
    assert not sched.on_task_started(waiting.reservation_id, 0.6)
    assert sched.choose_path(query(2), 0.6).path == "normal"
    assert sched.records[-1]["reason"] == "congested but no lease can hold it"


def test_pause_on_worse_conditions_then_fallback_before_first_token() -> None:
    sched = make_scheduler()
    sched.on_control_interval(0.0, [calm(0)])
    d = sched.choose_path(query(), 0.0)
    assert d.reservation_id is not None
    slow = calm(0, recent_step_time_s=0.08)  # decode steps now exceed the 50 ms ITL target
    assert sched.on_task_arrival(d.reservation_id, slow, 0.2) == "pause"
    assert sched.ledger.status(d.reservation_id) == "reserved"
    assert sched.on_control_interval(0.5, [slow]) == [d.reservation_id]
    assert sched.on_task_arrival(d.reservation_id, slow, 0.5) == "fallback"
    sched.on_fallback(d.reservation_id)  # already revoked: nothing to free, no error
    arrival = [r for r in sched.records if r["kind"] == "arrival"]
    assert [r["verdict"] for r in arrival] == ["pause", "fallback"] and "ITL target" in arrival[0]["reason"]


def test_a_start_reported_after_the_revocation_reinstates_the_task_and_the_next_lease_carries_it() -> None:
    """A router learns of starts from its nodes' reports: a task its node started just before the
    control interval that revoked it (decode pressure) is reported started after it. The node goes
    on running it, so ``on_task_reported_started`` re-opens it as committed and the next lease is the
    headroom plus what it holds, as the simulator publishes (it revokes a started task only once its
    lease has expired: ``test_started_work_falls_back_once_decode_pressure_outlasts_its_lease``)."""
    sched = make_scheduler()
    sched.on_control_interval(0.0, [calm(0)])
    d = sched.choose_path(query(input_tokens=2_000), 0.0)
    rid = d.reservation_id
    assert rid is not None and sched.on_task_arrival(rid, calm(0), 0.1) == "run"
    assert sched.on_control_interval(0.5, [calm(0, queued_decode_requests=1)]) == [rid]
    assert sched.on_task_reported_started(rid, 0.51), "the node had started it"
    assert sched.ledger.status(rid) == "committed" and sched.records[-1]["kind"] == "reinstated"
    assert sched.on_control_interval(0.9, [calm(0)]) == []  # before the revoked lease's expiry (1.0)
    headroom = sched.policy_for(0).propose(calm(0))
    assert sched.ledger.lease(0).budgets == headroom + sched.ledger.held_by(rid)  # type: ignore[union-attr]
    assert sched.ledger.available(0, 0.9) == headroom
    sched.on_prefill_done(rid)
    sched.on_request_finished(rid)
    assert sched.ledger.held(0).is_zero()
    expired = sched.choose_path(query(1, input_tokens=2_000), 1.0).reservation_id
    assert expired is not None and sched.on_task_arrival(expired, calm(0), 2.5) == "fallback"
    assert not sched.on_task_reported_started(expired, 2.5), "an expired one stays closed"


def test_expired_lease_falls_back() -> None:
    sched = make_scheduler()
    sched.on_control_interval(0.0, [calm(0)])
    d = sched.choose_path(query(), 0.0)
    assert d.reservation_id is not None
    assert sched.on_task_arrival(d.reservation_id, calm(0), 1.0) == "fallback"  # TTL 1 s ran out
    assert sched.ledger.status(d.reservation_id) == "expired"


def test_started_work_falls_back_once_decode_pressure_outlasts_its_lease() -> None:
    """As the node plugin aborts a started prompt whose lease expired (``_abort_stalled_chunk``): under
    pressure the lease is revoked to zero with its expiry kept, and once that passes the started work
    is handed back (revoked) rather than left holding its KV, waiting for credit that never comes."""
    sched = make_scheduler()
    sched.on_control_interval(0.0, [calm(0)])
    rid = sched.choose_path(query(input_tokens=4_000), 0.0).reservation_id
    assert rid is not None and sched.on_task_started(rid, 0.1)
    pressed = calm(0, queued_decode_requests=5, borrowed_tasks=1, borrowed_prefill_tokens_queued=2_000)
    assert sched.on_control_interval(0.5, [pressed]) == []  # revoked to zero, expiring at 1.0
    assert sched.ledger.lease(0).budgets.is_zero()  # type: ignore[union-attr]
    assert sched.on_control_interval(1.0, [pressed]) == [rid]
    assert sched.on_control_interval(1.5, [pressed]) == [rid], "offered again until the node drops it"
    sched.on_fallback(rid)
    assert sched.ledger.status(rid) == "released" and sched.on_control_interval(2.0, [pressed]) == []


def test_a_lapsed_task_holds_nothing_in_the_lease_published_beside_it() -> None:
    sched = make_scheduler()
    sched.on_control_interval(0.0, [calm(0)])
    rid = sched.choose_path(query(input_tokens=4_000), 0.0).reservation_id
    assert rid is not None and sched.on_task_started(rid, 0.1)
    busy = calm(0, borrowed_tasks=1, borrowed_prefill_tokens_queued=2_000)
    sched.on_control_interval(0.5, [calm(0, queued_decode_requests=5)])  # pressure: zero, expiring at 1.0
    assert sched.on_control_interval(1.25, [busy]) == [rid]  # the pressure is over, the old lease expired
    assert sched.ledger.lease(0).budgets == sched.policy_for(0).propose(busy)  # type: ignore[union-attr]


def test_life_cycle_releases_compute_at_prefill_end_and_kv_at_finish() -> None:
    sched = make_scheduler(max_tasks=1)
    sched.on_control_interval(0.0, [calm(0)])
    headroom = sched.ledger.available(0, 0.0)
    d = sched.choose_path(query(input_tokens=4_000), 0.0)
    rid = d.reservation_id
    assert rid is not None and sched.on_task_started(rid, 0.0)
    # Next interval: the committed work is added back, so what is free again is exactly the new headroom.
    busy = calm(0, borrowed_tasks=1, borrowed_prefill_tokens_queued=4_000)
    sched.on_control_interval(0.5, [busy])
    expected_headroom = sched.policy_for(0).propose(busy)
    assert sched.ledger.lease(0).budgets == expected_headroom + sched.ledger.held_by(rid)  # type: ignore[union-attr]
    assert sched.ledger.available(0, 0.5) == expected_headroom
    sched.on_prefill_done(rid)
    assert sched.ledger.held_by(rid) == LeaseBudgets(kv_tokens=4_500, decode_tokens=500)
    sched.on_request_finished(rid)
    assert sched.ledger.status(rid) == "released" and sched.ledger.held(0).is_zero()
    assert headroom.tasks == 1


def test_per_node_policies_and_bounded_records() -> None:
    heuristic = HeuristicPolicy(ConstantPredictor(20_000.0), margin=1.0)
    sched = ClusterScheduler(
        {0: StaticPolicy(), 1: heuristic}, LeaseLedger(), FakeCost(), control_interval_s=0.5, max_records=3
    )
    sched.on_control_interval(0.0, [calm(0), calm(1)])
    decisions = [
        sched.choose_path(query(i, input_tokens=1_000, decode_cached_tokens={0: 900}), 0.0) for i in range(4)
    ]
    assert {d.node_id for d in decisions if d.path == "borrow"} == {
        1
    }  # node 0 holds the prefix but never lends
    assert len(sched.records) == 3 and sched.records[-1]["request_id"] == 3
    with pytest.raises(KeyError, match="no node policy configured for node 2"):
        sched.on_control_interval(0.5, [calm(2)])


def test_configuration_and_query_validation() -> None:
    with pytest.raises(ValueError, match="shorter than control_interval_s"):
        ClusterScheduler(StaticPolicy(ttl_s=0.1), LeaseLedger(), FakeCost(), control_interval_s=0.5)
    with pytest.raises(ValueError, match="normal_uncached_tokens"):
        query(normal_uncached_tokens=20_000)
    with pytest.raises(ValueError, match="input_tokens"):
        query(input_tokens=-1, normal_uncached_tokens=0)


def test_arrived_task_is_not_revoked_for_the_room_it_takes_itself() -> None:
    sched = make_scheduler(max_tasks=1)
    sched.on_control_interval(0.0, [calm(0)])
    arrived = sched.choose_path(query(0, input_tokens=2_000), 0.0)
    assert arrived.reservation_id is not None
    assert sched.on_task_arrival(arrived.reservation_id, calm(0), 0.1) == "run"
    # The node now reports the queued task, so its own headroom is zero tasks; it must still be kept.
    queued = calm(0, borrowed_tasks=1, borrowed_prefill_tokens_queued=2_000)
    assert sched.on_control_interval(0.5, [queued]) == []
    assert sched.on_task_started(arrived.reservation_id, 0.6)


def test_policy_without_pressure_hook_zero_proposal_revokes() -> None:
    policy = UtilisationPolicy(itl_target_s=0.05, threshold=0.5, ttl_s=1.0)
    sched = ClusterScheduler(policy, LeaseLedger(), FakeCost(), control_interval_s=0.5)
    sched.on_control_interval(0.0, [calm(0)])
    d = sched.choose_path(query(input_tokens=1_000), 0.0)
    assert d.path == "borrow" and d.reservation_id is not None
    busy = calm(0, recent_step_time_s=0.04)  # utilisation 0.8 >= 0.5: the policy stops lending
    assert sched.on_task_arrival(d.reservation_id, busy, 0.1) == "pause"
    assert sched.on_control_interval(0.5, [busy]) == [d.reservation_id]


def test_itl_guard_shrinks_leases_while_the_pool_is_slowed_and_recovers() -> None:
    sched = make_scheduler(safe_tokens_per_s=20_000.0, itl_guard=1.10)
    # node 0: batch 30 at 2x its decode-only step; node 1: batch 10 unaffected -> inflation 1.75
    slowed = [
        calm(0, decode_batch_size=30, recent_step_time_s=0.04, recent_decode_only_step_time_s=0.02),
        calm(1, decode_batch_size=10, recent_step_time_s=0.02, recent_decode_only_step_time_s=0.02),
    ]
    sched.on_control_interval(0.0, slowed)
    assert sched.itl_inflation == pytest.approx(0.7 + 0.3 * 1.75)
    assert sched.lend_scale == 0.5
    assert sched.ledger.lease(1).budgets.prefill_tokens == 10_000  # half of 20k tokens/s x 1 s
    sched.on_control_interval(0.5, slowed)
    assert sched.lend_scale == 0.25
    calm_states = [calm(0, recent_decode_only_step_time_s=0.02), calm(1, recent_decode_only_step_time_s=0.02)]
    for i in range(8):  # inflation decays under the guard, then the scale climbs back 0.1 a step
        sched.on_control_interval(1.0 + 0.5 * i, calm_states)
    assert sched.itl_inflation < 1.10
    assert 0.25 < sched.lend_scale <= 1.0
    off = make_scheduler(itl_guard=None)
    off.on_control_interval(0.0, slowed)
    assert off.lend_scale == 1.0 and off.ledger.lease(1).budgets.prefill_tokens == 20_000
    with pytest.raises(ValueError, match="itl_guard"):
        make_scheduler(itl_guard=0.9)


def test_unchanged_states_reuse_the_proposal_and_decode_pressure_and_keep_republishing() -> None:
    """A node whose state, apart from its clock, is unchanged costs no policy call, yet its lease is
    still republished every interval (a new epoch); a changed state asks the policy again, and states
    given out of node order are handled in node order."""

    class Counting(HeuristicPolicy):
        calls = 0

        def decode_pressure(self, state: NodeState) -> str | None:
            Counting.calls += 1
            return super().decode_pressure(state)

    sched = ClusterScheduler(
        Counting(ConstantPredictor(20_000.0), margin=1.0), LeaseLedger(), FakeCost(), control_interval_s=0.5
    )
    for i in range(3):
        sched.on_control_interval(
            0.5 * i, [replace(calm(1), time_s=0.5 * i), replace(calm(0), time_s=0.5 * i)]
        )
    # propose_with_pressure asks decode_pressure once per distinct state and node
    assert Counting.calls == 2
    assert sched.ledger.lease(0).epoch == 2 and sched.ledger.lease(1).epoch == 2  # type: ignore[union-attr]
    sched.on_control_interval(1.5, [calm(0, kv_used_tokens=9_000), calm(1)])
    assert Counting.calls == 3
    assert sched.ledger.lease(0).budgets == sched.policy_for(0).propose(calm(0, kv_used_tokens=9_000))  # type: ignore[union-attr]


def test_a_replayed_interval_publishes_what_a_full_one_would() -> None:
    """At a fixed point (nothing reserved, the ITL guard at rest, a path policy that only stores the
    states) a replayed interval leaves the ledger exactly as a full one with the same states: the
    same epochs, budgets, expiries and granted tokens, and no lease record. A node under decode
    pressure is revoked again."""
    full, replayed = make_scheduler(), make_scheduler()
    idle, pressed = calm(0, recent_step_time_s=0.0), calm(1, queued_decode_requests=3)
    for sched in (full, replayed):
        sched.on_control_interval(0.0, [idle, calm(1)])
        sched.on_control_interval(0.5, [replace(idle, time_s=0.5), replace(pressed, time_s=0.5)])
    assert replayed.replay_control_interval(1.0)
    full.on_control_interval(1.0, [replace(idle, time_s=1.0), replace(pressed, time_s=1.0)])
    for node in (0, 1):
        assert replayed.ledger.lease(node) == full.ledger.lease(node)
        granted = replayed.ledger.granted_prefill_tokens(node, 1.7)
        assert granted == full.ledger.granted_prefill_tokens(node, 1.7)
    assert replayed.ledger.lease(1).budgets.is_zero()  # type: ignore[union-attr]
    assert replayed.ledger.lease(0).epoch == 2  # type: ignore[union-attr]
    assert replayed.ledger.granted_prefill_tokens(0, 1.7) > 0
    assert list(replayed.records) == list(full.records)


def test_an_interval_is_replayed_only_at_a_fixed_point() -> None:
    """A reservation held or made since, an ITL guard still recovering, or a path policy with its own
    ``plan`` refuses a replay (the caller then runs the interval in full)."""
    from policies.path import PathPolicy

    sched = make_scheduler()
    sched.on_control_interval(0.0, [calm(0, recent_step_time_s=0.0)])
    assert sched.ledger.reserve(0, LeaseBudgets(prefill_tokens=100, tasks=1), 0.1) is not None
    assert not sched.replay_control_interval(0.5)
    sched.on_control_interval(0.5, [calm(0, recent_step_time_s=0.0)])
    assert not sched.replay_control_interval(1.0)  # the interval itself saw the reservation

    class Guarded:  # the heuristic's leases under an ITL budget of 50 ms
        ttl_s = 1.0
        itl_budget_s = 0.05
        inner = HeuristicPolicy(ConstantPredictor(20_000.0), ttl_s=1.0, margin=1.0)

        def propose(self, state: NodeState) -> LeaseBudgets:
            return self.inner.propose(state)

    budget_s = Guarded.itl_budget_s
    slow = ClusterScheduler(Guarded(), LeaseLedger(), FakeCost(), control_interval_s=0.5)  # type: ignore[arg-type]
    slow.on_control_interval(0.0, [calm(0, recent_step_time_s=2 * budget_s)])
    assert slow.node_scale[0] == 0.5 and not slow.replay_control_interval(0.5)
    t_s = 0.0
    while slow.node_scale[0] < 1.0:  # recovering by 0.1 an interval (up to 1 exactly) is no fixed point
        t_s += 0.5
        slow.on_control_interval(t_s, [calm(0, recent_step_time_s=0.0)])
        assert not slow.replay_control_interval(t_s + 0.5)
    slow.on_control_interval(t_s + 0.5, [calm(0, recent_step_time_s=0.0)])  # at rest
    assert slow.replay_control_interval(t_s + 1.0)

    class Planning(PathPolicy):
        uses_leases = True

        def plan(self, now_s: float, states: Any) -> dict[int, float]:
            return {0: 0.5}

        def choose(self, q: PathQuery, now_s: float, ledger: LeaseLedger) -> Any:
            raise AssertionError

    planned = make_scheduler(path=Planning())
    planned.on_control_interval(0.0, [calm(0, recent_step_time_s=0.0)])
    assert not planned.replay_control_interval(0.5)


def test_lender_choice_can_balance_decode_load_among_leases_that_beat_the_normal_path() -> None:
    """Two equal leases: ``fastest`` breaks the tie to node 0; ``least_kv_load`` borrows on the node
    whose decode KV the router counts lowest. A less loaded node whose option misses the margin (here:
    borrowed work queued on it) is never chosen for its load."""
    from policies.lease_path import LeasePath

    loads = {0: 150_000, 1: 20_000}
    picks = {}
    for choice in ("fastest", "least_kv_load"):
        path = LeasePath(FakeCost(), congestion="wait", lender_choice=choice)  # type: ignore[arg-type]
        sched = make_scheduler(path=path)
        sched.on_control_interval(0.0, [calm(0), calm(1)])
        picks[choice] = sched.choose_path(query(1, wait_s=2.0, decode_kv_load_tokens=loads), 0.0).node_id
    assert picks == {"fastest": 0, "least_kv_load": 1}
    path = LeasePath(FakeCost(), congestion="wait", borrow_margin=0.2, lender_choice="least_kv_load")
    sched = make_scheduler(path=path)
    sched.on_control_interval(0.0, [calm(0), calm(1)])
    # a first borrow goes to the less loaded node 1; its 16k tokens queued there (0.8 s at the lease's
    # rate) put node 1's option for the next request past the margin
    first = query(1, wait_s=0.5, input_tokens=16_000, decode_kv_load_tokens=loads)
    assert sched.choose_path(first, 0.0).node_id == 1
    d = sched.choose_path(query(2, wait_s=0.5, decode_kv_load_tokens=loads), 0.0)
    assert d.node_id == 0, "node 1 is less loaded, but its queued borrow makes it too slow"
    with pytest.raises(ValueError, match="lender_choice"):
        LeasePath(FakeCost(), lender_choice="random")  # type: ignore[arg-type]
