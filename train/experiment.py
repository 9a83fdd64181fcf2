"""One experiment point (policy x trace x model x shape x load x seed) and how to run it.

Used by ``crossflow simulate`` (one point) and ``crossflow compare`` (a grid of them), so both build
traces, clusters and schedulers the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs import datasheet  # noqa: F401  (registers the heuristic-datasheet policy)
from envs.arrivals import poisson_retime, sample_sessions, subset
from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.estimator import ClusterEstimator
from envs.hardware import Precision
from envs.metrics import SimResult
from envs.request import Trace
from envs.simulator import Simulator, simulate
from envs.splits import ALL, SIDES, trace_side
from policies.slo import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S

DEFAULT_TP: dict[str, int] = {"gpt-oss-120b": 1, "glm-5": 8, "glm-4.5-air": 2, "llama-3.1-70b": 4}
"""Tensor-parallel degree per worker when the user gives none (the smallest that fits with room for KV)."""

DEFAULT_SESSION_RATE_PER_S: dict[str, float] = {"agent": 0.004}
"""Closed-loop traces: sessions started per second at load factor 1."""

OPEN_LOOP_ARRIVALS = ("recorded", "poisson")
"""``Point.open_loop_arrivals``: the recording's timestamps, or a seeded per-minute Poisson re-timing
(``envs.arrivals.poisson_retime``) so that seeds vary open-loop traces too."""
_RETIME_STREAM = 0xA11
"""Second word of the re-timing generator's seed, so it never shares a stream with the simulator's."""

MAX_THINK_S = 300.0
"""Think times above this are capped in experiments: a session idle for longer (a person away) adds
nothing to load and would stretch a replay over days of simulated time."""


def default_tp(model: str) -> int:
    return DEFAULT_TP.get(model.lower(), 1)


def cap_think_time(trace: Trace, max_s: float) -> Trace:
    """Copy of ``trace`` whose think times are at most ``max_s`` (closed-loop traces only)."""
    if not trace.closed_loop or not math.isfinite(max_s):
        return trace
    reqs = [
        r if r.think_time_s <= max_s else dataclasses.replace(r, think_time_s=max_s) for r in trace.requests
    ]
    return dataclasses.replace(trace, requests=reqs, meta={**trace.meta, "max_think_s": max_s})


def head(trace: Trace, n: int | None) -> Trace:
    """First ``n`` requests (open-loop) or first ``n`` sessions (closed-loop), references kept valid."""
    if n is None:
        return trace
    if trace.closed_loop:
        keep = set(trace.session_ids[:n])
        ids = [r.request_id for r in trace.requests if r.session_id in keep]
    else:
        ids = [r.request_id for r in trace.requests[:n]]
    return subset(trace, ids, trace.name)


@dataclass(frozen=True)
class Point:
    """One simulation of the grid."""

    policy: str = "static"
    trace: str = "agent"
    model: str = "gpt-oss-120b"
    gpu: str = "H200"
    tp: int | None = None
    shape: str = "2P4D"
    load: float = 1.0
    session_rate_per_s: float | None = None
    max_requests: int | None = None
    """Open-loop: first N requests; closed-loop: first N sessions (None: the whole trace)."""
    seed: int = 0
    max_think_s: float = MAX_THINK_S
    rate_curve: str | None = None
    """Closed-loop traces: start sessions along a bundled ServeGen day curve (e.g. ``"m-large"``,
    ``"m-large@3"`` for day 3) rescaled to the session rate, instead of a constant-rate Poisson process."""
    dtype: Precision | None = None
    """Weight precision of the linear layers (``bf16``/``fp8``/``fp4``; None: the checkpoint's)."""
    kv_dtype: Precision | None = None
    """KV-cache precision (None: the checkpoint's)."""
    ep: int = 1
    """Expert-parallel degree per worker (MoE models)."""
    dp_attention: int = 1
    """Data-parallel attention replicas per worker (MoE models)."""
    cluster_overrides: tuple[tuple[str, Any], ...] = ()
    """Other ``ClusterConfig`` fields set away from their defaults, e.g. ``(("prefill_routing",
    "round_robin"),)``."""
    decode_prefix_cache: bool = False
    """Decode workers keep a radix prefix cache (``ClusterConfig.decode_prefix_cache``; SGLang's
    ``--disaggregation-decode-enable-radix-cache``), for every policy of the point."""
    split: str = ALL
    """Side of the development / held-out split (``envs.splits``): ``all``, ``dev`` or ``heldout``; taken
    before ``max_requests``."""
    open_loop_arrivals: str = "recorded"
    """Open-loop traces: ``recorded`` timestamps or ``poisson`` (a per-minute re-timing drawn from
    ``seed``, see ``OPEN_LOOP_ARRIVALS``). Ignored by closed-loop traces, whose seed draws the session
    starts."""
    slo_ttft_s: float = DEFAULT_TTFT_SLO_S
    slo_tpot_s: float = DEFAULT_TPOT_SLO_S
    """The per-request SLO of the cluster (what ``RunMetrics.slo_attainment`` counts, and the ITL target
    the lending policies derive from it)."""
    policy_params: tuple[tuple[str, Any], ...] = ()
    """Dotted policy parameters laid over the shipped tuned values (``policies.catalog``), e.g.
    ``(("node.artifact", "my_rl.npz"),)`` for a trained RL policy; empty: the tuned values as shipped."""

    def __post_init__(self) -> None:
        if self.split not in (ALL, *SIDES):
            raise ValueError(f"Point.split must be one of {(ALL, *SIDES)}, got {self.split!r}")
        if self.open_loop_arrivals not in OPEN_LOOP_ARRIVALS:
            raise ValueError(
                f"Point.open_loop_arrivals must be one of {OPEN_LOOP_ARRIVALS}, "
                f"got {self.open_loop_arrivals!r}"
            )
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0):
            raise ValueError(f"Point SLO must be positive, got {self.slo_ttft_s} s, {self.slo_tpot_s} s")
        if any(name == "decode_prefix_cache" for name, _ in self.cluster_overrides):
            raise ValueError("Point: set decode_prefix_cache as its own field, not in cluster_overrides")

    @property
    def resolved_tp(self) -> int:
        return self.tp if self.tp is not None else default_tp(self.model)

    def cluster(self) -> ClusterConfig:
        return ClusterConfig.from_shape(
            self.shape,
            gpu=self.gpu,
            model=self.model,
            tp=self.resolved_tp,
            slo_ttft_s=self.slo_ttft_s,
            slo_tpot_s=self.slo_tpot_s,
            decode_prefix_cache=self.decode_prefix_cache,
            **dict(self.cluster_overrides),
        )

    def label(self) -> str:
        return (
            f"{self.policy}|{self.trace}|{self.model}|{self.shape}|load={self.load:g}|seed={self.seed}"
            + self.deployment_suffix()
            + self.workload_suffix()
            + "".join(f"|{k}={v}" for k, v in self.policy_params)
        )

    def workload_suffix(self) -> str:
        """``|split=heldout|arrivals=poisson|slo=5s,50ms`` for the workload fields off their defaults."""
        parts = []
        if self.split != ALL:
            parts.append(f"|split={self.split}")
        if self.open_loop_arrivals != "recorded":
            parts.append(f"|arrivals={self.open_loop_arrivals}")
        if (self.slo_ttft_s, self.slo_tpot_s) != (DEFAULT_TTFT_SLO_S, DEFAULT_TPOT_SLO_S):
            parts.append(f"|slo={self.slo_ttft_s:g}s,{1e3 * self.slo_tpot_s:g}ms")
        return "".join(parts)

    def deployment_suffix(self) -> str:
        """``|dtype=fp8|ep=8`` for the precision/parallelism fields that differ from their defaults
        (and ``|decode_cache`` when decode workers keep a prefix cache)."""
        return (
            "".join(
                f"|{k}={v}"
                for k, v in (
                    ("dtype", self.dtype),
                    ("kv_dtype", self.kv_dtype),
                    ("ep", self.ep),
                    ("dp", self.dp_attention),
                )
                if v not in (None, 1)
            )
            + ("|decode_cache" if self.decode_prefix_cache else "")
            + "".join(f"|{k}={v}" for k, v in self.cluster_overrides)
        )

    def cost_model(self) -> CostModel:
        """The cost model of one worker of this point (model, precision, parallelism)."""
        from envs.models import resolve_model

        spec = resolve_model(self.model, self.gpu, self.dtype, self.kv_dtype)
        return CostModel(self.gpu, spec, self.resolved_tp, ep=self.ep, dp_attention=self.dp_attention)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tp"] = self.resolved_tp
        return d


def prepare_trace(point: Point) -> Trace:
    """The trace ``point`` replays: its split side, first ``max_requests``, think times capped, and (open
    loop, ``open_loop_arrivals="poisson"``) arrivals re-timed from ``seed``."""
    trace = head(trace_side(point.trace, point.split), point.max_requests)
    trace = cap_think_time(trace, point.max_think_s)
    if point.open_loop_arrivals == "poisson" and not trace.closed_loop:
        trace = poisson_retime(trace, np.random.default_rng([abs(point.seed), _RETIME_STREAM]))
    return trace


def session_rate(point: Point, trace: Trace) -> float | None:
    if not trace.closed_loop:
        return None
    if point.session_rate_per_s is not None:
        return point.session_rate_per_s
    return DEFAULT_SESSION_RATE_PER_S.get(point.trace, 0.004)


def rate_curve(point: Point) -> tuple[Any, Any] | None:
    """The session-start rate curve of ``point`` (one day of a ServeGen model), or None."""
    if point.rate_curve is None:
        return None
    from envs.arrivals import load_servegen_curve

    model, _, day = point.rate_curve.partition("@")
    return load_servegen_curve(model, days=1, start_day=int(day) if day else 0)


def build_scheduler(
    policy: str,
    config: ClusterConfig,
    cost_model: CostModel,
    *,
    predictor: Any = None,
    params: Mapping[str, Any] | None = None,
) -> Any:
    """The cluster scheduler for catalog policy ``policy`` (``policies.catalog``; None for a passive one
    such as ``static``: every request takes the normal path). ``params``: dotted policy parameters
    (None: the shipped tuned values for the cluster's model). The shipped interference model is loaded
    only for a policy that declares it needs one, and only when ``predictor`` is not given."""
    from policies.catalog import make_scheduler, policy_spec
    from policies.context import PolicyContext

    needs = policy_spec(policy).needs_predictor
    if needs and predictor is None:
        from interference_model.artifact import default_predictor

        predictor = default_predictor(config.gpu, config.model, config.tp)
    ctx = PolicyContext(ClusterEstimator(config, cost_model), config, predictor if needs else None)
    return make_scheduler(policy, ctx, params, model=config.model)


def point_scheduler(
    point: Point,
    *,
    predictor: Any = None,
    params: Mapping[str, Any] | None = None,
    config: ClusterConfig | None = None,
    cost_model: CostModel | None = None,
) -> Any:
    """The scheduler ``run_point`` runs ``point`` with: ``params``, else the point's own
    ``policy_params`` over the policy's tuned values, else the tuned values. Building it checks every
    parameter value (a policy refuses a bad one with a ``ValueError`` naming it), so callers build it
    once before a grid runs or a bundle is written (``train.compare.validate_artifacts``,
    ``crossflow bundle``)."""
    if params is None and point.policy_params:
        from policies.catalog import tuned_params

        params = {**tuned_params(point.policy, point.model), **dict(point.policy_params)}
    config = config if config is not None else point.cluster()
    cost_model = cost_model if cost_model is not None else point.cost_model()
    return build_scheduler(point.policy, config, cost_model, predictor=predictor, params=params)


def run_point(
    point: Point,
    *,
    progress: bool = False,
    trace: Trace | None = None,
    predictor: Any = None,
    max_time_s: float = math.inf,
    params: Mapping[str, Any] | None = None,
) -> SimResult:
    """Simulate one point (deterministic in ``point`` and ``params``).

    ``trace`` skips re-loading a prepared trace; ``predictor`` replaces the shipped interference model
    for the policies that need one; ``max_time_s`` caps simulated time (unfinished requests stay so);
    ``params`` replaces the policy's shipped tuned values (``build_scheduler``).
    """
    trace, config, kwargs = _simulation_args(point, trace, predictor, max_time_s, params)
    return simulate(trace, config, progress=progress, **kwargs)


def build_simulator(
    point: Point,
    *,
    trace: Trace | None = None,
    predictor: Any = None,
    max_time_s: float = math.inf,
    params: Mapping[str, Any] | None = None,
) -> Simulator:
    """The simulator ``run_point`` runs, not yet started: for callers that step it themselves
    (``Simulator.step_until``); its ``run()`` gives ``run_point``'s result."""
    trace, config, kwargs = _simulation_args(point, trace, predictor, max_time_s, params)
    return Simulator(trace, config, **kwargs)


def _simulation_args(
    point: Point,
    trace: Trace | None,
    predictor: Any,
    max_time_s: float,
    params: Mapping[str, Any] | None,
) -> tuple[Trace, ClusterConfig, dict[str, Any]]:
    trace = trace if trace is not None else prepare_trace(point)
    config = point.cluster()
    cost_model = point.cost_model()
    scheduler = point_scheduler(
        point, predictor=predictor, params=params, config=config, cost_model=cost_model
    )
    return (
        trace,
        config,
        {
            "scheduler": scheduler,
            "cost_model": cost_model,
            "load_factor": point.load,
            "session_rate_per_s": session_rate(point, trace),
            "seed": point.seed,
            "max_time_s": max_time_s,
            "session_rate_curve": rate_curve(point) if trace.closed_loop else None,
        },
    )


PHASE_STEP_S = 0.005
"""Steps (emulated seconds) of the neighbourhood a replay through the router is simulated at, around
its measured phase (``phase_neighbourhood``): from run to run the router's first request fell 0.014
to 0.024 s after its first control interval (60 requests, time scale 6), so two steps either side
span that jitter."""
PHASE_STEPS = 2


def phase_neighbourhood(
    phase_s: float, interval_s: float, step_s: float = PHASE_STEP_S, steps: int = PHASE_STEPS
) -> list[float]:
    """The delays (``simulate_at_phase``'s ``delay_s``) to simulate a replay at: its measured phase
    (the router's ``control_phase_s``) and ``steps`` steps of ``step_s`` either side, each folded
    into one control interval."""
    if not interval_s > 0 or step_s < 0 or steps < 0:
        raise ValueError(
            "phase_neighbourhood: need interval_s > 0, step_s >= 0, steps >= 0; "
            f"got {interval_s}, {step_s}, {steps}"
        )
    return [(phase_s + k * step_s) % interval_s for k in range(-steps, steps + 1)]


def simulate_at_phase(point: Point, trace: Trace, scheduler: Any, delay_s: float | None) -> SimResult:
    """``point`` on ``trace`` with ``scheduler`` at the seed and load ``run_point`` uses. With
    ``delay_s``, the control plane runs from time 0, before the first request (as a router's does),
    and every arrival of the open-loop trace comes ``delay_s`` later: the control grid meets the
    arrivals at another phase. A router's grid has no set phase against its clients' arrivals, so
    the simulator's answer over a spread of phases is what a replay through a router is to be read
    against. ``None``: the trace as it is, the control ticks starting at its first arrival."""
    if delay_s is not None:
        if trace.closed_loop:
            raise ValueError(
                f"simulate_at_phase: trace {trace.name!r} is closed-loop (its arrivals are drawn)"
            )
        later = delay_s * point.load  # the simulator divides arrival times by the load
        shifted = [dataclasses.replace(r, arrival_s=r.arrival_s + later) for r in trace.requests]
        trace = dataclasses.replace(trace, requests=shifted)
    sim = Simulator(
        trace,
        point.cluster(),
        scheduler=scheduler,
        cost_model=point.cost_model(),
        load_factor=point.load,
        session_rate_per_s=session_rate(point, trace),
        seed=point.seed,
    )
    if delay_s is not None:
        sim.start_control_ticks()
    return sim.run()


__all__ = [
    "Point",
    "build_scheduler",
    "build_simulator",
    "cap_think_time",
    "head",
    "phase_neighbourhood",
    "point_scheduler",
    "prepare_trace",
    "run_point",
    "sample_sessions",
    "simulate_at_phase",
]
