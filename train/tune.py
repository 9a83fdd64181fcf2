"""``crossflow tune``: every policy's thresholds, searched equally, for capacity at SLO on development traces.

For each policy of the catalog with a tuning grid (``PolicySpec.grid``: the peers' thresholds and
chunk sizes, Crossflow's TTL, margins and ITL guard; every grid has the same number of points), and
each development trace, the **capacity at SLO** of every grid point: the highest load factor at which
at least the SLO threshold share of requests finish within the per-request SLO
(``train.saturation.served_slo_share``), found by ``find_capacity`` starting from static's capacity
and stopping at ``MAX_CAPACITY_FACTOR`` times it.
The threshold is static's on that trace (``capacity_search``: 90 %, or 90 % of static's idle share
when static never reaches 90 %), the same for every policy. A grid point's score is the geometric mean
over the traces of its capacity over static's; each policy keeps its best point (the first on ties).
``hindsight-split`` has no grid: its capacity is the best static capacity over every xPyD split of the
same GPUs.

The result records the command, the cluster, the traces, static's capacity and threshold, and every
grid point's capacities; ``compare``, ``simulate`` and anything else that builds a policy through
``policies.catalog`` use its ``params`` on that model. It goes to the model's shipped file by default
(``policies.catalog.model_tuned_file``: ``policies/data/tuned_policies.json`` for gpt-oss-120b,
``tuned_policies-<model>.json`` for any other ``--model``); a model, or a policy, without values of
its own runs gpt-oss-120b's.

Traces: the first ``DEV_SUBSET`` sessions or requests of the development side of each bundled trace
(``envs.splits``; open-loop arrivals re-timed from the seed, as ``compare`` runs them). ``compare``
evaluates on the held-out side, which shares no session or minute window with it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from envs.cluster_config import parse_shape
from policies.catalog import (
    TUNED_FORMAT,
    load_tuned,
    model_tuned_file,
    policy_names,
    policy_spec,
    tuned_params,
)
from train.cli_types import positive_int
from train.compare import DEFAULT_SUBSET, is_closed_loop, same_gpu_splits, time_cap_s, trace_for
from train.experiment import Point, run_point
from train.jsonio import write_json
from train.saturation import LOAD_BOUNDS, capacity_search, find_capacity, served_slo_share

DEV_SUBSET: dict[str, int] = {"agent": 60, "mooncake": 2000}
"""Bundled trace -> first N sessions (closed loop) or requests (open loop) of its development side used
for tuning (2,000 for other open-loop traces). ``compare`` evaluates on the held-out side, which shares
no session or minute window with it."""
DEFAULT_TRACES = ("agent", "mooncake")
CAPACITY_FORMAT = "crossflow-capacity/1"
"""``--evaluate`` output: capacities of the shipped tuned values on the evaluation side (not a tuned file)."""
MAX_CAPACITY_FACTOR = 4.0
"""Searches stop at this multiple of static's capacity (twice the highest load ``compare`` runs): a
closed-loop trace of N sessions adds no load once all N are in flight, so its SLO share stops falling
with the load factor and an unbounded search would report a capacity that means nothing. A capacity
at the cap is reported unbracketed (at least that much)."""

Side = Literal["development", "evaluation"]
SPLIT_SIDE: dict[str, str] = {"development": "dev", "evaluation": "heldout"}
"""Tuning reads the development side of the bundled split (``envs.splits``); ``--evaluate`` measures on
the held-out side ``compare`` evaluates on."""


def _subset(trace: str, side: Side, max_requests: int | None = None, max_sessions: int | None = None) -> int:
    """Sessions (closed loop: ``--max-sessions``) or requests (open loop: ``--max-requests``) of
    ``trace`` to replay on ``side``."""
    chosen = max_sessions if is_closed_loop(trace) else max_requests
    if chosen is not None:
        return chosen
    return DEV_SUBSET.get(trace, 2000) if side == "development" else DEFAULT_SUBSET.get(trace, 1000)


@dataclass(frozen=True)
class TuneSpec:
    """What to tune, and on which cluster."""

    policies: tuple[str, ...]
    traces: tuple[str, ...] = DEFAULT_TRACES
    model: str = "gpt-oss-120b"
    gpu: str = "H200"
    shape: str = "2P4D"
    seed: int = 0
    decode_prefix_cache: bool = False
    side: Side = "development"
    """``development``: search every grid; ``evaluation``: measure the shipped tuned values only."""
    max_requests: int | None = None
    """First N requests of each open-loop trace's side (default ``DEV_SUBSET`` / compare's subset)."""
    max_sessions: int | None = None
    """First N sessions of each closed-loop trace's side (the agent sessions)."""

    def point(self, policy: str, trace: str, shape: str | None = None) -> Point:
        """``policy`` on ``trace``'s side of the split (its load is set by the search), with open-loop
        arrivals re-timed from the seed as ``compare`` runs them."""
        return Point(
            policy=policy,
            trace=trace,
            model=self.model,
            gpu=self.gpu,
            shape=shape or self.shape,
            seed=self.seed,
            max_requests=_subset(trace, self.side, self.max_requests, self.max_sessions),
            split=SPLIT_SIDE[self.side],
            open_loop_arrivals="poisson",
            decode_prefix_cache=self.decode_prefix_cache,
        )


@dataclass(frozen=True)
class CapacityJob:
    """One capacity search: ``point`` (its load is ignored) with ``params``, against ``threshold``."""

    point: Point
    params: tuple[tuple[str, Any], ...]
    threshold: float
    start_load: float
    grid_index: int = 0
    side: Side = "development"


def _share_at(point: Point, params: Mapping[str, Any], load: float) -> float:
    at = replace(point, load=load)
    trace = trace_for(at)
    cap_s = time_cap_s(at, trace) if point.policy != "static" else math.inf
    result = run_point(at, trace=trace, params=params, max_time_s=cap_s)
    return served_slo_share(result.metrics.to_dict())


def capacity_job(job: CapacityJob) -> dict[str, Any]:
    """Worker: the capacity at SLO of one policy and parameter set on one development trace."""
    t0 = time.perf_counter()
    params = dict(job.params)
    load, _, bracketed, probes = find_capacity(
        lambda load: _share_at(job.point, params, load),
        threshold=job.threshold,
        start_load=job.start_load,
        bounds=(LOAD_BOUNDS[0], MAX_CAPACITY_FACTOR * job.start_load),
    )
    return {
        "policy": job.point.policy,
        "trace": job.point.trace,
        "shape": job.point.shape,
        "grid_index": job.grid_index,
        "params": params,
        "capacity": load,
        "bracketed": bracketed,
        "probes": probes,
        "wall_s": time.perf_counter() - t0,
    }


def static_job(point: Point) -> dict[str, Any]:
    """Worker: static's saturation search on ``point``'s trace (sets the SLO threshold)."""
    t0 = time.perf_counter()
    found = capacity_search(lambda load: _share_at(point, {}, load))
    return {"trace": point.trace, "shape": point.shape, **found, "wall_s": time.perf_counter() - t0}


def _pool_map(
    fn: Callable[[Any], dict[str, Any]], items: Sequence[Any], jobs: int, desc: str
) -> Iterable[dict[str, Any]]:
    """``fn`` over ``items`` in ``jobs`` processes (in this process if 1), yielding as they finish."""
    print(
        f"tune: {desc}: {len(items)} search(es) on {min(jobs, max(1, len(items)))} process(es)",
        file=sys.stderr,
    )
    if jobs <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(items))) as pool:
        for fut in cf.as_completed([pool.submit(fn, item) for item in items]):
            yield fut.result()


def _geo_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values and min(values) > 0 else 0.0


def _grid(spec: TuneSpec, name: str) -> list[dict[str, Any]]:
    """The parameter sets to measure: the whole grid on the development side, the shipped tuned
    values for the model on the evaluation side."""
    return policy_spec(name).grid_points() if spec.side == "development" else [tuned_params(name, spec.model)]


def run_tune(spec: TuneSpec, *, jobs: int = 1, command: str = "") -> dict[str, Any]:
    """Tune every policy of ``spec`` (see the module docstring); returns the tuned-values document
    (with ``side="evaluation"``: the capacities of the shipped tuned values, format ``CAPACITY_FORMAT``)."""
    t0 = time.perf_counter()
    side = spec.side
    statics = {
        r["trace"]: r
        for r in _pool_map(static_job, [spec.point("static", t) for t in spec.traces], jobs, "static")
    }
    for trace, static in statics.items():
        if not static["usable"]:
            raise ValueError(f"static never meets the SLO on {side} trace {trace!r}: nothing to compare with")
    todo: list[CapacityJob] = []
    for name in spec.policies:
        ps = policy_spec(name)
        for trace in spec.traces:
            sat = statics[trace]
            if ps.grid_level:
                todo += [
                    CapacityJob(
                        spec.point("static", trace, shape), (), sat["threshold"], sat["load"], i, side
                    )
                    for i, shape in enumerate(same_gpu_splits(spec.shape))
                ]
                continue
            for i, params in enumerate(_grid(spec, name)):
                point = spec.point(name, trace)
                todo.append(CapacityJob(point, tuple(params.items()), sat["threshold"], sat["load"], i, side))
    # the slow simulations (agent, lending policies) first, so the pool ends evenly
    todo.sort(key=lambda j: (j.point.trace != "agent", j.point.policy == "static"))
    found: list[dict[str, Any]] = list(_pool_map(capacity_job, todo, jobs, "capacity at SLO"))
    policies: dict[str, Any] = {}
    for name in spec.policies:
        ps = policy_spec(name)
        mine = [r for r in found if (r["policy"] == name) or (ps.grid_level and r["policy"] == "static")]
        rows: list[dict[str, Any]] = []
        if ps.grid_level:
            capacity = {t: max(r["capacity"] for r in mine if r["trace"] == t) for t in spec.traces}
            best_shape = {
                t: max((r for r in mine if r["trace"] == t), key=lambda r: r["capacity"])["shape"]
                for t in spec.traces
            }
            policies[name] = {
                "params": {},
                "capacity": capacity,
                "shape": best_shape,
                "score": _geo_mean([capacity[t] / statics[t]["load"] for t in spec.traces]),
                "splits": sorted(
                    ({"trace": r["trace"], "shape": r["shape"], "capacity": r["capacity"]} for r in mine),
                    key=lambda r: (r["trace"], r["shape"]),
                ),
            }
            continue
        for i, params in enumerate(_grid(spec, name)):
            per_trace = {r["trace"]: r for r in mine if r["grid_index"] == i}
            capacity = {t: per_trace[t]["capacity"] for t in spec.traces}
            rows.append(
                {
                    "params": params,
                    "capacity": capacity,
                    "bracketed": {t: per_trace[t]["bracketed"] for t in spec.traces},
                    "score": _geo_mean([capacity[t] / statics[t]["load"] for t in spec.traces]),
                }
            )
        best = max(rows, key=lambda r: r["score"]) if rows else {"params": {}, "capacity": {}, "score": 0.0}
        policies[name] = {
            "params": best["params"],
            "capacity": best["capacity"],
            "score": best["score"],
            "grid": rows,
        }
    return {
        "format": TUNED_FORMAT if side == "development" else CAPACITY_FORMAT,
        "command": command,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "objective": "capacity at SLO: the highest load factor with served SLO share >= static's threshold "
        "on the trace; score = geo-mean over traces of capacity / static capacity",
        "spec": asdict(spec),
        "traces": {t: trace_for(spec.point("static", t)).name for t in spec.traces},
        "static": {
            t: {k: statics[t][k] for k in ("load", "threshold", "relative", "idle_share")}
            for t in spec.traces
        },
        "policies": policies,
        "jobs": jobs,
        "wall_s": time.perf_counter() - t0,
    }


# ---- command line ------------------------------------------------------------------------------------
def default_policies() -> tuple[str, ...]:
    """Every catalog policy with a tuning grid, and ``hindsight-split``."""
    return tuple(n for n in policy_names() if policy_spec(n).grid or policy_spec(n).grid_level)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``crossflow tune``."""
    p = sub.add_parser(
        "tune",
        help="search every policy's grid for capacity at SLO on the development traces",
        description="For each policy with a tuning grid (grids of equal size), find the capacity at SLO of "
        "every grid point on the development side of the traces, keep the best, and write the tuned values "
        "that compare and simulate use. See train/tune.py and docs/compare.md.",
    )
    p.add_argument("--policies", default=None, help="comma-separated (default: every tunable policy)")
    p.add_argument("--traces", default=",".join(DEFAULT_TRACES), help=f"default: {','.join(DEFAULT_TRACES)}")
    p.add_argument("--model", default="gpt-oss-120b")
    p.add_argument("--gpu", default="H200")
    p.add_argument("--shape", default="2P4D")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-requests",
        type=positive_int,
        default=None,
        help="first N requests of each open-loop trace's side (default: mooncake 2000 for tuning, "
        "compare's subset with --evaluate)",
    )
    p.add_argument(
        "--max-sessions",
        type=positive_int,
        default=None,
        help="first N sessions of each closed-loop trace's side (agent; default 60)",
    )
    p.add_argument(
        "--decode-prefix-cache",
        action="store_true",
        help="decode workers keep a radix prefix cache, for every policy (decode-side rules read it)",
    )
    p.add_argument(
        "--evaluate",
        action="store_true",
        help="measure the shipped tuned values' capacity at SLO on compare's evaluation subsets instead "
        "(writes --out, default runs/capacity.json; the tuned file is left alone)",
    )
    p.add_argument(
        "--update",
        action="store_true",
        help="replace only these policies' entries in the existing tuned file (same traces, subsets, "
        "cluster and seed; each replaced entry records its own command)",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel searches")
    p.add_argument(
        "--out",
        default=None,
        help="where to write the tuned values (default: --model's shipped file, "
        "policies/data/tuned_policies[-MODEL].json)",
    )
    p.set_defaults(func=_run)
    return p


def spec_from_args(args: argparse.Namespace) -> TuneSpec:
    policies = tuple(x.strip() for x in (args.policies or "").split(",") if x.strip()) or default_policies()
    traces = tuple(x.strip() for x in args.traces.split(",") if x.strip())
    known = policy_names()
    for name in policies:
        if name not in known:
            raise ValueError(f"--policies: unknown policy {name!r}; known: {', '.join(known)}")
        ps = policy_spec(name)
        if not (ps.grid or ps.grid_level or args.evaluate) or ps.passive:
            raise ValueError(f"--policies: {name!r} has no tuning grid")
    from envs.traces import BUNDLED_TRACES

    for trace in traces:
        if trace not in BUNDLED_TRACES:
            names = ", ".join(sorted(BUNDLED_TRACES))
            raise ValueError(f"--traces: unknown bundled trace {trace!r}; known: {names}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    parse_shape(args.shape)
    from envs.hardware import get_model

    try:  # the catalog name (lower case, as the tuned file is named)
        model = get_model(args.model).name.lower()
    except (KeyError, ValueError) as exc:
        raise ValueError(f"--model: {exc}") from None
    return TuneSpec(
        policies=policies,
        traces=traces,
        model=model,
        gpu=args.gpu,
        shape=args.shape.upper(),
        seed=args.seed,
        decode_prefix_cache=bool(args.decode_prefix_cache),
        side="evaluation" if args.evaluate else "development",
        max_requests=args.max_requests,
        max_sessions=args.max_sessions,
    )


_UPDATE_KEYS = (
    "traces",
    "model",
    "gpu",
    "shape",
    "seed",
    "decode_prefix_cache",
    "side",
    "max_requests",
    "max_sessions",
)
"""Spec fields a ``--update`` must share with the file it updates (everything but the policies)."""


def _updatable(path: Path, spec: TuneSpec) -> dict[str, Any]:
    """The tuned file ``--update`` rewrites, checked before any search: it exists and was tuned on the
    same traces, subsets, cluster and seed (errors name the file and the field)."""
    if spec.side != "development":
        raise ValueError("--update applies to tuning, not to --evaluate")
    doc = load_tuned(path)
    if not doc:
        raise ValueError(f"{path}: no tuned file to update")
    old = doc.get("spec", {})
    new = asdict(spec)
    for key in _UPDATE_KEYS:
        if old.get(key) != (list(new[key]) if isinstance(new[key], tuple) else new[key]):
            raise ValueError(f"{path}: field 'spec.{key}' is {old.get(key)!r}, this run has {new[key]!r}")
    return doc


def merge_update(previous: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``previous`` with the policies of ``update`` replaced; each replaced entry carries the command and
    time that produced it, and ``updates`` lists every such run. Static's capacities must agree (the
    same searches on the same traces), else the two runs are not comparable and this raises."""
    for trace, row in update["static"].items():
        if not math.isclose(row["load"], previous["static"][trace]["load"], rel_tol=1e-9):
            raise ValueError(
                f"static's capacity on {trace!r} changed ({previous['static'][trace]['load']:.4g} -> "
                f"{row['load']:.4g}): the code under static changed, re-tune every policy"
            )
    merged = dict(previous)
    merged["policies"] = dict(previous["policies"])
    for name, entry in update["policies"].items():
        merged["policies"][name] = {
            **entry,
            "command": update["command"],
            "created_utc": update["created_utc"],
        }
    merged["updates"] = [
        *previous.get("updates", []),
        {
            "command": update["command"],
            "created_utc": update["created_utc"],
            "policies": sorted(update["policies"]),
            "wall_s": update["wall_s"],
        },
    ]
    merged["spec"] = {**previous["spec"], "policies": sorted(merged["policies"])}
    return merged


def _run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    command = "crossflow " + " ".join(shlex.quote(a) for a in getattr(args, "argv", sys.argv[1:]))
    out = Path(
        args.out or (model_tuned_file(spec.model) if spec.side == "development" else "runs/capacity.json")
    )
    previous = _updatable(out, spec) if args.update else None
    result = run_tune(spec, jobs=args.jobs, command=command)
    wall_s = result["wall_s"]
    if previous is not None:
        result = merge_update(previous, result)
    write_json(out, result, indent=1)
    print(f"tune: {len(spec.policies)} policies ({spec.side} side) in {wall_s:.0f} s -> {out}")
    for t, s in result["static"].items():
        print(f"  static on {t}: capacity {s['load']:.3g} (SLO share threshold {s['threshold']:.3f})")
    for name, row in result["policies"].items():
        caps = ", ".join(f"{t} {c:.3g}" for t, c in row["capacity"].items())
        print(f"  {name}: score {row['score']:.3f} ({caps}) with {row['params'] or row.get('shape')}")
    return 0
