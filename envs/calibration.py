"""Calibrating the cost model against Vidur's real H100 / A100 operator measurements.

Three steps, each a function:

* ``extract_points(profiles_dir)`` reads the upstream Vidur profiles (``data/profiling/...`` and the
  e2d00e9 A100 attention set) and subsamples them into the small CSVs shipped in
  ``envs/data/calibration/`` (one row per measurement, median milliseconds per layer per GPU).
* ``fit_knobs(points)`` fits the ``GPUSpec`` efficiency knobs on those points; the result is pasted
  into ``envs/hardware.py`` (the GPU catalog keeps literals so it needs no file at import).
* ``evaluate(points)`` predicts every shipped point with the catalog GPUs through the very operator
  functions ``CostModel`` uses, and ``accuracy_table`` summarises the error per GPU and operator.

Command line: ``python -m envs.calibration [--profiles DIR]`` rebuilds the points when ``DIR`` (the
upstream Vidur data) is given, then prints the fitted knobs and the accuracy table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from envs import cost_model as cm
from envs.hardware import GPUSpec, get_gpu, with_knobs

POINTS_DIR = Path(__file__).parent / "data" / "calibration"
GEMM_TOKENS = (1, 4, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192, 16384, 32768)
_GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
_ELEMENTWISE_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
POINT_FILES = ("gemm", "elementwise", "all_reduce", "attention_prefill", "attention_decode", "cpu_overhead")


# --- Extraction (needs the upstream data; not run in CI) ----------------------------------------


def _read_csv(path: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(path)
    except (OSError, pd.errors.ParserError) as exc:
        raise ValueError(f"{path}: cannot read Vidur profile: {exc}") from exc


def _require(df: pd.DataFrame, path: Path, columns: list[str]) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}")


def _gemm_shapes(df: pd.DataFrame, op: str) -> tuple[np.ndarray, np.ndarray]:
    """(k, n) of a Vidur op on one TP shard: fused QKV and gate+up split n, output and down split k."""
    tp = df.num_tensor_parallel_workers.to_numpy()
    h = df.n_embd.to_numpy()
    head_dim = h // df.n_head.to_numpy()
    inter = df.n_expanded_embd.to_numpy()
    up = np.where(df.use_gated_mlp.astype(bool).to_numpy(), 2, 1)
    shapes = {
        "attn_pre_proj": (h, (df.n_head.to_numpy() + 2 * df.n_kv_head.to_numpy()) * head_dim / tp),
        "attn_post_proj": (df.n_head.to_numpy() * head_dim / tp, h),
        "mlp_up_proj": (h, up * inter / tp),
        "mlp_down_proj": (inter / tp, h),
    }
    k, n = shapes[op]
    return np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64)


def _mlp_points(profiles_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """GEMM rows (one per op) and element-wise rows (sum of the five small kernels) from every mlp.csv."""
    gemm_parts, elem_parts = [], []
    for gpu in ("h100", "a100"):
        for path in sorted((profiles_dir / "data/profiling/compute" / gpu).glob("*/*/mlp.csv")):
            model = path.parent.name
            if model == "phi-2":  # parallel attention/MLP block with partial rotary: not our layer shape
                continue
            df = _read_csv(path)
            _require(
                df,
                path,
                [
                    "n_head",
                    "n_kv_head",
                    "n_embd",
                    "n_expanded_embd",
                    "use_gated_mlp",
                    "num_tokens",
                    "num_tensor_parallel_workers",
                    *(f"time_stats.{op}.median" for op in _GEMM_OPS + _ELEMENTWISE_OPS),
                ],
            )
            df = df[df.num_tokens.isin(GEMM_TOKENS)]
            base = pd.DataFrame(
                {
                    "gpu": gpu.upper(),
                    "model": model,
                    "tp": df.num_tensor_parallel_workers.to_numpy(),
                    "tokens": df.num_tokens.to_numpy(),
                }
            )
            for op in _GEMM_OPS:
                k, n = _gemm_shapes(df, op)
                gemm_parts.append(
                    base.assign(op=op, k=k, n=n, median_ms=df[f"time_stats.{op}.median"].to_numpy())
                )
            tp = df.num_tensor_parallel_workers.to_numpy()
            h = df.n_embd.to_numpy()
            bytes_per_token = cm.elementwise_bytes_per_token(
                h,
                (df.n_head.to_numpy() + df.n_kv_head.to_numpy()) / tp,
                h // df.n_head.to_numpy(),
                df.n_expanded_embd.to_numpy() / tp,
                True,
            )
            elem_ms = sum(df[f"time_stats.{op}.median"].to_numpy() for op in _ELEMENTWISE_OPS)
            elem_parts.append(
                base.assign(op="elementwise", bytes_per_token=bytes_per_token, median_ms=elem_ms)
            )
    if not gemm_parts:
        raise ValueError(f"{profiles_dir}: no data/profiling/compute/*/*/*/mlp.csv found")
    # Some token counts were profiled more than once; keep one point (the median of the medians).
    gemm = (
        pd.concat(gemm_parts)
        .groupby(["gpu", "model", "tp", "tokens", "op", "k", "n"], as_index=False, sort=False)["median_ms"]
        .median()
    )
    elementwise = (
        pd.concat(elem_parts)
        .groupby(["gpu", "model", "tp", "tokens", "op", "bytes_per_token"], as_index=False, sort=False)[
            "median_ms"
        ]
        .median()
    )
    return gemm, elementwise


def _all_reduce_points(profiles_dir: Path, every: int = 10) -> pd.DataFrame:
    """Single-node NCCL all-reduce (rank 0, all GPUs on one NVLink node), every ``every``-th size."""
    parts = []
    for gpu in ("h100", "a100"):
        path = profiles_dir / f"data/profiling/network/{gpu}_dgx/all_reduce.csv"
        df = _read_csv(path)
        _require(
            df, path, ["rank", "num_workers", "size", "devices_per_node", "time_stats.all_reduce.median"]
        )
        df = df[(df["rank"] == 0) & (df.devices_per_node >= df.num_workers) & (df.num_workers <= 8)]
        df = df.groupby(["num_workers", "size"], as_index=False)["time_stats.all_reduce.median"].median()
        sizes = np.sort(df["size"].unique())
        df = df[df["size"].isin(sizes[::every])]
        parts.append(
            pd.DataFrame(
                {
                    "gpu": gpu.upper(),
                    "op": "all_reduce",
                    "tp": df.num_workers.to_numpy(),
                    "size_bytes": df["size"].to_numpy(),
                    "median_ms": df["time_stats.all_reduce.median"].to_numpy(),
                }
            )
        )
    return pd.concat(parts, ignore_index=True)


def _attention_points(profiles_dir: Path, rng: np.random.Generator) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A100 prefill and decode attention (CodeLlama-34B shape at TP2), subsampled with ``rng``."""
    path = profiles_dir / "history/e2d00e9/data/profiling/a100/attention.csv"
    df = _read_csv(path)
    _require(
        df,
        path,
        [
            "n_embd",
            "n_q_head",
            "n_kv_head",
            "num_tensor_parallel_workers",
            "batch_size",
            "prefill_chunk_size",
            "kv_cache_size",
            "is_prefill",
            "time_stats.attn_prefill.median",
            "time_stats.attn_decode.median",
        ],
    )
    tp = df.num_tensor_parallel_workers.to_numpy()
    head_dim = df.n_embd.to_numpy() // df.n_q_head.to_numpy()
    base = pd.DataFrame(
        {
            "gpu": "A100",
            "tp": tp,
            "q_heads_per_gpu": df.n_q_head.to_numpy() / tp,
            "kv_heads_per_gpu": np.maximum(df.n_kv_head.to_numpy() / tp, 1),
            "head_dim": head_dim,
            "batch": df.batch_size.to_numpy(),
            "chunk_tokens": df.prefill_chunk_size.to_numpy(),
            "kv_tokens": df.kv_cache_size.to_numpy(),
        }
    )
    is_prefill = df.is_prefill.astype(bool).to_numpy()
    prefill = base[is_prefill].assign(
        op="attention_prefill", median_ms=df["time_stats.attn_prefill.median"].to_numpy()[is_prefill]
    )
    decode = base[~is_prefill].assign(
        op="attention_decode", median_ms=df["time_stats.attn_decode.median"].to_numpy()[~is_prefill]
    )
    prefill = prefill.iloc[np.sort(rng.choice(len(prefill), size=min(600, len(prefill)), replace=False))]
    decode = decode.iloc[np.sort(rng.choice(len(decode), size=min(800, len(decode)), replace=False))]
    return prefill.reset_index(drop=True), decode.reset_index(drop=True)


def _cpu_overhead_points(profiles_dir: Path) -> pd.DataFrame:
    path = profiles_dir / "history/e2d00e9/data/profiling/a100/cpu_overheads.csv"
    df = _read_csv(path)
    parts = [
        "schedule_median",
        "sampler_e2e_median",
        "prepare_inputs_e2e_median",
        "process_model_outputs_median",
    ]
    _require(df, path, ["batch_size", *parts])
    return pd.DataFrame(
        {
            "gpu": "A100",
            "op": "cpu_overhead",
            "batch": df.batch_size.to_numpy(),
            "median_ms": sum(df[c].to_numpy() for c in parts),
        }
    )


def extract_points(profiles_dir: Path, seed: int = 0) -> dict[str, pd.DataFrame]:
    """Subsample the upstream Vidur profiles into the shipped calibration points (see module doc)."""
    profiles_dir = Path(profiles_dir)
    rng = np.random.default_rng(seed)
    gemm, elementwise = _mlp_points(profiles_dir)
    prefill, decode = _attention_points(profiles_dir, rng)
    return {
        "gemm": gemm,
        "elementwise": elementwise,
        "all_reduce": _all_reduce_points(profiles_dir),
        "attention_prefill": prefill,
        "attention_decode": decode,
        "cpu_overhead": _cpu_overhead_points(profiles_dir),
    }


def write_points(points: dict[str, pd.DataFrame], out_dir: Path = POINTS_DIR) -> None:
    """Write each frame as ``<name>.csv`` atomically (temp file, then rename)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, df in points.items():
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
        with os.fdopen(fd, "w", newline="") as fh:
            df.to_csv(fh, index=False, float_format="%.6g")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; shipped data must be world-readable
        os.replace(tmp, out_dir / f"{name}.csv")


def load_points(points_dir: Path = POINTS_DIR) -> dict[str, pd.DataFrame]:
    """The shipped calibration points, one frame per operator family."""
    points = {}
    for name in POINT_FILES:
        path = Path(points_dir) / f"{name}.csv"
        df = _read_csv(path)
        _require(df, path, ["gpu", "median_ms"])
        points[name] = df
    return points


# --- Predictions through the cost model's own operator functions --------------------------------


def _prefill_flops(df: pd.DataFrame) -> np.ndarray:
    pairs = cm.CostModel.prefill_attention_pairs(df.chunk_tokens.to_numpy(), df.kv_tokens.to_numpy())
    return 2.0 * pairs * df.q_heads_per_gpu.to_numpy() * 2 * df.head_dim.to_numpy()


def _query_head_rows(df: pd.DataFrame) -> np.ndarray:
    return df.chunk_tokens.to_numpy() * df.q_heads_per_gpu.to_numpy()


def _decode_kv_bytes(df: pd.DataFrame) -> np.ndarray:
    per_token = 2.0 * df.kv_heads_per_gpu.to_numpy() * df.head_dim.to_numpy() * cm.ACTIVATION_BYTES
    return df.batch.to_numpy() * df.kv_tokens.to_numpy() * per_token


def predict_ms(name: str, df: pd.DataFrame, gpu: GPUSpec) -> np.ndarray:
    """Cost-model prediction (ms) of every point in ``df`` from point file ``name`` on ``gpu``."""
    if name == "gemm":
        return 1e3 * cm.gemm_time_s(
            gpu, df.tokens.to_numpy(dtype=np.float64), df.k.to_numpy(), df.n.to_numpy()
        )
    if name == "elementwise":
        return 1e3 * cm.elementwise_time_s(
            gpu, df.tokens.to_numpy(dtype=np.float64), df.bytes_per_token.to_numpy()
        )
    if name == "all_reduce":
        out = np.empty(len(df))
        for tp in df.tp.unique():  # the ring factor depends on tp, which the formula takes as an int
            sel = (df.tp == tp).to_numpy()
            out[sel] = cm.allreduce_time_s(gpu, df.size_bytes.to_numpy()[sel], int(tp))
        return 1e3 * out
    if name == "attention_prefill":
        return 1e3 * cm.attention_prefill_time_s(gpu, _prefill_flops(df), _query_head_rows(df))
    if name == "attention_decode":
        return 1e3 * cm.attention_decode_time_s(gpu, df.batch.to_numpy(), _decode_kv_bytes(df))
    raise KeyError(f"unknown point file {name!r}; choices: {', '.join(POINT_FILES)}")


def evaluate(
    points: dict[str, pd.DataFrame] | None = None, gpus: dict[str, GPUSpec] | None = None
) -> pd.DataFrame:
    """One row per shipped point: gpu, op, measured and predicted ms, signed error in percent."""
    points = load_points() if points is None else points
    frames = []
    for name, df in points.items():
        if name == "cpu_overhead":  # a hint for the constant overhead, not a per-point prediction
            continue
        for gpu_name, part in df.groupby("gpu", sort=True):
            gpu = (gpus or {}).get(str(gpu_name)) or get_gpu(str(gpu_name))
            predicted = predict_ms(name, part, gpu)
            op = part["op"].to_numpy() if "op" in part.columns else name
            frames.append(
                pd.DataFrame(
                    {
                        "gpu": gpu_name,
                        "family": name,
                        "op": op,
                        "measured_ms": part.median_ms.to_numpy(),
                        "predicted_ms": predicted,
                    }
                )
            )
    out = pd.concat(frames, ignore_index=True)
    out["error_pct"] = 100.0 * (out.predicted_ms / out.measured_ms - 1.0)
    return out


def accuracy_table(errors: pd.DataFrame) -> pd.DataFrame:
    """Per GPU and operator: points, median and p90 absolute % error, median signed % error."""
    g = errors.assign(abs_pct=errors.error_pct.abs()).groupby(["gpu", "op"], sort=True)
    return (
        pd.DataFrame(
            {
                "points": g.size(),
                "median_abs_pct": g.abs_pct.median(),
                "p90_abs_pct": g.abs_pct.quantile(0.9),
                "median_signed_pct": g.error_pct.median(),
            }
        )
        .round(1)
        .reset_index()
    )


# --- Fitting --------------------------------------------------------------------------------------


def _relative_lstsq(design: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares on relative error (rows weighted by 1 / measurement); coefficients clipped >= 0."""
    seconds = np.asarray(seconds, dtype=np.float64)
    w = 1.0 / seconds
    coef = np.linalg.lstsq(np.asarray(design, dtype=np.float64) * w[:, None], seconds * w, rcond=None)[0]
    return np.maximum(coef, 1e-12)


def _fit_gemm(gpu: GPUSpec, df: pd.DataFrame) -> dict[str, object]:
    seconds = df.median_ms.to_numpy() / 1e3
    small = df.tokens.to_numpy() <= 16
    weight_read_s = (df.k * df.n * 2.0 + df.tokens * (df.k + df.n) * 2.0).to_numpy() / gpu.hbm_bytes_per_s
    launch_s, inv_mem_eff = _relative_lstsq(np.c_[np.ones(small.sum()), weight_read_s[small]], seconds[small])
    gpu = with_knobs(gpu, kernel_launch_s=float(launch_s), memory_efficiency=float(1.0 / inv_mem_eff))
    knots = sorted(int(t) for t in df.tokens.unique() if t >= 16)
    candidates = np.linspace(0.02, 1.0, 197)
    efficiencies = []
    for knot in knots:
        part = df[df.tokens == knot]
        errors = []
        for eff in candidates:
            trial = with_knobs(gpu, gemm_efficiency_tokens=(knot,), gemm_efficiency=(float(eff),))
            pred = cm.gemm_time_s(
                trial, part.tokens.to_numpy(dtype=np.float64), part.k.to_numpy(), part.n.to_numpy()
            )
            errors.append(np.median(np.abs(np.log(pred / (part.median_ms.to_numpy() / 1e3)))))
        # Where weight reads dominate, every efficiency above some bound fits equally well: take the
        # highest one within 0.5% of the best error, so compute binds only where the data say so.
        errors_arr = np.asarray(errors)
        feasible = candidates[errors_arr <= errors_arr.min() + 0.005]
        efficiencies.append(float(feasible.max()))
    # Efficiency never falls as rows grow (more rows never idle tensor cores): running minimum from
    # the right, which also irons out wave-quantisation bumps in the measurements.
    efficiencies = [round(float(e), 3) for e in np.minimum.accumulate(np.asarray(efficiencies)[::-1])[::-1]]
    return {
        "kernel_launch_s": float(launch_s),
        "memory_efficiency": float(1.0 / inv_mem_eff),
        "gemm_efficiency_tokens": (1, *knots),
        "gemm_efficiency": (efficiencies[0], *efficiencies),
    }


def fit_knobs(points: dict[str, pd.DataFrame] | None = None) -> dict[str, dict[str, object]]:
    """Efficiency knobs per measured GPU (``H100``, ``A100``) fitted on ``points``."""
    points = load_points() if points is None else points
    knobs: dict[str, dict[str, object]] = {}
    for gpu_name in ("H100", "A100"):
        gpu = get_gpu(gpu_name)
        k: dict[str, object] = _fit_gemm(gpu, points["gemm"][points["gemm"].gpu == gpu_name])
        el = points["elementwise"][points["elementwise"].gpu == gpu_name]
        stream_s = (el.tokens * el.bytes_per_token).to_numpy() / gpu.hbm_bytes_per_s
        launch_s, inv_eff = _relative_lstsq(np.c_[np.ones(len(el)), stream_s], el.median_ms.to_numpy() / 1e3)
        k |= {"elementwise_launch_s": float(launch_s), "elementwise_memory_efficiency": float(1 / inv_eff)}
        ar = points["all_reduce"][points["all_reduce"].gpu == gpu_name]
        bus_s = (ar.size_bytes * 2.0 * (ar.tp - 1) / ar.tp).to_numpy() / (gpu.nvlink_gb_per_s * 1e9)
        latency_s, inv_eff = _relative_lstsq(np.c_[np.ones(len(ar)), bus_s], ar.median_ms.to_numpy() / 1e3)
        k |= {"allreduce_latency_s": float(latency_s), "allreduce_bus_efficiency": float(1 / inv_eff)}
        knobs[gpu_name] = k
    # Attention was measured on A100 only; H100 (and the extrapolated GPUs) reuse its efficiencies.
    pf = points["attention_prefill"]
    launch_s, row_s, inv_eff = _relative_lstsq(
        np.c_[
            np.ones(len(pf)), _query_head_rows(pf), _prefill_flops(pf) / (get_gpu("A100").bf16_tflops * 1e12)
        ],
        pf.median_ms / 1e3,
    )
    attention: dict[str, object] = {
        "attention_prefill_launch_s": float(launch_s),
        "attention_prefill_row_s": float(row_s),
        "attention_prefill_efficiency": float(1 / inv_eff),
    }
    dc = points["attention_decode"]
    launch_s, per_request_s, inv_eff = _relative_lstsq(
        np.c_[np.ones(len(dc)), dc.batch, _decode_kv_bytes(dc) / get_gpu("A100").hbm_bytes_per_s],
        dc.median_ms.to_numpy() / 1e3,
    )
    attention |= {
        "attention_decode_launch_s": float(launch_s),
        "attention_decode_per_request_s": float(per_request_s),
        "attention_decode_memory_efficiency": float(1 / inv_eff),
    }
    for k in knobs.values():
        k |= attention
    cpu = points["cpu_overhead"]
    intercept_s, _ = _relative_lstsq(np.c_[np.ones(len(cpu)), cpu.batch], cpu.median_ms.to_numpy() / 1e3)
    knobs["cpu"] = {"iteration_overhead_s": float(intercept_s)}
    return knobs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m envs.calibration", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--profiles",
        type=Path,
        default=None,
        help="upstream Vidur data (its repository root); when given, rebuild envs/data/calibration/ from it",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the attention-point subsample")
    args = parser.parse_args(argv)
    if args.profiles is not None:
        write_points(extract_points(args.profiles, seed=args.seed))
        print(f"wrote calibration points to {POINTS_DIR}")
    points = load_points()
    print("fitted knobs (paste into envs/hardware.py / envs/cost_model.py):")
    for gpu_name, knobs in fit_knobs(points).items():
        print(
            f"  {gpu_name}: "
            + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in knobs.items())
        )
    print("\naccuracy of the catalog knobs on the shipped points:")
    print(accuracy_table(evaluate(points)).to_string(index=False))


if __name__ == "__main__":
    main()
