"""The lease environment's contract: check_env, determinism, reward terms, the shield."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from envs.rl_env import EnvConfig, LeaseEnv, RewardWeights, Window, counters_delta, reward_terms
from envs.simulator import Counters
from policies.lease import LeaseBudgets
from policies.node_policies import StaticPolicy
from policies.node_state import NodeState
from policies.rl_policy import (
    N_ACTIONS,
    LeaseShape,
    MlpWeights,
    RLPolicy,
    action_to_controls,
    lease_budgets,
    observe,
)
from tests.fakes import session_trace


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


TINY = EnvConfig(
    shape="1P2D",
    n_sessions=6,
    base_session_rate_per_s=4.0,
    load_range=(1.0, 2.0),
    warmup_s_range=(0.0, 2.0),
    episode_intervals=12,
    eval_fraction=0.25,
)


def tiny_env(split: str = "train", config: EnvConfig = TINY) -> LeaseEnv:
    trace = session_trace(8, 5, first_input=40_000, grow=8000, output=40, think_s=0.2)
    return LeaseEnv(config, predictor=FakePredictor(), trace=trace, split=split)


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


def test_gymnasium_check_env() -> None:
    import warnings

    import gymnasium
    from gymnasium.utils.env_checker import check_env

    from envs.rl_env import ENV_ID

    trace = session_trace(8, 5, first_input=40_000, grow=8000, output=40, think_s=0.2)
    env = gymnasium.make(ENV_ID, config=TINY, predictor=FakePredictor(), trace=trace)
    assert env.spec is not None and env.spec.id == ENV_ID
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped, skip_render_check=True)
    assert not [w for w in caught if "spec" in str(w.message)], [str(w.message) for w in caught]


def test_sb3_check_env() -> None:
    from stable_baselines3.common.env_checker import check_env

    check_env(tiny_env(), warn=True)


def rollout(env: LeaseEnv, seed: int, n_steps: int) -> list[tuple[np.ndarray, float, bool, bool]]:
    actions = np.random.default_rng(99).uniform(-1, 1, (n_steps, N_ACTIONS)).astype(np.float32)
    obs, _ = env.reset(seed=seed)
    out = [(obs, 0.0, False, False)]
    for a in actions:
        obs, r, term, trunc, _ = env.step(a)
        out.append((obs, r, term, trunc))
        if term or trunc:
            obs, _ = env.reset()
    return out


def test_same_seed_same_trajectory_and_different_seed_differs() -> None:
    a = rollout(tiny_env(), seed=3, n_steps=60)
    b = rollout(tiny_env(), seed=3, n_steps=60)
    c = rollout(tiny_env(), seed=4, n_steps=60)
    for (oa, ra, ta, ua), (ob, rb, tb, ub) in zip(a, b, strict=True):
        np.testing.assert_array_equal(oa, ob)
        assert (ra, ta, ua) == (rb, tb, ub)
    assert any(not np.array_equal(x[0], y[0]) or x[1] != y[1] for x, y in zip(a, c, strict=True))


def test_reward_terms_on_hand_built_counter_differences() -> None:
    before = Counters(prefill_tokens=50_000, output_tokens=100, itl_slo_miss_tokens=5, fallbacks=1)
    after = Counters(
        prefill_tokens=150_000, output_tokens=600, itl_slo_miss_tokens=15, ttft_slo_misses=2, fallbacks=2
    )
    delta = counters_delta(after, before)
    assert (delta.prefill_tokens, delta.output_tokens, delta.itl_slo_miss_tokens) == (100_000, 500, 10)
    terms = reward_terms(delta, RewardWeights())
    # 100k input tokens x 1e-5, 500 output x 1e-3, 10 ITL misses x 2e-3, 2 TTFT misses x 0.5, 1 fallback x 0.2
    assert terms == pytest.approx(
        {
            "input_tokens": 1.0,
            "output_tokens": 0.5,
            "itl_misses": -0.02,
            "ttft_misses": -1.0,
            "fallbacks": -0.2,
        }
    )
    assert reward_terms(Counters(), RewardWeights()) == pytest.approx(dict.fromkeys(terms, 0.0))


def test_step_rewards_share_each_interval_reward_across_nodes() -> None:
    env = tiny_env()
    env.reset(seed=1)
    n = env.n_nodes
    step_rewards, interval_rewards = [], []
    while True:
        _, r, term, trunc, info = env.step(np.ones(N_ACTIONS, np.float32))
        step_rewards.append(r)
        if "reward_terms" in info:
            interval_rewards.append(sum(info["reward_terms"].values()))
            assert r == pytest.approx(interval_rewards[-1] / n)
        if term or trunc:
            break
    # Interval k's reward is paid 1/n at its last step and (n-1)/n over the next interval's first steps.
    expected = sum(interval_rewards) - (n - 1) / n * interval_rewards[-1]
    assert sum(step_rewards) == pytest.approx(expected)
    assert len(interval_rewards) == TINY.episode_intervals or term


def test_no_lending_episode_equals_static_replay() -> None:
    """Actions of -1 (lend nothing) reproduce ``run_policy(static)`` on the same window exactly."""
    env = tiny_env()
    window = Window(sample_seed=5, load=1.5, sim_seed=7, warmup_s=1.0)
    env.reset(seed=0, options={"window": window})
    total = 0.0
    while True:
        _, _, term, trunc, info = env.step(-np.ones(N_ACTIONS, np.float32))
        total += sum(info.get("reward_terms", {}).values())
        if term or trunc:
            break
    static = env.run_policy(window, StaticPolicy())
    assert static["reward"] == pytest.approx(total, rel=1e-12)
    assert static["borrowed_prefill_tokens"] == 0


def test_lending_borrows_on_a_congested_tiny_cluster() -> None:
    env = tiny_env()
    window = Window(sample_seed=5, load=2.0, sim_seed=7, warmup_s=1.0)
    env.reset(seed=0, options={"window": window})
    borrowed = 0
    while True:
        _, _, term, trunc, _ = env.step(np.ones(N_ACTIONS, np.float32))
        if term or trunc:
            break
    assert env._sim is not None
    borrowed = env._sim.counters.borrowed_prefill_tokens
    assert borrowed > 0


def test_shield_never_lends_above_the_prediction() -> None:
    shape = LeaseShape(ttl_s=2.0, max_tasks=4)
    rng = np.random.default_rng(0)
    for _ in range(200):
        state = node_state(
            decode_batch_size=int(rng.integers(0, 60)), kv_used_tokens=int(rng.integers(0, 800_000))
        )
        safe = float(rng.uniform(0, 30_000))
        scale, tasks = action_to_controls(rng.uniform(-1.5, 1.5, N_ACTIONS), shape)
        budgets = lease_budgets(state, safe, scale, tasks, shape)
        assert budgets.prefill_tokens <= safe * shape.ttl_s
        assert budgets.tasks <= shape.max_tasks
    unshielded = dataclasses.replace(shape, shield=False)
    scale, tasks = action_to_controls(np.ones(N_ACTIONS), unshielded)
    assert scale == unshielded.unshielded_max_scale
    assert lease_budgets(node_state(), 1000.0, scale, tasks, unshielded).prefill_tokens == 4000


def always_lend_policy(shape: LeaseShape) -> RLPolicy:
    """A policy whose action is always (+big, +big) -> clipped to lend the maximum."""
    n = len(observe(node_state(), 1.0, shape))
    weights = MlpWeights(((np.zeros((N_ACTIONS, n)), np.full(N_ACTIONS, 5.0)),), np.zeros(n), np.ones(n))
    return RLPolicy(FakePredictor(), weights, shape)


@pytest.mark.parametrize(
    "pressure",
    [
        {"queued_decode_requests": 1},
        {"recent_step_time_s": 0.06},
        {"kv_used_tokens": 950_000},
        {"decode_batch_size": 240},
    ],
)
def test_rl_policy_returns_zero_under_decode_pressure(pressure: dict[str, Any]) -> None:
    policy = always_lend_policy(LeaseShape(itl_target_s=0.05, ttl_s=2.0))
    assert not policy.propose(node_state()).is_zero()
    assert policy.propose(node_state(**pressure)) == LeaseBudgets.zero()
    assert policy.decode_pressure(node_state(**pressure)) is not None


def test_observation_is_bounded_for_extreme_states() -> None:
    shape = LeaseShape()
    extreme = node_state(
        decode_batch_size=10_000,
        context_tokens_mean=1e9,
        kv_used_tokens=2_000_000,
        queued_decode_requests=99,
        recent_step_time_s=5.0,
    )
    for state in (node_state(), extreme, node_state(decode_batch_size=0, max_running_requests=0)):
        obs = observe(state, 1e9, shape)
        assert obs.dtype == np.float32 and obs.min() >= 0.0 and obs.max() <= 1.0


def test_eval_split_holds_out_sessions() -> None:
    train, held_out = tiny_env("train"), tiny_env("eval")
    assert len(train.trace.session_ids) == 6 and len(held_out.trace.session_ids) == 2
    inputs = {tuple(r.input_tokens for r in t.trace.requests) for t in (train, held_out)}
    assert len(inputs) == 2


def test_bad_config_is_rejected_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="load_range"):
        EnvConfig(load_range=(2.0, 1.0))
    with pytest.raises(ValueError, match="split"):
        tiny_env(split="test")
