"""Benchmark of the interference model against the issue's targets.

Held-out simulated profiles of one GPU x model (default gpt-oss-120b on H200, TP1): MAPE and unsafe
share (prediction > 1.05 x true) against the noisy held-out labels and against the noise-free labels
of the same states, for LightGBM and the baselines; then single-call and 1,000-row latency of the
fast predictor. Targets: MAPE <= 5%, unsafe <= 2%, <= 20 us, <= 2 ms.

    python benchmarks/bench_interference.py [--gpu H200 --model gpt-oss-120b --tp 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from envs.cost_model import CostModel
from envs.profiler import DEFAULT_CHUNK_SIZES, simulate_profiles
from interference_model.artifact import DEFAULT_ITL_TARGET
from interference_model.baselines import AnalyticInverseBaseline, LinearBaseline, UtilisationThresholdBaseline
from interference_model.evaluate import Predicts, evaluate
from interference_model.fit import FitConfig, fit_interference_model
from interference_model.labels import LABEL, ItlTarget, derive_labels
from interference_model.predictor import SafeThroughputPredictor
from interference_model.schema import FEATURES


def _time_us(fn: object, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--model", default="gpt-oss-120b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--itl-target", default=DEFAULT_ITL_TARGET)
    ap.add_argument("--train-states", type=int, default=4000)
    ap.add_argument("--test-states", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=9, help="measurements per profile point")
    ap.add_argument(
        "--global-shift", action="store_true", help="one conformal shift instead of per batch bin"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target = ItlTarget.parse(args.itl_target)
    cm = CostModel(args.gpu, args.model, tp=args.tp)
    setup = (args.gpu, args.model, args.tp)
    train = derive_labels(
        simulate_profiles(*setup, args.train_states, seed=0, cost_model=cm, repeats=args.repeats), target
    )
    test = derive_labels(
        simulate_profiles(*setup, args.test_states, seed=1, cost_model=cm, repeats=args.repeats), target
    )
    clean = derive_labels(
        simulate_profiles(*setup, args.test_states, seed=1, cost_model=cm, noise=None), target
    )
    t0 = time.perf_counter()
    config = FitConfig(shift_batch_edges=()) if args.global_shift else FitConfig()
    fit = fit_interference_model(train, target, config)
    fit_s = time.perf_counter() - t0
    predictor = SafeThroughputPredictor(fit.booster.dump_model(), fit.shift)
    predictors: dict[str, Predicts] = {
        "lightgbm": predictor,
        "linear": LinearBaseline().fit(train),
        "utilisation_threshold": UtilisationThresholdBaseline().fit(train),
        "analytic_cost_model": AnalyticInverseBaseline(
            cm, target, DEFAULT_CHUNK_SIZES, cm.kv_capacity_tokens
        ),
    }
    report = evaluate(test, predictors, reference=clean[LABEL].to_numpy())

    X = test[list(FEATURES)].to_numpy()
    row = tuple(float(v) for v in X[len(X) // 2])
    single_us = min(_time_us(lambda: predictor.safe_prefill_tokens_per_s(*row), 5000) for _ in range(3))
    batch_ms = min(_time_us(lambda: predictor.predict(X[:1000]), 50) for _ in range(3)) / 1000
    lgb_single_us = _time_us(lambda: fit.booster.predict(np.asarray([[*row, row[0] * row[1]]])), 200)

    print(
        f"{args.gpu}/{args.model}/tp{args.tp}, ITL target {target}: train {len(train)} states (seed 0), "
        f"held-out {len(test)} states (seed 1), {args.repeats} repeats; "
        f"fit {fit_s:.1f} s, {predictor.n_trees} trees"
    )
    print(f"{'predictor':<24}{'MAPE':>8}{'unsafe':>9}   | vs noise-free truth:{'MAPE':>7}{'unsafe':>9}")
    for name, m in report["metrics"].items():
        ref = report["vs_reference"][name]
        print(
            f"{name:<24}{m['mape']:>8.1%}{m['unsafe_share']:>9.1%}   |{'':>20}{ref['mape']:>7.1%}"
            f"{ref['unsafe_share']:>9.1%}"
        )
    print(
        f"fast predictor: single call {single_us:.1f} us (LightGBM predict {lgb_single_us:.0f} us), "
        f"1,000 rows {batch_ms:.2f} ms"
    )
    if args.json:
        out = {
            "setup": list(setup),
            "itl_target": str(target),
            "train_states": len(train),
            "test_states": len(test),
            "metrics": report["metrics"],
            "vs_noise_free": report["vs_reference"],
            "single_call_us": single_us,
            "batch_1000_ms": batch_ms,
            "lightgbm_single_call_us": lgb_single_us,
            "fit_seconds": fit_s,
            "conformal_log_shifts": list(fit.shift.log_shifts),
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
