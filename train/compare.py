"""`crossflow compare`: policies x traces x models x shapes x matched loads, against static and an oracle.

Contract: every simulated point is deterministic in its ``Point`` (same seed, same arrivals for every
policy at a point). Loads are *matched*: a grid load of 0.85 means 85 % of the static cluster's
saturation load for that (trace, model, shape), found by :func:`find_saturation` and cached in the run
folder (``saturation.json``). For each (trace, model, shape, load) the oracle simulates static on every
xPyD split of the same GPU count and keeps the best in hindsight (``train.report.choose_oracle``).

The run folder gets ``results.json``, ``report.md``, PNGs, and (unless ``--no-wandb``) one offline W&B
run per grid point under ``wandb/``. See ``docs/compare.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from envs.cluster_config import parse_shape
from envs.hardware import Precision
from envs.request import Trace
from policies.catalog import describe_params, policy_names, policy_spec
from train import report
from train.experiment import Point, default_tp, prepare_trace, run_point
from train.jsonio import write_json
from train.model_args import add_model_arguments, apply_models_dir, check_model, model_options
from train.saturation import SATURATION_THRESHOLD, _saturation_job, served_slo_share

DEFAULT_POLICIES = ("static", "heuristic")
DEFAULT_TRACES = ("agent", "mooncake")
DEFAULT_MODELS = ("gpt-oss-120b",)
DEFAULT_SHAPES = ("2P4D",)
DEFAULT_LOADS = (0.5, 1.0, 1.5, 2.0)
"""Fractions of static saturation: half load and saturation (the latency regime), 1.5x and 2x (static
cannot keep up: the throughput regime where borrowed capacity shows as served tokens)."""
DEFAULT_SUBSET = {"agent": 60, "mooncake": 2000, "mooncake-synthetic": 2000, "azure-code": 2000}
"""Default grid: first N sessions (agent) or requests (open-loop) so the whole run takes minutes."""

FULL_TRACES = ("agent", "mooncake")
FULL_MODELS = ("gpt-oss-120b", "glm-5")
FULL_SHAPES = ("2P4D", "4P2D", "1P5D")
FULL_LOADS = (0.5, 1.0, 1.5, 2.0)
"""``--full``: the paper-style grid (2 models x 2 traces x 4 loads on 2P4D plus the extreme splits)."""
FULL_SUBSET = {"agent": 100, "mooncake": 4000, "mooncake-synthetic": 4000, "azure-code": 4000}

TIME_CAP_FACTOR, TIME_CAP_SLACK_S = 4.0, 3600.0
"""A lending simulation stops at ``FACTOR x`` the static replay's duration at its point plus ``SLACK``:
a request that can never be admitted would otherwise keep the control loop ticking forever."""


@dataclass(frozen=True)
class GridSpec:
    """What to run. ``max_requests`` None means the per-trace subset (``DEFAULT_SUBSET``/``FULL_SUBSET``)."""

    policies: tuple[str, ...] = DEFAULT_POLICIES
    traces: tuple[str, ...] = DEFAULT_TRACES
    models: tuple[str, ...] = DEFAULT_MODELS
    shapes: tuple[str, ...] = DEFAULT_SHAPES
    load_fractions: tuple[float, ...] = DEFAULT_LOADS
    gpu: str = "H200"
    max_requests: int | None = None
    seed: int = 0
    full: bool = False
    oracle: bool = True
    interference_model: str | None = None
    """Artifact folder for heuristic/rl (None: the shipped default per model)."""
    dtype: Precision | None = None
    kv_dtype: Precision | None = None
    ep: int = 1
    dp_attention: int = 1
    """Precision and parallelism of every model's workers (``train.model_args``)."""
    decode_prefix_cache: bool = False
    """Decode workers keep a radix prefix cache, for every policy (``Point.decode_prefix_cache``)."""

    def model_options(self) -> dict[str, Any]:
        return model_options(self)

    def point_options(self) -> dict[str, Any]:
        """The ``Point`` fields every simulation of the grid shares beyond trace, model and shape."""
        return {**model_options(self), "decode_prefix_cache": self.decode_prefix_cache}

    def subset(self, trace: str) -> int | None:
        if self.max_requests is not None:
            return self.max_requests
        return (FULL_SUBSET if self.full else DEFAULT_SUBSET).get(trace, 2000)


@dataclass(frozen=True)
class SimTask:
    """One simulation: a point, whether to keep its timeline and decision reasons, its predictor."""

    point: Point
    detail: bool = True
    artifact_dir: str | None = None
    predictor: Any = field(default=None, compare=False)
    """An injected predictor object (tests); overrides ``artifact_dir``."""
    max_time_s: float = math.inf
    """Simulated-time cap (see ``TIME_CAP_FACTOR``); requests unfinished by then count as unfinished."""


@functools.lru_cache(maxsize=4)
def _prepared_trace(trace: str, max_requests: int | None, max_think_s: float) -> Trace:
    # Parsing the bundled agent trace costs ~1 s per simulation (measured); a worker process runs many
    # points of one trace. Requests are frozen and the simulator never mutates a Trace, so sharing is safe.
    return prepare_trace(Point(trace=trace, max_requests=max_requests, max_think_s=max_think_s))


def simulate_task(task: SimTask) -> dict[str, Any]:
    """Worker: run one point; returns metrics (and timeline, reason counts) or the error, never raises."""

    point, t0 = task.point, time.perf_counter()
    out: dict[str, Any] = {"label": point.label(), "point": point.to_dict()}
    try:
        trace = _prepared_trace(point.trace, point.max_requests, point.max_think_s)
        predictor = None
        if policy_spec(point.policy).needs_predictor:
            predictor = task.predictor if task.predictor is not None else _load_predictor(task)
        result = run_point(point, trace=trace, predictor=predictor, max_time_s=task.max_time_s)
    except Exception as exc:  # one broken point must not sink the grid; the report lists it
        out.update(error=f"{type(exc).__name__}: {exc}", metrics=None, wall_s=time.perf_counter() - t0)
        return out
    metrics = result.metrics.to_dict()
    capped = math.isfinite(task.max_time_s) and metrics["n_finished"] < metrics["n_requests"]
    out.update(metrics=metrics, served_slo_share=served_slo_share(metrics), error=None, time_capped=capped)
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


def _load_predictor(task: SimTask) -> Any:
    if task.artifact_dir is None:
        raise ValueError(f"policy {task.point.policy!r} needs an interference-model artifact")
    p = task.point
    return _cached_predictor(task.artifact_dir, p.gpu, p.model, p.resolved_tp)


@functools.lru_cache(maxsize=4)
def _cached_predictor(artifact_dir: str, gpu: str, model: str, tp: int) -> Any:
    # Compiling the trees costs ~0.5 s (measured); the predictor is read-only, so a worker reuses it.
    from interference_model.artifact import load_predictor

    return load_predictor(artifact_dir, gpu=gpu, model=model, tp=tp)


def resolve_artifact(spec: GridSpec, model: str) -> str:
    """Folder of the interference model for ``model``: ``--interference-model`` or the shipped default."""
    from interference_model.artifact import DATA_DIR, artifact_slug

    folder = (
        Path(spec.interference_model)
        if spec.interference_model
        else (DATA_DIR / artifact_slug(spec.gpu, model, default_tp(model)))
    )
    if not (folder / "metadata.json").is_file():
        needing = [p for p in spec.policies if policy_spec(p).needs_predictor]
        raise FileNotFoundError(
            f"no interference-model artifact at {folder} (needed by {needing} "
            f"on {model}); pass --interference-model PATH or fit one with `crossflow fit-interference`"
        )
    return str(folder)


def oracle_shapes(shape: str) -> list[str]:
    """Every xPyD split with the same worker count as ``shape`` (x, y >= 1), ``shape`` included."""
    n_p, n_d = parse_shape(shape)
    total = n_p + n_d
    return [f"{p}P{total - p}D" for p in range(1, total)]


def _map(
    fn: Callable[[Any], dict[str, Any]], items: Sequence[Any], jobs: int, desc: str, progress: bool
) -> Iterable[dict[str, Any]]:
    """``fn`` over ``items`` in ``jobs`` processes (in this process if 1), yielding as they finish."""
    from tqdm import tqdm

    bar = tqdm(total=len(items), desc=desc, disable=not progress, leave=False, file=sys.stderr)
    try:
        if jobs <= 1 or len(items) <= 1:
            for item in items:
                yield fn(item)
                bar.update()
            return
        with cf.ProcessPoolExecutor(max_workers=min(jobs, len(items))) as pool:
            for fut in cf.as_completed([pool.submit(fn, item) for item in items]):
                yield fut.result()
                bar.update()
    finally:
        bar.close()


def saturation_loads(spec: GridSpec, out_dir: Path, jobs: int, progress: bool) -> list[dict[str, Any]]:
    """Static saturation per (trace, model, shape), reusing ``saturation.json`` in ``out_dir`` if present."""
    cache_path = out_dir / "saturation.json"
    cache: dict[str, Any] = {}
    if cache_path.is_file():
        try:
            cache = json.loads(cache_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{cache_path}: corrupt saturation cache ({exc}); delete it to recompute"
            ) from exc
    options = tuple(spec.point_options().items())
    keys = [
        (t, m, s, spec.gpu, spec.subset(t), spec.seed, options)
        for t in spec.traces
        for m in spec.models
        for s in spec.shapes
    ]
    suffix = Point(**spec.point_options()).deployment_suffix()
    name = {k: f"{'|'.join(map(str, k[:6]))}{suffix}|thr={SATURATION_THRESHOLD}|rule=v2" for k in keys}
    todo = [k for k in keys if name[k] not in cache]
    for res in _map(_saturation_job, todo, jobs, "saturation search", progress):
        key = (
            res["trace"],
            res["model"],
            res["shape"],
            res["gpu"],
            res["max_requests"],
            res["seed"],
            options,
        )
        cache[name[key]] = res
        write_json(cache_path, cache, indent=1)
    return [cache[name[k]] for k in keys]


def build_tasks(
    spec: GridSpec, saturation: Sequence[dict[str, Any]], predictor: Any = None
) -> tuple[list[dict[str, Any]], list[SimTask]]:
    """Grid rows (point + load fraction + saturation) and the deduplicated simulations they need."""
    artifacts = {}
    if predictor is None and any(policy_spec(p).needs_predictor for p in spec.policies):
        artifacts = {m: resolve_artifact(spec, m) for m in spec.models}
    rows: list[dict[str, Any]] = []
    tasks: dict[Point, SimTask] = {}
    for sat in saturation:
        if not sat["usable"]:
            continue  # static never meets the SLO here: no load to match (report.md says so)
        for frac in spec.load_fractions:
            load = frac * sat["load"]
            common = {
                "trace": sat["trace"],
                "model": sat["model"],
                "gpu": spec.gpu,
                "load": load,
                "max_requests": sat["max_requests"],
                "seed": spec.seed,
                **spec.point_options(),
            }
            for policy in spec.policies:
                pt = Point(policy=policy, shape=sat["shape"], **common)
                rows.append({"point": pt, "load_fraction": frac, "saturation_load": sat["load"]})
                if not policy_spec(policy).grid_level:  # hindsight-split is built from the splits' runs
                    tasks[pt] = SimTask(pt, True, artifacts.get(pt.model), predictor)
            hindsight = any(policy_spec(p).grid_level for p in spec.policies)
            for shape in oracle_shapes(sat["shape"]) if spec.oracle or hindsight else []:
                pt = Point(policy="static", shape=shape, **common)
                tasks.setdefault(pt, SimTask(pt, False))
    # Lending policies are the slow simulations: start them first so the pool ends evenly.
    ordered = sorted(tasks.values(), key=lambda t: (t.point.policy == "static", t.point.trace != "agent"))
    return rows, ordered


def run_compare(
    spec: GridSpec,
    out_dir: str | Path,
    *,
    jobs: int = 1,
    progress: bool = False,
    use_wandb: bool = False,
    command: str = "",
    predictor: Any = None,
) -> dict[str, Any]:
    """Run the grid, write results.json, report.md and PNGs into ``out_dir``; return the results dict."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    saturation = saturation_loads(spec, out, jobs, progress)
    rows, tasks = build_tasks(spec, saturation, predictor)
    sims: dict[str, dict[str, Any]] = {}
    # Static first (fast, and it sets the time cap of the lending simulations at the same point).
    for res in _map(
        simulate_task, [t for t in tasks if t.point.policy == "static"], jobs, "static", progress
    ):
        sims[res["label"]] = res
    lending = [replace(t, max_time_s=_time_cap(t.point, sims)) for t in tasks if t.point.policy != "static"]
    for res in _map(simulate_task, lending, jobs, "policies", progress):
        sims[res["label"]] = res
    points = [_grid_row(spec, row, sims) for row in rows]
    grid_labels = {p["label"] for p in points}
    candidates = [
        {k: v for k, v in s.items() if k not in ("timeline", "reasons")}
        for label, s in sims.items()
        if label not in grid_labels
    ]
    results: dict[str, Any] = {
        "run_id": out.name,
        "command": command,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "grid": {**asdict(spec), "subsets": {t: spec.subset(t) for t in spec.traces}},
        "jobs": jobs,
        "saturation_threshold": SATURATION_THRESHOLD,
        "saturation": saturation,
        "points": points,
        "oracle_candidates": sorted(candidates, key=lambda c: c["label"]),
        "failed_oracle": [c for c in candidates if c.get("error")],
    }
    results["policy_params"] = describe_params([p for p in spec.policies if not policy_spec(p).passive])
    results["summary"] = report.summarise(points)
    results["targets"] = report.evaluate_targets(points)
    if use_wandb:
        results["wandb"] = _log_wandb(points, out, tasks)
    results["wall_s"] = time.perf_counter() - t0
    write_json(out / "results.json", results, indent=1)
    report.write_report(results, out)
    return results


def _time_cap(point: Point, sims: dict[str, dict[str, Any]]) -> float:
    static = sims.get(replace(point, policy="static").label())
    if not static or not static.get("metrics"):
        return math.inf
    return TIME_CAP_FACTOR * float(static["metrics"]["duration_s"]) + TIME_CAP_SLACK_S


def _hindsight_row(pt: Point, sims: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``hindsight-split`` at ``pt``: the static run on the split the oracle keeps among every split of
    the same GPUs (``report.choose_oracle``), relabelled; its ``hindsight_shape`` says which."""
    static = sims.get(replace(pt, policy="static").label())
    cands = {}
    for shape in oracle_shapes(pt.shape):
        c = sims.get(replace(pt, policy="static", shape=shape).label())
        if c and c.get("metrics"):
            cands[shape] = c
    if not static or not static.get("metrics"):
        return {
            "label": pt.label(),
            "point": pt.to_dict(),
            "metrics": None,
            "error": "no static run to compare",
        }
    best = report.choose_oracle(static["metrics"], {k: v["metrics"] for k, v in cands.items()}, pt.shape)
    chosen = cands.get(best, static)
    return {**chosen, "label": pt.label(), "point": pt.to_dict(), "hindsight_shape": best}


def _grid_row(spec: GridSpec, row: dict[str, Any], sims: dict[str, dict[str, Any]]) -> dict[str, Any]:
    pt: Point = row["point"]
    res = dict(_hindsight_row(pt, sims) if policy_spec(pt.policy).grid_level else sims[pt.label()])
    res.update(load_fraction=row["load_fraction"], saturation_load=row["saturation_load"])
    res.update(oracle_shape=None, oracle_metrics=None, oracle_share=None)
    static = sims.get(Point(**{**asdict(pt), "policy": "static"}).label())
    if not spec.oracle or not res.get("metrics") or not static or not static.get("metrics"):
        return res
    cands = {}
    for shape in oracle_shapes(pt.shape):
        c = sims.get(Point(**{**asdict(pt), "policy": "static", "shape": shape}).label())
        if c and c.get("metrics"):
            cands[shape] = c["metrics"]
    best = report.choose_oracle(static["metrics"], cands, pt.shape)
    oracle_m = cands.get(best, static["metrics"])
    res.update(oracle_shape=best, oracle_metrics=oracle_m if pt.policy == "static" else None)
    key = "input_tokens_per_s"
    res["oracle_share"] = report.oracle_share(res["metrics"][key], static["metrics"][key], oracle_m[key])
    return res


def _log_wandb(points: Sequence[dict[str, Any]], out: Path, tasks: Sequence[SimTask]) -> dict[str, Any]:
    from train import wandb_log

    wandb_log.default_to_offline()
    artifacts = {t.point.label(): t.artifact_dir for t in tasks}
    runs = []
    for p in points:
        if not p.get("metrics"):
            continue
        pt = p["point"]
        tl = p.get("timeline") or {}
        history = [dict(zip(tl, vals, strict=True)) for vals in zip(*tl.values(), strict=True)] if tl else []
        runs.append(
            wandb_log.RunLog(
                name=p["label"],
                group=out.name,
                tags=[pt["policy"], pt["trace"], pt["model"], pt["shape"]],
                config={**pt, "load_fraction": p["load_fraction"], "saturation_load": p["saturation_load"]},
                summary={
                    **p["metrics"],
                    "served_slo_share": p["served_slo_share"],
                    "oracle_share": p["oracle_share"],
                    "oracle_shape": p["oracle_shape"],
                },
                history=history,
                artifact_dir=artifacts.get(p["label"]),
            )
        )
    t0 = time.perf_counter()
    folders = wandb_log.log_runs(runs, wandb_dir=out)
    return {
        "mode": os.environ.get("WANDB_MODE"),
        "runs": len(folders),
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


def _load_fraction(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"load fractions must be > 0, got {text!r}")
    return value


def _shape(text: str) -> str:
    try:
        parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text.upper()


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``crossflow compare``."""
    p = sub.add_parser(
        "compare",
        help="static PD vs lease policies on matched loads, with an oracle, report and W&B runs",
        description="Run policies x traces x models x shapes x loads (fractions of static saturation) with "
        "identical arrivals, compare against static and the best static split in hindsight, and write "
        "results.json, report.md and plots into a run folder. See docs/compare.md.",
    )
    p.add_argument("--policies", type=_csv(str), default=None, help="default: static,heuristic")
    p.add_argument("--traces", type=_csv(str), default=None, help="default: agent,mooncake")
    p.add_argument("--models", type=_csv(str), default=None, help="default: gpt-oss-120b")
    p.add_argument("--shapes", type=_csv(_shape), default=None, help="default: 2P4D")
    p.add_argument(
        "--loads",
        type=_csv(_load_fraction),
        default=None,
        help="fractions of static saturation (default: 0.5,0.7,0.85,1.0)",
    )
    p.add_argument("--gpu", default="H200")
    p.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="first N sessions (agent) / requests (others) of every trace (default: per-trace subset)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel simulations")
    p.add_argument("--out", default=None, help="run folder (default: runs/compare-<UTC timestamp>)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write results.json here")
    p.add_argument(
        "--full",
        action="store_true",
        help="paper-style grid: 2 models x 2 traces x 4 loads x "
        "2P4D, 4P2D, 1P5D (explicit flags still override)",
    )
    p.add_argument("--no-oracle", action="store_true", help="skip the best-static-split oracle")
    p.add_argument(
        "--decode-prefix-cache",
        action="store_true",
        help="decode workers keep a radix prefix cache, for every policy (as the shipped tuning did)",
    )
    p.add_argument(
        "--interference-model",
        default=None,
        metavar="DIR",
        help="artifact folder for heuristic/rl (default: the shipped one per model)",
    )
    p.add_argument("--no-wandb", action="store_true", help="do not log W&B runs")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_model_arguments(p)
    p.set_defaults(func=_run)
    return p


def spec_from_args(args: argparse.Namespace) -> GridSpec:
    full = bool(args.full)
    if args.max_requests is not None and args.max_requests < 1:
        raise ValueError(f"--max-requests must be >= 1, got {args.max_requests}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    return GridSpec(
        policies=args.policies or DEFAULT_POLICIES,
        traces=args.traces or (FULL_TRACES if full else DEFAULT_TRACES),
        models=args.models or (FULL_MODELS if full else DEFAULT_MODELS),
        shapes=args.shapes or (FULL_SHAPES if full else DEFAULT_SHAPES),
        load_fractions=args.loads or (FULL_LOADS if full else DEFAULT_LOADS),
        gpu=args.gpu,
        max_requests=args.max_requests,
        seed=args.seed,
        full=full,
        oracle=not args.no_oracle,
        decode_prefix_cache=bool(args.decode_prefix_cache),
        interference_model=args.interference_model,
        **model_options(args),
    )


def check_names(spec: GridSpec) -> None:
    """Fail before any simulation on an unknown policy, trace or model (naming the flag)."""
    from envs.traces import BUNDLED_TRACES

    known = policy_names()
    for policy in spec.policies:
        if policy not in known:
            raise ValueError(f"--policies: unknown policy {policy!r}; known: {', '.join(known)}")
    for trace in spec.traces:
        if trace not in BUNDLED_TRACES:
            raise ValueError(f"--traces: unknown bundled trace {trace!r}; known: {sorted(BUNDLED_TRACES)}")
    for model in spec.models:
        check_model(model, gpu=spec.gpu, tp=default_tp(model), model_flag="--models", **spec.model_options())


def _run(args: argparse.Namespace) -> int:
    from train import wandb_log

    apply_models_dir(args)
    spec = spec_from_args(args)
    check_names(spec)
    out = Path(args.out or f"runs/compare-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}")
    if not args.no_wandb:
        wandb_log.default_to_offline()
    command = (
        "crossflow " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "crossflow compare"
    )
    results = run_compare(
        spec, out, jobs=args.jobs, progress=not args.no_progress, use_wandb=not args.no_wandb, command=command
    )
    if args.json:
        write_json(Path(args.json), results, indent=1)
    failed = [p["label"] for p in results["points"] if p.get("error")] + [
        c["label"] for c in results["failed_oracle"]
    ]
    print(f"compare: {len(results['points'])} grid points in {results['wall_s']:.0f} s -> {out}/report.md")
    for policy, row in results["summary"].items():
        g_in, g_out = row["input_tokens_per_s_change"], row["output_tokens_per_s_change"]
        print(
            f"  {policy}: input {_pct(g_in)}, output {_pct(g_out)} geo-mean over static "
            f"({row['n_headline_points']} points)"
        )
    if failed:
        print(
            f"compare: {len(failed)} simulation(s) failed, see report.md: {', '.join(failed[:5])}",
            file=sys.stderr,
        )
        return 1
    return 0


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f} %"
