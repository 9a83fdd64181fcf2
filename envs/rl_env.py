"""A gymnasium environment over the PD simulator for learning lease policies (see ``LeaseEnv``).

Also holds what training and evaluation share with it: the reward (:class:`RewardWeights`,
:func:`reward_terms`), episode windows (:class:`Window`, :func:`eval_windows`) and
:meth:`LeaseEnv.run_policy`, which replays one window with any ``NodePolicy`` (static, heuristic,
the exported ``rl``) so all of them are compared on identical arrivals.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from envs.arrivals import sample_sessions, split_sessions, subset
from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.estimator import ClusterEstimator
from envs.request import Trace
from envs.simulator import Counters, Simulator
from envs.traces import load_trace
from policies.lease import LeaseBudgets
from policies.ledger import LeaseLedger
from policies.node_policies import NodePolicy, SafePrefillPredictor
from policies.node_state import NodeState
from policies.rl_policy import (
    FEATURES,
    N_ACTIONS,
    LeaseShape,
    action_to_controls,
    decode_pressure,
    lease_budgets,
    observe,
    predict_safe,
)
from policies.scheduler import ClusterScheduler
from policies.slo import DEFAULT_CONTROL_INTERVAL_S

_OBSERVE_BEFORE_TICK_S = 1e-6
"""Observations are taken this long before a control tick, so the tick applies the action chosen
from (to within a microsecond) the state it sees."""


@dataclass(frozen=True)
class RewardWeights:
    """Reward per control interval, from differences of the simulator's running ``Counters``.

    ``reward = input_token_value x d(prefill_tokens) + output_token_value x d(output_tokens)
    - itl_miss_cost x d(itl_slo_miss_tokens) - ttft_miss_cost x d(ttft_slo_misses)
    - fallback_cost x d(fallbacks)``.

    * Tokens served (input and output) are the goal; within a window of fixed length, serving more
      is higher throughput. Output tokens are worth more per token because each costs a whole decode
      iteration, while a prefill chunk computes thousands of tokens at once.
    * ITL misses: an output token produced by an iteration slower than the ITL target. Its cost is
      twice its value, so lending that slows decode past the target loses reward: this is what keeps
      "decode always wins" when the shield is off.
    * TTFT misses: a request whose first token came later than the TTFT target. Without this term a
      policy gains nothing from shortening the prefill queue that the throughput terms do not see.
    * Fallbacks: a borrowed request sent back to the normal path before its first token (its lease
      was revoked or expired). Without this term "lend, then revoke" is free; it wastes a transfer
      and delays the request.

    Reward hacking this guards against: *never lending* earns the static cluster's tokens and no
    penalties, so it is the safe floor, not an optimum, whenever borrowing serves more; *lend and
    revoke* pays the fallback cost. Residual risk: the token terms count prefill computed, so a
    policy could in principle prefer requests with less cache reuse; the scheduler, not the policy,
    picks the requests, which limits that.
    """

    input_token_value: float = 1e-5
    output_token_value: float = 1e-3
    itl_miss_cost: float = 2e-3
    ttft_miss_cost: float = 0.5
    fallback_cost: float = 0.2


def counters_delta(after: Counters, before: Counters) -> Counters:
    """Field-wise ``after - before``."""
    return Counters(
        **{f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(Counters)}
    )


def reward_terms(delta: Counters, weights: RewardWeights) -> dict[str, float]:
    """The reward's terms for one interval's counter differences (their sum is the reward)."""
    return {
        "input_tokens": weights.input_token_value * delta.prefill_tokens,
        "output_tokens": weights.output_token_value * delta.output_tokens,
        "itl_misses": -weights.itl_miss_cost * delta.itl_slo_miss_tokens,
        "ttft_misses": -weights.ttft_miss_cost * delta.ttft_slo_misses,
        "fallbacks": -weights.fallback_cost * delta.fallbacks,
    }


@dataclass(frozen=True)
class EnvConfig:
    """Everything that defines the environment (picklable, so subprocess vector envs rebuild it)."""

    trace: str = "agent"
    """Bundled trace name or trace file."""
    shape: str = "2P4D"
    gpu: str = "H200"
    model: str = "gpt-oss-120b"
    tp: int = 1
    control_interval_s: float = DEFAULT_CONTROL_INTERVAL_S
    n_sessions: int = 48
    """Closed-loop traces: sessions sampled into one episode's window."""
    base_session_rate_per_s: float = 0.05
    """Closed-loop traces: session start rate at load factor 1 (as ``crossflow compare``)."""
    load_range: tuple[float, float] = (1.0, 4.0)
    """Load factor drawn uniformly per training episode."""
    warmup_s_range: tuple[float, float] = (30.0, 240.0)
    """Simulated time run with no lending before the agent acts (drawn per episode, rounded to the
    control grid), so episodes start from loaded, varied states rather than an empty cluster."""
    episode_intervals: int = 240
    """Control intervals per episode (the agent makes ``n_decode`` decisions per interval)."""
    max_think_s: float = 300.0
    """Think times are capped at this (as in ``crossflow compare``)."""
    eval_fraction: float = 0.2
    """Share of sessions (closed-loop) or of the trace's time span (open-loop) held out for evaluation."""
    split_seed: int = 0
    lease_shape: LeaseShape = field(default_factory=LeaseShape)
    reward: RewardWeights = field(default_factory=RewardWeights)

    def __post_init__(self) -> None:
        lo, hi = self.load_range
        if not 0 < lo <= hi:
            raise ValueError(f"EnvConfig.load_range must satisfy 0 < low <= high, got {self.load_range}")
        wlo, whi = self.warmup_s_range
        if not 0 <= wlo <= whi:
            raise ValueError(
                f"EnvConfig.warmup_s_range must satisfy 0 <= low <= high, got {self.warmup_s_range}"
            )
        if self.episode_intervals < 1 or self.n_sessions < 1 or not self.control_interval_s > 0:
            raise ValueError(
                "EnvConfig: episode_intervals, n_sessions and control_interval_s must be positive"
            )
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"EnvConfig.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.lease_shape.ttl_s < self.control_interval_s:
            raise ValueError("EnvConfig: lease_shape.ttl_s must be >= control_interval_s")

    def cluster(self) -> ClusterConfig:
        return ClusterConfig.from_shape(
            self.shape, gpu=self.gpu, model=self.model, tp=self.tp, control_interval_s=self.control_interval_s
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Window:
    """One episode's workload: which part of the trace, at what load, with which seed."""

    sample_seed: int
    """Closed-loop: seed of the session sample; open-loop: seed of the window start."""
    load: float
    sim_seed: int
    warmup_s: float


def _draw_window(config: EnvConfig, rng: np.random.Generator) -> Window:
    interval = config.control_interval_s
    warmup = round(float(rng.uniform(*config.warmup_s_range)) / interval) * interval
    return Window(
        sample_seed=int(rng.integers(2**31)),
        load=float(rng.uniform(*config.load_range)),
        sim_seed=int(rng.integers(2**31)),
        warmup_s=warmup,
    )


def eval_windows(
    config: EnvConfig, n: int, seed: int = 1234, loads: tuple[float, ...] | None = None
) -> list[Window]:
    """``n`` fixed evaluation windows; loads cycle through ``loads`` (default: low, middle, high of the
    training range) so every load level is covered."""
    levels = loads or (config.load_range[0], sum(config.load_range) / 2, config.load_range[1])
    rng = np.random.default_rng(seed)
    return [
        dataclasses.replace(_draw_window(config, rng), load=float(levels[i % len(levels)])) for i in range(n)
    ]


def _cap_think(trace: Trace, max_s: float) -> Trace:
    if not trace.closed_loop or not math.isfinite(max_s):
        return trace
    reqs = [
        r if r.think_time_s <= max_s else dataclasses.replace(r, think_time_s=max_s) for r in trace.requests
    ]
    return dataclasses.replace(trace, requests=reqs)


class _EnvNodePolicy:
    """The node policy the env's scheduler calls: zero (warm-up), the agent's controls, or a delegate."""

    def __init__(self, shape: LeaseShape, predictor: SafePrefillPredictor, n_nodes: int) -> None:
        self.shape = shape
        self.predictor = predictor
        self.mode = "zero"
        self.delegate: NodePolicy | None = None
        self.controls: list[tuple[float, int]] = [(0.0, 0)] * n_nodes

    @property
    def ttl_s(self) -> float:
        return self.delegate.ttl_s if self.mode == "delegate" and self.delegate else self.shape.ttl_s

    def decode_pressure(self, state: NodeState) -> str | None:
        if self.mode == "delegate" and self.delegate is not None:
            fn = getattr(self.delegate, "decode_pressure", None)
            if fn is not None:
                return fn(state)
            return "policy proposes no lease" if self.delegate.propose(state).is_zero() else None
        if self.mode == "agent" and not self.shape.shield:
            return None
        return decode_pressure(state, self.shape)

    def propose(self, state: NodeState) -> LeaseBudgets:
        if self.mode == "delegate" and self.delegate is not None:
            return self.delegate.propose(state)
        if self.mode != "agent":
            return LeaseBudgets.zero()
        scale, tasks = self.controls[state.node_id]
        return lease_budgets(state, predict_safe(self.predictor, state), scale, tasks, self.shape)


class LeaseEnv(gym.Env[np.ndarray, np.ndarray]):
    """Learn how much each decode node lends, one node decision per step, parameters shared by nodes.

    ## Description
    The PD cluster simulator replays a window of a bundled trace. Every control interval each decode
    node publishes a lease; here the agent chooses it. One ``step`` decides for **one** decode node;
    after the last node of the interval has decided, the simulator advances one control interval
    and the next round of decisions starts. Deciding one node at a time with one set of parameters
    is what the deployed ``rl`` policy needs (``propose(state)`` per node, any number of nodes), keeps
    the observation and action small, and gives ``n_decode`` samples per simulated interval.

    ## Action Space
    ``Box(-1, 1, (2,), float32)``: ``[compute_scale, task_share]`` mapped by
    ``policies.rl_policy.action_to_controls``: the share of the interference model's predicted safe
    prefill throughput to lend (at most 1 with the shield; ``unshielded_max_scale`` without), and the
    number of borrowed tasks admitted (``round(share x max_tasks)``). TTL is a fixed policy
    parameter (``LeaseShape.ttl_s``) because the scheduler treats it as a per-policy constant.
    Shield (``LeaseShape.shield``, default on): never above the prediction, and zero under decode
    pressure (queued decode requests, KV above the watermark, batch near its cap, or the recent step
    above the ITL target), whatever the action.

    ## Observation Space
    ``Box(0, 1, (14,), float32)``: ``policies.rl_policy.FEATURES`` of the node being decided: batch
    share, log context mean and spread, log remaining output, KV occupancy / reserved / free shares,
    queued decode requests, borrowed tasks and queued borrowed prefill tokens, recent and decode-only
    step times over the ITL target, the predicted safe throughput (log), and the decode-pressure
    flag. Only what ``NodeState`` and the predictor give, because that is all a node policy sees when
    deployed; prefill-pool congestion and the traffic mix reach the node through the scheduler (it
    borrows only when the prefill pool is congested, so an unused lease costs nothing) and through
    the borrowed work it sends. Giving the policy pool signals needs ``NodeState`` to carry them.

    ## Rewards
    See :class:`RewardWeights`: tokens served minus ITL-miss, TTFT-miss and fallback costs, per
    interval, cluster-wide (the simulator does not attribute misses to nodes). Each step returns
    ``1 / n_decode`` of the most recently completed interval's reward (the stepping node's share), so
    rewards have the same scale at every step and an episode's return is the sum of its intervals'.

    ## Starting State
    ``reset`` draws a window from ``np_random``: ``n_sessions`` sessions of the training split
    (closed-loop) or a time window of the training span (open-loop), a load factor in
    ``load_range``, a simulator seed, and a warm-up in ``warmup_s_range`` run with no lending.
    ``reset(options={"window": Window(...)})`` replays a given window (evaluation).

    ## Episode End
    Truncated after ``episode_intervals`` intervals; terminated when the window's requests are all
    finished.

    ## Arguments
    ``config`` (:class:`EnvConfig`), ``predictor`` (the interference model; default: the shipped one
    for the config's GPU/model/TP), ``trace`` (overrides ``config.trace``, e.g. a test fixture),
    ``split`` (``"train"`` or ``"eval"``: which part of the trace windows come from).
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium's documented class attribute

    def __init__(
        self,
        config: EnvConfig | None = None,
        *,
        predictor: SafePrefillPredictor | None = None,
        trace: Trace | None = None,
        split: str = "train",
    ) -> None:
        super().__init__()
        self.config = config or EnvConfig()
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.split = split
        self.cluster = self.config.cluster()
        self.cost_model = CostModel(self.cluster.gpu, self.cluster.model, self.cluster.tp)
        if predictor is None:
            from interference_model.artifact import default_predictor

            predictor = default_predictor(self.cluster.gpu, self.cluster.model, self.cluster.tp)
        self.predictor = predictor
        full = _cap_think(
            trace if trace is not None else load_trace(self.config.trace), self.config.max_think_s
        )
        self.trace = self._split(full)
        self.n_nodes = self.cluster.n_decode
        self.observation_space = gym.spaces.Box(0.0, 1.0, (len(FEATURES),), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (N_ACTIONS,), np.float32)
        self._policy = _EnvNodePolicy(self.config.lease_shape, predictor, self.n_nodes)
        self._sim: Simulator | None = None
        self._obs = np.zeros((self.n_nodes, len(FEATURES)), np.float32)
        self._safe = np.zeros(self.n_nodes)
        self._node = 0
        self._interval = 0
        self._t_s = 0.0
        self._counters = Counters()
        self._step_reward = 0.0
        self.window: Window | None = None

    # ---- trace split and windows --------------------------------------------------------------------
    def _split(self, trace: Trace) -> Trace:
        cfg = self.config
        if trace.closed_loop:
            held_out, training = split_sessions(trace, cfg.eval_fraction, cfg.split_seed)
            return training if self.split == "train" else held_out
        end_s = max((r.arrival_s for r in trace.requests), default=0.0)
        cut_s = (1.0 - cfg.eval_fraction) * end_s
        ids = [r.request_id for r in trace.requests if (r.arrival_s < cut_s) == (self.split == "train")]
        offset = 0.0 if self.split == "train" else cut_s
        return subset(trace, ids, f"{trace.name}[{self.split}]", arrival_offset_s=offset)

    def _window_trace(self, window: Window) -> Trace:
        cfg = self.config
        rng = np.random.default_rng(window.sample_seed)
        if self.trace.closed_loop:
            n = min(cfg.n_sessions, len(self.trace.session_ids))
            return sample_sessions(self.trace, n, rng)
        # Open-loop: arrivals are divided by the load, so the window covers load x simulated time.
        span_s = (window.warmup_s + cfg.episode_intervals * cfg.control_interval_s) * window.load
        end_s = max((r.arrival_s for r in self.trace.requests), default=0.0)
        start_s = float(rng.uniform(0.0, max(0.0, end_s - span_s)))
        ids = [r.request_id for r in self.trace.requests if start_s <= r.arrival_s < start_s + span_s]
        return subset(self.trace, ids, f"{self.trace.name}[window]", arrival_offset_s=start_s)

    def _start(self, window: Window, policy: _EnvNodePolicy) -> Simulator:
        """A fresh simulator for ``window`` driven by ``policy``, run through its warm-up with no lending."""
        scheduler = ClusterScheduler(
            policy,
            LeaseLedger(),
            ClusterEstimator(self.cluster, self.cost_model),
            control_interval_s=self.config.control_interval_s,
        )
        sim = Simulator(
            self._window_trace(window),
            self.cluster,
            scheduler=scheduler,
            cost_model=self.cost_model,
            load_factor=window.load,
            session_rate_per_s=self.config.base_session_rate_per_s,
            seed=window.sim_seed,
        )
        policy.mode = "zero"
        sim.step_until(window.warmup_s - _OBSERVE_BEFORE_TICK_S)
        return sim

    # ---- gymnasium API ------------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        window = (options or {}).get("window") or _draw_window(self.config, self.np_random)
        if not isinstance(window, Window):
            raise TypeError(f"options['window'] must be a Window, got {type(window).__name__}")
        self.window = window
        self._sim = self._start(window, self._policy)
        self._t_s = window.warmup_s
        self._policy.mode = "agent"
        self._policy.controls = [(0.0, 0)] * self.n_nodes
        self._node = 0
        self._interval = 0
        self._step_reward = 0.0
        self._counters = dataclasses.replace(self._sim.counters)
        self._snapshot()
        return self._obs[0].copy(), {"node_id": 0, "window": dataclasses.asdict(window)}

    def _snapshot(self) -> None:
        assert self._sim is not None
        shape = self.config.lease_shape
        for state in self._sim.node_states():
            safe = predict_safe(self.predictor, state)
            self._safe[state.node_id] = safe
            self._obs[state.node_id] = observe(state, safe, shape)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._sim is None:
            raise RuntimeError("call reset() before step()")
        node = self._node
        self._policy.controls[node] = action_to_controls(action, self.config.lease_shape)
        info: dict[str, Any] = {"node_id": node, "safe_tokens_per_s": float(self._safe[node])}
        terminated = truncated = False
        self._node += 1
        if self._node == self.n_nodes:
            self._node = 0
            self._t_s += self.config.control_interval_s
            more = self._sim.step_until(self._t_s - _OBSERVE_BEFORE_TICK_S)
            self._interval += 1
            now = dataclasses.replace(self._sim.counters)
            terms = reward_terms(counters_delta(now, self._counters), self.config.reward)
            self._counters = now
            self._step_reward = sum(terms.values()) / self.n_nodes
            info["reward_terms"] = terms
            self._snapshot()
            terminated = not more or self._sim.done
            truncated = not terminated and self._interval >= self.config.episode_intervals
        return self._obs[self._node].copy(), float(self._step_reward), terminated, truncated, info

    # ---- evaluation --------------------------------------------------------------------------------
    def run_policy(self, window: Window, policy: NodePolicy) -> dict[str, float]:
        """Replay ``window`` exactly as an episode would, with ``policy`` deciding every lease.

        Independent of any running episode (its own simulator and scheduler).

        Returns the episode's reward and serving figures over the controlled part (after warm-up):
        input/output tokens per second, TTFT of requests that arrived in it (mean, p99, share past
        the target, and how many had no first token by the end), ITL-miss token share, borrowed
        prefill tokens and fallbacks.
        """
        cfg = self.config
        wrapper = _EnvNodePolicy(cfg.lease_shape, self.predictor, self.n_nodes)
        sim = self._start(window, wrapper)
        wrapper.mode, wrapper.delegate = "delegate", policy
        start_s, start = window.warmup_s, dataclasses.replace(sim.counters)
        total = 0.0
        intervals = 0
        for k in range(1, cfg.episode_intervals + 1):
            prev = dataclasses.replace(sim.counters)
            more = sim.step_until(start_s + k * cfg.control_interval_s - _OBSERVE_BEFORE_TICK_S)
            total += sum(reward_terms(counters_delta(sim.counters, prev), cfg.reward).values())
            intervals = k
            if not more or sim.done:
                break
        end_s = start_s + intervals * cfg.control_interval_s
        d = counters_delta(sim.counters, start)
        duration = max(end_s - start_s, 1e-9)
        arrived = [r for r in sim.reqs if start_s <= r.arrival_s < end_s]
        ttft = np.array([r.first_token_s - r.arrival_s for r in arrived if r.first_token_s <= end_s])
        return {
            "reward": total,
            "duration_s": duration,
            "input_tokens_per_s": d.prefill_tokens / duration,
            "output_tokens_per_s": d.output_tokens / duration,
            "ttft_mean_s": float(ttft.mean()) if len(ttft) else math.nan,
            "ttft_p99_s": float(np.quantile(ttft, 0.99)) if len(ttft) else math.nan,
            "ttft_miss_share": d.ttft_slo_misses / max(d.first_tokens, 1),
            "no_first_token": float(len(arrived) - len(ttft)),
            "itl_miss_share": d.itl_slo_miss_tokens / max(d.output_tokens, 1),
            "borrowed_prefill_tokens": float(d.borrowed_prefill_tokens),
            "fallbacks": float(d.fallbacks),
        }


ENV_ID = "crossflow/Lease-v0"
"""``gymnasium.make(ENV_ID, config=EnvConfig(...))`` builds a :class:`LeaseEnv` with its spec set."""

if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="envs.rl_env:LeaseEnv")
