"""``crossflow profile``, ``crossflow fit-interference`` and ``crossflow eval-interference``.

The first user journey: simulated profiles (Parquet) -> a conservative LightGBM artifact -> an
evaluation against baselines on held-out profiles. Each command returns an exit code and, with
``--json PATH``, writes its figures machine-readable.
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np

from interference_model.artifact import DEFAULT_ITL_TARGET
from train.jsonio import write_json
from train.model_args import add_model_arguments, model_from_args, model_options


def _fit_command(args: argparse.Namespace) -> str:
    """The canonical command line that reproduces this fit (recorded in the artifact)."""
    argv = [
        "crossflow",
        "fit-interference",
        "--profiles",
        str(args.profiles),
        "--itl-target",
        args.itl_target,
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
    return shlex.join(argv)


# --- profile -------------------------------------------------------------------------------------


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
    p.add_argument("--n-states", type=int, default=4000, help="node states to sweep (default: 4000)")
    p.add_argument("--repeats", type=int, default=9, help="measurements per point (default: 9)")
    p.add_argument("--max-batch", type=int, default=256, help="largest decode batch sampled (default: 256)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--no-noise", action="store_true", help="noise-free timings (the cost model's truth)")
    p.add_argument("--out", required=True, help="Parquet file to write")
    p.add_argument("--json", default=None, help="also write a summary as JSON here")
    add_model_arguments(p)
    p.set_defaults(func=run_profile)
    return p


def run_profile(args: argparse.Namespace) -> int:
    from envs.profiler import MeasurementNoise, StateSampler, simulate_profiles
    from interference_model.schema import profiles_sha256, write_profiles

    t0 = time.perf_counter()
    if args.source == "sglang":
        from serving.profiler import RealProfileConfig
        from serving.profiler import run_profile as measure

        if not args.url:
            raise ValueError("--source sglang needs --url (the SGLang worker's base URL)")
        df = measure(
            RealProfileConfig(url=args.url, hardware=args.gpu, model=args.model, tp=args.tp, seed=args.seed)
        )
    else:
        from envs.cost_model import CostModel

        spec = model_from_args(args, tp=args.tp)
        df = simulate_profiles(
            args.gpu,
            args.model,
            args.tp,
            args.n_states,
            args.seed,
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


# --- fit-interference ----------------------------------------------------------------------------


def add_fit_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fit-interference",
        help="fit a conservative LightGBM safe-prefill-throughput model from profiles",
        description="Derive safe-prefill-throughput labels at an ITL target, fit LightGBM with grouped CV "
        "and a conformal shift, and write an artifact folder (model.txt + metadata.json).",
    )
    p.add_argument("--profiles", required=True, help="Parquet profile file")
    p.add_argument(
        "--itl-target",
        default=DEFAULT_ITL_TARGET,
        help="ITL target: ratio to the decode-only step ('1.5x'), absolute ('40ms'), or the looser of both "
        f"('1.5x|25ms'); default {DEFAULT_ITL_TARGET}, as the shipped artifacts",
    )
    p.add_argument(
        "--cached-prefix-tokens", type=int, default=0, help="label prefill with this cached prefix"
    )
    p.add_argument("--unsafe-target", type=float, default=0.02, help="allowed out-of-fold unsafe share")
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
    p.add_argument("--wandb", action="store_true", help="also log the artifact to W&B (offline by default)")
    p.add_argument("--json", default=None, help="write the CV metrics as JSON here")
    p.set_defaults(func=run_fit)
    return p


def run_fit(args: argparse.Namespace) -> int:
    from interference_model.artifact import log_artifact_to_wandb, save_artifact
    from interference_model.fit import FitConfig, fit_interference_model
    from interference_model.labels import ItlTarget, derive_labels
    from interference_model.schema import profiles_sha256, read_profiles

    target = ItlTarget.parse(args.itl_target)
    profiles = read_profiles(args.profiles)
    keys = profiles[["hardware", "model", "tp"]].drop_duplicates()
    if len(keys) != 1:
        raise ValueError(f"{args.profiles}: one hardware/model/tp per fit, found {keys.to_dict('records')}")
    hardware, model, tp = keys.iloc[0]["hardware"], keys.iloc[0]["model"], int(keys.iloc[0]["tp"])
    labels = derive_labels(profiles, target, cached_prefix_tokens=args.cached_prefix_tokens)
    config = FitConfig(
        quantile_alpha=args.quantile_alpha,
        monotone=args.quantile_alpha is None,
        unsafe_target=args.unsafe_target,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    fit = fit_interference_model(labels, target, config)
    out = save_artifact(
        args.out,
        fit,
        itl_target=target,
        hardware=hardware,
        model=model,
        tp=tp,
        data_sha256=profiles_sha256(profiles),
        extra={
            "command": _fit_command(args),
            "profiles_note": args.profiles_note,
            "cached_prefix_tokens": args.cached_prefix_tokens,
            "n_train_states": len(labels),
            "profiles_file": Path(args.profiles).name,
            "label_limited_by": labels["limited_by"].value_counts().to_dict(),
        },
    )
    summary = {
        "artifact": str(out),
        "hardware": hardware,
        "model": model,
        "tp": tp,
        "itl_target": str(target),
        "n_states": len(labels),
        "log_shifts": list(fit.shift.log_shifts),
        "shift_batch_edges": list(fit.shift.batch_edges),
        "cv_metrics": fit.cv_metrics,
        "feature_importance_gain": fit.feature_importance(),
        "fit_seconds": round(time.perf_counter() - t0, 2),
    }
    cv = fit.cv_metrics
    print(
        f"fitted {hardware}/{model}/tp{tp} at ITL {target} on {len(labels)} states: CV MAPE "
        f"{cv['mape']:.1%}, unsafe {cv['unsafe_share']:.1%}, log shifts "
        f"{min(fit.shift.log_shifts):+.3f}..{max(fit.shift.log_shifts):+.3f} -> {out}"
    )
    if args.wandb:
        summary["wandb_logged"] = log_artifact_to_wandb(out)
    write_json(args.json, summary)
    return 0


# --- eval-interference ---------------------------------------------------------------------------


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval-interference",
        help="evaluate an interference artifact and baselines on held-out profiles",
        description="MAPE and unsafe share (prediction > 1.05 x true) of the artifact, a linear model, a "
        "utilisation threshold and the inverted cost model, overall and by region, with PNG plots.",
    )
    p.add_argument("--artifact", required=True, help="artifact folder from fit-interference")
    p.add_argument("--profiles", required=True, help="held-out Parquet profiles")
    p.add_argument(
        "--train-profiles",
        default=None,
        help="training profiles, to fit the linear and threshold baselines (skipped without)",
    )
    p.add_argument(
        "--reference-profiles",
        default=None,
        help="noise-free profiles of the same states (profile --no-noise, same seed): a second truth",
    )
    p.add_argument("--plots", default=None, help="folder for calibration.png and error_by_region.png")
    p.add_argument("--json", default=None, help="write the full report as JSON here")
    p.set_defaults(func=run_eval)
    return p


def run_eval(args: argparse.Namespace) -> int:
    from envs.cost_model import CostModel
    from interference_model.artifact import load_predictor
    from interference_model.baselines import (
        AnalyticInverseBaseline,
        LinearBaseline,
        UtilisationThresholdBaseline,
    )
    from interference_model.evaluate import evaluate
    from interference_model.labels import LABEL, ItlTarget, derive_labels
    from interference_model.schema import read_profiles

    predictor = load_predictor(args.artifact)
    meta = predictor.metadata
    target = ItlTarget(
        meta["itl_target"]["kind"],
        float(meta["itl_target"]["value"]),
        float(meta["itl_target"].get("floor_ms", 0.0)),
    )
    prefix = int(meta.get("cached_prefix_tokens", 0))
    test = read_profiles(args.profiles)
    _check_same_setup(args.profiles, test, meta)
    labels = derive_labels(test, target, cached_prefix_tokens=prefix)
    cost_model = CostModel(meta["hardware"], meta["model"], tp=int(meta["tp"]))
    chunks = tuple(int(c) for c in sorted(test["chunk_tokens"].unique()))
    predictors: dict[str, Any] = {
        "lightgbm": predictor,
        "analytic_cost_model": AnalyticInverseBaseline(
            cost_model, target, chunks, int(test["kv_capacity_tokens"].iloc[0]), prefix
        ),
    }
    if args.train_profiles:
        train = derive_labels(read_profiles(args.train_profiles), target, cached_prefix_tokens=prefix)
        predictors["linear"] = LinearBaseline().fit(train)
        predictors["utilisation_threshold"] = UtilisationThresholdBaseline().fit(train)
    reference = None
    if args.reference_profiles:
        ref = derive_labels(read_profiles(args.reference_profiles), target, cached_prefix_tokens=prefix)
        if not np.array_equal(ref["state_id"].to_numpy(), labels["state_id"].to_numpy()):
            raise ValueError(f"{args.reference_profiles}: states differ from {args.profiles} (same seed?)")
        reference = ref[LABEL].to_numpy()
    report = evaluate(labels, predictors, plot_dir=args.plots, reference=reference)
    report.update(
        {
            "artifact": str(args.artifact),
            "profiles": str(args.profiles),
            "itl_target": str(target),
            "feature_importance_gain": meta.get("feature_importance_gain", {}),
        }
    )
    print(
        f"{'predictor':<24}{'MAPE':>8}{'unsafe':>9}"
        + ("   vs noise-free: MAPE  unsafe" if reference is not None else "")
    )
    for name, m in report["metrics"].items():
        line = f"{name:<24}{m['mape']:>8.1%}{m['unsafe_share']:>9.1%}"
        if reference is not None:
            r = report["vs_reference"][name]
            line += f"   {r['mape']:>17.1%}{r['unsafe_share']:>8.1%}"
        print(line)
    write_json(args.json, report)
    return 0


def _check_same_setup(path: str, profiles: Any, meta: dict[str, Any]) -> None:
    keys = profiles[["hardware", "model", "tp"]].drop_duplicates()
    want = (str(meta["hardware"]).lower(), str(meta["model"]).lower(), int(meta["tp"]))
    for rec in keys.to_dict("records"):
        have = (str(rec["hardware"]).lower(), str(rec["model"]).lower(), int(rec["tp"]))
        if have != want:
            raise ValueError(f"{path}: profiles are for {have}, the artifact for {want}")
