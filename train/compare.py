"""`crossflow compare`: policies vs static PD in two regimes, over seeds, against a fluid upper bound.

For every (trace, model, shape, split side) and every seed (see ``docs/compare.md``):

1. **Static saturation.** Static's capacity at SLO per seed (``train.saturation.capacity_search``, to
   within 2 %); the geometric mean over seeds anchors the load points.
2. **Capacity regime.** Every other policy's capacity at SLO per seed (same SLO threshold as static at
   that seed), and throughput over the steady window at ``throughput_loads`` x saturation.
3. **Latency regime.** TTFT and ITL at ``latency_loads`` x saturation.
4. **Baselines and bounds.** ``hindsight-split`` (static on the split with the best capacity at SLO, in
   hindsight, per seed), the fluid bound (``train.bound``) and the fewest GPUs that serve the trace at
   its recorded rate within SLO, per policy.

Every policy at a (point, seed) replays the same arrivals (open-loop traces are re-timed per seed,
``envs.arrivals.poisson_retime``; closed-loop ones draw their session starts from the seed), so
changes vs static are paired by seed (``train.stats``). The run folder gets ``results.json``,
``report.md``, PNGs, ``finished/`` (one file per finished simulation or search, keyed by its
configuration and the code version; rerunning into the folder skips them, ``_Runner``) and, unless
``--no-wandb``, one offline W&B run per (policy, point) plus a summary run (``_log_wandb``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import itertools
import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from envs.cluster_config import parse_shape
from envs.hardware import Precision
from envs.metrics import SimResult, SloShareBound
from envs.request import Trace
from envs.splits import ALL, SIDES
from policies.catalog import describe_params, policy_names, policy_spec
from policies.slo import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S
from train import bound, report
from train.cli_fields import add_field, resolve, show
from train.cli_types import non_negative_int, positive_int
from train.experiment import (
    DEFAULT_SESSION_RATE_PER_S,
    DEFAULT_TP,
    OPEN_LOOP_ARRIVALS,
    Point,
    build_simulator,
    default_tp,
    point_scheduler,
    prepare_trace,
    run_point,
    session_rate,
)
from train.jsonio import write_json
from train.model_args import add_model_arguments, apply_models_dir, check_model, model_options
from train.saturation import (
    CAPACITY_RESOLUTION,
    SLO_SHARE_TARGET,
    capacity_search,
    fewest_workers,
    served_slo_share,
)

HINDSIGHT_SPLIT = "hindsight-split"
"""Grid-level baseline (not a node policy): static on the split of the same GPUs with the highest
capacity at SLO, chosen per seed after the fact (``hindsight_split``)."""
GRID_BASELINES = (HINDSIGHT_SPLIT,)

DEFAULT_POLICIES = ("static", "heuristic", HINDSIGHT_SPLIT)
DEFAULT_TRACES = ("mooncake",)
"""The default grid (under 2 minutes on 2 cores) runs the open-loop Mooncake trace only: a lending
simulation of the agent trace costs 5-12 s, and a seeded capacity search needs ~6 of them per seed."""
DEFAULT_MODELS = ("gpt-oss-120b",)
DEFAULT_SHAPES = ("2P4D",)
LATENCY_LOADS = (0.25, 0.5, 0.75, 1.0)
"""Latency regime: fractions of static saturation where every policy serves the offered load."""
THROUGHPUT_LOADS = (1.5, 2.0, 3.0)
"""Capacity regime: overload points (static cannot keep up) where steady-window throughput is read."""
DEFAULT_SEEDS, FULL_SEEDS = 3, 5
DEFAULT_SPLITS: tuple[str, ...] = ("heldout",)
FULL_SPLITS: tuple[str, ...] = ("heldout", "dev")
DEFAULT_SUBSET = {"agent": 60, "mooncake": 1000, "mooncake-synthetic": 1000, "azure-code": 1000}
"""Default grid: first N sessions (agent) or requests (open-loop) of the split side."""
FILE_SUBSET = 1000
"""A trace file (not bundled): first N requests (open loop) or sessions (closed loop)."""

FULL_POLICIES = ("static", "heuristic", "dynamo-load", "deflect", HINDSIGHT_SPLIT)
FULL_TRACES = ("agent", "mooncake")
FULL_MODELS = ("gpt-oss-120b", "glm-5")
FULL_SHAPES = ("2P4D", "4P2D")
FULL_SUBSET = {"agent": 20, "mooncake": 1000, "mooncake-synthetic": 1000, "azure-code": 1000}
"""``--full``: the grid a reviewer reads (docs/compare.md, "--full"): static, the heuristic, the two best
tuned peers (dynamo-load on 2P4D, deflect on 4P2D) and the best split in hindsight, on 2 traces x 2
models x the decode-heavy and the prefill-heavy split, both split sides, 5 seeds; sized to finish in
30 minutes on 2 cores with the process backend. Larger subsets, more shapes or every peer are flags
away (``--max-requests``, ``--max-sessions``, ``--shapes``, ``--policies``), and ``--backend ray``
spreads what no longer fits."""

TIME_CAP_FACTOR, TIME_CAP_SLACK_S = 4.0, 3600.0
"""A lending simulation stops at ``FACTOR x`` the trace's arrival span at its load plus ``SLACK``
(closed loop: the session-start span plus the longest session's think time): a request that can never
be admitted would otherwise keep the control loop ticking forever."""
POLICY_STEP, SPLIT_STEP = 1.25, 2.0
"""Bracketing steps of the capacity searches: policies start at static's capacity (gains are mostly
under 25 %), other splits of the same GPUs may be far from it."""
DEFAULT_MAX_WORKERS = 32


@dataclass(frozen=True)
class GridSpec:
    """What to run. ``max_requests`` None means the per-trace subset (``DEFAULT_SUBSET``/``FULL_SUBSET``)."""

    policies: tuple[str, ...] = DEFAULT_POLICIES
    traces: tuple[str, ...] = DEFAULT_TRACES
    models: tuple[str, ...] = DEFAULT_MODELS
    shapes: tuple[str, ...] = DEFAULT_SHAPES
    latency_loads: tuple[float, ...] = LATENCY_LOADS
    throughput_loads: tuple[float, ...] = THROUGHPUT_LOADS
    gpu: str = "H200"
    tp: int | None = None
    """Tensor-parallel degree per worker of every model (None: the per-model default,
    ``train.experiment.DEFAULT_TP``)."""
    max_requests: int | None = None
    """Open-loop traces: replay the first N requests of each side (None: the per-trace subset)."""
    max_sessions: int | None = None
    """Closed-loop (agent session) traces: replay the first N sessions of each side (None: the subset)."""
    seed: int = 0
    """First seed; the grid runs ``seed, seed + 1, ..., seed + seeds - 1``."""
    seeds: int = DEFAULT_SEEDS
    splits: tuple[str, ...] | None = None
    """Split sides (``envs.splits``): ``heldout``, ``dev`` or ``all``. None: ``DEFAULT_SPLITS`` (``--full``:
    ``FULL_SPLITS``) for bundled traces and ``all`` for trace files, which have no shared split."""
    full: bool = False
    interference_model: str | None = None
    """Artifact folder for heuristic/rl (None: the shipped default per model)."""
    dtype: Precision | None = None
    kv_dtype: Precision | None = None
    ep: int = 1
    dp_attention: int = 1
    """Precision and parallelism of every model's workers (``train.model_args``)."""
    slo_ttft_s: float = DEFAULT_TTFT_SLO_S
    slo_tpot_s: float = DEFAULT_TPOT_SLO_S
    open_loop_arrivals: str = "poisson"
    gpus_needed: bool = True
    max_workers: int = DEFAULT_MAX_WORKERS
    """Largest cluster (workers) the GPUs-needed search tries."""
    decode_prefix_cache: bool = False
    """Decode workers keep a radix prefix cache, for every policy (``Point.decode_prefix_cache``)."""
    policy_params: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    """Per policy name, dotted parameters over its tuned values; set for the policies of
    ``--policy-bundle`` (``add_bundles``: a bundle's own values, laid over its policy's tuned values for
    each model by ``pinned_params``)."""

    def __post_init__(self) -> None:
        if self.max_workers < 2:
            raise ValueError(f"--max-workers must be >= 2, got {self.max_workers}")
        for name in ("seeds", "max_requests", "max_sessions", "tp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    def model_options(self) -> dict[str, Any]:
        return model_options(self)

    def point_options(self) -> dict[str, Any]:
        """The ``Point`` fields every simulation of the grid shares beyond trace, model and shape."""
        return {**model_options(self), "decode_prefix_cache": self.decode_prefix_cache}

    def subset(self, trace: str, split: str = ALL) -> int | None:
        """How many units of ``trace`` each side replays: sessions of a closed-loop trace
        (``max_sessions``; with only ``max_requests`` given, the fewest first sessions of the side that
        hold that many requests), requests of an open-loop one (``max_requests``), else the per-trace
        subset."""
        if is_closed_loop(trace):
            if self.max_sessions is not None:
                return self.max_sessions
            if self.max_requests is not None:
                from train.cli import sessions_holding

                return sessions_holding(_side(trace, split), self.max_requests)
        elif self.max_requests is not None:
            return self.max_requests
        return (FULL_SUBSET if self.full else DEFAULT_SUBSET).get(trace, FILE_SUBSET)

    def splits_for(self, trace: str) -> tuple[str, ...]:
        """The split sides ``trace`` runs on (see ``splits``)."""
        if self.splits is not None:
            return self.splits
        if not is_bundled(trace):
            return (ALL,)
        return FULL_SPLITS if self.full else DEFAULT_SPLITS

    def resolved_tp(self, model: str) -> int:
        return self.tp if self.tp is not None else default_tp(model)

    def seed_list(self) -> tuple[int, ...]:
        return tuple(range(self.seed, self.seed + self.seeds))

    def simulated_policies(self) -> tuple[str, ...]:
        """Policies that are simulated as themselves (grid baselines are built from static runs)."""
        return tuple(p for p in self.policies if not policy_spec(p).grid_level)

    def point(self, policy: str, combo: Combo, shape: str, load: float, seed: int) -> Point:
        return Point(
            policy=policy,
            trace=combo.trace,
            model=combo.model,
            gpu=self.gpu,
            tp=self.tp,
            shape=shape,
            load=load,
            max_requests=self.subset(combo.trace, combo.split),
            seed=seed,
            split=combo.split,
            open_loop_arrivals=self.open_loop_arrivals,
            slo_ttft_s=self.slo_ttft_s,
            slo_tpot_s=self.slo_tpot_s,
            policy_params=self.pinned_params(policy, combo.model),
            **self.point_options(),
        )

    def pinned_params(self, policy: str, model: str) -> tuple[tuple[str, Any], ...]:
        """``Point.policy_params`` of ``policy`` on ``model``: a bundle's values over its policy's
        shipped tuned values for that model (``tuned_params``), so the point records every value it
        runs with; ``()`` for a policy with no values of its own here (its tuned values apply)."""
        given = dict(self.policy_params).get(policy)
        if given is None:
            return ()
        from policies.catalog import tuned_params

        base = policy_spec(policy).bundle_of or policy
        return tuple(sorted({**tuned_params(base, model), **dict(given)}.items()))


@dataclass(frozen=True)
class Combo:
    """What a load is matched within: one trace side on one model (shapes vary inside)."""

    trace: str
    model: str
    split: str

    def key(self) -> str:
        return f"{self.trace}|{self.model}|{self.split}"


@dataclass(frozen=True)
class SimTask:
    """One simulation: a point, whether to keep its timeline and decision reasons, its predictor."""

    point: Point
    detail: bool = True
    artifact_dir: str | None = None
    predictor: Any = field(default=None, compare=False)
    """An injected predictor object (tests); overrides ``artifact_dir``."""
    regime: str = "latency"
    load_fraction: float = 1.0
    requests_dir: str | None = field(default=None, compare=False)
    """Write this simulation's per-request table there (``requests_part``), for ``--requests-out``."""


def requests_part(task: SimTask) -> Path:
    """Where ``task``'s per-request table is written (a file per simulation label)."""
    import hashlib

    assert task.requests_dir is not None
    digest = hashlib.sha256(task.point.label().encode()).hexdigest()[:24]
    return Path(task.requests_dir) / f"{digest}.parquet"


@dataclass(frozen=True)
class CapacityJob:
    """A capacity-at-SLO search of one policy on one shape at one seed (``point.load`` is unused)."""

    point: Point
    threshold: float
    relative_fallback: bool
    start_load: float = 1.0
    step: float = 2.0
    artifact_dir: str | None = None
    predictor: Any = field(default=None, compare=False)
    role: str = "capacity"
    """``capacity`` (a grid shape) or ``split`` (another split of the same GPUs, for hindsight-split)."""

    def name(self) -> str:
        return (
            f"capacity|{self.point.label()}|thr={self.threshold:.6g}|fallback={int(self.relative_fallback)}"
            f"|res={CAPACITY_RESOLUTION}|v4"
        )


@dataclass(frozen=True)
class GpusJob:
    """Fewest workers (over splits) at which ``point.policy`` serves the trace at load 1 within SLO."""

    point: Point
    thresholds: tuple[tuple[int, float], ...]
    """(seed, SLO-share threshold) pairs: every seed must pass."""
    max_workers: int
    artifact_dir: str | None = None
    predictor: Any = field(default=None, compare=False)

    def name(self) -> str:
        return f"gpus|{self.point.label()}|{self.thresholds}|max={self.max_workers}|v3"


# ---- worker side ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _prepared(point: Point) -> Trace:
    # Parsing the bundled agent trace costs ~1 s (measured); a worker process runs many points of one
    # trace. Requests are frozen and the simulator never mutates a Trace, so sharing is safe.
    return prepare_trace(point)


def _trace_point(point: Point) -> Point:
    """The fields of ``point`` the prepared trace depends on (so points share one cached trace)."""
    base = Point(
        trace=point.trace,
        max_requests=point.max_requests,
        max_think_s=point.max_think_s,
        split=point.split,
        open_loop_arrivals=point.open_loop_arrivals,
    )
    return replace(base, seed=point.seed) if point.open_loop_arrivals == "poisson" else base


def trace_for(point: Point) -> Trace:
    return _prepared(_trace_point(point))


@functools.lru_cache(maxsize=16)
def _work(point: Point) -> tuple[Trace, np.ndarray, np.ndarray]:
    trace = bound.served_trace(trace_for(point), point.cluster())
    prefill_s, decode_s = bound.request_work(trace, bound.work_coefficients(point.cost_model()))
    return trace, prefill_s, decode_s


def request_work(point: Point) -> tuple[Trace, np.ndarray, np.ndarray]:
    """(served trace, best-case prefill and decode worker-seconds per request) of ``point``'s trace."""
    deployment = {
        k: getattr(point, k) for k in ("model", "gpu", "tp", "dtype", "kv_dtype", "ep", "dp_attention")
    }
    return _work(replace(_trace_point(point), **deployment))


def arrival_span_s(point: Point, trace: Trace) -> float:
    """How long ``point``'s arrivals last in simulated time (closed loop: the expected session-start
    span plus the longest session's think time); 0 for an empty trace."""
    if not trace.requests:
        return 0.0
    if not trace.closed_loop:
        return max(r.arrival_s for r in trace.requests) / point.load
    rate = session_rate(point, trace) or DEFAULT_SESSION_RATE_PER_S.get(point.trace, 0.004)
    think: dict[int, float] = {}
    for r in trace.requests:
        think[r.session_id] = think.get(r.session_id, 0.0) + max(0.0, r.think_time_s)
    return len(think) / (rate * point.load) + max(think.values())


def time_cap_s(point: Point, trace: Trace) -> float:
    """The simulated-time cap of a lending simulation (see ``TIME_CAP_FACTOR``)."""
    if not trace.requests:
        return math.inf
    return TIME_CAP_FACTOR * arrival_span_s(point, trace) + TIME_CAP_SLACK_S


def _cap_for(point: Point, trace: Trace) -> float:
    """``point``'s simulated-time cap: ``time_cap_s`` for a lending policy, none for static."""
    return time_cap_s(point, trace) if point.policy != "static" else math.inf


SLO_CHECKS_PER_SPAN = 64
"""A capacity probe judged against a threshold checks its SLO-share bound this many times over its
arrival span (``arrival_span_s``), and as often after it, to stop once it is sure to fail."""


def _predictor(point: Point, artifact_dir: str | None, injected: Any) -> Any:
    if not policy_spec(point.policy).needs_predictor:
        return None
    if injected is not None:
        return injected
    if artifact_dir is None:
        raise ValueError(f"policy {point.policy!r} needs an interference-model artifact")
    return _cached_predictor(artifact_dir, point.gpu, point.model, point.resolved_tp)


@functools.lru_cache(maxsize=4)
def _cached_predictor(artifact_dir: str, gpu: str, model: str, tp: int) -> Any:
    # Compiling the trees costs ~0.5 s (measured); the predictor is read-only, so a worker reuses it.
    from interference_model.artifact import load_predictor

    return load_predictor(artifact_dir, gpu=gpu, model=model, tp=tp)


def _simulate(point: Point, artifact_dir: str | None, predictor: Any) -> Any:
    trace = trace_for(point)
    cap = _cap_for(point, trace)
    result = run_point(
        point, trace=trace, predictor=_predictor(point, artifact_dir, predictor), max_time_s=cap
    )
    return result, math.isfinite(cap) and result.metrics.n_finished < result.metrics.n_requests


def _probe(
    point: Point, artifact_dir: str | None, predictor: Any, threshold: float | None
) -> tuple[float, float, bool]:
    """A capacity probe: ``(served SLO share, cluster ITL p99, stopped early)``. With a ``threshold``
    the simulation stops as soon as the share is certain to end below it (``envs.metrics.SloShareBound``)
    and the share is then that bound (under the threshold), the ITL p99 NaN."""
    trace = trace_for(point)
    sim = build_simulator(
        point,
        trace=trace,
        predictor=_predictor(point, artifact_dir, predictor),
        max_time_s=_cap_for(point, trace),
    )
    result: SimResult | None
    if threshold is None:
        result = sim.run()
    else:
        bound = SloShareBound(sim)
        every = max(arrival_span_s(point, trace) / SLO_CHECKS_PER_SPAN, point.slo_ttft_s)
        result = sim.run_checked(lambda t: bound(t) < threshold, every)
        if result is None:
            return bound.last, math.nan, True
    m = result.metrics.to_dict()
    return served_slo_share(m), float(m["itl_p99_s"]), False


def slo_misses(point: Point, requests: Any) -> dict[str, int]:
    """Requests missing the TTFT half of the SLO (unfinished ones included) and the TPOT half."""
    df = requests[requests["error"] == ""]
    ttft = (df["first_token_s"] - df["arrival_s"]).to_numpy(dtype=np.float64)
    n_out = df["output_tokens"].to_numpy(dtype=np.float64)
    tpot = (df["finish_s"] - df["first_token_s"]).to_numpy(dtype=np.float64) / np.maximum(n_out - 1, 1)
    ttft_miss = ~(ttft <= point.slo_ttft_s)
    tpot_miss = ~ttft_miss & ~(np.where(n_out > 1, tpot, 0.0) <= point.slo_tpot_s)
    return {"ttft": int(ttft_miss.sum()), "tpot": int(tpot_miss.sum())}


def simulate_task(task: SimTask) -> dict[str, Any]:
    """Worker: run one point; returns metrics, steady-window throughput and its fluid bound (and the
    timeline and reason counts with ``detail``) or the error; never raises."""
    point, t0 = task.point, time.perf_counter()
    out: dict[str, Any] = {
        "label": point.label(),
        "point": point.to_dict(),
        "regime": task.regime,
        "load_fraction": task.load_fraction,
    }
    try:
        result, capped = _simulate(point, task.artifact_dir, task.predictor)
        served, prefill_s, decode_s = request_work(point)
        window = bound.steady_window(result.requests, served)
        steady = bound.window_served(result.requests, window, prefill_s, decode_s)
        earliest = bound.earliest_arrivals(result.requests, served)
        cfg = point.cluster()
        limit = bound.throughput_bound(cfg.n_prefill + cfg.n_decode, window, earliest, prefill_s + decode_s)
    except Exception as exc:  # one broken point must not sink the grid; the report lists it
        out.update(error=f"{type(exc).__name__}: {exc}", metrics=None, wall_s=time.perf_counter() - t0)
        return out
    metrics = result.metrics.to_dict()
    from train.cli import simulate_command

    trace = trace_for(point)
    cap = _cap_for(point, trace)
    base = policy_spec(point.policy).bundle_of  # a bundle's alias reruns as the policy it bundles
    out["rerun"] = simulate_command(
        point if base is None else replace(point, policy=base),
        closed_loop=trace.closed_loop,
        artifact_dir=task.artifact_dir if policy_spec(point.policy).needs_predictor else None,
        max_sim_time_s=cap if math.isfinite(cap) else None,
    ) + (" # needs the injected predictor" if task.predictor is not None else "")
    out.update(
        metrics=metrics,
        served_slo_share=served_slo_share(metrics),
        slo_misses=slo_misses(point, result.requests),
        steady={**steady, "window": list(window)},
        bound=limit,
        error=None,
        time_capped=capped,
    )
    if task.requests_dir is not None:
        from train.requests_out import requests_table, write_parquet

        table = requests_table(result)
        for col, value in (
            ("point", point.label()), ("policy", point.policy), ("trace", point.trace),
            ("model", point.model), ("shape", point.shape), ("split", point.split), ("load", point.load),
            ("seed", point.seed),
        ):  # fmt: skip
            table.insert(0, col, value)
        write_parquet([table], requests_part(task))
    if task.detail:
        out["timeline"] = {
            k: [float(v) for v in col] for k, col in result.timeline.to_dict(orient="list").items()
        }
        reasons: dict[str, int] = {}
        for r in result.decisions:
            if "reason" in r:
                k = report.normalise_reason(
                    r.get("kind", "?"), str(r["reason"]), r.get("path") or r.get("verdict")
                )
                reasons[k] = reasons.get(k, 0) + 1
        out["reasons"] = reasons
    out["wall_s"] = time.perf_counter() - t0
    return out


def capacity_job(job: CapacityJob) -> dict[str, Any]:
    """Worker: one capacity-at-SLO search; every probe's share and cluster ITL p99 are kept."""
    t0 = time.perf_counter()
    itl_p99: dict[float, float] = {}

    def share_below(load: float, threshold: float | None) -> tuple[float, bool]:
        share, itl_p99[load], early = _probe(
            replace(job.point, load=load), job.artifact_dir, job.predictor, threshold
        )
        return share, early

    out: dict[str, Any] = {"name": job.name(), "point": job.point.to_dict(), "role": job.role}
    try:
        found = capacity_search(
            lambda load: share_below(load, None)[0],
            threshold=job.threshold,
            relative_fallback=job.relative_fallback,
            start_load=job.start_load,
            step=job.step,
            share_below=share_below,
        )
    except Exception as exc:
        out.update(error=f"{type(exc).__name__}: {exc}", usable=False, wall_s=time.perf_counter() - t0)
        return out
    found["itl_p99_s"] = itl_p99.get(found["load"], math.nan)
    out.update(found, error=None, n_simulations=len(itl_p99), wall_s=time.perf_counter() - t0)
    return out


def gpus_job(job: GpusJob) -> dict[str, Any]:
    """Worker: the fewest workers at which every seed meets its SLO threshold at load 1."""
    t0 = time.perf_counter()
    runs = 0
    thresholds = dict(job.thresholds)

    def passes(n_prefill: int, n_decode: int) -> tuple[bool, str]:
        nonlocal runs
        for seed, threshold in sorted(thresholds.items()):
            pt = replace(job.point, shape=f"{n_prefill}P{n_decode}D", seed=seed, load=1.0)
            result, _ = _simulate(pt, job.artifact_dir, job.predictor)
            runs += 1
            if served_slo_share(result.metrics.to_dict()) < threshold:
                misses = slo_misses(pt, result.requests)
                return False, "prefill" if misses["ttft"] >= misses["tpot"] else "decode"
        return True, ""

    out: dict[str, Any] = {"name": job.name(), "point": job.point.to_dict()}
    try:
        lower = []
        for seed, threshold in sorted(thresholds.items()):
            served, prefill_s, decode_s = request_work(replace(job.point, seed=seed, load=1.0))
            lower.append(
                bound.fewest_workers_bound(
                    served, prefill_s, decode_s, threshold=threshold,
                    slo_ttft_s=job.point.slo_ttft_s, slo_tpot_s=job.point.slo_tpot_s,
                )
            )  # fmt: skip
        fluid = None if any(x is None for x in lower) else max(x for x in lower if x is not None)
        # start every split walk at the best-case prefill share of the work
        share = float(prefill_s.sum() / max((prefill_s + decode_s).sum(), 1e-12))
        found = fewest_workers(
            passes,
            first_prefill_share=share,
            min_workers=max(2, fluid or 2),
            max_workers=job.max_workers,
        )
    except Exception as exc:
        out.update(error=f"{type(exc).__name__}: {exc}", workers=None, wall_s=time.perf_counter() - t0)
        return out
    tp = job.point.resolved_tp
    out.update(
        found,
        first_prefill_share=share,
        gpus=None if found["workers"] is None else found["workers"] * tp,
        fluid_min_workers=fluid,
        tp=tp,
        error=None,
        n_simulations=runs,
        wall_s=time.perf_counter() - t0,
    )
    return out


def _run_job(job: Any) -> dict[str, Any]:
    if isinstance(job, SimTask):
        return {"kind": "sim", **simulate_task(job)}
    if isinstance(job, CapacityJob):
        return {"kind": "capacity", **capacity_job(job)}
    return {"kind": "gpus", **gpus_job(job)}


# ---- main side -----------------------------------------------------------------------------------------
def resolve_artifact(spec: GridSpec, model: str) -> str:
    """Folder of the interference model for ``model``: ``--interference-model`` or the shipped default."""
    from interference_model.artifact import DATA_DIR, artifact_slug

    folder = (
        Path(spec.interference_model)
        if spec.interference_model
        else (DATA_DIR / artifact_slug(spec.gpu, model, spec.resolved_tp(model)))
    )
    if not (folder / "metadata.json").is_file():
        needing = [p for p in spec.policies if policy_spec(p).needs_predictor]
        raise FileNotFoundError(
            f"no interference-model artifact at {folder} (needed by {needing} "
            f"on {model}); pass --interference-model PATH or fit one with `crossflow fit-interference`"
        )
    return str(folder)


def artifact_of(artifacts: dict[str, str], policy: str, model: str) -> str | None:
    """The interference-model folder ``policy`` uses on ``model``: its bundle's, else the grid's."""
    return artifacts.get(f"{policy}|{model}") or artifacts.get(model)


BUNDLE_SOURCE = "policy bundle "
"""``PolicySpec.source`` prefix of the catalog aliases ``add_bundles`` registers."""


def add_bundles(
    spec: GridSpec, refs: Sequence[str]
) -> tuple[GridSpec, dict[str, str], dict[str, dict[str, Any]]]:
    """``spec`` with the policy of every bundle in ``refs`` (folders or ``wandb:`` references) added
    under the bundle's name, and the bundles' interference models as ``artifact_of`` keys.

    Each bundle is registered in the catalog as an alias of its policy (same node and path policy), so
    the report and W&B name it; its parameters go into ``spec.policy_params``. The process pool's
    workers are forked after this and inherit the registration; Ray workers register the aliases the
    backend hands them (``RayBackend.aliases``).
    """
    from policies.bundle import load_policy_bundle, resolve_bundle
    from policies.catalog import PolicySpec, register_policy

    policies, params, artifacts = list(spec.policies), dict(spec.policy_params), {}
    info: dict[str, dict[str, Any]] = {}
    for ref in refs:
        bundle = load_policy_bundle(resolve_bundle(ref))
        base = policy_spec(bundle.policy)
        alias = PolicySpec(
            bundle.name,
            f"policy bundle {bundle.name} v{bundle.version} ({bundle.policy}, digest {bundle.digest[:12]})",
            node=base.node,
            path=base.path,
            source=f"{BUNDLE_SOURCE}{ref}",
            bundle_of=bundle.policy,
        )
        # a name of the catalog's own is refused; an alias of an earlier bundle is replaced
        if bundle.name in policy_names() and not policy_spec(bundle.name).source.startswith(BUNDLE_SOURCE):
            raise ValueError(f"--policy-bundle {ref}: name {bundle.name!r} is already a catalog policy")
        register_policy(alias, replace=True)
        if bundle.name not in policies:
            policies.append(bundle.name)
        params[bundle.name] = bundle.point_params()
        info[bundle.name] = {
            "ref": str(ref), "folder": str(bundle.folder), "version": bundle.version,
            "policy": bundle.policy, "digest": bundle.digest,
        }  # fmt: skip
        if bundle.interference_model is not None:
            for model in spec.models:
                artifacts[f"{bundle.name}|{model}"] = str(bundle.interference_model)
    new = replace(spec, policies=tuple(policies), policy_params=tuple(sorted(params.items())))
    return new, artifacts, info


def validate_artifacts(spec: GridSpec, artifacts: dict[str, str], predictor: Any = None) -> None:
    """Load every artifact the grid will use (interference model per model, the tuned values, RL
    weights) and build every policy bundle's scheduler (``predictor``: an injected one, as the grid
    gets), so a corrupt artifact or a bad parameter value fails before any simulation starts."""
    from policies.catalog import tuned_params

    for name in spec.simulated_policies():  # each model's tuned file, read and checked
        for model in spec.models:
            tuned_params(policy_spec(name).bundle_of or name, model)
    for key, folder in artifacts.items():
        model = key.rpartition("|")[2]
        _cached_predictor(folder, spec.gpu, model, spec.resolved_tp(model))
    from policies.rl_policy import DEFAULT_ARTIFACT, load_artifact, runs_rl_weights

    if any(runs_rl_weights(policy_spec(p)) for p in spec.simulated_policies()):
        load_artifact(DEFAULT_ARTIFACT)
    # a bundle's parameter values: its scheduler is built once per model, so a bad value fails here
    bundled = dict(spec.policy_params)
    first = combos(spec)[0]
    for policy in (p for p in spec.simulated_policies() if p in bundled):
        for model in spec.models:
            point = spec.point(policy, replace(first, model=model), spec.shapes[0], 1.0, spec.seed)
            try:
                point_scheduler(
                    point, predictor=_predictor(point, artifact_of(artifacts, policy, model), predictor)
                )
            except (ValueError, TypeError) as exc:
                raise ValueError(f"policy bundle {policy!r} on {model}: {exc}") from None


def same_gpu_splits(shape: str) -> list[str]:
    """Every xPyD split with the same worker count as ``shape`` (x, y >= 1), ``shape`` included."""
    n_p, n_d = parse_shape(shape)
    total = n_p + n_d
    return [f"{p}P{total - p}D" for p in range(1, total)]


def _map(
    fn: Callable[[Any], dict[str, Any]],
    items: Sequence[Any],
    jobs: int,
    desc: str,
    progress: bool,
    pool: cf.Executor | None = None,
) -> Iterable[dict[str, Any]]:
    """``fn`` over ``items`` in ``jobs`` processes (``pool`` if given; in this process if 1), yielding
    as they finish."""
    from tqdm import tqdm

    bar = tqdm(total=len(items), desc=desc, disable=not progress, leave=False, file=sys.stderr)
    try:
        if jobs <= 1 or len(items) <= 1:
            for item in items:
                yield fn(item)
                bar.update()
            return
        own = pool is None
        executor = pool or cf.ProcessPoolExecutor(max_workers=min(jobs, len(items)))
        try:
            for fut in cf.as_completed([executor.submit(fn, item) for item in items]):
                yield fut.result()
                bar.update()
        finally:
            if own:
                executor.shutdown()
    finally:
        bar.close()


FINISHED_DIR = "finished"
"""Run-folder subfolder with one ``<key>.json`` per finished simulation or search (``_Runner``)."""


def job_name(job: Any) -> str:
    return job.point.label() if isinstance(job, SimTask) else job.name()


@functools.lru_cache(maxsize=16)
def _artifact_identity(folder: str) -> dict[str, Any]:
    from train.wandb_log import artifact_reference

    return artifact_reference(folder)


def job_config(job: Any) -> dict[str, Any]:
    """Everything a job's result depends on besides the code: its kind and name, the full point, the
    policy's tuned values and the interference model by hash (an injected predictor by type)."""
    from policies.catalog import tuned_params

    spec = policy_spec(job.point.policy)
    config: dict[str, Any] = {
        "kind": type(job).__name__,
        "name": job_name(job),
        "point": job.point.to_dict(),
        "tuned": tuned_params(job.point.policy, job.point.model) if not spec.passive else {},
    }
    if isinstance(job, SimTask):
        config["detail"] = job.detail
    if spec.needs_predictor:
        if job.predictor is not None:
            config["predictor"] = (
                f"injected:{type(job.predictor).__module__}.{type(job.predictor).__qualname__}"
            )
        elif job.artifact_dir is not None:
            config["predictor"] = _artifact_identity(job.artifact_dir)
    return config


class _Runner:
    """Runs job lists in parallel; each finished job (simulation or search) is written to
    ``finished/<key>.json`` as it finishes (``key``: ``train.provenance.config_key`` of ``job_config``),
    and a job whose file exists without an error is not run again."""

    def __init__(self, out: Path, jobs: int, progress: bool, backend: Any = None) -> None:
        from train.provenance import code_version

        self.dir = out / FINISHED_DIR
        self.jobs, self.progress = jobs, progress
        self.code = code_version()
        self.backend = backend
        # one pool for every stage: its workers keep their prepared traces and predictors
        self.pool = cf.ProcessPoolExecutor(max_workers=jobs) if jobs > 1 and backend is None else None
        self.reused = self.ran = 0
        self.used: set[str] = set()

    def _load(self, key: str) -> dict[str, Any] | None:
        path = self.dir / f"{key}.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # written atomically: edited by hand
            print(f"compare: {path}: unreadable ({exc}); running that job again", file=sys.stderr)
            return None
        result = data.get("result") if isinstance(data, dict) else None
        return result if isinstance(result, dict) and not result.get("error") else None

    def run(self, items: Sequence[Any], desc: str) -> list[dict[str, Any]]:
        """Results in the order of ``items``; an item equal to an earlier one (same simulation or same
        search) is run once, one already in ``finished/`` is not run again."""
        from train.provenance import config_key

        results: dict[int, dict[str, Any]] = {}
        first_of: dict[str, int] = {}
        keys: dict[int, tuple[str, dict[str, Any]]] = {}
        todo: list[tuple[int, Any]] = []
        for i, item in enumerate(items):
            name = job_name(item)
            if name in first_of:
                continue
            first_of[name] = i
            config = job_config(item)
            key = config_key(config)
            keys[i] = (key, config)
            self.used.add(key)
            cached = self._load(key)
            if isinstance(item, SimTask) and item.requests_dir and not requests_part(item).is_file():
                cached = None  # finished before without its per-request table: run it again
            if cached is not None:
                results[i] = cached
                self.reused += 1
            else:
                todo.append((i, item))
        # the slowest jobs first, so the pool ends evenly
        pending = sorted(todo, key=lambda t: _expected_cost(t[1]), reverse=True)
        runs = (
            self.backend.map(_run_job_indexed, pending, desc, self.progress)
            if self.backend is not None
            else _map(_run_job_indexed, pending, self.jobs, desc, self.progress, self.pool)
        )
        for res in runs:
            i = res.pop("_index")
            results[i] = res
            self.ran += 1
            key, config = keys[i]
            if not res.get("error"):
                record = {"key": key, "config": config, "code": self.code, "result": res}
                write_json(self.dir / f"{key}.json", record, indent=None)
        return [results[first_of[job_name(item)]] for item in items]

    def prune(self) -> int:
        """Delete finished-job files this run did not use (another code version or grid); returns how
        many. Called only after a run completed, so an interrupted run keeps everything."""
        stale = [p for p in self.dir.glob("*.json") if p.stem not in self.used]
        for path in stale:
            path.unlink()
        return len(stale)

    def close(self, cancel: bool = False) -> None:
        """Shut the pool down; ``cancel`` (Ctrl-C) drops queued jobs and stops running ones at once
        (their results were never written, so the folder stays consistent)."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        if not cancel:
            pool.shutdown()
            return
        workers = list(getattr(pool, "_processes", {}).values())  # no public handle on the workers
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in workers:
            proc.terminate()
        for proc in workers:
            proc.join(timeout=5)


class RayBackend:
    """``--backend ray``: every job is a Ray task (``ray.remote`` of the same worker function the process
    pool runs, so results are the same); ``address`` None starts a local Ray instance, else joins a
    cluster (``ray://host:10001`` or ``auto``). Workers import this package, so every node needs
    Crossflow installed (or a ``runtime_env`` that ships it)."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--backend ray: Ray is not installed; pip install 'crossflow[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"address": address, "include_dashboard": False, "log_to_driver": False}
            if address is None and num_cpus is not None:
                kwargs["num_cpus"] = num_cpus
            ray.init(**kwargs)
        self.address = address
        self.aliases: tuple[Any, ...] = ()
        """Catalog entries (``PolicySpec``) a worker must register first: the policy bundles' aliases,
        which a Ray worker, unlike a forked process, does not inherit."""

    def map(
        self, fn: Callable[[Any], dict[str, Any]], items: Sequence[Any], desc: str, progress: bool
    ) -> Iterable[dict[str, Any]]:
        from tqdm import tqdm

        remote = self.ray.remote(_with_aliases)
        refs = [remote.remote(self.aliases, fn, item) for item in items]
        with tqdm(total=len(refs), desc=desc, disable=not progress, leave=False, file=sys.stderr) as bar:
            try:
                while refs:
                    done, refs = self.ray.wait(refs, num_returns=1)
                    yield self.ray.get(done[0])
                    bar.update()
            except BaseException:
                for ref in refs:
                    self.ray.cancel(ref, force=True)
                raise


def _with_aliases(aliases: Sequence[Any], fn: Callable[[Any], dict[str, Any]], item: Any) -> dict[str, Any]:
    """Ray task body: register ``aliases`` in this worker's catalog (once), then run ``fn(item)``."""
    from policies.catalog import register_policy

    for alias in aliases:
        if alias.name not in policy_names():
            register_policy(alias)
    return fn(item)


def make_backend(args: argparse.Namespace) -> RayBackend | None:
    """None (the local process pool) or a ``RayBackend`` for ``--backend ray``."""
    if args.backend == "process":
        if args.ray_address is not None:
            raise ValueError("--ray-address: needs --backend ray")
        return None
    return RayBackend(args.ray_address, num_cpus=args.jobs)


def _run_job_indexed(item: tuple[int, Any]) -> dict[str, Any]:
    index, job = item
    return {**_run_job(job), "_index": index}


def _expected_cost(job: Any) -> float:
    lending = 10.0 if job.point.policy != "static" else 1.0
    agent = 5.0 if job.point.trace == "agent" else 1.0
    kind = {GpusJob: 25.0, CapacityJob: 7.0}.get(type(job), 1.0)
    return lending * agent * kind


def combos(spec: GridSpec) -> list[Combo]:
    return [Combo(t, m, s) for t in spec.traces for m in spec.models for s in spec.splits_for(t)]


def is_bundled(trace: str) -> bool:
    from envs.traces import BUNDLED_TRACES

    return trace in BUNDLED_TRACES


@functools.lru_cache(maxsize=32)
def _loaded(trace: str) -> Trace:
    from envs.traces import load_trace

    return load_trace(trace)


@functools.lru_cache(maxsize=32)
def _side(trace: str, split: str) -> Trace:
    from envs.splits import trace_side

    return trace_side(trace, split)


def is_closed_loop(trace: str) -> bool:
    """Whether bundled trace or trace file ``trace`` is closed loop (agent sessions); loads it once."""
    return _loaded(trace).closed_loop


def describe_traces(spec: GridSpec) -> list[str]:
    """One line per trace: what a side replays and which split sides run (printed before the grid)."""
    lines = []
    for t in spec.traces:
        closed = is_closed_loop(t)
        unit, flag = ("sessions", "--max-sessions") if closed else ("requests", "--max-requests")
        for side in spec.splits_for(t):
            n = spec.subset(t, side)
            note = ""
            if closed and spec.max_sessions is None and spec.max_requests is not None:
                note = f", the fewest whole sessions holding {spec.max_requests} requests (--max-requests)"
                flag = "--max-sessions counts sessions"
            origin = "bundled" if is_bundled(t) else "file, no shared dev/held-out split"
            lines.append(f"{t} ({origin}) [{side}]: first {n} {unit}{note} ({flag}; --splits picks sides)")
    return lines


def run_compare(
    spec: GridSpec,
    out_dir: str | Path,
    *,
    jobs: int = 1,
    progress: bool = False,
    use_wandb: bool = False,
    command: str = "",
    predictor: Any = None,
    backend: Any = None,
    requests_out: str | os.PathLike[str] | None = None,
    bundles: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the grid, write results.json, report.md and PNGs into ``out_dir``; return the results dict.

    Every artifact is checked before anything is written (``validate_artifacts``). Finished jobs land in
    ``out_dir/finished/`` as they finish; on ``KeyboardInterrupt`` the pool is stopped, ``interrupted.json``
    says what finished and how to resume, and the interrupt propagates.
    """
    t0 = time.perf_counter()
    out = Path(out_dir)
    artifacts: dict[str, str] = {}
    bundle_info: dict[str, dict[str, Any]] = {}
    if bundles:
        spec, artifacts, bundle_info = add_bundles(spec, bundles)
        if backend is not None:
            backend.aliases = tuple(policy_spec(name) for name in bundle_info)
    if predictor is None and any(
        policy_spec(p).needs_predictor and not artifact_of(artifacts, p, m)
        for p in spec.policies
        for m in spec.models
    ):
        artifacts.update({m: resolve_artifact(spec, m) for m in spec.models})
    validate_artifacts(spec, artifacts, predictor)
    if requests_out is not None:
        from train.requests_out import check_requests_out

        check_requests_out(requests_out)
    out.mkdir(parents=True, exist_ok=True)
    requests_dir = str(out / "requests") if requests_out is not None else None
    runner = _Runner(out, jobs, progress, backend)
    stage = "static capacity"
    try:
        seeds = spec.seed_list()

        # 1. static capacity at SLO on every grid shape and seed: the saturation, the SLO rule per seed
        stage1 = [
            CapacityJob(spec.point("static", c, shape, 1.0, seed), SLO_SHARE_TARGET, True)
            for c in combos(spec)
            for shape in spec.shapes
            for seed in seeds
        ]
        static_caps = runner.run(stage1, stage)
        saturation = _saturation_table(spec, static_caps)
        sat = {(s["combo"], s["shape"]): s for s in saturation}

        # 2. policies' capacity, other splits (hindsight), the regime points, GPUs needed
        stage = "capacity, regimes, GPUs needed"
        jobs2 = _stage2_jobs(spec, sat, artifacts, predictor, requests_dir)
        done2 = runner.run(jobs2, stage)
        capacities = [r for r in static_caps + done2 if r["kind"] == "capacity"]
        sims = {r["label"]: r for r in done2 if r["kind"] == "sim"}
        gpus = [r for r in done2 if r["kind"] == "gpus"]

        # 3. hindsight-split: static on the best split of each seed (simulated where it is not the grid shape)
        hindsight = hindsight_split(spec, capacities, saturation) if HINDSIGHT_SPLIT in spec.policies else []
        stage3 = [
            SimTask(pt, False, regime=regime, load_fraction=frac, requests_dir=requests_dir)
            for h in hindsight
            if h["shape"] != h["grid_shape"]
            for regime, frac, pt in _regime_points(spec, sat, h)
            if pt.label() not in sims
        ]
        stage = "hindsight split"
        done3 = runner.run(stage3, stage)
        for r in done3:
            sims[r["label"]] = r
    except KeyboardInterrupt:
        runner.close(cancel=True)
        note = {
            "interrupted_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "stage": stage,
            "finished_this_run": runner.ran,
            "reused": runner.reused,
            "finished_total": len(list((out / FINISHED_DIR).glob("*.json"))),
            "resume": f"{command or 'crossflow compare ...'} (with the same --out) skips every finished job",
        }
        write_json(out / "interrupted.json", note)
        raise
    finally:
        runner.close()
    (out / "interrupted.json").unlink(missing_ok=True)
    pruned = runner.prune()
    requests_written = None
    if requests_out is not None:
        import pandas as pd

        from train.requests_out import write_parquet

        tasks = {t.point.label(): t for t in [*jobs2, *stage3] if isinstance(t, SimTask)}
        requests_written = {
            "path": str(requests_out),
            "rows": write_parquet((pd.read_parquet(requests_part(t)) for t in tasks.values()), requests_out),
            "simulations": len(tasks),
        }

    points = _grid_rows(spec, saturation, sims, hindsight)
    results: dict[str, Any] = {
        "run_id": out.name,
        "command": command,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "grid": {
            **asdict(spec),
            "subsets": {t: spec.subset(t, spec.splits_for(t)[0]) for t in spec.traces},
            "subsets_by_side": {t: {x: spec.subset(t, x) for x in spec.splits_for(t)} for t in spec.traces},
            "subset_units": {t: "sessions" if is_closed_loop(t) else "requests" for t in spec.traces},
            "splits_run": {t: list(spec.splits_for(t)) for t in spec.traces},
            "seed_list": list(seeds),
        },
        "jobs": jobs,
        "backend": "process" if backend is None else backend.name,
        "code_version": runner.code,
        "jobs_run": runner.ran,
        "jobs_reused": runner.reused,
        "jobs_pruned": pruned,
        "requests_out": requests_written,
        "bundles": bundle_info,
        "slo_share_target": SLO_SHARE_TARGET,
        "capacity_resolution": CAPACITY_RESOLUTION,
        "saturation": saturation,
        "capacity": [_strip(c) for c in capacities],
        "capacity_bound": _capacity_bounds(spec, saturation),
        "hindsight": hindsight,
        "gpus_needed": gpus,
        "points": points,
        "failed": [r for r in [*static_caps, *done2, *done3] if r.get("error")],
    }
    results["policy_params"] = describe_params(
        [p for p in spec.simulated_policies() if not policy_spec(p).passive], spec.models
    )
    results["summary"] = report.summarise(results)
    results["targets"] = report.evaluate_targets(results)
    results["wall_s"] = time.perf_counter() - t0
    write_json(out / "results.json", results, indent=1)
    written = report.write_report(results, out)
    if use_wandb:
        results["wandb"] = _log_wandb(results, out, artifacts, [p for p in written if p.suffix == ".png"])
        results["wall_s"] = time.perf_counter() - t0
        write_json(out / "results.json", results, indent=1)
    return results


def _regimes(spec: GridSpec) -> list[tuple[str, float]]:
    return [("latency", f) for f in spec.latency_loads] + [("throughput", f) for f in spec.throughput_loads]


def _regime_points(
    spec: GridSpec, sat: dict[tuple[str, str], dict[str, Any]], h: dict[str, Any]
) -> list[tuple[str, float, Point]]:
    """The hindsight choice ``h``'s static runs at every regime load of its grid shape's saturation."""
    c = Combo(h["trace"], h["model"], h["split"])
    load = sat[(c.key(), h["grid_shape"])]["load"]
    return [
        (regime, frac, spec.point("static", c, h["shape"], frac * load, h["seed"]))
        for regime, frac in _regimes(spec)
    ]


def _stage2_jobs(
    spec: GridSpec,
    sat: dict[tuple[str, str], dict[str, Any]],
    artifacts: dict[str, str],
    predictor: Any,
    requests_dir: str | None = None,
) -> list[Any]:
    """Capacity searches of the other policies and splits, regime points, GPUs-needed searches."""
    seeds = spec.seed_list()
    lending = [p for p in spec.simulated_policies() if p != "static"]
    jobs: list[Any] = []
    for c in combos(spec):
        for shape in spec.shapes:
            s = sat[(c.key(), shape)]
            if not s["usable"]:
                continue  # static misses the SLO at every load: nothing to match (report.md says so)
            for seed in seeds:
                thr, start = s["thresholds"][seed], s["loads"][seed]
                for policy in lending:
                    pt = spec.point(policy, c, shape, 1.0, seed)
                    jobs.append(
                        CapacityJob(
                            pt,
                            thr,
                            False,
                            start,
                            POLICY_STEP,
                            artifact_of(artifacts, policy, c.model),
                            predictor,
                        )
                    )
                if HINDSIGHT_SPLIT in spec.policies:
                    for other in same_gpu_splits(shape):
                        grid = sat.get((c.key(), other))
                        if grid and grid["usable"] and math.isclose(grid["thresholds"][seed], thr):
                            continue  # a grid shape judged on the same SLO rule: stage 1 searched it
                        pt = spec.point("static", c, other, 1.0, seed)
                        jobs.append(CapacityJob(pt, thr, False, start, SPLIT_STEP, role="split"))
            for regime, frac in _regimes(spec):
                for policy in spec.simulated_policies():
                    for seed in seeds:
                        pt = spec.point(policy, c, shape, frac * s["load"], seed)
                        jobs.append(
                            SimTask(
                                pt,
                                seed == seeds[0],
                                artifact_of(artifacts, policy, c.model),
                                predictor,
                                regime,
                                frac,
                                requests_dir,
                            )
                        )
        first = sat.get((c.key(), spec.shapes[0]))
        if spec.gpus_needed and first and first["usable"]:
            thresholds = tuple(sorted(first["thresholds"].items()))
            for policy in spec.simulated_policies():
                pt = spec.point(policy, c, spec.shapes[0], 1.0, seeds[0])
                art = artifact_of(artifacts, policy, c.model)
                jobs.append(GpusJob(pt, thresholds, spec.max_workers, art, predictor))
    return jobs


def _strip(capacity: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in capacity.items() if k != "kind"}


def _saturation_table(spec: GridSpec, static_caps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (combo, grid shape): static's capacity per seed, the SLO threshold per seed (relative where
    static misses the target when idle) and their geometric mean (the load points' anchor)."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in static_caps:
        p = r["point"]
        c = Combo(p["trace"], p["model"], p["split"])
        by.setdefault((c.key(), p["shape"]), []).append(r)
    rows = []
    for c in combos(spec):
        for shape in spec.shapes:
            found = [r for r in by.get((c.key(), shape), []) if not r.get("error") and r.get("usable")]
            loads = {int(r["point"]["seed"]): float(r["load"]) for r in found}
            rows.append(
                {
                    "combo": c.key(),
                    "trace": c.trace,
                    "model": c.model,
                    "split": c.split,
                    "shape": shape,
                    "usable": bool(loads) and len(loads) == len(by.get((c.key(), shape), [])),
                    "loads": loads,
                    "load": math.exp(sum(map(math.log, loads.values())) / len(loads)) if loads else math.nan,
                    "thresholds": {int(r["point"]["seed"]): float(r["threshold"]) for r in found},
                    "relative": any(r["relative"] for r in found),
                    "idle_shares": {int(r["point"]["seed"]): r["idle_share"] for r in found},
                    "bracketed": all(r["bracketed"] for r in found),
                    "errors": [r["error"] for r in by.get((c.key(), shape), []) if r.get("error")],
                }
            )
    return rows


def hindsight_split(
    spec: GridSpec, capacities: Sequence[dict[str, Any]], saturation: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The ``hindsight-split`` baseline per (trace, model, split side, grid shape, seed): the split of
    the same GPUs with the highest static capacity at SLO at that seed (ties keep the grid shape).

    ``capacities`` are capacity-search results; a split counts only when it was judged on the grid
    shape's SLO threshold at that seed (``saturation``, from ``_saturation_table``). Returns one dict per
    choice: ``shape``, ``grid_shape``, ``load`` (its capacity), ``bracketed``, ``capacities`` (split ->
    capacity) and the point fields.
    """
    static: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in capacities:
        p = r["point"]
        if p["policy"] == "static" and not r.get("error") and r.get("usable", True):
            static.setdefault((p["trace"], p["model"], p["split"], p["shape"], int(p["seed"])), []).append(r)
    rules = {(s["combo"], s["shape"]): s["thresholds"] for s in saturation}
    out = []
    for c in combos(spec):
        for shape in spec.shapes:
            for seed in spec.seed_list():
                thr = rules.get((c.key(), shape), {}).get(seed)
                found = {
                    s: r
                    for s in same_gpu_splits(shape)
                    for r in static.get((c.trace, c.model, c.split, s, seed), [])
                    if thr is not None and math.isclose(float(r["threshold"]), thr)
                }
                caps = {s: float(r["load"]) for s, r in found.items()}
                if shape not in caps:
                    continue
                best = max(caps, key=lambda s: (caps[s], s == shape))
                out.append(
                    {
                        "trace": c.trace,
                        "model": c.model,
                        "split": c.split,
                        "grid_shape": shape,
                        "seed": seed,
                        "shape": best,
                        "load": caps[best],
                        "bracketed": bool(found[best]["bracketed"]),
                        "itl_p99_s": found[best].get("itl_p99_s", math.nan),
                        "capacities": caps,
                    }
                )
    return out


def _grid_rows(
    spec: GridSpec,
    saturation: Sequence[dict[str, Any]],
    sims: dict[str, dict[str, Any]],
    hindsight: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """One row per (policy, combo, grid shape, regime, load fraction, seed), hindsight-split included."""
    choice = {(h["trace"], h["model"], h["split"], h["grid_shape"], h["seed"]): h["shape"] for h in hindsight}
    rows = []
    for s in saturation:
        if not s["usable"]:
            continue
        c = Combo(s["trace"], s["model"], s["split"])
        for (regime, frac), seed, policy in itertools.product(
            _regimes(spec), spec.seed_list(), spec.policies
        ):
            load, shape = frac * s["load"], s["shape"]
            if policy == HINDSIGHT_SPLIT:
                shape = choice.get((c.trace, c.model, c.split, s["shape"], seed), "")
            res = sims.get(
                spec.point(policy if policy != HINDSIGHT_SPLIT else "static", c, shape, load, seed).label()
            )
            if not shape or res is None:
                continue
            row = {k: v for k, v in res.items() if k != "kind"}
            row.update(
                policy=policy,
                trace=c.trace,
                model=c.model,
                split=c.split,
                shape=s["shape"],
                run_shape=shape,
                seed=seed,
                regime=regime,
                load_fraction=frac,
                saturation_load=s["load"],
            )
            rows.append(row)
    return rows


def _capacity_bounds(spec: GridSpec, saturation: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fluid bound on capacity at SLO per (combo, grid shape, seed) (open-loop traces only)."""
    out = []
    for s in saturation:
        if not s["usable"]:
            continue
        c = Combo(s["trace"], s["model"], s["split"])
        n_p, n_d = parse_shape(s["shape"])
        for seed, threshold in s["thresholds"].items():
            pt = spec.point("static", c, s["shape"], 1.0, seed)
            served, prefill_s, decode_s = request_work(pt)
            load = bound.capacity_bound(
                served, prefill_s, decode_s, n_p + n_d, threshold=threshold,
                slo_ttft_s=spec.slo_ttft_s, slo_tpot_s=spec.slo_tpot_s,
            )  # fmt: skip
            out.append({"combo": c.key(), "shape": s["shape"], "seed": seed, "load": load})
    return out


SEED_COLUMNS = (
    "ttft_mean_s", "ttft_p99_s", "itl_mean_s", "itl_p99_s", "input_tokens_per_s", "output_tokens_per_s",
    "slo_attainment", "borrowed_share", "local_share",
)  # fmt: skip
"""Per-seed columns of each run's ``seeds`` table (besides served SLO share and steady throughput)."""


def comparison_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """``report.summarise``'s cells as table rows: policy, side, group, metric, mean, 95 % interval, n,
    verdict (changes vs static are ratios - 1; shares are plain)."""
    columns = ["policy", "split", "group", "metric", "mean", "low", "high", "n", "verdict"]
    rows = []
    for policy, sides in sorted(summary.items()):
        for side, groups in sorted(sides.items()):
            for group, cell in sorted(groups.items()):
                for metric, e in sorted(cell.items()):
                    if isinstance(e, dict) and "mean" in e:
                        rows.append(
                            [policy, side, group, metric, e["mean"], e["low"], e["high"], e["n"],
                             e.get("verdict", "")]
                        )  # fmt: skip
    return columns, rows


RUN_BUNDLES = "bundles"
"""Folder of a compare run where the catalog policies it ran are written as policy bundles."""


def run_bundles(results: dict[str, Any], out: Path, artifacts: dict[str, str]) -> dict[tuple[str, str], str]:
    """(policy, model) -> the policy bundle folder that policy ran on that model: a ``--policy-bundle``'s
    own folder; for a catalog policy with a scheduler, a bundle written now into ``out/bundles/`` with
    the values it ran (the tuned ones and any ``policy_params`` over them), the interference model it
    used and, for the ``rl`` node policy, its weights. Passive and grid-level policies have none.
    Rewritten on each call (same policy, values and files: the same digest)."""
    import shutil

    from policies.bundle import write_policy_bundle
    from policies.catalog import tuned_params
    from policies.rl_policy import ARTIFACT_PARAM, DEFAULT_ARTIFACT, runs_rl_weights

    given = results.get("bundles") or {}
    found: dict[tuple[str, str], str] = {}
    for p in results["points"]:
        policy, model = p["policy"], p["model"]
        if (policy, model) in found:
            continue
        if policy in given:
            found[(policy, model)] = given[policy]["folder"]
            continue
        spec = policy_spec(policy)
        if spec.passive or spec.grid_level:
            continue
        params = {**tuned_params(policy, model), **{k: v for k, v in p["point"].get("policy_params") or ()}}
        rl = params.pop(ARTIFACT_PARAM, DEFAULT_ARTIFACT) if runs_rl_weights(spec) else None
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{policy}-{model}")
        folder = out / RUN_BUNDLES / name
        if folder.exists():
            shutil.rmtree(folder)
        write_policy_bundle(
            folder,
            name=name,
            policy=policy,
            params=params,
            interference_model=artifact_of(artifacts, policy, model) if spec.needs_predictor else None,
            rl_policy=rl,
            command=results.get("command", ""),
        )
        found[(policy, model)] = str(folder)
    return found


def _log_wandb(
    results: dict[str, Any], out: Path, artifacts: dict[str, str], plots: Sequence[Path]
) -> dict[str, Any]:
    """W&B runs of one compare (offline unless the user chose online), grouped under one name per
    invocation (``<run folder>@<created time>``, so a rerun into the same folder starts a new group):

    * one run per (point, policy) -- trace, model, shape, split side, regime, load fraction -- with
      ``job_type`` the regime, seed means in the summary, a ``seeds`` table (one row per seed), the first
      seed's per-minute timeline as history, the interference model it used by hash, and the policy
      bundle it ran as a ``policy-bundle`` artifact (``run_bundles``, ``wandb_log.log_bundle_artifact``);
    * one ``summary`` run: the comparison table with the 95 % intervals, every plot as an image, and
      ``results.json`` + ``report.md`` as a versioned ``compare-results`` artifact.
    """
    from train import wandb_log

    wandb_log.default_to_offline()
    group = f"{out.name}@{results['created_utc']}"
    bundles = run_bundles(results, out, artifacts)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for p in results["points"]:
        if p.get("metrics"):
            key = (
                p["policy"],
                p["trace"],
                p["model"],
                p["shape"],
                p["split"],
                p["regime"],
                p["load_fraction"],
            )
            groups.setdefault(key, []).append(p)
    runs = []
    for (policy, trace, model, shape, split, regime, frac), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["seed"])
        tl = rows[0].get("timeline") or {}
        history = [dict(zip(tl, vals, strict=True)) for vals in zip(*tl.values(), strict=True)] if tl else []
        means = {
            k: float(np.mean([r["metrics"][k] for r in rows]))
            for k, v in rows[0]["metrics"].items()
            if isinstance(v, int | float)
        }
        seed_rows = [
            [r["seed"], r["run_shape"], r["point"]["load"], r["served_slo_share"],
             r["steady"]["input_tokens_per_s"], r["steady"]["output_tokens_per_s"],
             *(r["metrics"].get(c) for c in SEED_COLUMNS)]
            for r in rows
        ]  # fmt: skip
        runs.append(
            wandb_log.RunLog(
                name=f"{policy}|{Path(trace).name}|{model}|{shape}|{split}|{regime}={frac:g}",
                group=group,
                tags=[policy, Path(trace).name, model, shape, split, regime],
                job_type=regime,
                config={
                    **{k: v for k, v in rows[0]["point"].items() if k not in ("seed", "policy", "load")},
                    "policy": policy,
                    "seeds": [r["seed"] for r in rows],
                    "load_fraction": frac,
                    "saturation_load": rows[0]["saturation_load"],
                    "run_shapes": sorted({r["run_shape"] for r in rows}),
                    "code_version": results["code_version"],
                },
                summary={
                    **means,
                    "n_seeds": len(rows),
                    "served_slo_share": float(np.mean([r["served_slo_share"] for r in rows])),
                    "steady_input_tokens_per_s": float(
                        np.mean([r["steady"]["input_tokens_per_s"] for r in rows])
                    ),
                    "steady_output_tokens_per_s": float(
                        np.mean([r["steady"]["output_tokens_per_s"] for r in rows])
                    ),
                },
                history=history,
                tables={
                    "seeds": (
                        [
                            "seed",
                            "run_shape",
                            "load",
                            "served_slo_share",
                            "steady_input_tokens_per_s",
                            "steady_output_tokens_per_s",
                            *SEED_COLUMNS,
                        ],
                        seed_rows,
                    )
                },
                artifact_dir=artifact_of(artifacts, policy, model)
                if policy_spec(policy).needs_predictor
                else None,
                policy_bundle=bundles.get((policy, model)),
            )
        )
    columns, table = comparison_rows(results["summary"])
    runs.append(
        wandb_log.RunLog(
            name=f"summary|{out.name}",
            group=group,
            tags=["summary"],
            job_type="summary",
            config={
                "grid": results["grid"],
                "command": results["command"],
                "code_version": results["code_version"],
            },
            summary={
                "jobs_run": results["jobs_run"],
                "jobs_reused": results["jobs_reused"],
                "rows": len(results["points"]),
            },
            tables={"comparison": (columns, table)},
            images={f"plot/{p.stem}": str(p) for p in plots},
            output_artifact=(
                f"compare-{re.sub(r'[^A-Za-z0-9_.-]+', '-', out.name)}",
                "compare-results",
                [str(out / "results.json"), str(out / "report.md")],
            ),
        )
    )
    t0 = time.perf_counter()
    folders = wandb_log.log_runs(runs, wandb_dir=out)
    return {
        "mode": os.environ.get("WANDB_MODE"),
        "group": group,
        "runs": len(folders),
        "policy_bundles": {f"{policy}|{model}": path for (policy, model), path in sorted(bundles.items())},
        "dir": "wandb",
        "wall_s": time.perf_counter() - t0,
    }


# ---- command line ------------------------------------------------------------------------------------
def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        items = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return items

    return parse


def _shape(text: str) -> str:
    try:
        parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text.upper()


def _split(text: str) -> str:
    if text not in (ALL, *SIDES):
        raise argparse.ArgumentTypeError(f"split sides are {', '.join((*SIDES, ALL))}; got {text!r}")
    return text


def _positive(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``crossflow compare``: every grid flag's default and help default come from ``GridSpec``
    (``train.cli_fields``), so ``--help`` says what a run without the flag does."""
    p = sub.add_parser(
        "compare",
        help="static PD vs lease policies in the latency and capacity regimes, over seeds, with a bound",
        description="Run policies x traces x models x shapes over seeds: capacity at SLO per policy, "
        "latency at fractions of static saturation, steady-window throughput past it, the fewest GPUs "
        "that serve each trace, a fluid upper bound and the best split in hindsight; write results.json, "
        "report.md and plots into a run folder. See docs/compare.md.",
    )
    G = GridSpec
    add_field(
        p, G, "policies", "--policies", type=_csv(str), alt=("--full", FULL_POLICIES),
        help="policies (catalog names)",
    )  # fmt: skip
    add_field(
        p, G, "traces", "--traces", type=_csv(str), alt=("--full", FULL_TRACES),
        help="bundled trace names or trace files of any supported format (envs/traces.py)",
    )  # fmt: skip
    add_field(p, G, "models", "--models", type=_csv(str), alt=("--full", FULL_MODELS), help="served models")
    add_field(p, G, "shapes", "--shapes", type=_csv(_shape), alt=("--full", FULL_SHAPES), help="xPyD shapes")
    add_field(
        p, G, "latency_loads", "--latency-loads", type=_csv(_positive),
        help="latency regime, fractions of static saturation",
    )  # fmt: skip
    add_field(
        p, G, "throughput_loads", "--throughput-loads", type=_csv(_positive),
        help="capacity regime, overload points as fractions of static saturation",
    )  # fmt: skip
    add_field(p, G, "gpu", "--gpu", help="GPU of every worker")
    add_field(
        p, G, "tp", "--tp", type=positive_int, default_text="per model: "
        + ", ".join(f"{m} {t}" for m, t in DEFAULT_TP.items()), help="tensor-parallel degree per worker",
    )  # fmt: skip
    subset_text = ", ".join(f"{t} {n}" for t, n in DEFAULT_SUBSET.items() if t != "agent")
    add_field(
        p, G, "max_requests", "--max-requests", type=positive_int,
        default_text=f"{subset_text}, a trace file {FILE_SUBSET}; --full: "
        + ", ".join(f"{t} {n}" for t, n in FULL_SUBSET.items() if t != "agent"),
        help="open-loop traces: replay the first N requests of each split side",
    )  # fmt: skip
    add_field(
        p, G, "max_sessions", "--max-sessions", type=positive_int,
        default_text=f"agent {DEFAULT_SUBSET['agent']} (--full: {FULL_SUBSET['agent']}), a trace file "
        f"{FILE_SUBSET}",
        help="closed-loop (agent session) traces: replay the first N sessions of each split side",
    )  # fmt: skip
    add_field(p, G, "seed", "--seed", type=non_negative_int, help="first seed")
    add_field(p, G, "seeds", "--seeds", type=positive_int, alt=("--full", FULL_SEEDS), help="seeds per point")
    add_field(
        p, G, "splits", "--splits", type=_csv(_split),
        default_text=f"bundled traces {show(DEFAULT_SPLITS)} (--full: {show(FULL_SPLITS)}), trace files "
        f"{ALL} (they have no shared split; a side of a file is split by the same hash of its path)",
        help="split sides: heldout, dev, all",
    )  # fmt: skip
    add_field(p, G, "slo_ttft_s", "--slo-ttft", type=_positive, metavar="S", help="TTFT SLO, s")
    add_field(p, G, "slo_tpot_s", "--slo-tpot", type=_positive, metavar="S", help="TPOT SLO, s per token")
    add_field(
        p, G, "open_loop_arrivals", "--arrivals", choices=OPEN_LOOP_ARRIVALS,
        help="open-loop traces: per-seed Poisson re-timing at the per-minute rate, or the recording",
    )  # fmt: skip
    p.add_argument("--no-gpus-needed", action="store_true", help="skip the fewest-GPUs search")
    add_field(
        p, G, "max_workers", "--max-workers", type=positive_int, help="largest cluster the GPUs search tries"
    )
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=min(2, os.cpu_count() or 1),
        help="parallel simulations (default: min(2, CPUs))",
    )
    p.add_argument("--out", default=None, help="run folder (default: runs/compare-<UTC timestamp>)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write results.json here")
    p.add_argument(
        "--full",
        action="store_true",
        help="the reviewer's grid (30 minutes on 2 cores): static, heuristic, the best tuned peers "
        "dynamo-load and deflect, hindsight-split x agent (20 sessions) and mooncake (1,000 requests) x "
        "gpt-oss-120b and glm-5 x 2P4D, 4P2D, both split sides, 5 seeds (explicit flags still override)",
    )
    add_field(
        p, G, "decode_prefix_cache", "--decode-prefix-cache", action="store_true",
        help="decode workers keep a radix prefix cache, for every policy (as the shipped tuning did)",
    )  # fmt: skip
    add_field(
        p, G, "interference_model", "--interference-model", metavar="DIR",
        default_text="the shipped one per model", help="artifact folder for heuristic/rl",
    )  # fmt: skip
    p.add_argument(
        "--requests-out",
        default=None,
        metavar="PATH.parquet",
        help="one row per request of every regime simulation (path, nodes, TTFT, ITL, decision reason, "
        "lease id, and the point), as Parquet",
    )
    p.add_argument(
        "--backend",
        choices=("process", "ray"),
        default="process",
        help="run the simulations in local processes (default) or as Ray tasks "
        "(pip install 'crossflow[ray]')",
    )
    p.add_argument(
        "--ray-address", default=None, metavar="ADDR", help="Ray cluster to join (default: start a local one)"
    )
    p.add_argument(
        "--policy-bundle",
        action="append",
        default=[],
        metavar="DIR|wandb:ENTITY/PROJECT/NAME:VERSION",
        help="add the policy of a policy bundle to the grid, under the bundle's name (repeatable; "
        "docs/policy_bundle.md)",
    )
    p.add_argument("--no-wandb", action="store_true", help="do not log W&B runs")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_model_arguments(p)
    p.set_defaults(func=_run)
    return p


def spec_from_args(args: argparse.Namespace) -> GridSpec:
    full = bool(args.full)
    alts = {
        "policies": FULL_POLICIES,
        "traces": FULL_TRACES,
        "models": FULL_MODELS,
        "shapes": FULL_SHAPES,
        "seeds": FULL_SEEDS,
    }
    return GridSpec(
        **{name: resolve(args, GridSpec, name, value, full) for name, value in alts.items()},
        latency_loads=args.latency_loads,
        throughput_loads=args.throughput_loads,
        gpu=args.gpu,
        tp=args.tp,
        max_requests=args.max_requests,
        max_sessions=args.max_sessions,
        seed=args.seed,
        splits=args.splits,
        full=full,
        decode_prefix_cache=bool(args.decode_prefix_cache),
        interference_model=args.interference_model,
        slo_ttft_s=args.slo_ttft_s,
        slo_tpot_s=args.slo_tpot_s,
        open_loop_arrivals=args.open_loop_arrivals,
        gpus_needed=not args.no_gpus_needed,
        max_workers=args.max_workers,
        **model_options(args),
    )


def check_names(spec: GridSpec) -> None:
    """Fail before any simulation on an unknown policy, trace or model (naming the flag)."""
    from envs.traces import BUNDLED_TRACES

    known = policy_names()
    for policy in spec.policies:
        if policy not in known:
            raise ValueError(f"--policies: unknown policy {policy!r}; known: {', '.join(known)}")
    if "static" not in spec.policies:
        raise ValueError("--policies: must include static (every change is measured against it)")
    for trace in spec.traces:
        if trace not in BUNDLED_TRACES and not Path(trace).is_file():
            raise ValueError(
                f"--traces: {trace!r} is neither a bundled trace ({', '.join(BUNDLED_TRACES)}) nor a file"
            )
        try:
            _loaded(trace)  # a malformed file fails here, naming file and line, before anything runs
        except ValueError as exc:
            raise ValueError(f"--traces: {exc}") from None
    for model in spec.models:
        check_model(
            model, gpu=spec.gpu, tp=spec.resolved_tp(model), model_flag="--models", **spec.model_options()
        )


def _run(args: argparse.Namespace) -> int:
    from train import wandb_log

    apply_models_dir(args)
    spec = spec_from_args(args)
    check_names(spec)
    out = Path(args.out or f"runs/compare-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}")
    if not args.no_wandb:
        wandb_log.default_to_offline()
    command = "crossflow " + " ".join(shlex.quote(a) for a in getattr(args, "argv", None) or ["compare"])
    for line in describe_traces(spec):
        print(f"compare: {line}", file=sys.stderr)
    try:
        results = run_compare(
            spec,
            out,
            jobs=args.jobs,
            progress=not args.no_progress,
            use_wandb=not args.no_wandb,
            command=command,
            backend=make_backend(args),
            requests_out=args.requests_out,
            bundles=args.policy_bundle,
        )
    except KeyboardInterrupt:
        note = out / "interrupted.json"
        if note.is_file():
            info = json.loads(note.read_text(encoding="utf-8"))
            print(
                f"compare: interrupted during {info['stage']}: {info['finished_total']} finished job(s) kept "
                f"in {out}/{FINISHED_DIR}/ ({info['finished_this_run']} this run); rerun the same command "
                "with the same --out to resume",
                file=sys.stderr,
            )
        return 130
    if args.json:
        write_json(Path(args.json), results, indent=1)
    print(
        f"compare: {len(results['points'])} rows ({spec.seeds} seed(s)) in {results['wall_s']:.0f} s "
        f"-> {out}/report.md"
    )
    for line in report.headline_lines(results):
        print(f"  {line}")
    failed = [r.get("label") or r.get("name") for r in results["failed"]]
    if failed:
        print(
            f"compare: {len(failed)} job(s) failed, see report.md: {', '.join(map(str, failed[:5]))}",
            file=sys.stderr,
        )
        return 1
    return 0
