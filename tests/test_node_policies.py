"""Node policies on tiny hand-made node states, with a fake interference predictor."""

from __future__ import annotations

from dataclasses import replace

import pytest

from envs.cluster_config import ClusterConfig
from envs.estimator import ClusterEstimator
from policies.context import PolicyContext
from policies.lease import LeaseBudgets
from policies.node_policies import (
    DecodePressureRule,
    HeuristicPolicy,
    NodePolicy,
    NodePolicyRegistry,
    StaticPolicy,
    UtilisationPolicy,
    make_node_policy,
    node_policy_names,
)
from policies.node_state import NodeState
from tests.fakes import LinearCostModel


class FakePredictor:
    """Safe prefill rate = 10_000 - 500 x batch tokens/s; records the keyword arguments it got."""

    def __init__(self) -> None:
        self.calls: list[dict[str, float]] = []

    def safe_prefill_tokens_per_s(
        self,
        decode_batch_size: int,
        context_tokens_mean: float,
        context_tokens_std: float,
        remaining_output_tokens_mean: float,
        kv_occupancy: float,
        remaining_output_tokens_max: float | None = None,
        remaining_output_tokens_context_weighted: float | None = None,
    ) -> float:
        self.calls.append(
            dict(
                decode_batch_size=decode_batch_size,
                context_tokens_mean=context_tokens_mean,
                context_tokens_std=context_tokens_std,
                remaining_output_tokens_mean=remaining_output_tokens_mean,
                kv_occupancy=kv_occupancy,
            )
        )
        return 10_000.0 - 500.0 * decode_batch_size


def state(**overrides: float) -> NodeState:
    """A calm node: 4 running requests, 10% KV used, 20 ms steps, room for 32 requests."""
    base = NodeState(
        node_id=0,
        time_s=0.0,
        decode_batch_size=4,
        context_tokens_mean=2000.0,
        context_tokens_std=500.0,
        remaining_output_tokens_mean=100.0,
        kv_capacity_tokens=100_000,
        kv_used_tokens=10_000,
        kv_reserved_tokens=400,
        queued_decode_requests=0,
        borrowed_tasks=0,
        borrowed_prefill_tokens_queued=0,
        recent_step_time_s=0.02,
        decode_only_step_time_s=0.02,
        max_running_requests=32,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def test_static_never_lends() -> None:
    policy = StaticPolicy()
    assert isinstance(policy, NodePolicy)
    assert policy.propose(state(decode_batch_size=0, kv_used_tokens=0, recent_step_time_s=0.0)).is_zero()


def test_utilisation_lends_fixed_slice_only_below_threshold() -> None:
    policy = UtilisationPolicy(itl_target_s=0.05, threshold=0.5, ttl_s=2.0, prefill_tokens_per_s=1000.0)
    # max(0.02 / 0.05, 4 / 32) = 0.4 < 0.5: lends.
    assert policy.utilisation(state()) == pytest.approx(0.4)
    assert policy.propose(state()) == LeaseBudgets(2000, 65536, 32768, 16384, 2)
    # KV slice capped by free KV: 100_000 - 95_000 - 400.
    assert policy.propose(state(kv_used_tokens=95_000)).kv_tokens == 4600
    # 0.03 / 0.05 = 0.6: no lease, whatever the contexts look like.
    assert policy.propose(state(recent_step_time_s=0.03)).is_zero()
    assert policy.propose(state(decode_batch_size=16)).is_zero()


def test_heuristic_budgets_by_hand() -> None:
    predictor = FakePredictor()
    policy = HeuristicPolicy(predictor, itl_target_s=0.05, ttl_s=0.5, margin=0.8, max_tasks=4)
    lease = policy.propose(state(borrowed_tasks=1, borrowed_prefill_tokens_queued=1000))
    # prefill: 0.8 x (10_000 - 2_000) x 0.5 - 1_000 queued = 2_200.
    assert lease.prefill_tokens == 2200
    # KV: free = 100_000 - 10_000 - 400 = 89_600; output need 4 x 100 = 400 is covered by the reservation;
    # watermark room = 90_000 - 10_400 = 79_600 -> min = 79_600.
    assert lease.kv_tokens == 79_600
    assert lease.tasks == 3  # max_tasks 4 minus 1 already borrowed
    assert lease.decode_tokens == 3 * 8192
    assert lease.transfer_tokens == min(79_600, int(262144 * 0.5))  # pulled KV must fit the KV budget
    assert predictor.calls[-1] == dict(
        decode_batch_size=4,
        context_tokens_mean=2000.0,
        context_tokens_std=500.0,
        remaining_output_tokens_mean=100.0,
        kv_occupancy=0.1,
    )


def test_heuristic_kv_headroom_for_unreserved_output() -> None:
    policy = HeuristicPolicy(FakePredictor())
    # 4 x 100 = 400 output tokens still to come, none reserved: they come off the free KV (90_000).
    lease = policy.propose(state(kv_reserved_tokens=0, kv_used_tokens=50_000))
    assert lease.kv_tokens == min(100_000 - 50_000 - 400, 90_000 - 50_000) == 40_000
    lease = policy.propose(
        state(kv_reserved_tokens=0, kv_used_tokens=89_000, remaining_output_tokens_mean=200)
    )
    assert lease.kv_tokens == min(11_000 - 800, 1_000) == 1_000


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"queued_decode_requests": 1}, "queued"),
        ({"kv_used_tokens": 91_000}, "KV occupancy"),
        ({"decode_batch_size": 29}, "near max_running_requests"),
        ({"recent_step_time_s": 0.051}, "above ITL target"),
    ],
)
def test_heuristic_decode_always_wins(overrides: dict[str, float], reason: str) -> None:
    policy = HeuristicPolicy(FakePredictor(), itl_target_s=0.05)
    assert not policy.propose(state()).is_zero()
    pressure = policy.decode_pressure(state(**overrides))
    assert pressure is not None and reason in pressure
    assert policy.propose(state(**overrides)).is_zero()
    rule = policy.pressure_rule()  # the same test as data, for a node that holds no policy
    assert rule.reason(state(**overrides)) == pressure and rule.reason(state()) is None
    assert DecodePressureRule.from_dict(rule.to_dict()) == rule


def test_a_slow_step_with_no_decode_batch_is_not_decode_pressure() -> None:
    """Slow recent steps on a node with no decode batch and none queued were borrowed prefill alone:
    no inter-token latency to protect, so the lease stays (and the same rule, sent to a node without
    a policy, does not hold its borrowed work back). With a batch, or a decode queued, it is pressure."""
    policy = HeuristicPolicy(FakePredictor(), itl_target_s=0.05)
    idle = state(decode_batch_size=0, kv_used_tokens=0, recent_step_time_s=0.27)
    assert policy.decode_pressure(idle) is None and not policy.propose(idle).is_zero()
    assert policy.pressure_rule().reason(idle) is None
    assert "above ITL target" in (policy.decode_pressure(replace(idle, decode_batch_size=1)) or "")
    assert "queued" in (policy.decode_pressure(replace(idle, queued_decode_requests=1)) or "")


def test_heuristic_shrinks_monotonically_with_batch() -> None:
    policy = HeuristicPolicy(FakePredictor())
    budgets = [policy.propose(state(decode_batch_size=b)).prefill_tokens for b in (0, 4, 8, 16, 28, 29)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 0 and budgets[-1] == 0


def test_heuristic_zero_when_nothing_usable() -> None:
    policy = HeuristicPolicy(FakePredictor(), max_tasks=2)
    assert policy.propose(state(borrowed_tasks=2)).is_zero()  # task slots used up
    assert policy.propose(state(borrowed_prefill_tokens_queued=10**6)).is_zero()  # compute used up


def test_heuristic_validates_configuration() -> None:
    with pytest.raises(ValueError, match="margin"):
        HeuristicPolicy(FakePredictor(), margin=1.5)
    with pytest.raises(ValueError, match="ttl_s"):
        HeuristicPolicy(FakePredictor(), ttl_s=0.0)
    with pytest.raises(TypeError, match="safe_prefill_tokens_per_s"):
        HeuristicPolicy(object())  # type: ignore[arg-type]


def context(predictor: object | None = None) -> PolicyContext:
    cfg = ClusterConfig(slo_tpot_s=0.04)
    return PolicyContext(ClusterEstimator(cfg, LinearCostModel()), cfg, predictor)  # type: ignore[arg-type]


def test_registry_builds_by_name_from_one_context_and_accepts_plugins() -> None:
    assert {"static", "utilisation", "heuristic"} <= set(node_policy_names())
    heuristic = make_node_policy("heuristic", context(FakePredictor()), ttl_s=0.25)
    assert isinstance(heuristic, HeuristicPolicy) and heuristic.ttl_s == 0.25
    assert heuristic.itl_target_s == 0.04  # the cluster's TPOT SLO, from the context
    assert isinstance(make_node_policy("static", context()), StaticPolicy)
    with pytest.raises(KeyError, match="unknown node policy 'no_such_policy'"):
        make_node_policy("no_such_policy", context())
    with pytest.raises(ValueError, match="node policy 'heuristic' needs an interference-model predictor"):
        make_node_policy("heuristic", context())  # declared need, checked before the factory runs
    with pytest.raises(TypeError, match="node policy 'static'"):
        make_node_policy("static", context(), no_such_field=1)

    registry = NodePolicyRegistry("node policy")  # private: registrations must not leak into other tests
    registry.register("always_one", lambda ctx, ttl_s=1.0: UtilisationPolicy(threshold=99.0, ttl_s=ttl_s))
    assert registry.make("always_one", context(), ttl_s=0.5).propose(state()).tasks == 2
    with pytest.raises(ValueError, match="already registered"):
        registry.register("always_one", lambda ctx: StaticPolicy())
    registry.register("always_one", lambda ctx: StaticPolicy(), replace=True)
    assert registry.make("always_one", context()).propose(state()).is_zero()
    with pytest.raises(ValueError, match="identifier"):
        registry.register("not a name", lambda ctx: StaticPolicy())


def test_smallest_chunk_breaks_is_a_zero_largest_chunk() -> None:
    """The proposal's no-chunk test asks one step time; it agrees with the bisection's size being 0."""
    from envs.cost_model import CostModel
    from policies.node_policies import largest_chunk_within, smallest_chunk_breaks

    config = ClusterConfig.from_shape("2P4D")
    cost = ClusterEstimator(config, CostModel(config.gpu, config.model, config.tp))
    for target in (0.005, 0.02, 0.04):
        for max_chunk in (1, 64, 100, 8192):
            for batch in (0, 1, 8, 64, 256):
                for context in (0, 4_000, 400_000, 4_000_000):
                    chunk, _ = largest_chunk_within(cost, batch, context, target, max_chunk)
                    assert smallest_chunk_breaks(cost, batch, context, target, max_chunk) == (chunk == 0)
