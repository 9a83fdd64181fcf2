"""The mixed-iteration share budget (``LeasePath.mixed_share_budget``) on hand-built states, and the
token counts the simulator reports for it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from policies.lease_path import LeasePath
from policies.ledger import LeaseLedger
from policies.node_policies import HeuristicPolicy
from policies.path import PathReason
from policies.scheduler import ClusterScheduler
from tests.fakes import ConstantPredictor
from tests.test_scheduler import FakeCost, calm, query


def budget_path(budget: float | None = 0.01, **kw: object) -> LeasePath:
    return LeasePath(
        FakeCost(),
        congestion="wait",
        slo_ttft_s=5.0,
        mixed_share_budget=budget,
        **{"mixed_share_window_s": 10.0, **kw},  # type: ignore[arg-type]
    )


def scheduler_with(path: LeasePath, safe_tokens_per_s: float = 20_000.0) -> ClusterScheduler:
    policy = HeuristicPolicy(ConstantPredictor(safe_tokens_per_s), ttl_s=1.0, margin=1.0)
    return ClusterScheduler(policy, LeaseLedger(), FakeCost(), path=path, control_interval_s=0.5)


def test_share_is_counted_per_node_over_a_decayed_window() -> None:
    path = budget_path()
    path.observe(0.0, [calm(0, decode_tokens_total=1000, mixed_decode_tokens_total=20), calm(1)])
    assert path.mixed_share(0) == pytest.approx(0.02)
    assert path.mixed_share(1) == 0.0  # no tokens seen: nothing to protect yet
    # 10 s later (one time constant) 1000 clean tokens: the old ones count e^-1
    path.observe(10.0, [calm(0, decode_tokens_total=2000, mixed_decode_tokens_total=20), calm(1)])
    decay = math.exp(-1.0)
    assert path.mixed_share(0) == pytest.approx(20 * decay / (1000 * decay + 1000))
    # the same running totals again (no tokens since) add nothing; totals that went back: a restart
    before = path.mixed_share(0)
    path.observe(10.0, [calm(0, decode_tokens_total=2000, mixed_decode_tokens_total=20), calm(1)])
    assert path.mixed_share(0) == pytest.approx(before)
    path.observe(10.0, [calm(0, decode_tokens_total=100, mixed_decode_tokens_total=100), calm(1)])
    assert path.mixed_share(0) == pytest.approx((20 * decay + 100) / (1000 * decay + 1000 + 100))
    # with the budget off nothing is counted
    off = budget_path(None)
    off.observe(0.0, [calm(0, decode_tokens_total=1000, mixed_decode_tokens_total=900)])
    assert off.mixed_share(0) == 0.0 and not off.over_mixed_share(0)


def test_a_node_past_its_budget_is_not_offered_while_one_within_it_is() -> None:
    path = budget_path(0.01)
    sched = scheduler_with(path)
    busy = calm(0, decode_tokens_total=1000, mixed_decode_tokens_total=50)  # 5 % of its tokens
    clean = calm(1, decode_tokens_total=1000, mixed_decode_tokens_total=5)  # 0.5 %
    sched.on_control_interval(0.0, [busy, clean])
    d = sched.choose_path(query(1, wait_s=2.0), 0.0)
    assert d.path == "borrow" and d.node_id == 1
    # without the budget the same request goes to node 0 (the tie between equal nodes breaks low)
    free = scheduler_with(budget_path(None))
    free.on_control_interval(0.0, [busy, clean])
    assert free.choose_path(query(1, wait_s=2.0), 0.0).node_id == 0


def test_every_node_past_its_budget_sends_the_request_the_normal_way_with_its_reason() -> None:
    sched = scheduler_with(budget_path(0.01))
    over = [calm(n, decode_tokens_total=1000, mixed_decode_tokens_total=30) for n in (0, 1)]
    sched.on_control_interval(0.0, over)
    d = sched.choose_path(query(1, wait_s=2.0), 0.0)
    assert d.path == "normal" and d.code is PathReason.MIXED_SHARE_BUDGET and "0.0300 > 0.01" in d.reason
    assert sched.ledger.held(0).is_zero() and sched.ledger.held(1).is_zero()
    # the share decays as clean tokens come: after enough of them the node lends again
    sched.on_control_interval(
        30.0, [replace(s, decode_tokens_total=5000, mixed_decode_tokens_total=30) for s in over]
    )
    assert sched.path.mixed_share(0) < 0.01  # type: ignore[attr-defined]
    assert sched.choose_path(query(2, wait_s=2.0), 30.0).path == "borrow"


def rescue_path() -> LeasePath:
    return budget_path(0.01, mixed_share_rescue=0.25)


def test_a_late_request_may_pass_the_budget_while_plain_pd_fails_the_slo_and_where_it_meets_it() -> None:
    over = [calm(n, decode_tokens_total=1000, mixed_decode_tokens_total=30) for n in (0, 1)]
    path = rescue_path()
    sched = scheduler_with(path, safe_tokens_per_s=200_000.0)  # leases hold 200k prefill tokens
    sched.on_control_interval(0.0, over)
    # a first late request (6 s of queue + 0.5 s > 5 s) among none: 100 % of recent requests late
    d = sched.choose_path(query(1, wait_s=6.0), 0.0)
    assert path.late_share() == 1.0 and d.path == "borrow"
    # a request the normal path serves in time keeps to the budget whatever the others do
    d = sched.choose_path(query(2, wait_s=2.0), 0.0)
    assert d.path == "normal" and d.code is PathReason.MIXED_SHARE_BUDGET
    # a late request the lease cannot bring within the SLO either (120k tokens: 6 s) is not rescued,
    # though the lease holds it and beats the normal path
    d = sched.choose_path(query(3, wait_s=20.0, input_tokens=120_000), 0.0)
    assert d.path == "normal" and d.code is PathReason.MIXED_SHARE_BUDGET and "late" in d.reason
    free = scheduler_with(budget_path(None), safe_tokens_per_s=200_000.0)
    free.on_control_interval(0.0, over)
    assert free.choose_path(query(3, wait_s=20.0, input_tokens=120_000), 0.0).path == "borrow"
    # a burst: one late request after 9 on time (10 % late, under the 25 % line) keeps to the budget
    burst_path = rescue_path()
    burst = scheduler_with(burst_path, safe_tokens_per_s=200_000.0)
    burst.on_control_interval(0.0, over)
    for i in range(9):
        burst.choose_path(query(10 + i, wait_s=1.0), 0.0)
    d = burst.choose_path(query(20, wait_s=6.0), 0.0)
    assert burst_path.late_share() == pytest.approx(0.1) and d.code is PathReason.MIXED_SHARE_BUDGET


def test_the_rescue_counts_late_requests_over_its_own_window() -> None:
    """Nine requests on time at t=0, then a late one at t=20: over the budget's 10 s window the nine
    have decayed (late share 1 / (9 e^-2 + 1) = 0.45, past the 0.25 line: rescued); over a 100 s
    rescue window they still count (0.12: it keeps to the budget), a burst read against more history."""
    over = [calm(n, decode_tokens_total=1000, mixed_decode_tokens_total=30) for n in (0, 1)]
    shares = {}
    for window in (None, 100.0):
        path = budget_path(0.01, mixed_share_rescue=0.25, mixed_share_rescue_window_s=window)
        sched = scheduler_with(path, safe_tokens_per_s=200_000.0)
        sched.on_control_interval(0.0, over)
        for i in range(9):
            sched.choose_path(query(10 + i, wait_s=1.0), 0.0)
        sched.on_control_interval(20.0, over)
        d = sched.choose_path(query(20, wait_s=6.0), 20.0)
        shares[window] = (round(path.late_share(), 3), d.path)
    assert shares[None] == (round(1 / (9 * math.exp(-2.0) + 1), 3), "borrow")
    assert shares[100.0] == (round(1 / (9 * math.exp(-0.2) + 1), 3), "normal")
    with pytest.raises(ValueError, match="mixed_share_rescue_window_s"):
        budget_path(0.01, mixed_share_rescue=0.25, mixed_share_rescue_window_s=0.0)


def test_the_budget_can_count_borrowed_work_reserved_but_not_yet_run() -> None:
    """A node at 0.5 % of mixed tokens (budget 1 %) takes one borrow; counting that reservation's
    prefill (its time at the lease's rate, times the node's 100 decode tokens/s over the 10 s window)
    puts it past the budget, so the next borrow in the same burst is refused there, where the share
    it has already run would still let it in."""
    node = calm(0, decode_tokens_total=1000, mixed_decode_tokens_total=5)
    decisions = {}
    for counts in (False, True):
        path = budget_path(0.01, mixed_share_counts_reserved=counts)
        sched = scheduler_with(path)
        sched.on_control_interval(0.0, [node])
        first = sched.choose_path(query(1, wait_s=2.0, input_tokens=4000), 0.0)
        assert first.path == "borrow"
        lease = sched.ledger.lease(0)
        assert lease is not None
        held = sched.ledger.held(0).prefill_tokens
        pending = held * lease.ttl_s / lease.budgets.prefill_tokens * 1000 / 10.0
        projected = path.projected_mixed_share(0, sched.ledger)
        assert projected == pytest.approx((5 + pending) / (1000 + pending))
        assert path.mixed_share(0) == pytest.approx(0.005), "what the node has run is unchanged"
        decisions[counts] = sched.choose_path(query(2, wait_s=2.0, input_tokens=4000), 0.0)
    assert decisions[False].path == "borrow"
    assert decisions[True].path == "normal" and decisions[True].code is PathReason.MIXED_SHARE_BUDGET


def test_a_rescue_stops_at_its_ceiling_counting_its_own_work() -> None:
    """Past the budget a late request is rescued only where the node's share, with what it holds and
    the rescued request's own prefill, stays at or under ``mixed_share_rescue_ceiling``."""
    over = [calm(0, decode_tokens_total=1000, mixed_decode_tokens_total=30)]  # 3 %, budget 1 %
    probe = budget_path(0.01, mixed_share_rescue=0.25)
    sched = scheduler_with(probe, safe_tokens_per_s=200_000.0)
    sched.on_control_interval(0.0, over)
    with_request = probe.projected_mixed_share(0, sched.ledger, extra_prefill_tokens=10_000)
    assert 0.03 < with_request < 0.05
    verdicts = {}
    for ceiling in (None, with_request + 1e-6, with_request - 1e-6):
        path = budget_path(0.01, mixed_share_rescue=0.25, mixed_share_rescue_ceiling=ceiling)
        sched = scheduler_with(path, safe_tokens_per_s=200_000.0)
        sched.on_control_interval(0.0, over)
        verdicts[ceiling] = sched.choose_path(query(1, wait_s=6.0), 0.0)
    assert [d.path for d in verdicts.values()] == ["borrow", "borrow", "normal"]
    refused = verdicts[with_request - 1e-6]
    assert refused.code is PathReason.MIXED_SHARE_BUDGET and "late" in refused.reason
    # past the lift's late share (here every recent request is late) the ceiling no longer applies
    lifted = budget_path(
        0.01,
        mixed_share_rescue=0.25,
        mixed_share_rescue_ceiling=with_request - 1e-6,
        mixed_share_ceiling_lift=0.5,
    )
    sched = scheduler_with(lifted, safe_tokens_per_s=200_000.0)
    sched.on_control_interval(0.0, over)
    assert sched.choose_path(query(1, wait_s=6.0), 0.0).path == "borrow" and lifted.late_share() == 1.0
    with pytest.raises(ValueError, match="mixed_share_ceiling_lift"):
        budget_path(0.01, mixed_share_rescue=0.25, mixed_share_ceiling_lift=0.5)  # a lift without a ceiling
    with pytest.raises(ValueError, match="mixed_share_rescue_ceiling"):
        budget_path(0.01, mixed_share_rescue_ceiling=0.05)  # a ceiling without a rescue
    with pytest.raises(ValueError, match="mixed_share_rescue_ceiling"):
        budget_path(0.01, mixed_share_rescue=0.25, mixed_share_rescue_ceiling=1.5)


def test_bad_budget_settings_are_refused() -> None:
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="mixed_share_budget"):
            budget_path(bad)
    with pytest.raises(ValueError, match="mixed_share_window_s"):
        budget_path(0.01, mixed_share_window_s=0.0)
    with pytest.raises(ValueError, match="mixed_share_rescue"):
        budget_path(0.01, mixed_share_rescue=1.5)
    with pytest.raises(ValueError, match="mixed_share_rescue"):
        LeasePath(FakeCost(), mixed_share_budget=0.01, mixed_share_rescue=0.25)  # no SLO to be late for


def test_the_simulator_counts_the_tokens_of_iterations_with_lent_prefill() -> None:
    from tests.test_fair_simulator import _lending_sim

    # node 0 never lends (static), nodes 1 and 2 run the heuristic
    sim = _lending_sim(seed=1, predictor_tokens_per_s=30_000.0, ttl_s=2.0, zero_node=True)
    decode, mixed = [0, 0, 0], [0, 0, 0]
    t = 0.0
    while sim.step_until(t):
        for s in sim.tick_node_states:
            assert s.decode_tokens_total >= decode[s.node_id], "a running total"
            decode[s.node_id] = s.decode_tokens_total
            mixed[s.node_id] = s.mixed_decode_tokens_total
        t += 0.5
    assert sim.counters.borrowed_prefill_tokens > 0
    assert 0 < sum(mixed) < sum(decode)
    assert decode[0] > 0 and mixed[0] == 0  # it decodes, but never mixes lent prefill in
    # every token an iteration produced is counted once, in the interval it was produced in (the
    # histogram also holds the gaps of re-prefills after retractions, which iterations do not produce)
    for w in sim.decode:
        retracted = sum(r.retractions for r in sim.reqs if r.decode_worker == w.idx)
        assert w.decode_tokens_total == w.itl.tokens - retracted and decode[w.idx] <= w.decode_tokens_total


def test_the_catalogs_heuristic_runs_the_budget_with_the_rescue_by_default() -> None:
    from envs.cluster_config import ClusterConfig
    from envs.estimator import ClusterEstimator
    from policies.catalog import make_scheduler
    from policies.context import PolicyContext
    from policies.lease_path import DEFAULT_MIXED_SHARE_BUDGET, DEFAULT_MIXED_SHARE_RESCUE
    from tests.fakes import LinearCostModel

    cfg = ClusterConfig()
    ctx = PolicyContext(ClusterEstimator(cfg, LinearCostModel()), cfg, ConstantPredictor(1e4))  # type: ignore[arg-type]
    for name in ("heuristic", "heuristic-shed", "rl", "greedy-model"):
        sched = make_scheduler(name, ctx, {})
        assert sched is not None and isinstance(sched.path, LeasePath), name
        assert sched.path.mixed_share_budget == DEFAULT_MIXED_SHARE_BUDGET
        assert sched.path.mixed_share_rescue == DEFAULT_MIXED_SHARE_RESCUE
    off = make_scheduler("heuristic", ctx, {"path.mixed_share_budget": None, "path.mixed_share_rescue": None})
    assert off is not None and off.path.mixed_share_budget is None  # type: ignore[attr-defined]


def test_rl_and_its_ablation_keep_to_the_budget_whatever_their_knobs() -> None:
    from types import SimpleNamespace

    from policies.lease_path import DEFAULT_MIXED_SHARE_BUDGET
    from policies.rl_policy import GREEDY_KNOBS, LearnedPath

    cluster = SimpleNamespace(slo_ttft_s=5.0, slo_tpot_s=0.05)
    # 3 % of each node's tokens came from mixed iterations, past the default budget of 0.25 %
    over = [calm(n, decode_tokens_total=1000, mixed_decode_tokens_total=30) for n in (0, 1)]
    assert 0.03 > DEFAULT_MIXED_SHARE_BUDGET

    def scheduler(**kw: object) -> ClusterScheduler:
        path = LearnedPath(FakeCost(), cluster, pool_tokens_per_s=1e4, knobs=GREEDY_KNOBS, **kw)  # type: ignore[arg-type]
        sched = scheduler_with(path)
        sched.on_control_interval(0.0, over)
        return sched

    # the greedy knobs borrow whenever a lease is faster; the budget still keeps an on-time request off
    d = scheduler().choose_path(query(1, wait_s=2.0), 0.0)
    assert d.path == "normal" and d.code is PathReason.MIXED_SHARE_BUDGET
    assert scheduler(mixed_share_budget=None).choose_path(query(1, wait_s=2.0), 0.0).path == "borrow"
    # the rescue counts requests apart from the request-rate feature: one request is one arrival
    sched = scheduler()
    sched.choose_path(query(2, wait_s=2.0), 0.0)
    assert sched.path._arrivals.total == pytest.approx(1.0)  # type: ignore[attr-defined]
    assert sched.path._requests.total == pytest.approx(1.0)  # type: ignore[attr-defined]
