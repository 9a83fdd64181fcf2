"""``crossflow profile``, ``crossflow fit-interference`` and ``crossflow eval-interference``.

The first user journey: simulated profiles (Parquet) -> a conservative LightGBM artifact of the
lease label -> an evaluation against honest baselines on held-out profiles, with the targets. Each
command returns an exit code and, with ``--json PATH``, writes its figures machine-readable.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np

from interference_model.artifact import DEFAULT_ITL_TARGET
from interference_model.fit import SHIFT_ALLOCATIONS, FitConfig
from interference_model.labels import DEFAULT_HORIZON_S, DEFAULT_TPOT_SLO_MS
from train.cli_types import non_negative_int, positive_int
from train.jsonio import write_json
from train.model_args import add_model_arguments, model_from_args, model_options


def _fit_command(args: argparse.Namespace) -> str:
    """The canonical command line that reproduces this fit (recorded in the artifact)."""
    argv = [
        "crossflow",
        "fit-interference",
        "--profiles",
        *(str(path) for path in args.profiles),
        "--itl-target",
        args.itl_target,
        "--horizon",
        f"{args.horizon:g}",
        "--tpot-slo",
        f"{args.tpot_slo:g}",
        "--min-lease-tokens",
        f"{args.min_lease_tokens:g}",
        "--cached-prefix-tokens",
        str(args.cached_prefix_tokens),
        "--unsafe-target",
        str(args.unsafe_target),
        "--seed",
        str(args.seed),
        "--out",
        str(args.out),
    ]
    if args.quantile_alpha is not None:
        argv += ["--quantile-alpha", str(args.quantile_alpha)]
    # Spelled out whatever the defaults: the command must rebuild this artifact after they change.
    argv += ["--shift-allocation", args.shift_allocation]
    argv.append("--decode-step-input" if args.decode_step_input else "--no-decode-step-input")
    if args.no_kv_room:
        argv.append("--no-kv-room")
    return shlex.join(argv)


def _label(args: argparse.Namespace) -> Any:
    from interference_model.labels import LeaseLabel

    return LeaseLabel.parse(args.itl_target, args.horizon, args.tpot_slo, kv_room=not args.no_kv_room)


# --- profile -------------------------------------------------------------------------------------


def _output_file(text: str) -> str:
    """A file path to write (not an existing directory)."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is a directory; give a file name such as {text}/profiles.parquet"
        )
    return text


def add_profile_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile",
        help="measure interference profiles (simulated or on a live SGLang worker) and write them as Parquet",
        description="Sweep decode-node states x injected prefill chunks and write the profile schema "
        "(interference_model.schema). --source sim times them on the cost model with realistic noise; "
        "--source sglang measures them on the live worker at --url (serving.profiler; not yet validated "
        "on GPU hardware).",
    )
    p.add_argument(
        "--source", choices=["sim", "sglang"], default="sim", help="where timings come from (default: sim)"
    )
    p.add_argument("--url", default=None, help="--source sglang: base URL of the SGLang worker")
    p.add_argument("--gpu", default="H200", help="GPU (default: H200)")
    p.add_argument("--model", default="gpt-oss-120b", help="model (default: gpt-oss-120b)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    p.add_argument("--n-states", type=positive_int, default=8000, help="node states to sweep (default: 8000)")
    p.add_argument("--repeats", type=positive_int, default=9, help="measurements per point (default: 9)")
    p.add_argument(
        "--checkpoints",
        default=None,
        help="decode steps at which each state is measured again, comma-separated, from 0 "
        "(default: envs.profiler.DEFAULT_CHECKPOINT_STEPS)",
    )
    p.add_argument(
        "--max-batch", type=positive_int, default=256, help="largest decode batch sampled (default: 256)"
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default: 0)")
    p.add_argument("--no-noise", action="store_true", help="noise-free timings (the cost model's truth)")
    p.add_argument("--out", required=True, type=_output_file, help="Parquet (or .csv) file to write")
    p.add_argument("--json", default=None, help="also write a summary as JSON here")
    add_model_arguments(p)
    p.set_defaults(func=run_profile)
    return p


def run_profile(args: argparse.Namespace) -> int:
    from envs.profiler import DEFAULT_CHECKPOINT_STEPS, MeasurementNoise, StateSampler, simulate_profiles
    from interference_model.schema import profiles_sha256, write_profiles

    t0 = time.perf_counter()
    if args.source == "sglang":
        from serving.profiler import RealProfileConfig
        from serving.profiler import run_profile as measure

        if not args.url:
            raise ValueError("--source sglang needs --url (the SGLang worker's base URL)")
        import httpx

        try:
            df = measure(
                RealProfileConfig(
                    url=args.url, hardware=args.gpu, model=args.model, tp=args.tp, seed=args.seed
                )
            )
        except httpx.TransportError as exc:
            raise ValueError(
                f"--url {args.url}: cannot reach the SGLang worker ({type(exc).__name__}: {exc})"
            ) from None
    else:
        from envs.cost_model import CostModel

        spec = model_from_args(args, tp=args.tp)
        steps = DEFAULT_CHECKPOINT_STEPS if args.checkpoints is None else _int_list(args.checkpoints)
        df = simulate_profiles(
            args.gpu,
            args.model,
            args.tp,
            args.n_states,
            args.seed,
            checkpoint_steps=steps,
            repeats=args.repeats,
            noise=None if args.no_noise else MeasurementNoise(),
            sampler=StateSampler(max_batch=args.max_batch),
            cost_model=CostModel(args.gpu, spec, args.tp, ep=args.ep, dp_attention=args.dp_attention),
        )
    path = write_profiles(df, args.out)
    summary = {
        "path": str(path),
        "rows": len(df),
        "states": int(df["state_id"].nunique()),
        "data_sha256": profiles_sha256(df),
        "seconds": round(time.perf_counter() - t0, 2),
        "hardware": args.gpu,
        "model": args.model,
        "tp": args.tp,
        "seed": args.seed,
        **model_options(args),
    }
    print(f"wrote {summary['rows']} rows ({summary['states']} states) to {path}")
    write_json(args.json, summary)
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(
            f"--checkpoints {text!r}: write integers separated by commas, e.g. 0,64,128"
        ) from None


# --- fit-interference ----------------------------------------------------------------------------


def add_fit_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fit-interference",
        help="fit a conservative LightGBM model of the lease label (safe prefill over a lease) from profiles",
        description="Derive the lease label (the prefill a node can absorb over --horizon seconds with every "
        "step within the ITL target and the TPOT SLO, and its KV within room), fit LightGBM with grouped CV "
        "and a conformal shift, and write an artifact folder (model.txt + metadata.json).",
    )
    p.add_argument(
        "--profiles",
        required=True,
        nargs="+",
        help="Parquet profile file(s) of one hardware/model/TP; several files (e.g. drawn with different "
        "seeds) are fitted as one set, each file's states their own cross-validation groups",
    )
    p.add_argument(
        "--itl-target",
        default=DEFAULT_ITL_TARGET,
        help="ITL target: ratio to the decode-only step ('1.5x'), absolute ('40ms'), or the looser of both "
        f"('1.5x|25ms'); default {DEFAULT_ITL_TARGET}, as the shipped artifacts",
    )
    p.add_argument(
        "--horizon",
        type=float,
        default=DEFAULT_HORIZON_S,
        help="lease horizon in seconds: the TTL the policy multiplies the rate by "
        f"(default {DEFAULT_HORIZON_S:g})",
    )
    p.add_argument(
        "--tpot-slo",
        type=float,
        default=DEFAULT_TPOT_SLO_MS,
        help=f"no step may take longer, in ms (default {DEFAULT_TPOT_SLO_MS:g})",
    )
    p.add_argument("--no-kv-room", action="store_true", help="label the ITL part only, without the KV cap")
    p.add_argument(
        "--min-lease-tokens",
        type=float,
        default=64.0,
        help="predictions under this many tokens per horizon read 0 (default 64)",
    )
    p.add_argument(
        "--cached-prefix-tokens", type=int, default=0, help="label prefill with this cached prefix"
    )
    p.add_argument("--unsafe-target", type=float, default=0.02, help="allowed out-of-fold unsafe share")
    p.add_argument(
        "--shift-allocation",
        choices=SHIFT_ALLOCATIONS,
        default=FitConfig().shift_allocation,
        help="per_bin: each batch bin meets --unsafe-target; pooled: the bins share it, shifts chosen "
        "for the lowest out-of-fold MAPE (default %(default)s)",
    )
    p.add_argument(
        "--decode-step-input",
        action=argparse.BooleanOptionalAction,
        default=FitConfig().decode_step_input,
        help="give the trees the step budget a decode-step model, fitted on the profiles' decode-only "
        "steps, says the decode batch leaves (docs/interference_model.md, 'The decode step as an "
        "input'; default %(default)s)",
    )
    p.add_argument(
        "--quantile-alpha",
        type=float,
        default=None,
        help="use a quantile objective at this level (disables monotone constraints)",
    )
    p.add_argument("--seed", type=int, default=0, help="CV shuffling and LightGBM seed")
    p.add_argument("--out", required=True, help="artifact folder to write")
    p.add_argument(
        "--profiles-note",
        default="",
        help="provenance of the profiles (e.g. the profile command) to record in the metadata",
    )
    _add_wandb_flag(p)
    p.add_argument("--json", default=None, help="write the CV metrics as JSON here")
    p.set_defaults(func=run_fit)
    return p


def run_fit(args: argparse.Namespace) -> int:
    from interference_model.artifact import log_artifact_to_wandb, save_artifact
    from interference_model.fit import fit_interference_model
    from interference_model.labels import concat_labels, derive_labels
    from interference_model.schema import profiles_sha256, read_profiles

    label = _label(args)
    tables, hashes, setups = [], [], set()
    for path in args.profiles:
        profiles = read_profiles(path)
        keys = profiles[["hardware", "model", "tp"]].drop_duplicates()
        if len(keys) != 1:
            raise ValueError(f"{path}: one hardware/model/tp per fit, found {keys.to_dict('records')}")
        hardware, model, tp = keys.iloc[0]["hardware"], keys.iloc[0]["model"], int(keys.iloc[0]["tp"])
        setups.add((str(hardware).lower(), str(model).lower(), tp))
        if len(setups) > 1:
            raise ValueError(f"{path}: profiles of {sorted(setups)} given together; fit one setup at a time")
        tables.append(
            derive_labels(profiles, label, cached_prefix_tokens=args.cached_prefix_tokens, source=str(path))
        )
        hashes.append(profiles_sha256(profiles))
        del profiles  # a 16,000-state profile holds gigabytes; one at a time
    labels = concat_labels(tables)
    data_sha256 = hashes[0] if len(hashes) == 1 else hashlib.sha256("".join(hashes).encode()).hexdigest()
    config = FitConfig(
        quantile_alpha=args.quantile_alpha,
        monotone=args.quantile_alpha is None,
        unsafe_target=args.unsafe_target,
        min_lease_tokens=args.min_lease_tokens,
        shift_allocation=args.shift_allocation,
        decode_step_input=args.decode_step_input,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    try:
        fit = fit_interference_model(labels, label, config)
    except ValueError as exc:
        raise ValueError(f"{' '.join(args.profiles)}: {exc}") from None
    out = save_artifact(
        args.out,
        fit,
        hardware=hardware,
        model=model,
        tp=tp,
        data_sha256=data_sha256,
        extra={
            "command": _fit_command(args),
            "profiles_note": args.profiles_note,
            "cached_prefix_tokens": args.cached_prefix_tokens,
            "n_train_states": len(labels),
            "profiles_file": " ".join(Path(path).name for path in args.profiles),
            "profiles_sha256": hashes,
            "label_limited_by": labels["limited_by"].value_counts().to_dict(),
            "seed": args.seed,
        },
    )
    summary = {
        "artifact": str(out),
        "hardware": hardware,
        "model": model,
        "tp": tp,
        "label": str(label),
        "itl_target": str(label.itl_target),
        "n_states": len(labels),
        "log_shifts": list(fit.shift.log_shifts),
        "shift_batch_edges": list(fit.shift.batch_edges),
        "cv_metrics": fit.cv_metrics,
        "feature_importance_gain": fit.feature_importance(),
        "fit_seconds": round(time.perf_counter() - t0, 2),
    }
    cv = fit.cv_metrics
    print(
        f"fitted {hardware}/{model}/tp{tp}, label {label}, on {len(labels)} states: CV MAPE "
        f"{cv['mape']:.1%}, unsafe {cv['unsafe_share']:.1%}, log shifts "
        f"{min(fit.shift.log_shifts):+.3f}..{max(fit.shift.log_shifts):+.3f} -> {out}"
    )
    if not args.no_wandb:
        summary["wandb_logged"] = log_artifact_to_wandb(
            out, wandb_dir=Path(out).parent, summary={"cv_" + k: v for k, v in cv.items()}
        )
    write_json(args.json, summary)
    return 0


def _add_wandb_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-wandb",
        action="store_true",
        help="do not log to W&B (logged offline by default, under wandb/ beside the output; "
        "online when you are logged in and set WANDB_MODE=online)",
    )


# --- eval-interference ---------------------------------------------------------------------------


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval-interference",
        help="evaluate an interference artifact against honest baselines and the targets on held-out data",
        description="MAPE and unsafe share (prediction > 1.05 x true) of the artifact and of the baselines "
        "a user has -- the datasheet roofline (no calibration), the utilisation rule, a linear fit -- each "
        "also at the artifact's unsafe share; the simulator's own cost model inverted (its ground truth, "
        "not a baseline); the targets (MAPE, unsafe share, single-decision latency, gain over the "
        "datasheet); "
        "overall and by region, with PNG plots.",
    )
    p.add_argument("--artifact", required=True, help="artifact folder from fit-interference")
    p.add_argument("--profiles", required=True, help="held-out profiles (Parquet or CSV), another seed")
    _add_wandb_flag(p)
    p.add_argument(
        "--train-profiles",
        default=None,
        nargs="+",
        help="training profiles (the artifact's own, all of them), to fit the linear and utilisation "
        "baselines on what the model saw (skipped without)",
    )
    p.add_argument(
        "--reference-profiles",
        default=None,
        help="noise-free profiles of the same states (profile --no-noise, same seed): a second truth",
    )
    p.add_argument("--plots", default=None, help="folder for calibration.png and error_by_region.png")
    p.add_argument(
        "--latency-runs",
        type=positive_int,
        default=1,
        help="repeat the single-decision latency measurement and report the median (default 1)",
    )
    p.add_argument("--json", default=None, help="write the full report as JSON here")
    p.set_defaults(func=run_eval)
    return p


REFERENCE_ROWS = ("simulator_cost_model",)
"""Rows of the table that are not baselines a user has."""


def eval_predictors(
    meta: dict[str, Any], test: Any, train: Any, label: Any, predictor: Any
) -> dict[str, Any]:
    """The artifact's predictor and every baseline of the table, keyed by row name."""
    from envs.cost_model import CostModel
    from envs.profiler import datasheet_roofline
    from interference_model.baselines import InvertedTimeModel, LinearBaseline, UtilisationThresholdBaseline

    gpu, model, tp = meta["hardware"], meta["model"], int(meta["tp"])
    prefix = int(meta.get("cached_prefix_tokens", 0))
    chunks = tuple(int(c) for c in sorted(test["chunk_tokens"].unique()))
    steps = tuple(int(k) for k in sorted(test["decode_step"].unique()))
    capacity = int(test["kv_capacity_tokens"].iloc[0])

    def inverted(timer: Any, name: str) -> Any:
        return InvertedTimeModel(
            timer, label, chunks, steps, capacity, cached_prefix_tokens=prefix, name=name
        )

    predictors: dict[str, Any] = {
        "lightgbm": predictor,
        "datasheet_roofline": inverted(datasheet_roofline(gpu, model, tp), "datasheet_roofline"),
    }
    if train is not None:
        config = FitConfig.from_recorded(meta["fit_config"])
        predictors["linear"] = LinearBaseline(label, config).fit(train)
        predictors["utilisation_threshold"] = UtilisationThresholdBaseline(config.unsafe_target or 0.02).fit(
            train
        )
    predictors["simulator_cost_model"] = inverted(CostModel(gpu, model, tp=tp), "simulator_cost_model")
    return predictors


def _fmt(value: Any, spec: str, width: int) -> str:
    missing = value is None or (isinstance(value, float) and not np.isfinite(value))
    return f"{'n/a' if missing else format(value, spec):>{width}}"


def print_report(report: dict[str, Any]) -> None:
    """The table a person reads: every row, at equal unsafe share, and the targets."""
    ref = "vs_reference" in report
    print(f"label: {report['label']}; {report['n_states']} held-out states")
    head = f"{'predictor':<38}{'MAPE':>8}{'unsafe':>8}{'MAPE@eq':>9}"
    print(head + ("  | noise-free:  MAPE  unsafe MAPE@eq" if ref else ""))
    for name, m in report["metrics"].items():
        eq = report["at_equal_unsafe"].get(name, {}).get("mape")
        tag = f"{name} (ground truth)" if name in REFERENCE_ROWS else name
        line = f"{tag:<38}{_fmt(m['mape'], '.1%', 8)}{_fmt(m['unsafe_share'], '.1%', 8)}{_fmt(eq, '.1%', 9)}"
        if ref:
            r = report["vs_reference"][name]
            req = report["vs_reference_at_equal_unsafe"].get(name, {}).get("mape")
            line += f"  |{_fmt(r['mape'], '.1%', 18)}{_fmt(r['unsafe_share'], '.1%', 8)}{_fmt(req, '.1%', 8)}"
        print(line)
    print(
        "MAPE@eq: the row divided by the one constant that gives it lightgbm's unsafe share on these states"
    )
    lat = report["latency_us"]
    print(
        f"single decision: fast predictor {lat['fast_predictor_cpu_us']:.1f} us CPU "
        f"({lat['fast_predictor_us']:.1f} us wall-clock), LightGBM predict on one thread "
        f"{lat.get('lightgbm_one_thread_cpu_us', float('nan')):.0f} us CPU "
        f"({lat.get('lightgbm_one_thread_us', float('nan')):.0f} us wall-clock); median of "
        f"{int(lat.get('runs', 1))} run(s), load average {lat.get('load_average', os.getloadavg()[0]):.1f} "
        f"on {os.cpu_count()} cores"
    )
    for t in report["targets"]:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        value = _fmt(t["value"], ".3g", 0)
        print(f"target {t['target']}: {value} (want {t['kind']} {t['limit']:g}) -> {verdict}")


def run_eval(args: argparse.Namespace) -> int:
    from interference_model.artifact import artifact_label, load_booster, load_predictor
    from interference_model.evaluate import Targets, check_targets, evaluate, repeated_latency_us
    from interference_model.labels import LABEL, concat_labels, derive_labels
    from interference_model.schema import FEATURES, read_profiles

    predictor = load_predictor(args.artifact)
    meta = predictor.metadata
    label = artifact_label(meta)
    prefix = int(meta.get("cached_prefix_tokens", 0))
    test = read_profiles(args.profiles)
    _check_same_setup(args.profiles, test, meta)
    labels = derive_labels(test, label, cached_prefix_tokens=prefix, source=str(args.profiles))
    train = None
    if args.train_profiles:
        tables = []
        for path in args.train_profiles:
            train_profiles = read_profiles(path)
            _check_same_setup(path, train_profiles, meta)
            tables.append(derive_labels(train_profiles, label, cached_prefix_tokens=prefix, source=str(path)))
            del train_profiles
        train = concat_labels(tables)
    predictors = eval_predictors(meta, test, train, label, predictor)
    reference = None
    if args.reference_profiles:
        ref = derive_labels(
            read_profiles(args.reference_profiles),
            label,
            cached_prefix_tokens=prefix,
            source=str(args.reference_profiles),
        )
        if not np.array_equal(ref["state_id"].to_numpy(), labels["state_id"].to_numpy()):
            raise ValueError(f"{args.reference_profiles}: states differ from {args.profiles} (same seed?)")
        reference = ref[LABEL].to_numpy()
    report = evaluate(labels, predictors, plot_dir=args.plots, reference=reference)
    latency = repeated_latency_us(
        predictor, labels[list(FEATURES)].to_numpy(), load_booster(args.artifact), runs=args.latency_runs
    )
    targets = Targets()
    report.update(
        {
            "artifact": str(args.artifact),
            "profiles": str(args.profiles),
            "label": str(label),
            "label_spec": label.to_dict(),
            "label_limited_by": labels["limited_by"].value_counts().to_dict(),
            "reference_rows": list(REFERENCE_ROWS),
            "latency_us": latency,
            "targets": check_targets(report, latency, targets),
            "target_limits": {f: getattr(targets, f) for f in targets.__dataclass_fields__},
            "feature_importance_gain": meta.get("feature_importance_gain", {}),
        }
    )
    print_report(report)
    if not args.no_wandb:
        report["wandb_logged"] = _log_eval(args, report)
    write_json(args.json, report)
    return 0


def _log_eval(args: argparse.Namespace, report: dict[str, Any]) -> bool:
    """One offline W&B run for an evaluation: every row's metrics, the targets, the plots as files."""
    from train import wandb_log

    summary: dict[str, Any] = {}
    for row, metrics in report["metrics"].items():
        for key, value in metrics.items():
            if isinstance(value, int | float):
                summary[f"{row}/{key}"] = value
    for target in report["targets"]:
        summary[f"target/{target['target'].split()[0]}"] = bool(target["met"])
    out_dir = Path(args.json).parent if args.json else Path(args.artifact).parent
    run = wandb_log.RunLog(
        name=f"eval-{Path(args.artifact).name}",
        group="eval-interference",
        tags=["eval-interference", str(report["label"])],
        config={
            "artifact": str(args.artifact),
            "profiles": str(args.profiles),
            "label": report["label_spec"],
        },
        summary=summary,
        artifact_dir=str(args.artifact),
        job_type="eval-interference",
        images={p.stem: str(p) for p in sorted(Path(args.plots).glob("*.png"))} if args.plots else {},
    )
    return bool(wandb_log.log_runs([run], wandb_dir=out_dir))


def _check_same_setup(path: str, profiles: Any, meta: dict[str, Any]) -> None:
    keys = profiles[["hardware", "model", "tp"]].drop_duplicates()
    want = (str(meta["hardware"]).lower(), str(meta["model"]).lower(), int(meta["tp"]))
    for rec in keys.to_dict("records"):
        have = (str(rec["hardware"]).lower(), str(rec["model"]).lower(), int(rec["tp"]))
        if have != want:
            raise ValueError(f"{path}: profiles are for {have}, the artifact for {want}")
