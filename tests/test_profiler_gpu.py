"""The torch profiling script (benchmarks/gpu/profile_torch.py): a CPU smoke test with tiny shapes,
and the real run on a CUDA device (``cuda`` marker: skipped unless torch sees one)."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from interference_model.columns import PROFILE_COLUMNS
from interference_model.labels import LABEL, LeaseLabel, derive_labels
from interference_model.schema import read_profiles

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "profile_torch.py"


def load_script() -> ModuleType:
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("profile_torch", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_torch"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def check_outputs(out: Path, models: set[str]) -> dict[str, object]:
    gemm, attention = read_csv(out / "gemm.csv"), read_csv(out / "attention.csv")
    assert {r["model"] for r in gemm} == models == {r["model"] for r in attention}
    for op in ("attn_post_proj", "moe_router", "moe_experts", "lm_head"):
        for stat in ("min", "max", "mean", "median", "std"):
            assert all(float(r[f"time_stats.{op}.{stat}"]) >= 0 for r in gemm), (op, stat)
    assert all(float(r["time_stats.lm_head.median"]) > 0 for r in gemm)
    prefill = [r for r in attention if r["is_prefill"] == "True"]
    decode = [r for r in attention if r["is_prefill"] == "False"]
    assert prefill and decode and all(float(r["time_stats.attn_decode.median"]) > 0 for r in decode)
    profiles = read_profiles(out / "profiles.csv")  # the schema gate itself
    with (out / "profiles.csv").open() as fh:
        assert next(csv.reader(fh)) == list(PROFILE_COLUMNS)
    assert set(profiles["source"]) == {"torch"} and set(profiles["model"]) == models
    assert (profiles.groupby("state_id")["decode_step"].nunique() > 1).any()  # the batch evolves
    for _, part in profiles.groupby("model"):
        labels = derive_labels(part, LeaseLabel.parse("1.5x|25ms"))
        assert (labels[LABEL] >= 0).all() and len(labels) == part["state_id"].nunique()
    meta = json.loads((out / "meta.json").read_text())
    assert set(meta["models"]) == models and meta["torch"]
    return meta


def test_cpu_smoke_run_writes_vidur_tables_and_valid_profiles(tmp_path: Path) -> None:
    script = load_script()
    start = time.perf_counter()
    assert script.main(["--out", str(tmp_path), "--device", "cpu", "--tiny"]) == 0
    assert time.perf_counter() - start < 30
    meta = check_outputs(tmp_path, {"gpt-oss-120b", "GLM-5"})
    assert meta["tiny"] is True and meta["hardware"] == "cpu" and meta["truncated"] is False


def test_remaining_outputs_spread_the_batch() -> None:
    script = load_script()
    assert script.remaining_outputs(4, 100) == [50, 100, 150, 200]
    assert script.remaining_outputs(1, 3) == [6]


@pytest.mark.cuda
def test_full_run_on_the_gpu_fits_five_minutes(tmp_path: Path) -> None:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--max-seconds", "240"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.perf_counter() - start < 300
    meta = check_outputs(tmp_path, {"gpt-oss-120b", "GLM-5"})
    assert meta["cuda"] and meta["tiny"] is False


@pytest.mark.parametrize(("model", "tp"), [("gpt-oss-120b", 1), ("GLM-5", 8)])
def test_layer_stack_runs_at_the_real_per_gpu_shapes(model: str, tp: int) -> None:
    # Real attention widths (MLA latent and rope splits included) and hidden size; fewer, narrower
    # experts and a small vocabulary keep it to seconds and tens of MB on the CPU.
    import dataclasses

    import torch

    from envs.hardware import get_model

    script = load_script()
    spec = dataclasses.replace(get_model(model), experts=16, expert_intermediate=256 * tp, vocab=1024)
    stack = script.Stack(spec, tp, 2, 2048, torch.device("cpu"), torch.bfloat16)
    layers, head = stack.run(37, 3, 500, torch.Generator().manual_seed(0))
    out = layers()
    assert tuple(out.shape) == (40, spec.hidden) and bool(torch.isfinite(out.float()).all())
    assert tuple(head().shape) == (4, spec.vocab // tp)
    experts = stack.layers[0].experts
    h = torch.randn(29, spec.hidden, dtype=torch.bfloat16)
    counts, rows = experts.route(29, torch.Generator().manual_seed(1))
    outputs = []
    for mode in ("direct", "padded", ""):  # grouped GEMM, padded grouped GEMM, loop
        experts.grouped = mode
        outputs.append(experts(h, counts, rows).float())
    assert int(counts.sum()) == 29 * spec.active_experts
    for other in outputs[1:]:
        torch.testing.assert_close(other, outputs[0], rtol=2e-2, atol=2e-2)
