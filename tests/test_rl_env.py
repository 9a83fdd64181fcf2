"""The ``rl`` environment and policy: gymnasium contract, determinism, reward terms on hand-built
requests, knob mapping, features, the scheduler's lease-share hook, and that the deployed policy and
the environment take the same decisions."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from envs.cluster_config import ClusterConfig
from envs.estimator import ClusterEstimator
from envs.rl_env import EnvConfig, GoodputCounter, PathLeaseEnv, RewardWeights, Window, draw_windows
from envs.sim_state import SHED_ERROR_PREFIX
from policies.catalog import make_scheduler, policy_spec, tuned_params
from policies.context import PolicyContext
from policies.lease import LeaseBudgets
from policies.ledger import LeaseLedger
from policies.node_state import NodeState
from policies.path import PathQuery
from policies.rl_policy import (
    ACTIONS,
    FEATURES,
    GREEDY_KNOBS,
    HEURISTIC_KNOBS,
    KNOB_RANGES,
    Knobs,
    LearnedPath,
    MlpWeights,
    action_to_knobs,
    save_artifact,
)
from policies.scheduler import ClusterScheduler
from tests.fakes import LinearCostModel


class FakePredictor:
    """Safe throughput falls linearly with the batch: 20,000 tok/s idle, zero at 64 requests."""

    def safe_prefill_tokens_per_s(
        self,
        decode_batch_size: float,
        context_tokens_mean: float,
        context_tokens_std: float,
        remaining_output_tokens_mean: float,
        kv_occupancy: float,
        remaining_output_tokens_max: float | None = None,
        remaining_output_tokens_context_weighted: float | None = None,
    ) -> float:
        return max(0.0, 20_000.0 * (1.0 - decode_batch_size / 64.0))


TINY = EnvConfig(load_range=(2.5, 2.5), warmup_s_range=(4.0, 4.0), episode_steps=4)
"""Short episodes of the real environment (Mooncake development side, 2P4D)."""


@pytest.fixture(scope="module")
def tiny_env() -> PathLeaseEnv:
    return PathLeaseEnv(TINY, predictor=FakePredictor())


def node_state(**changes: Any) -> NodeState:
    base = NodeState(
        node_id=0,
        time_s=1.0,
        decode_batch_size=8,
        context_tokens_mean=4000.0,
        context_tokens_std=500.0,
        remaining_output_tokens_mean=100.0,
        kv_capacity_tokens=1_000_000,
        kv_used_tokens=32_000,
        kv_reserved_tokens=400,
        queued_decode_requests=0,
        borrowed_tasks=0,
        borrowed_prefill_tokens_queued=0,
        recent_step_time_s=0.02,
        decode_only_step_time_s=0.02,
        max_running_requests=256,
    )
    return dataclasses.replace(base, **changes)


def query(rid: int, uncached: int, output: int, wait_s: float = 0.0) -> PathQuery:
    return PathQuery(
        request_id=rid,
        session_id=rid,
        input_tokens=uncached,
        expected_output_tokens=output,
        normal_uncached_tokens=uncached,
        normal_queue_wait_s=wait_s,
        normal_prefill_worker=0,
    )


def _ctx(predictor: Any = None) -> PolicyContext:
    cfg = ClusterConfig(n_prefill=2, n_decode=4)
    return PolicyContext(ClusterEstimator(cfg, LinearCostModel()), cfg, predictor)  # type: ignore[arg-type]


# ---- gymnasium contract and determinism -------------------------------------------------------------
def test_gymnasium_check_env(tiny_env: PathLeaseEnv) -> None:
    import warnings

    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any checker warning fails the test
        check_env(tiny_env, skip_render_check=True)
    assert tiny_env.observation_space.shape == (len(FEATURES),)
    assert tiny_env.action_space.shape == (len(ACTIONS),)


def _episode(env: PathLeaseEnv, seed: int, actions: np.ndarray) -> list[Any]:
    obs, info = env.reset(seed=seed)
    out: list[Any] = [obs.tolist(), info["window"]]
    for a in actions:
        obs, reward, terminated, truncated, info = env.step(a)
        out.append((obs.tolist(), reward, terminated, truncated, info["met"], info["missed"], info["shed"]))
        if terminated or truncated:
            break
    return out


def test_same_seed_same_episode_and_other_seed_another(tiny_env: PathLeaseEnv) -> None:
    actions = np.random.default_rng(3).uniform(-1, 1, (TINY.episode_steps, len(ACTIONS))).astype(np.float32)
    first = _episode(tiny_env, 11, actions)
    again = _episode(PathLeaseEnv(TINY, predictor=FakePredictor()), 11, actions)
    assert first == again
    assert _episode(tiny_env, 12, actions)[1] != first[1]  # another window
    assert first[-1][3]  # truncated after episode_steps


def test_observations_stay_in_the_box_and_training_uses_the_development_side(tiny_env: PathLeaseEnv) -> None:
    from envs.splits import development_trace

    assert tiny_env.side == "dev" and len(tiny_env.trace.requests) == len(
        development_trace("mooncake").requests
    )
    obs, _ = tiny_env.reset(seed=5)
    for _ in range(TINY.episode_steps):
        assert tiny_env.observation_space.contains(obs)
        obs, *_ = tiny_env.step(tiny_env.action_space.sample())
    with pytest.raises(ValueError, match="side must be one of"):
        PathLeaseEnv(TINY, predictor=FakePredictor(), side="test")


# ---- reward terms on hand-built requests -------------------------------------------------------------
def _req(
    rid: int, arrival: float, first: float = math.nan, finish: float = math.nan, output: int = 11
) -> Any:
    return SimpleNamespace(
        rid=rid, arrival_s=arrival, first_token_s=first, finish_s=finish, output=output, error=""
    )


def test_goodput_counter_counts_each_request_once_when_its_fate_is_known() -> None:
    c = GoodputCounter(slo_ttft_s=5.0, slo_tpot_s=0.05)
    ok = _req(0, 0.0, first=1.0, finish=1.4)  # TTFT 1 s, TPOT 0.04 s: met at the finish
    c.on_first_token(ok)
    assert c.counts() == (0, 0, 0)
    c.on_finish(ok)
    late = _req(1, 0.0, first=6.0, finish=6.1)  # TTFT 6 s: a miss at the first token, not again at the end
    c.on_first_token(late)
    assert c.counts() == (1, 1, 0)
    c.on_finish(late)
    slow = _req(2, 0.0, first=1.0, finish=2.0)  # TPOT 0.1 s: a miss at the finish
    c.on_first_token(slow)
    c.on_finish(slow)
    one = _req(3, 0.0, first=4.9, finish=4.9, output=1)  # a single output token has no TPOT
    c.on_first_token(one)
    c.on_finish(one)
    shed, refused = _req(4, 0.0), _req(5, 0.0)
    shed.error, refused.error = SHED_ERROR_PREFIX + "past capacity", "exceeds the context window"
    c.on_reject(shed)
    c.on_reject(refused)  # a context-window refusal leaves the count, as in compare
    assert c.counts() == (2, 2, 1)
    waiting = [_req(6, 0.0), _req(7, 8.0), _req(8, 1.0, first=2.0), _req(9, math.nan)]
    assert c.past_deadline(SimpleNamespace(now_s=10.0, reqs=waiting)) == 1  # only request 6 is past 5 s
    w = RewardWeights()
    assert w.reward(*c.counts()) == 2 - 2 - 1
    assert RewardWeights(met_value=2.0, miss_cost=0.5, shed_cost=3.0).reward(4, 2, 1) == 8 - 1 - 3


def test_step_reward_is_the_weighted_goodput_counts(tiny_env: PathLeaseEnv) -> None:
    tiny_env.reset(seed=2)
    total = 0
    for _ in range(TINY.episode_steps):
        _, reward, _, _, info = tiny_env.step(HEURISTIC_KNOBS.to_action())
        assert reward == info["met"] - info["missed"] - info["shed"]
        total += info["met"]
    assert total > 0  # a loaded window finishes requests within the SLO


# ---- knobs ---------------------------------------------------------------------------------------------
def test_actions_map_onto_the_knob_ranges_and_back() -> None:
    low, high = action_to_knobs(-np.ones(4)), action_to_knobs(np.ones(4) * 7)  # clipped
    for name in ACTIONS:
        lo, hi = getattr(KNOB_RANGES, name)
        assert math.isclose(getattr(low, name), lo) and math.isclose(getattr(high, name), hi)
    for knobs in (HEURISTIC_KNOBS, GREEDY_KNOBS, Knobs(0.5, 0.3, 0.2, 2.0)):
        back = action_to_knobs(knobs.to_action())
        assert math.isclose(back.wait_share, knobs.wait_share, abs_tol=1e-6)
        assert math.isclose(back.lease_share, knobs.lease_share, abs_tol=1e-6)
    assert action_to_knobs(HEURISTIC_KNOBS.to_action()).shed_factor == KNOB_RANGES.shed_factor[1]
    with pytest.raises(ValueError, match="4 finite numbers"):
        action_to_knobs(np.array([0.0, np.nan, 0.0, 0.0]))


def test_knobs_steer_the_lease_rule() -> None:
    path = LearnedPath(_ctx().cost, _ctx().cluster, pool_tokens_per_s=1e4, knobs=GREEDY_KNOBS)
    assert (path.wait_limit_s, path.borrow_margin, path.shed_limit_s) == (0.0, 0.0, math.inf)
    path.set_knobs(Knobs(1.0, 0.4, 0.1, 2.0))
    assert (path.wait_limit_s, path.borrow_margin, path.shed_limit_s) == (2.0, 0.1, 10.0)
    ledger = LeaseLedger()
    # a request already past 2x the TTFT SLO on the normal path with no lease anywhere is shed
    decision = path.choose(query(1, 8000, 100, wait_s=20.0), 0.0, ledger)
    assert decision.path == "shed"
    path.set_knobs(HEURISTIC_KNOBS)
    assert path.choose(query(2, 8000, 100, wait_s=20.0), 0.0, ledger).path == "normal"


# ---- features ------------------------------------------------------------------------------------------
def test_features_see_the_traffic_mix_and_the_pool() -> None:
    ctx = _ctx(FakePredictor())
    path = LearnedPath(ctx.cost, ctx.cluster, pool_tokens_per_s=1e4, predictor=FakePredictor())
    states = [node_state(node_id=i) for i in range(4)]
    for t in range(30):  # prefill-heavy traffic: 8k uncached tokens per 100 output tokens
        path.choose(query(t, 8000, 100), float(t), LeaseLedger())
    heavy = path.features(30.0, states)
    for t in range(30, 400):  # then output-heavy traffic for six minutes
        path.choose(query(t, 200, 2000), float(t), LeaseLedger())
    light = path.features(400.0, states)
    i60, i300 = FEATURES.index("log_mix_60s"), FEATURES.index("log_mix_300s")
    assert heavy[i60] > light[i60] and heavy[i300] > light[i300]
    assert heavy[FEATURES.index("arrival_over_pool_60s")] > 0
    for f in (heavy, light):
        assert f.dtype == np.float32 and f.shape == (len(FEATURES),) and ((0 <= f) & (f <= 1)).all()
    pressured = path.features(400.0, [node_state(node_id=0, queued_decode_requests=3), *states[1:]])
    assert pressured[FEATURES.index("decode_pressure_share")] == 0.25


# ---- the scheduler's lease-share hook ------------------------------------------------------------------
class _FixedNode:
    ttl_s = 2.0

    def propose(self, state: NodeState) -> LeaseBudgets:
        return LeaseBudgets(
            prefill_tokens=10_000, kv_tokens=50_000, transfer_tokens=0, decode_tokens=0, tasks=2
        )


def test_a_path_policy_plan_scales_the_published_prefill_budget() -> None:
    ctx = _ctx()
    path = LearnedPath(ctx.cost, ctx.cluster, pool_tokens_per_s=1e4, knobs=Knobs(0.5, 0.4, 0.1, None))
    scheduler = ClusterScheduler(_FixedNode(), LeaseLedger(), ctx.cost, path=path, itl_guard=None)
    scheduler.on_control_interval(0.0, [node_state(node_id=0), node_state(node_id=1)])
    lease = scheduler.ledger.lease(0)
    assert lease is not None and lease.budgets.prefill_tokens == 5_000 and lease.budgets.kv_tokens == 50_000
    path.set_knobs(HEURISTIC_KNOBS)  # share 1: the node policy's proposal unchanged
    scheduler.on_control_interval(0.5, [node_state(node_id=0), node_state(node_id=1)])
    lease = scheduler.ledger.lease(1)
    assert lease is not None and lease.budgets.prefill_tokens == 10_000


# ---- catalog and deployment ------------------------------------------------------------------------------
def test_rl_and_its_ablation_size_leases_as_the_tuned_heuristic() -> None:
    heuristic = {k: v for k, v in tuned_params("heuristic").items() if not k.startswith("path.")}
    assert heuristic and tuned_params("rl") == heuristic == tuned_params("greedy-model")
    assert policy_spec("rl").needs_predictor and policy_spec("rl").path == "rl"
    assert policy_spec("greedy-model").path == "greedy-model"


def _constant_policy(tmp_path: Path, action: np.ndarray) -> Path:
    """An artifact whose actor always answers ``action`` (zero weights, the action as the last bias)."""
    n = len(FEATURES)
    layers = ((np.zeros((8, n)), np.zeros(8)), (np.zeros((len(ACTIONS), 8)), action.astype(np.float64)))
    weights = MlpWeights(layers, np.zeros(n), np.ones(n))
    return save_artifact(tmp_path / "constant.npz", weights, {"decision_intervals": TINY.decision_intervals})


def test_the_deployed_policy_decides_as_the_environment_does(tmp_path: Path) -> None:
    env = PathLeaseEnv(TINY, predictor=FakePredictor())
    action = Knobs(0.8, 0.2, 0.05, 1.5).to_action()
    window = Window(start=0.3, load=3.0, sim_seed=7, warmup_s=0.0)
    env.reset(options={"window": window})
    met = missed = shed = 0
    for _ in range(TINY.episode_steps):
        _, _, _, _, info = env.step(action)
        met, missed, shed = met + info["met"], missed + info["missed"], shed + info["shed"]
    artifact = _constant_policy(tmp_path, action)
    deployed = env.run_policy(window, "rl", {**tuned_params("rl"), "path.artifact": str(artifact)})
    assert (deployed["missed"], deployed["shed"]) == (missed, shed) and deployed[
        "reward"
    ] == met - missed - shed
    scheduler = make_scheduler("rl", _ctx(FakePredictor()), {"path.artifact": str(artifact)})
    assert scheduler is not None and isinstance(scheduler.path, LearnedPath)
    assert scheduler.path.decision_intervals == TINY.decision_intervals


def test_validation_windows_cover_the_load_range() -> None:
    windows = draw_windows(EnvConfig(), 6, seed=1)
    assert [w.load for w in windows] == [1.5, 2.75, 4.0] * 2
    assert windows == draw_windows(EnvConfig(), 6, seed=1) and windows != draw_windows(EnvConfig(), 6, seed=2)
