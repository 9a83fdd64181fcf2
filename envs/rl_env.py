"""A gymnasium environment over the PD simulator for learning the ``rl`` policy (see ``PathLeaseEnv``).

Also holds what training and evaluation share with it: the reward (:class:`RewardWeights`,
:class:`GoodputCounter`), episode windows (:class:`Window`, :func:`draw_windows`) and
:meth:`PathLeaseEnv.run_policy`, which replays one window with any catalog policy (static, heuristic,
the peers, ``greedy-model``, the exported ``rl``) so all of them are scored on identical arrivals.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from envs.arrivals import poisson_retime, sample_sessions, subset
from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.estimator import ClusterEstimator
from envs.request import Trace
from envs.sim_state import SHED_ERROR_PREFIX, ReqState
from envs.simulator import Simulator
from envs.splits import development_trace, heldout_trace
from policies.catalog import make_scheduler, policy_spec, tuned_params
from policies.context import PolicyContext
from policies.node_policies import SafePrefillPredictor
from policies.rl_policy import ACTIONS, FEATURES, HEURISTIC_KNOBS, LearnedPath
from policies.slo import DEFAULT_CONTROL_INTERVAL_S

_OBSERVE_BEFORE_TICK_S = 1e-6
"""Observations are taken this long before a control tick; the action applies from then on (the
tick sizes its leases with it), so it acts on (to within a microsecond) the state it saw."""
SIDES = ("dev", "heldout")


@dataclass(frozen=True)
class RewardWeights:
    """Reward per control interval: SLO goodput, each request counted once, when its fate is known.

    ``reward = met_value x met - miss_cost x missed - shed_cost x shed`` where, during the interval,

    * ``met``: requests that finished within both SLOs (TTFT <= ``slo_ttft_s``, mean inter-token time
      <= ``slo_tpot_s``: the rule ``crossflow compare`` counts);
    * ``missed``: requests whose first token came late (counted at the first token, so the signal
      comes seconds before the finish), or that finished in time for TTFT but over the TPOT SLO;
      at the end of an episode every request still waiting past its TTFT deadline is counted too;
    * ``shed``: requests the policy shed (refused at arrival).

    Why these terms. Capacity at SLO is the highest load whose served SLO share stays above 90 %, and at
    a given load the share rises exactly with goodput, so goodput is the reward. A miss costs as much
    as a met request is worth, so "serve everything late" scores below "serve fewer in time". A shed
    request is an SLO miss in ``compare`` (it stays in the denominator), so shedding costs the same as
    a miss: it pays only when it lets others meet the SLO, never as a way to make a request disappear.
    Hacks closed: *delaying* work past the episode end (waiting requests past their deadline are
    counted at the end); *shedding* to hide load (costs a miss); *starving decode* for TTFT (TPOT
    misses cost the same). Requests refused for the context window leave the count, as in ``compare``.
    """

    met_value: float = 1.0
    miss_cost: float = 1.0
    shed_cost: float = 1.0

    def reward(self, met: int, missed: int, shed: int) -> float:
        return self.met_value * met - self.miss_cost * missed - self.shed_cost * shed


class GoodputCounter:
    """A simulator listener (``envs.simulator.SimListener``) that counts requests meeting or missing the
    SLO as their fate becomes known (see :class:`RewardWeights`)."""

    def __init__(self, slo_ttft_s: float, slo_tpot_s: float) -> None:
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self.met = 0
        self.missed = 0
        self.shed = 0
        self._late: set[int] = set()

    def counts(self) -> tuple[int, int, int]:
        return self.met, self.missed, self.shed

    def on_first_token(self, req: ReqState) -> None:
        if req.first_token_s - req.arrival_s > self.slo_ttft_s:
            self._late.add(req.rid)
            self.missed += 1

    def on_finish(self, req: ReqState) -> None:
        if req.rid in self._late:
            self._late.discard(req.rid)
            return
        tpot_s = (req.finish_s - req.first_token_s) / (req.output - 1) if req.output > 1 else 0.0
        if tpot_s <= self.slo_tpot_s:
            self.met += 1
        else:
            self.missed += 1

    def on_reject(self, req: ReqState) -> None:
        if req.error.startswith(SHED_ERROR_PREFIX):
            self.shed += 1

    def past_deadline(self, sim: Simulator) -> int:
        """Requests that have arrived, have no first token and are already past the TTFT SLO."""
        now = sim.now_s
        return sum(
            1
            for r in sim.reqs
            if r.arrival_s <= now - self.slo_ttft_s and math.isnan(r.first_token_s) and not r.error
        )

    def on_decode_iteration(self, w: Any) -> None:
        pass

    def on_prefill_iteration(self, pw: Any) -> None:
        pass

    def on_kv_landed(self, req: ReqState) -> None:
        pass


@dataclass(frozen=True)
class EnvConfig:
    """Everything that defines the environment (picklable)."""

    trace: str = "mooncake"
    """Bundled trace name (its development side is used; ``envs.splits``)."""
    shape: str = "2P4D"
    gpu: str = "H200"
    model: str = "gpt-oss-120b"
    tp: int = 1
    decode_prefix_cache: bool = True
    """Decode workers keep a prefix cache (as the shipped tuning and ``compare --decode-prefix-cache``)."""
    control_interval_s: float = DEFAULT_CONTROL_INTERVAL_S
    load_range: tuple[float, float] = (1.5, 4.0)
    """Load factor drawn uniformly per episode (static saturates near 0.87 on Mooncake 2P4D; the
    tuned heuristic near 2.5)."""
    warmup_s_range: tuple[float, float] = (20.0, 60.0)
    """Simulated time run at the heuristic's knobs before the agent acts (drawn per episode, rounded
    to the control grid), so episodes start from loaded, varied states."""
    decision_intervals: int = 4
    """Control intervals per agent step (the knobs hold for that long; the deployed policy runs its
    actor as often, ``LearnedPath.decision_intervals``): 2 s, long enough for a knob to show in the
    SLO counts, short against the minutes over which the traffic mix moves."""
    episode_steps: int = 45
    """Agent steps per episode (90 s of simulated time at the defaults)."""
    n_sessions: int = 48
    """Closed-loop traces: sessions sampled into one episode's window."""
    base_session_rate_per_s: float = 0.05
    """Closed-loop traces: session start rate at load factor 1."""
    max_think_s: float = 300.0
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
        if min(self.episode_steps, self.decision_intervals, self.n_sessions) < 1 or not (
            self.control_interval_s > 0
        ):
            raise ValueError(
                "EnvConfig: episode_steps, decision_intervals, n_sessions and control_interval_s must be "
                "positive"
            )

    @property
    def step_s(self) -> float:
        """Simulated seconds per agent step."""
        return self.decision_intervals * self.control_interval_s

    def cluster(self) -> ClusterConfig:
        return ClusterConfig.from_shape(
            self.shape,
            gpu=self.gpu,
            model=self.model,
            tp=self.tp,
            control_interval_s=self.control_interval_s,
            decode_prefix_cache=self.decode_prefix_cache,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Window:
    """One episode's workload: where in the trace side, at what load, with which seed."""

    start: float
    """Open-loop: where the window starts, as a share of the side's span; closed-loop: unused."""
    load: float
    sim_seed: int
    """Seeds the simulator, the Poisson re-timing (open-loop) or the session sample (closed-loop)."""
    warmup_s: float


def draw_window(config: EnvConfig, rng: np.random.Generator) -> Window:
    interval = config.control_interval_s
    warmup = round(float(rng.uniform(*config.warmup_s_range)) / interval) * interval
    return Window(
        start=float(rng.uniform()),
        load=float(rng.uniform(*config.load_range)),
        sim_seed=int(rng.integers(2**31)),
        warmup_s=warmup,
    )


def draw_windows(
    config: EnvConfig, n: int, seed: int, loads: tuple[float, ...] | None = None
) -> list[Window]:
    """``n`` fixed windows; loads cycle through ``loads`` (default: low, middle and high of the range)."""
    levels = loads or (config.load_range[0], sum(config.load_range) / 2, config.load_range[1])
    rng = np.random.default_rng(seed)
    return [
        dataclasses.replace(draw_window(config, rng), load=float(levels[i % len(levels)])) for i in range(n)
    ]


def _cap_think(trace: Trace, max_s: float) -> Trace:
    if not trace.closed_loop or not math.isfinite(max_s):
        return trace
    reqs = [
        r if r.think_time_s <= max_s else dataclasses.replace(r, think_time_s=max_s) for r in trace.requests
    ]
    return dataclasses.replace(trace, requests=reqs)


class PathLeaseEnv(gym.Env[np.ndarray, np.ndarray]):
    """Learn the ``rl`` policy's knobs: one step per control interval of the simulated PD cluster.

    ## Description
    The PD cluster simulator replays a window of the development side of a bundled trace under the
    catalog policy ``rl`` with its weights replaced by the agent: every step the agent sets the
    knobs of ``policies.rl_policy.LearnedPath`` (lease share, wait share, borrow margin, shed factor)
    for the next ``decision_intervals`` control intervals: every request arriving then is decided by
    the lease rule under them, and their leases are sized with the lease share. Steps are
    ``EnvConfig.step_s`` of simulated time apart. The scheduler, node policies and path policy
    are exactly what ``crossflow simulate --policy rl`` builds (``policies.catalog.make_scheduler``);
    only where the action comes from differs.

    ## Action Space
    ``Box(-1, 1, (4,), float32)``: ``policies.rl_policy.ACTIONS``, mapped by ``action_to_knobs``.

    ## Observation Space
    ``Box(0, 1, (17,), float32)``: ``policies.rl_policy.FEATURES`` (``LearnedPath.features``): the
    traffic mix over 1 and 5 minutes, the prefill pool's load, the decode nodes, the policy's own
    recent borrow and shed shares.

    ## Rewards
    :class:`RewardWeights`: SLO goodput per interval, misses and sheds at a cost.

    ## Starting State
    ``reset`` draws a :class:`Window` from ``np_random`` (a start in the side, a load in
    ``load_range``, a seed, a warm-up run at the heuristic's knobs); ``reset(options={"window": w})``
    replays a given one.

    ## Episode End
    Truncated after ``episode_steps`` steps; terminated when every request of the window is done.

    ## Arguments
    ``config`` (:class:`EnvConfig`), ``predictor`` (the interference model; default: the shipped one),
    ``side`` (``"dev"``, the default and the only one training uses, or ``"heldout"``), ``trace``
    (replaces the trace side, e.g. a test fixture).
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium's documented class attribute

    def __init__(
        self,
        config: EnvConfig | None = None,
        *,
        predictor: SafePrefillPredictor | None = None,
        side: str = "dev",
        trace: Trace | None = None,
    ) -> None:
        super().__init__()
        self.config = config or EnvConfig()
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        self.side = side
        self.cluster = self.config.cluster()
        self.cost_model = CostModel(self.cluster.gpu, self.cluster.model, self.cluster.tp)
        if predictor is None:
            from interference_model.artifact import default_predictor

            predictor = default_predictor(self.cluster.gpu, self.cluster.model, self.cluster.tp)
        self.predictor = predictor
        if trace is None:
            trace = (development_trace if side == "dev" else heldout_trace)(self.config.trace)
        self.trace = _cap_think(trace, self.config.max_think_s)
        self._span_s = max((r.arrival_s for r in self.trace.requests), default=0.0)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (len(FEATURES),), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (len(ACTIONS),), np.float32)
        self._sim: Simulator | None = None
        self._path: LearnedPath | None = None
        self._goodput: GoodputCounter | None = None
        self._counts = (0, 0, 0)
        self._interval = 0
        self._t_s = 0.0
        self.window: Window | None = None

    # ---- windows and simulations --------------------------------------------------------------------
    def window_trace(self, window: Window) -> Trace:
        """The requests ``window`` replays (open-loop: re-timed as a Poisson process from its seed)."""
        cfg = self.config
        rng = np.random.default_rng(window.sim_seed)
        if self.trace.closed_loop:
            return sample_sessions(self.trace, min(cfg.n_sessions, len(self.trace.session_ids)), rng)
        # Arrivals are divided by the load, so the window covers load x simulated time of the trace.
        span_s = (window.warmup_s + cfg.episode_steps * cfg.step_s) * window.load
        start_s = window.start * max(0.0, self._span_s - span_s)
        ids = [r.request_id for r in self.trace.requests if start_s <= r.arrival_s < start_s + span_s]
        part = subset(self.trace, ids, f"{self.trace.name}[window]", arrival_offset_s=start_s)
        return poisson_retime(part, rng)

    def simulator(
        self, window: Window, policy: str, params: Mapping[str, Any] | None = None
    ) -> tuple[Simulator, GoodputCounter]:
        """A fresh simulator of ``window`` under catalog policy ``policy`` (``params``: dotted
        parameters, default its shipped tuned values), with a goodput counter listening."""
        spec = policy_spec(policy)
        ctx = PolicyContext(
            ClusterEstimator(self.cluster, self.cost_model),
            self.cluster,
            self.predictor if spec.needs_predictor else None,
        )
        scheduler = make_scheduler(policy, ctx, params)
        trace = self.window_trace(window)
        sim = Simulator(
            trace,
            self.cluster,
            scheduler=scheduler,
            cost_model=self.cost_model,
            load_factor=window.load,
            session_rate_per_s=self.config.base_session_rate_per_s if trace.closed_loop else None,
            seed=window.sim_seed,
        )
        counter = GoodputCounter(self.cluster.slo_ttft_s, self.cluster.slo_tpot_s)
        sim.listener = counter
        return sim, counter

    # ---- gymnasium API ------------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        window = (options or {}).get("window") or draw_window(self.config, self.np_random)
        if not isinstance(window, Window):
            raise TypeError(f"options['window'] must be a Window, got {type(window).__name__}")
        self.window = window
        sim, self._goodput = self.simulator(window, "rl", {**tuned_params("rl"), "path.learner": True})
        assert sim.scheduler is not None
        path = sim.scheduler.path  # type: ignore[attr-defined]
        assert isinstance(path, LearnedPath)
        path.set_knobs(HEURISTIC_KNOBS)
        sim.step_until(window.warmup_s - _OBSERVE_BEFORE_TICK_S)
        self._sim, self._path = sim, path
        self._t_s = window.warmup_s
        self._interval = 0
        self._counts = self._goodput.counts()
        return self._observe(), {"window": dataclasses.asdict(window)}

    def _observe(self) -> np.ndarray:
        assert self._sim is not None and self._path is not None
        return self._path.features(self._sim.now_s, self._sim.node_states())

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._sim is None or self._path is None or self._goodput is None:
            raise RuntimeError("call reset() before step()")
        self._path.set_action(np.asarray(action))
        self._t_s += self.config.step_s
        more = self._sim.step_until(self._t_s - _OBSERVE_BEFORE_TICK_S)
        self._interval += 1
        terminated = not more or self._sim.done
        truncated = not terminated and self._interval >= self.config.episode_steps
        met, missed, shed = (a - b for a, b in zip(self._goodput.counts(), self._counts, strict=True))
        self._counts = self._goodput.counts()
        if truncated:
            missed += self._goodput.past_deadline(self._sim)
        reward = self.config.reward.reward(met, missed, shed)
        info = {"met": met, "missed": missed, "shed": shed, "knobs": dataclasses.asdict(self._path.knobs)}
        return self._observe(), float(reward), terminated, truncated, info

    # ---- evaluation --------------------------------------------------------------------------------
    def run_policy(
        self, window: Window, policy: str, params: Mapping[str, Any] | None = None
    ) -> dict[str, float]:
        """Replay ``window`` as an episode would, under catalog policy ``policy`` throughout (its own
        warm-up included: each policy is judged on the state it leads to). Independent of any running
        episode. Returns the controlled part's reward, goodput (SLO-meeting requests per second), SLO
        share of the requests whose fate became known, and misses and sheds."""
        cfg = self.config
        sim, counter = self.simulator(window, policy, params)
        sim.step_until(window.warmup_s - _OBSERVE_BEFORE_TICK_S)
        start = counter.counts()
        intervals = 0
        for k in range(1, cfg.episode_steps + 1):
            intervals = k
            if not sim.step_until(window.warmup_s + k * cfg.step_s - _OBSERVE_BEFORE_TICK_S) or sim.done:
                break
        met, missed, shed = (a - b for a, b in zip(counter.counts(), start, strict=True))
        missed += counter.past_deadline(sim)
        duration_s = intervals * cfg.step_s
        known = met + missed + shed
        return {
            "reward": cfg.reward.reward(met, missed, shed),
            "goodput_per_s": met / duration_s,
            "slo_share": met / known if known else math.nan,
            "missed": float(missed),
            "shed": float(shed),
        }


ENV_ID = "crossflow/PathLease-v1"
"""``gymnasium.make(ENV_ID, config=EnvConfig(...))`` builds a :class:`PathLeaseEnv` with its spec set."""

if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="envs.rl_env:PathLeaseEnv")

__all__ = [
    "ENV_ID",
    "EnvConfig",
    "GoodputCounter",
    "PathLeaseEnv",
    "RewardWeights",
    "Window",
    "draw_window",
    "draw_windows",
]
