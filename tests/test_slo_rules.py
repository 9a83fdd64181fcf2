"""The SLO-keyed lending rules on hand-built states: the ITL budget, chunks within it, the SLO guard,
the prefill pool's capacity test and the KV of requests pre-allocated before their prefill."""

from __future__ import annotations

from dataclasses import replace

import pytest

from envs.cluster_config import ClusterConfig
from envs.estimator import ClusterEstimator
from policies.context import PolicyContext
from policies.lease_path import LeasePath, prefill_pool_tokens_per_s
from policies.ledger import LeaseLedger
from policies.node_policies import HeuristicPolicy, largest_chunk_within, make_node_policy
from policies.node_state import NodeState
from policies.path import PathReason
from policies.scheduler import CHUNK_CONTEXT_BUCKET_TOKENS, ClusterScheduler
from policies.slo import DEFAULT_ITL_BUDGET_SHARE, itl_budget_s
from tests.fakes import ConstantPredictor
from tests.test_scheduler import FakeCost, calm, query


class StepCost(FakeCost):
    """Mixed iteration = 5 ms + 1 ms per decode request + 10 us per prefill token (context is free)."""

    def __init__(self) -> None:
        self.calls = 0

    def mixed_step_time_s(self, prefill_tokens: int, decode_batch: int, decode_context_tokens: int) -> float:
        self.calls += 1
        return 0.005 + 0.001 * decode_batch + 1e-5 * prefill_tokens


def budget_policy(budget_s: float = 0.04, **kw: object) -> HeuristicPolicy:
    return HeuristicPolicy(
        ConstantPredictor(20_000.0),
        ttl_s=1.0,
        margin=1.0,
        itl_budget_s=budget_s,
        cost=StepCost(),
        max_chunk_tokens=8192,
        **kw,  # type: ignore[arg-type]
    )


def test_itl_budget_is_a_share_of_the_tpot_slo() -> None:
    assert itl_budget_s(0.05) == pytest.approx(DEFAULT_ITL_BUDGET_SHARE * 0.05)
    assert itl_budget_s(0.04, 0.5) == pytest.approx(0.02)
    for bad in ((0.0, 0.5), (0.05, 0.0), (0.05, 1.5)):
        with pytest.raises(ValueError, match="itl_budget_s"):
            itl_budget_s(*bad)


def test_largest_chunk_within_the_step_budget() -> None:
    cost = StepCost()
    # 40 ms budget, batch 10: 5 + 10 + 0.01 x c <= 40 ms -> c <= 2500, in steps of 64 -> 2496
    assert largest_chunk_within(cost, 10, 20_000, 0.040, 8192) == (2496, pytest.approx(0.03996))
    # the budget cannot hold even 64 tokens beside 40 requests (5 + 40 > 40 ms)
    assert largest_chunk_within(cost, 40, 80_000, 0.040, 8192) == (0, 0.0)
    # a generous budget takes the largest chunk; an empty batch has no decode to protect
    assert largest_chunk_within(cost, 1, 2_000, 1.0, 8192)[0] == 8192
    assert largest_chunk_within(cost, 0, 0, 0.001, 4096)[0] == 4096


def test_heuristic_sizes_chunks_against_its_budget_and_stops_lending_when_none_fits() -> None:
    policy = budget_policy(0.040)
    assert policy.borrowed_chunk_tokens(10, 20_000) == 2496
    assert policy.borrowed_chunk_tokens(30, 60_000) == 448  # 5 + 30 + 0.01 x 448 = 39.5 ms
    assert not policy.propose(calm(0, decode_batch_size=10)).is_zero()
    assert policy.propose(calm(0, decode_batch_size=40, max_running_requests=64)).is_zero()
    unbounded = HeuristicPolicy(ConstantPredictor(20_000.0), ttl_s=1.0)
    assert unbounded.borrowed_chunk_tokens(40, 80_000) is None
    with pytest.raises(ValueError, match="needs a cost estimator"):
        HeuristicPolicy(ConstantPredictor(1.0), itl_budget_s=0.04)


def test_scheduler_asks_the_chunk_for_the_live_batch_rounding_context_up() -> None:
    policy = budget_policy(0.040)
    sched = ClusterScheduler(policy, LeaseLedger(), FakeCost(), control_interval_s=0.5)
    assert policy.cost is not None
    assert sched.borrowed_chunk_tokens(0, 10, 20_000) == 2496
    calls = policy.cost.calls  # type: ignore[attr-defined]
    # same batch, context within the same bucket: remembered, no new estimate
    assert sched.borrowed_chunk_tokens(0, 10, 20_000 - CHUNK_CONTEXT_BUCKET_TOKENS // 2) == 2496
    assert policy.cost.calls == calls  # type: ignore[attr-defined]
    no_rule = ClusterScheduler(
        HeuristicPolicy(ConstantPredictor(1.0), ttl_s=1.0), LeaseLedger(), FakeCost(), control_interval_s=0.5
    )
    assert no_rule.borrowed_chunk_tokens(0, 10, 20_000) is None


def test_slo_guard_halves_a_node_over_its_budget_and_only_that_node() -> None:
    sched = ClusterScheduler(budget_policy(0.030), LeaseLedger(), FakeCost(), control_interval_s=0.5)
    assert sched.itl_guard == "slo"
    slow, fast = calm(0, recent_step_time_s=0.035), calm(1, recent_step_time_s=0.020)
    sched.on_control_interval(0.0, [slow, fast])
    assert sched.node_scale == {0: 0.5, 1: 1.0}
    full = sched.ledger.lease(1)
    halved = sched.ledger.lease(0)
    assert full is not None and halved is not None
    assert halved.budgets.prefill_tokens == full.budgets.prefill_tokens // 2
    sched.on_control_interval(0.5, [replace(slow, recent_step_time_s=0.02), fast])
    assert sched.node_scale[0] == pytest.approx(0.6)  # recovers by 0.1 per interval below budget
    # the relative guard stays selectable, and bad values are refused
    relative = ClusterScheduler(budget_policy(), LeaseLedger(), FakeCost(), itl_guard=1.25)
    relative.on_control_interval(0.0, [slow, fast])
    assert relative.node_scale == {} and relative.lend_scale == 1.0
    with pytest.raises(ValueError, match="itl_guard"):
        ClusterScheduler(budget_policy(), LeaseLedger(), FakeCost(), itl_guard="tight")  # type: ignore[arg-type]


def capacity_path(pool_tokens_per_s: float = 40_000.0) -> LeasePath:
    return LeasePath(
        FakeCost(),
        congestion="capacity",
        slo_ttft_s=5.0,
        ttft_share=0.4,
        pool_tokens_per_s=pool_tokens_per_s,
        arrival_window_s=5.0,
    )


def test_capacity_test_leaves_a_draining_queue_alone() -> None:
    path = capacity_path()
    # 1.5 s of queue, but one 10k-token request per second arrives: 10k tok/s against a 40k pool
    for i in range(10):
        d = path.choose(query(i, wait_s=1.5), float(i), LeaseLedger())
        assert d.code is PathReason.NOT_CONGESTED
    assert path.arrival_tokens_per_s() < 40_000
    # the old fixed-wait rule calls the same queue congested
    old = LeasePath(FakeCost(), congestion="wait")
    assert old.congestion_reason(query(wait_s=1.5), 0.0) is not None


def test_capacity_test_borrows_when_work_outruns_the_pool_or_the_ttft_slo_is_at_risk() -> None:
    path = capacity_path()
    reasons = [path.congestion_reason(query(i, wait_s=0.5), i * 0.05) for i in range(30)]
    # 10k tokens every 50 ms = 200k tok/s arriving: soon past the 40k pool, and then congested
    assert reasons[0] is None and reasons[-1] is not None and "pool" in reasons[-1]
    # below capacity, a wait within the share of the SLO is fine, past it congested
    calm_path = capacity_path()
    assert calm_path.congestion_reason(query(wait_s=1.9), 0.0) is None
    assert "TTFT SLO" in (calm_path.congestion_reason(query(wait_s=2.1), 10.0) or "")
    # below the fixed floor nobody borrows, however fast work arrives
    assert all(path.congestion_reason(query(100 + i, wait_s=0.1), 2.0 + i * 0.01) is None for i in range(5))
    with pytest.raises(ValueError, match="capacity test"):
        LeasePath(FakeCost(), congestion="capacity")


def test_pool_rate_is_the_prefill_workers_at_full_chunks() -> None:
    cfg = ClusterConfig(n_prefill=2, n_decode=4)
    ctx = PolicyContext(FakeCost(), cfg)  # type: ignore[arg-type]
    assert prefill_pool_tokens_per_s(ctx) == pytest.approx(40_000.0)


def waiting_state(**overrides: float) -> NodeState:
    """95 % of KV used, 70 points of it pre-allocated for requests still waiting for prefill."""
    fields: dict[str, float] = dict(
        kv_capacity_tokens=1_000_000,
        kv_used_tokens=950_000,
        kv_reserved_tokens=2_000,
        kv_prealloc_waiting_tokens=700_000,
        prealloc_waiting_output_tokens=20_000,
    )
    return calm(0, **{**fields, **overrides})


def test_kv_of_requests_waiting_for_prefill_is_left_out_of_the_watermark_only_when_asked() -> None:
    s = waiting_state()
    assert s.kv_occupancy == pytest.approx(0.95) and s.kv_decoding_occupancy == pytest.approx(0.25)
    counted = budget_policy(1.0)
    assert counted.decode_pressure(s) is not None and counted.propose(s).is_zero()
    discounted = budget_policy(1.0, discount_prealloc_kv=True)
    assert discounted.decode_pressure(s) is None
    lease = discounted.propose(s)
    # KV lent is still real free KV (48k) less the running output (400) and the waiting requests'
    # expected output (20k) beyond the 2k already reserved
    assert lease.kv_tokens == 48_000 - (400 + 20_000 - 2_000)
    # and never KV that is not free
    full = waiting_state(kv_used_tokens=998_000)
    assert discounted.propose(full).kv_tokens == 0


def test_the_catalogs_heuristic_runs_the_slo_rules_by_default() -> None:
    cfg = ClusterConfig(slo_tpot_s=0.04)
    from tests.fakes import LinearCostModel

    ctx = PolicyContext(ClusterEstimator(cfg, LinearCostModel()), cfg, ConstantPredictor(1.0))  # type: ignore[arg-type]
    policy = make_node_policy("heuristic", ctx)
    assert isinstance(policy, HeuristicPolicy)
    assert policy.itl_budget_s == pytest.approx(itl_budget_s(0.04))
    assert policy.discount_prealloc_kv and policy.max_chunk_tokens == cfg.prefill_chunk_tokens
    old = make_node_policy("heuristic", ctx, itl_budget_share=None, discount_prealloc_kv=False)
    assert isinstance(old, HeuristicPolicy) and old.itl_budget_s is None and not old.discount_prealloc_kv


def test_heuristic_datasheet_swaps_only_the_safe_rate_for_the_roofline_one() -> None:
    from envs.datasheet import DatasheetSafeRate, datasheet_from_learned
    from interference_model.artifact import load_predictor
    from policies.catalog import make_scheduler, policy_spec

    learned = load_predictor(
        "interference_model/data/h200_gpt-oss-120b_tp1", gpu="H200", model="gpt-oss-120b", tp=1
    )
    sheet = datasheet_from_learned(learned)
    assert isinstance(sheet, DatasheetSafeRate)
    busy = dict(context_tokens_mean=12_000.0, context_tokens_std=3_000.0, remaining_output_tokens_mean=300.0)
    # the roofline leaves out every calibrated cost, so its safe rate is above the learned one
    for batch in (1, 16, 48):
        roof = sheet.safe_prefill_tokens_per_s(batch, kv_occupancy=0.3, **busy)
        assert roof > learned.safe_prefill_tokens_per_s(batch, kv_occupancy=0.3, **busy) > 0
    # and the KV cap is the learned predictor's: a full node lends nothing
    assert sheet.safe_prefill_tokens_per_s(16, kv_occupancy=0.999, **busy) == 0.0
    with pytest.raises(ValueError, match="metadata"):
        datasheet_from_learned(ConstantPredictor(1.0))
    assert policy_spec("heuristic-datasheet").grid == policy_spec("heuristic").grid
    cfg = ClusterConfig()
    from tests.fakes import LinearCostModel

    ctx = PolicyContext(ClusterEstimator(cfg, LinearCostModel()), cfg, learned)  # type: ignore[arg-type]
    sched = make_scheduler("heuristic-datasheet", ctx, {})
    assert sched is not None
    node = sched.policy_for(0)
    assert isinstance(node, HeuristicPolicy) and isinstance(node.predictor, DatasheetSafeRate)
    assert node.itl_budget_s == pytest.approx(itl_budget_s(cfg.slo_tpot_s))


def test_decode_side_prefix_reuse_borrows_an_uncongested_turn_where_its_prefix_sits() -> None:
    policy = HeuristicPolicy(ConstantPredictor(20_000.0), ttl_s=1.0, margin=1.0)
    path = LeasePath(FakeCost(), congestion="wait", prefix_reuse_share=0.5)
    sched = ClusterScheduler(policy, LeaseLedger(), FakeCost(), path=path, control_interval_s=0.5)
    sched.on_control_interval(0.0, [calm(0), calm(1)])
    # not congested, but node 1 holds 9k of the 10k-token prompt: it prefills the 1k suffix there
    d = sched.choose_path(query(1, wait_s=0.1, decode_cached_tokens={0: 2_000, 1: 9_000}), 0.0)
    assert d.path == "borrow" and d.node_id == 1 and d.code is PathReason.BORROWED
    assert sched.ledger.held_by(d.reservation_id).prefill_tokens == 1_000  # type: ignore[arg-type]
    # below the share: the normal path, as without the rule
    d = sched.choose_path(query(2, wait_s=0.1, decode_cached_tokens={0: 4_000}), 0.0)
    assert d.path == "normal" and d.code is PathReason.NOT_CONGESTED
    off = ClusterScheduler(
        policy,
        LeaseLedger(),
        FakeCost(),
        path=LeasePath(FakeCost(), congestion="wait"),
        control_interval_s=0.5,
    )
    off.on_control_interval(0.0, [calm(0), calm(1)])
    assert off.choose_path(query(3, wait_s=0.1, decode_cached_tokens={1: 9_000}), 0.0).path == "normal"
    with pytest.raises(ValueError, match="prefix_reuse_share"):
        LeasePath(FakeCost(), prefix_reuse_share=1.5)


def test_admission_control_sheds_a_congested_request_no_path_can_serve_in_time() -> None:
    path = LeasePath(
        FakeCost(),
        congestion="capacity",
        slo_ttft_s=5.0,
        pool_tokens_per_s=40_000.0,
        shed_ttft_factor=2.0,
    )
    policy = HeuristicPolicy(ConstantPredictor(20_000.0), ttl_s=1.0, margin=1.0)
    sched = ClusterScheduler(policy, LeaseLedger(), FakeCost(), path=path, control_interval_s=0.5)
    # no lease yet: a request 12 s behind the queue cannot meet 2 x 5 s
    d = sched.choose_path(query(1, wait_s=12.0), 0.0)
    assert d.path == "shed" and d.node_id is None and d.code is PathReason.SHED
    # a lease that brings it within the limit: borrowed, not shed
    sched.on_control_interval(0.0, [calm(0)])
    assert sched.choose_path(query(2, wait_s=12.0), 0.0).path == "borrow"
    # 8 s of queue is past the TTFT SLO but within 2x: served late, not shed
    assert path.choose(query(3, wait_s=8.0), 0.0, LeaseLedger()).path == "normal"
    with pytest.raises(ValueError, match="shed_ttft_factor"):
        LeasePath(FakeCost(), shed_ttft_factor=2.0)  # no SLO to key it to


def test_shed_requests_stay_in_the_slo_denominator_as_misses() -> None:
    from envs.cost_model import CostModel
    from envs.simulator import Simulator
    from policies.path import NormalOnly, PathDecision, PathPolicy
    from tests.fakes import open_trace

    class ShedOdd(PathPolicy):
        """Sheds every odd request; the rest take the normal path."""

        def choose(self, q, now_s, ledger):  # type: ignore[no-untyped-def]
            if q.request_id % 2:
                return PathDecision("shed", None, None, 0.0, None, "odd", PathReason.SHED)
            return NormalOnly(FakeCost()).choose(q, now_s, ledger)

    cfg = ClusterConfig(n_prefill=1, n_decode=1)
    cm = CostModel(cfg.gpu, cfg.model, cfg.tp)
    trace = open_trace([(0.5 * i, 1000, 20) for i in range(10)])
    sched = ClusterScheduler(StaticLike(), LeaseLedger(), FakeCost(), path=ShedOdd(), control_interval_s=0.5)
    sim = Simulator(trace, cfg, scheduler=sched, cost_model=cm)
    res = sim.run()
    m = res.metrics
    assert (sim.counters.shed, sim.counters.rejected, m.n_rejected, m.n_finished) == (5, 0, 0, 5)
    assert m.slo_attainment == pytest.approx(m.n_slo_met / 10) and m.slo_attainment <= 0.5
    assert res.requests["error"].str.startswith("shed: ").sum() == 5


class StaticLike:
    ttl_s = 1.0

    def propose(self, state: NodeState) -> object:
        from policies.lease import LeaseBudgets

        return LeaseBudgets.zero()


def test_heuristic_shed_is_the_heuristic_with_admission_control() -> None:
    from policies.catalog import make_scheduler, policy_spec
    from policies.lease_path import DEFAULT_SHED_TTFT_FACTOR
    from tests.fakes import LinearCostModel

    cfg = ClusterConfig()
    ctx = PolicyContext(ClusterEstimator(cfg, LinearCostModel()), cfg, ConstantPredictor(1e4))  # type: ignore[arg-type]
    shed, plain = make_scheduler("heuristic-shed", ctx, {}), make_scheduler("heuristic", ctx, {})
    assert shed is not None and plain is not None
    assert shed.path.shed_limit_s == pytest.approx(DEFAULT_SHED_TTFT_FACTOR * cfg.slo_ttft_s)  # type: ignore[attr-defined]
    assert plain.path.shed_limit_s == float("inf")  # type: ignore[attr-defined]
    assert policy_spec("heuristic-shed").grid == policy_spec("heuristic").grid
